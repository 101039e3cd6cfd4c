"""What a run found and how it is reported: a ``Finding`` (one difference after a step), the
``Difference`` (that finding placed in its run, with the command that replays it) and the
``Report`` of a whole run (its table, its verdict, its JSON).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

@dataclass
class Finding:
    """One difference found after a step.

    Args:
        what: ``outcome``, ``return``, ``refused call changed the state``, ``input changed``,
            ``matcher`` (a grammar's matcher not left as found), ``states``, ``drafter_rows``,
            ``last_pair_key``, ``export_state``, ``confidence`` (``draft_confidence``'s ``prob``
            or ``margin``, in ``tensor``) or ``contract``.
        side: whose behaviour is wrong when that is known (``candidate``, ``baseline``), else ``both``.
        state: the state's index in the scenario.
        tensor: the export_state key.
        row, element: the first differing element (row and column of a 2-D tensor).
        candidate, baseline: both sides' values (for ``contract``: what was seen and what the
            spec predicts).
        detail: one line of context.
    """

    what: str
    side: str = "both"
    state: int | None = None
    tensor: str | None = None
    row: int | None = None
    element: int | None = None
    candidate: str = ""
    baseline: str = ""
    detail: str = ""

    def where(self) -> str:
        """``what[tensor] of state S, row R, element E``, leaving out what is not known."""
        out = self.what + (f"[{self.tensor}]" if self.tensor else "")
        if self.state is not None:
            out += f" of state {self.state}"
        if self.row is not None:
            out += f", row {self.row}"
        if self.element is not None:
            out += f", element {self.element}"
        return out


@dataclass
class Difference(Finding):
    """A ``Finding`` placed in its run: which scenario, which step, which call, how to replay."""

    scenario_index: int = 0
    scenario_seed: int = 0
    generator: str = ""
    step: int = 0
    op: str = ""
    op_args: dict[str, Any] = field(default_factory=dict)
    expect: str = ""
    replay: str = ""
    index_share: bool | None = None  # the scenario's index sharing (DESIGN.md §9); None: the preset's

    def __str__(self) -> str:
        where = self.where()
        share = "" if self.index_share is None else f", index_share {str(self.index_share).lower()}"
        lines = [
            f"scenario {self.scenario_index} ({self.generator}, scenario seed {self.scenario_seed}{share}), step "
            f"{self.step}: {self.op}"
            + (f"  [spec: {self.expect}]" if self.expect else ""),
            f"  {where}: {self.detail}",
        ]
        if self.what == "contract":
            lines.append(f"  {self.side} saw: {self.candidate if self.side == 'candidate' else self.baseline}")
            lines.append(f"  spec says: {self.baseline if self.side == 'candidate' else self.candidate}")
        else:
            lines.append(f"  candidate: {self.candidate}")
            lines.append(f"  baseline:  {self.baseline}")
        lines.append(f"  replay: {self.replay}")
        return "\n".join(lines)


@dataclass
class Report:
    """The result of ``run``.

    Args:
        ok: no difference in any step of any scenario run.
        scenarios_run, steps_run: how much ran (up to and including the failing step).
        first_difference: where it stopped, or None.
        candidate, baseline, device, dtype, preset, max_seq_len, seed, weights_seed,
            generators, scenario_index: what ran (enough to run it again).
        seconds: wall time.
        by_generator: scenarios per generator.
        outcomes: ops run per call kind and spec outcome, e.g. ``{"propose": {"ok": 812, ...}}``.
        grammars: the scenarios drew grammars and sampled proposes and confidences were compared
            (DESIGN.md §10, §12); off when a backend does not take them.
    """

    ok: bool
    scenarios_run: int
    steps_run: int
    first_difference: Difference | None
    candidate: str
    baseline: str
    device: str
    dtype: str
    preset: str
    max_seq_len: int
    seed: int
    weights_seed: int
    generators: tuple[str, ...]
    scenario_index: int | None
    seconds: float
    by_generator: dict[str, int]
    outcomes: dict[str, dict[str, int]]
    grammars: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.first_difference is not None:
            d["first_difference"]["message"] = str(self.first_difference)
        return d

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, default=str)

    def summary(self) -> str:
        """A table of what ran, then the verdict (and the first difference)."""
        head = (
            f"glm-mtp conformance: candidate={self.candidate} baseline={self.baseline} device={self.device} "
            f"dtype={self.dtype} preset={self.preset} max_seq_len={self.max_seq_len} seed={self.seed}"
            + (f" scenario_index={self.scenario_index}" if self.scenario_index is not None else "")
            + f" grammars={'on' if self.grammars else 'off'}"
        )
        gens = ", ".join(f"{g} {n}" for g, n in self.by_generator.items())
        lines = [head, f"scenarios {self.scenarios_run} ({gens})   steps {self.steps_run}   {self.seconds:.1f} s", ""]
        cols = ["ok", "noop", "RuntimeError", "ValueError"]
        kinds = ["info", "alloc", "free", "prefill", "catchup", "propose", "verify"]
        kinds += [k for k in ("propose_batch", "catchup_batch") if k in self.outcomes]  # batched runs only
        w = max(10, *(len(k) + 1 for k in kinds))
        lines.append(f"{'call':<{w}}" + "".join(f"{c:>14}" for c in cols) + f"{'total':>10}")
        for kind in kinds:
            row = self.outcomes.get(kind, {})
            lines.append(f"{kind:<{w}}" + "".join(f"{row.get(c, 0):>14}" for c in cols) + f"{sum(row.values()):>10}")
        lines.append("")
        if self.ok:
            lines.append("RESULT: PASS: every step equal byte for byte")
        else:
            lines.append("RESULT: FAIL")
            lines.append(str(self.first_difference))
        return "\n".join(lines)
