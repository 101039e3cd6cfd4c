"""Run and record: scenarios played in lockstep on two backends, or on one backend alone.

``run(candidate, baseline, ...)`` builds scenarios (``scenarios.py``), plays each in lockstep
(``lockstep.py``) and stops at the first difference; the ``Report`` (``report.py``) names the
scenario, the step, the call with its arguments, the tensor, row and element with both values,
and a command that replays exactly that scenario. A backend is a name (``reference``,
``optimized``, ``mutant:<name>``, ``package.module:attr``) or a factory
``(weights, max_seq_len) -> DraftProposer`` (``backends.py``).
"""

from __future__ import annotations

import shlex
import time
from collections import Counter, defaultdict
from dataclasses import asdict
from typing import Sequence

import torch
from torch import Tensor

from glm_mtp.reference import MtpConfig
from glm_mtp.registry import dtype_name, parse_dtype

from .backends import Factory
from .lockstep import Harness, run_scenario
from .report import Difference, Report
from .scenarios import GENERATORS, MAX_DRAFTS, load_scenario, scenario

def replay_command(h: Harness, seed: int, index: int, generators: Sequence[str], max_drafts: int,
                   scenario_file: str | None = None) -> str:
    """The one-line CLI call that replays scenario ``index`` of run ``seed`` alone (or the
    scenario saved in ``scenario_file``)."""
    args = [
        "python", "-m", "glm_mtp.conformance",
        "--candidate", h.candidate_name, "--baseline", h.baseline_name,
        "--device", str(h.device), "--dtype", dtype_name(h.dtype),
        "--preset", h.preset if isinstance(h.preset, str) else "<custom MtpConfig>",
        "--max-seq-len", str(h.max_seq_len),
    ]
    args += (
        ["--scenario-file", scenario_file] if scenario_file else ["--seed", str(seed), "--scenario-index", str(index)]
    )
    if h.weights_seed:
        args += ["--weights-seed", str(h.weights_seed)]
    if tuple(generators) != GENERATORS:
        args += ["--generators", ",".join(generators)]
    if max_drafts != MAX_DRAFTS:
        args += ["--max-drafts", str(max_drafts)]
    args += ["--grammars", "on" if h.grammars else "off"]
    return " ".join(shlex.quote(a) for a in args)


