"""What an acceptance run needs to replay a trace instead of running its target (``trace.path``):
the drafter alone from its checkpoint, the trace's prompts and budgets, and the speedup model's
costs (the target's, measured when the trace was recorded; the drafter's, measured here).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .format import Trace, TraceError
from .validate import open_trace
from .identity import check_drafter, model_identity


def drafter_path(mcfg: Any) -> str | None:
    """The ``model`` group's checkpoint directory (the shipped one for ``path: null``); None for
    ``kind: random``."""
    from ..targets.checkpoint import SHIPPED, shipped_checkpoint

    if mcfg.kind == "random":
        return None
    return str(mcfg.path or shipped_checkpoint(mcfg.get("shipped") or SHIPPED))


def load_drafter(mcfg: Any) -> Any:
    """The drafter of the ``model`` group with no target weight read: its MTP layer, embedding
    and head (``MtpWeights.from_pretrained`` reads only those), its tokenizer and held-out names.
    ``kind: random`` builds its random model (the embedding is the random target's) and drops the
    target."""
    import json

    from glm_mtp.reference.weights import MtpWeights
    from glm_mtp.registry import parse_dtype

    from ..training.bpe import BpeTokenizer
    from ..targets.checkpoint import LoadedModel, random_model

    dtype = parse_dtype(mcfg.dtype)
    if mcfg.kind == "random":
        model = random_model(mcfg.preset, mcfg.seed, dtype)
        return LoadedModel(None, model.mtp, None, [], None)
    path = Path(drafter_path(mcfg))
    mtp = MtpWeights.from_pretrained(path, dtype=dtype)
    tokenizer: Any = None
    if (path / "corpus.json").exists() and (path / "tokenizer.json").exists():
        tokenizer = BpeTokenizer.load(path / "tokenizer.json")
    elif mcfg.kind == "hf":
        from ..targets.hf_target import HfTokenizer, has_tokenizer

        if has_tokenizer(str(path)):
            from transformers import AutoTokenizer

            tokenizer = HfTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    heldout = json.loads((path / "corpus.json").read_text())["heldout"] if (path / "corpus.json").exists() else []
    return LoadedModel(None, mtp, tokenizer, heldout, str(path))


def open_for_replay(cfg: Any, drafter_config: Any) -> Trace:
    """Open and check the trace at ``trace.path`` for this run: the whole trace (``open_trace``),
    then the run against it: its sampling (``check_replay_sampling``), the trace's mode,
    ``num_drafts <= max_drafts``, and the drafter against its metadata
    (``identity.check_drafter``). ``ValueError`` naming the field."""
    path = cfg.trace.path
    if not isinstance(path, str):
        raise ValueError(f"trace.path must be a trace directory or null, got {path!r}")
    try:
        trace = open_trace(path)
    except TraceError as e:
        raise ValueError(f"trace.path: {path}: {e}") from None
    check_replay_sampling(cfg, trace)
    if cfg.mode != trace.mode:
        raise ValueError(f"mode: the trace at {path} was recorded for mode={trace.mode}, this run is mode={cfg.mode}")
    if cfg.num_drafts > trace.max_drafts:
        raise ValueError(f"num_drafts={cfg.num_drafts} exceeds the trace's max_drafts={trace.max_drafts} (the longest "
                         "verify it can answer)")
    if trace.meta["hidden_dtype"] != cfg.model.dtype:
        raise ValueError(f"trace.path: {path}: hidden_dtype: the trace holds {trace.meta['hidden_dtype']} hiddens, the "
                         f"drafter runs in model.dtype={cfg.model.dtype} (the loop feeds the target's hiddens as they "
                         "are: record the trace in the drafter's dtype)")
    try:
        check_drafter(trace.meta, drafter_config, model_identity(cfg.model, drafter_path(cfg.model)))
    except ValueError as e:
        raise ValueError(f"trace.path: {path}: {e}") from None
    longest = max(it.length for it in trace.items) + cfg.num_drafts + 1
    cap = min(cfg.model.max_seq_len, drafter_config.max_position_embeddings)
    if longest > cap:
        raise ValueError(f"model.max_seq_len: the trace's longest item + num_drafts + 1 = {longest} exceeds "
                         f"model.max_seq_len={cap}")
    return trace


def check_replay_sampling(cfg: Any, trace: Trace) -> None:
    """A greedy trace replays temperature 0 only (``verify=match`` or rejection at temperature > 0
    needs the target's seeded samples or its distribution, which it does not hold). A sampled trace
    (DESIGN.md §14) replays ``verify=match`` at its own temperature, top_p, top_k and seed only
    (another value would sample another trajectory); argmax or sampled drafts."""
    from ..settings.sampling import verify_kind

    g = trace.meta["generation"]
    run = {"temperature": float(cfg.temperature), "top_p": cfg.get("top_p"), "top_k": cfg.get("top_k"),
           "seed": cfg.seed}
    if g["temperature"] == 0:
        if run["temperature"] != 0:
            raise ValueError(f"temperature: the trace at {cfg.trace.path} is greedy (recorded at temperature 0): it "
                             f"replays temperature 0 only (verify={verify_kind(cfg)} at temperature "
                             f"{run['temperature']:g} needs a trace recorded at that temperature with the seeded "
                             "sampler: record ... temperature=T seed=S)")
        return
    for key, value in run.items():
        recorded = float(g[key]) if key == "temperature" else g[key]
        if value != recorded:
            raise ValueError(f"{key}: the trace at {cfg.trace.path} was sampled with {key}={recorded!r}; a replay "
                             f"takes the trace's settings, got {key}={value!r}")
    if verify_kind(cfg) != "match":
        raise ValueError(f"verify: a sampled trace replays verify=match (seeded exact match); verify="
                         f"{verify_kind(cfg)} needs the target's distribution, which a trace does not hold")


@dataclass
class ReplayPrompts:
    """The trace's items as an acceptance run's inputs: ``windows`` (each item's tokens),
    ``starts`` (its prompt), ``prompt_lens`` and ``budgets`` (tokens the loop may generate from
    each: ``min(run.max_new_tokens, what the record answers at this k)``, at least 1)."""

    windows: list[list[int]]
    starts: list[list[int]]
    prompt_lens: list[int]
    budgets: list[int]


def replay_prompts(trace: Trace, max_new_tokens: int, num_drafts: int) -> ReplayPrompts:
    """The run's inputs from ``trace`` (see ``ReplayPrompts``)."""
    from ..targets.replay import item_budget

    windows = [it.tokens.tolist() for it in trace.items]
    lens = [it.prompt_len for it in trace.items]
    # at least 1: the prefill alone answers the first token (an item cut short by a near-tie)
    budgets = [max(1, min(max_new_tokens, item_budget(it, num_drafts))) for it in trace.items]
    return ReplayPrompts(windows, [w[:p] for w, p in zip(windows, lens)], lens, budgets)


def replay_costs(trace: Trace, proposer: Any, kmax: int, repeats: int = 15) -> dict[str, Any]:
    """The speedup model's costs for a replay: the target's decode step and verifies as the trace
    recorded them (``costs``), a draft step timed here (a propose of ``kmax`` drafts after the
    first item's prompt, per draft, median of ``repeats``). Without recorded costs, GLM-5's from
    bytes (``speedup.glm5_costs``)."""
    from ..loop import speedup as spd

    costs = trace.meta.get("costs")
    if costs is None:
        return {**spd.glm5_costs(kmax), "source": "glm5 (the trace records no target costs)"}
    it = trace.items[0]
    P = max(2, it.prompt_len)
    tokens, hidden = it.tokens[:P].tolist(), it.hidden[:P].to(proposer_device(proposer))
    state = proposer.alloc_state(hidden.device)
    proposer.prefill_drafter(tokens[:-1], hidden[:-1], state)
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        proposer.propose(tokens[-1], hidden[-2:-1], P - 2, kmax, state)
        if r:  # the first is a warm-up
            times.append((time.perf_counter() - t0) / kmax)
        proposer.after_verify(0, state)
    proposer.free_state(state)
    draft_ms = statistics.median(times) * 1e3
    step = costs["target_step_ms"]
    return {"c": draft_ms / step, "v": [v / step - 1.0 for v in costs["verify_ms"][:kmax]], "target_step_ms": step,
            "draft_step_ms": draft_ms, "verify_ms": costs["verify_ms"][:kmax], "repeats": repeats,
            "source": "trace (target, as recorded) + measured here (drafter)",
            "target_costs_recorded": costs}


def proposer_device(proposer: Any) -> torch.device:
    """The device of a drafter's weights."""
    weights = getattr(proposer, "weights", None) or getattr(proposer, "w", None)
    return weights.device if weights is not None and hasattr(weights, "device") else torch.device("cpu")