def run(
    candidate: str | Factory,
    baseline: str | Factory = "reference",
    scenarios: int = 100,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.bfloat16,
    preset: str | MtpConfig = "tiny",
    max_seq_len: int = 64,
    *,
    scenario_index: int | None = None,
    generators: Sequence[str] = GENERATORS,
    weights_seed: int = 0,
    max_drafts: int = MAX_DRAFTS,
    scenario_file: str | None = None,
    grammars: bool | None = None,
) -> Report:
    """Run ``scenarios`` scenarios (or only ``scenario_index``) on both backends in lockstep.

    Args:
        candidate: the backend under test (see ``resolve_backend``).
        baseline: the backend it must equal byte for byte.
        scenarios: how many scenarios, indices ``0..scenarios-1``.
        seed: the run's seed; scenario i depends only on (seed, i).
        device, dtype: of the weights and every tensor argument.
        preset: the config preset of the random weights.
        max_seq_len: the proposers' ``max_seq_len``.
        scenario_index: run this scenario alone (a replay); ``scenarios`` is then ignored.
        generators: which generators take turns (``realistic``, ``adversarial``, ``batched``; the
            first two by default).
        weights_seed: seed of the random weights.
        max_drafts: the largest ``num_drafts`` a valid propose uses.
        scenario_file: run the scenario saved in this JSON file alone (``save_scenario``; the
            hypothesis machine writes one on a failure); ``seed`` and ``scenarios`` are ignored.
        grammars: draw grammars and sampled proposes and compare confidences (DESIGN.md §10,
            §12): None when both backends take them (``contract.takes_grammars``), True to
            require it, False for off (``Harness.grammars``); the report says which ran.

    Returns:
        A ``Report``; ``report.ok`` is False at the first difference, which it describes.

    Raises:
        BackendError: a backend name does not resolve (``ValueError`` for a bad preset, dtype or device).
    """
    t0 = time.perf_counter()
    generators = tuple(generators)
    if not generators:
        raise ValueError("generators: name at least one of " + ", ".join(GENERATORS))
    if scenario_index is None and (isinstance(scenarios, bool) or not isinstance(scenarios, int) or scenarios < 1):
        raise ValueError(f"scenarios must be a positive integer, got {scenarios!r}")
    if scenario_index is not None and (not isinstance(scenario_index, int) or scenario_index < 0):
        raise ValueError(f"scenario_index must be a non-negative integer, got {scenario_index!r}")
    h = Harness(candidate, baseline, preset, parse_dtype(dtype), device, max_seq_len, weights_seed, grammars)
    indices = [0] if scenario_file else [scenario_index] if scenario_index is not None else range(scenarios)
    steps, ran, first = 0, 0, None
    by_gen: Counter[str] = Counter()
    outcomes: dict[str, Counter[str]] = defaultdict(Counter)
    for index in indices:
        sc = (
            load_scenario(scenario_file)
            if scenario_file
            else scenario(seed, index, h.config, max_seq_len, generators, max_drafts, bool(h.grammars))
        )
        n, finding, at = run_scenario(h, sc)
        steps, ran = steps + n, ran + 1
        by_gen[sc.generator] += 1
        for op in sc.ops[:n]:
            outcomes[op.kind][op.expect] += 1
        if finding is not None:
            op = sc.ops[at]
            first = Difference(
                **asdict(finding), scenario_index=index, scenario_seed=sc.scenario_seed, generator=sc.generator,
                step=at, op=op.call(), op_args=op.to_dict()["args"],
                expect=op.expect + (f" ({op.note})" if op.note else ""),
                replay=replay_command(h, seed, index, generators, max_drafts, scenario_file),
                index_share=sc.index_share,
            )
            break
    return Report(
        ok=first is None, scenarios_run=ran, steps_run=steps, first_difference=first,
        candidate=h.candidate_name, baseline=h.baseline_name, device=str(h.device), dtype=dtype_name(h.dtype),
        preset=preset if isinstance(preset, str) else "<custom>", max_seq_len=max_seq_len, seed=seed,
        weights_seed=weights_seed, generators=generators, scenario_index=scenario_index,
        seconds=time.perf_counter() - t0, by_generator=dict(by_gen), outcomes={k: dict(v) for k, v in outcomes.items()},
        grammars=bool(h.grammars),
    )


def record(
    backend: str | Factory,
    scenario_indices: Sequence[int],
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.bfloat16,
    preset: str = "tiny",
    max_seq_len: int = 64,
    weights_seed: int = 0,
) -> tuple[list[str], dict[str, Tensor]]:
    """Play scenarios on one backend alone and keep everything a lockstep would compare:
    each step's outcome, and every state's ``export_state`` after it, keyed
    ``"{scenario}/{step}/{state}/{key}"``. Two processes' records must agree byte for byte (the
    determinism check); ``torch.save`` the pair to carry it across.

    Args:
        backend: the backend spec (see ``resolve_backend``).
        scenario_indices: which scenarios of run ``seed``.
        seed, device, dtype, preset, max_seq_len, weights_seed: as in ``run``.
    """
    h = Harness(backend, backend, preset, parse_dtype(dtype), device, max_seq_len, weights_seed)
    outcomes: list[str] = []
    tensors: dict[str, Tensor] = {}
    for index in scenario_indices:
        sc = scenario(seed, index, h.config, max_seq_len, grammars=bool(h.grammars))
        side = h.lockstep(sc.index_share).candidate
        for step, op in enumerate(sc.ops):
            out, _ = side.call(op)
            outcomes.append(f"{index}/{step}: {out.kind} {out.value!r}")
            for i, v in enumerate(side.view()):
                outcomes.append(f"{index}/{step}/{i}: rows {v.rows} key {v.pair_key} {v.error}")
                for k, t in (v.export or {}).items():
                    tensors[f"{index}/{step}/{i}/{k}"] = t.detach().cpu()
    return outcomes, tensors
