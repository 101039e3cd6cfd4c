"""The lockstep runner: two drafters, the same weights, the same calls, compared byte for byte.

``run(candidate, baseline, ...)`` builds scenarios (``scenarios.py``), plays each op on both
backends and, after every op, compares:

- the outcome: the value returned (drafts, rows written), or the exception type raised;
- for a refused call, that it left every state's ``export_state`` byte-identical (both sides);
- that no call changed the tensors it was given;
- for every state: ``drafter_rows``, ``last_pair_key``, and every tensor of ``export_state``
  (key set, dtype, shape, device type, bytes);
- the contract: the baseline's (then the candidate's) outcome, return and rows against what the
  spec predicts (``Model``), exported keys, and ``seq_len`` agreeing with ``drafter_rows``.

It stops at the first difference and reports the scenario, the step, the call with its
arguments, the tensor, row and element with both values, and a command that replays exactly
that scenario. A backend is a name (``reference``, ``optimized``, ``mutant:<name>``,
``package.module:attr``) or a factory ``(weights, max_seq_len) -> DraftProposer``.
"""

from __future__ import annotations

import importlib
import json
import shlex
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.proposer import DraftProposer

from .compare import EXPORT_KEYS, first_mismatch, snapshots_equal
from .scenarios import GENERATORS, MAX_DRAFTS, Hidden, Op, Scenario, Tokens, load_scenario, other_device, scenario

Factory = Callable[[MtpWeights, int], DraftProposer]

DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}


class BackendError(ValueError):
    """A backend name that does not resolve, or a backend that cannot be imported."""


# ------------------------------------------------------------------------------------------------
# Backends.


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``torch.bfloat16`` from ``"bfloat16"``/``"bf16"`` (a dtype passes through)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: unknown dtype {name!r}; known: {sorted(DTYPES)}") from None


def _optimized_factory() -> Factory:
    try:
        from glm_mtp.optimized import OptimizedProposer  # type: ignore[attr-defined]
    except ImportError as e:
        raise BackendError(
            "backend 'optimized': glm_mtp.optimized.OptimizedProposer is not importable "
            f"({type(e).__name__}: {e}); the optimized backend may not have landed yet"
        ) from e
    return lambda w, n: OptimizedProposer(w, max_seq_len=n)


def resolve_backend(spec: str | Factory) -> tuple[str, Factory]:
    """``(name, factory)`` for a backend spec.

    Args:
        spec: ``"reference"``; ``"optimized"`` (``glm_mtp.optimized.OptimizedProposer``,
            imported only now); ``"mutant:<name>"`` (``mutants.MUTANTS``);
            ``"package.module:attr"`` (a factory or a proposer class); or a factory
            ``(weights, max_seq_len) -> DraftProposer`` itself, named by its import path when
            it has one (so the replay command can name it too).

    Raises:
        BackendError: the name is unknown or its module cannot be imported.
    """
    if callable(spec) and not isinstance(spec, str):
        mod, qual = getattr(spec, "__module__", None), getattr(spec, "__qualname__", None)
        name = f"{mod}:{qual}" if mod and qual and "<" not in qual else repr(spec)
        return name, spec
    if not isinstance(spec, str):
        raise BackendError(f"backend must be a name or a factory, got {type(spec).__name__}")
    if spec == "reference":
        return spec, lambda w, n: ReferenceProposer(w, n)
    if spec == "optimized":
        return spec, _optimized_factory()
    if spec.startswith("mutant:"):
        from .mutants import MUTANTS

        name = spec.removeprefix("mutant:")
        if name not in MUTANTS:
            raise BackendError(f"backend {spec!r}: unknown mutant {name!r}; known: {sorted(MUTANTS)}")
        cls = MUTANTS[name]
        return spec, lambda w, n: cls(w, n)
    if ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise BackendError(f"backend {spec!r}: cannot import ({type(e).__name__}: {e})") from e
        return spec, obj
    raise BackendError(f"unknown backend {spec!r}; use reference, optimized, mutant:<name> or package.module:attr")


# ------------------------------------------------------------------------------------------------
# One side of the lockstep.


@dataclass
class Outcome:
    """What a call did: returned ``value``, or raised ``error`` with ``message``."""

    value: Any = None
    error: type | None = None
    message: str = ""

    @property
    def kind(self) -> str:
        return "ok" if self.error is None else self.error.__name__

    def __str__(self) -> str:
        return f"returned {self.value!r}" if self.error is None else f"raised {self.error.__name__}: {self.message}"


def _same_value(a: Any, b: Any) -> bool:
    """Equal values of the same Python types all the way down (a tensor is never a list)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, Tensor):
        return first_mismatch(a, b) is None
    return a == b


@dataclass
class StateView:
    """One state as the suite sees it after a step."""

    rows: Any
    pair_key: Any
    export: dict[str, Tensor] | None
    error: str = ""  # a query that raised


class Side:
    """A proposer and the states (and latest drafts) a scenario has on it.

    Args:
        label: ``candidate`` or ``baseline``.
        proposer: the drafter.
        config, dtype, device: what its arguments are built for.
    """

    def __init__(self, label: str, proposer: DraftProposer, config: MtpConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.label, self.proposer, self.config, self.dtype, self.device = label, proposer, config, dtype, device
        self.states: list[Any] = []
        self.drafts: list[list[int]] = []

    def _arg(self, v: Any, drafts: list[int]) -> Any:
        if isinstance(v, Hidden):
            return v.materialize(self.config.hidden_size, self.dtype, self.device)
        if isinstance(v, Tokens):
            return v.materialize(drafts, self.device)
        return v

    def call(self, op: Op) -> tuple[Outcome, dict[str, Any]]:
        """Run ``op``; returns the outcome and the arguments passed (to check they are intact)."""
        p = self.proposer
        drafts = self.drafts[op.state] if 0 <= op.state < len(self.drafts) else []
        args = {k: self._arg(v, drafts) for k, v in op.args.items()}
        try:
            if op.kind == "info":
                value: Any = {
                    "prefill_hidden_rows": [p.prefill_hidden_rows(n) for n in args["lengths"]],
                    "prefill_uses_shared_buffers": p.prefill_uses_shared_buffers(),
                    "needs_comm": p.needs_comm(),
                    "max_seq_len": p.max_seq_len,
                }
            elif op.kind == "alloc":
                dev = self.device if args["device"] == "same" else other_device(self.device)
                self.states.append(p.alloc_state(dev))
                self.drafts.append([])
                value = None
            else:
                st = self.states[op.state]
                if op.kind == "free":
                    value = p.free_state(st)
                elif op.kind == "prefill":
                    value = p.prefill_drafter(args["prompt_tokens"], args["hiddens"], st)
                elif op.kind == "catchup":
                    value = p.catchup_drafter(args["tokens"], args["hiddens"], args["row_base"], args["pos_base"], st)
                elif op.kind == "propose":
                    value = p.propose(args["last_token"], args["target_hidden"], args["position"], args["num_drafts"], st)
                    if isinstance(value, list):
                        self.drafts[op.state] = list(value)
                elif op.kind == "verify":
                    value = p.after_verify(args["num_accepted"], st)
                else:
                    raise AssertionError(f"unknown op kind {op.kind!r}")
        except Exception as e:  # noqa: BLE001  the exception type is what we compare
            return Outcome(error=type(e), message=str(e).splitlines()[0] if str(e) else ""), args
        return Outcome(value=value), args

    def view(self) -> list[StateView]:
        out = []
        for st in self.states:
            try:
                out.append(StateView(self.proposer.drafter_rows(st), self.proposer.last_pair_key(st), self.proposer.export_state(st)))
            except Exception as e:  # noqa: BLE001
                out.append(StateView(None, None, None, f"{type(e).__name__}: {e}"))
        return out


# ------------------------------------------------------------------------------------------------
# Findings and reports.


@dataclass
class Finding:
    """One difference found after a step.

    Args:
        what: ``outcome``, ``return``, ``refused call changed the state``, ``input changed``,
            ``states``, ``drafter_rows``, ``last_pair_key``, ``export_state`` or ``contract``.
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

    def __str__(self) -> str:
        where = self.where()
        lines = [
            f"scenario {self.scenario_index} ({self.generator}, scenario seed {self.scenario_seed}), step {self.step}: {self.op}"
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
        )
        gens = ", ".join(f"{g} {n}" for g, n in self.by_generator.items())
        lines = [head, f"scenarios {self.scenarios_run} ({gens})   steps {self.steps_run}   {self.seconds:.1f} s", ""]
        cols = ["ok", "noop", "RuntimeError", "ValueError"]
        lines.append(f"{'call':<10}" + "".join(f"{c:>14}" for c in cols) + f"{'total':>10}")
        for kind in ("info", "alloc", "free", "prefill", "catchup", "propose", "verify"):
            row = self.outcomes.get(kind, {})
            lines.append(f"{kind:<10}" + "".join(f"{row.get(c, 0):>14}" for c in cols) + f"{sum(row.values()):>10}")
        lines.append("")
        if self.ok:
            lines.append("RESULT: PASS: every step equal byte for byte")
        else:
            lines.append("RESULT: FAIL")
            lines.append(str(self.first_difference))
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# The lockstep.


def _index_parts(index: tuple[int, ...] | None) -> tuple[int | None, int | None]:
    if not index:
        return None, None
    if len(index) == 1:
        return None, index[0]
    return index[0], index[-1]


class Lockstep:
    """Two sides stepping through the same ops.

    Args:
        candidate, baseline: the two sides (fresh proposers, no states yet).
    """

    def __init__(self, candidate: Side, baseline: Side) -> None:
        self.candidate, self.baseline = candidate, baseline

    def step(self, op: Op) -> Finding | None:
        """Run ``op`` on both sides; the first difference, or None."""
        c, b = self.candidate, self.baseline
        before = {"candidate": c.view(), "baseline": b.view()}
        out_b, args_b = b.call(op)
        out_c, args_c = c.call(op)

        state = op.state if op.state >= 0 else None
        if out_c.error is not out_b.error:
            return Finding("outcome", state=state, candidate=str(out_c), baseline=str(out_b), detail="the calls ended differently")
        if out_c.error is None and not _same_value(out_c.value, out_b.value):
            f = Finding("return", state=state, candidate=repr(out_c.value), baseline=repr(out_b.value), detail="the calls returned different values")
            if isinstance(out_c.value, list) and isinstance(out_b.value, list):
                f.tensor = "drafts"
                f.element = next((i for i, (x, y) in enumerate(zip(out_c.value, out_b.value)) if x != y), min(len(out_c.value), len(out_b.value)))
                f.detail = f"the drafts differ from draft {f.element + 1} on"
            also = self._compare(c.view(), b.view())
            if also is not None:  # where the rows went apart helps more than the token ids do
                f.detail += f"; also {also.where()}: {also.candidate} vs {also.baseline}"
            return f

        for side, args in ((c, args_c), (b, args_b)):
            f = self._inputs_intact(side, op, args)
            if f:
                return f
        after = {"candidate": c.view(), "baseline": b.view()}
        if out_c.error is not None:
            for label in ("baseline", "candidate"):
                f = self._unchanged(label, before[label], after[label], out_b if label == "baseline" else out_c)
                if f:
                    return f
        f = self._compare(after["candidate"], after["baseline"])
        if f:
            return f
        for label, out, views in (("baseline", out_b, after["baseline"]), ("candidate", out_c, after["candidate"])):
            f = self._contract(label, op, out, views, before[label])
            if f:
                return f
        return None

    def _inputs_intact(self, side: Side, op: Op, args: dict[str, Any]) -> Finding | None:
        fresh = {k: side._arg(v, side.drafts[op.state] if 0 <= op.state < len(side.drafts) else []) for k, v in op.args.items()
                 if isinstance(v, Hidden)}
        for k, t in fresh.items():
            given = args[k]
            if isinstance(t, Tensor) and t.device.type != "meta" and first_mismatch(given, t) is not None:
                m = first_mismatch(given, t)
                return Finding("input changed", side=side.label, tensor=k, candidate=m.candidate, baseline=m.baseline,
                               detail=f"{side.label} wrote into its argument {k} (element {m.index})")
        return None

    @staticmethod
    def _unchanged(label: str, before: list[StateView], after: list[StateView], out: Outcome) -> Finding | None:
        if len(before) != len(after):
            return Finding("refused call changed the state", side=label, detail=f"{out}; states {len(before)} -> {len(after)}")
        for i, (x, y) in enumerate(zip(before, after)):
            rule = "a refused call leaves the state byte-identical"
            if x.rows != y.rows or x.pair_key != y.pair_key or x.error != y.error:
                seen = f"drafter_rows {x.rows} -> {y.rows}, last_pair_key {x.pair_key} -> {y.pair_key}"
                c, b = (seen, rule) if label == "candidate" else (rule, seen)
                return Finding("refused call changed the state", side=label, state=i, candidate=c, baseline=b, detail=f"{label} {out}")
            if x.export is not None and y.export is not None and not snapshots_equal(x.export, y.export):
                key = next(k for k in x.export if k not in y.export or first_mismatch(y.export[k], x.export[k]) is not None)
                m = first_mismatch(y.export[key], x.export[key]) if key in y.export else None
                row, el = _index_parts(m.index if m else None)
                seen = f"{key} before {m.baseline if m else '?'}, after {m.candidate if m else 'missing'}"
                c, b = (seen, rule) if label == "candidate" else (rule, seen)
                return Finding("refused call changed the state", side=label, state=i, tensor=key, row=row, element=el,
                               candidate=c, baseline=b, detail=f"{label} {out}, yet export_state changed")
        return None

    @staticmethod
    def _compare(cv: list[StateView], bv: list[StateView]) -> Finding | None:
        if len(cv) != len(bv):
            return Finding("states", candidate=f"{len(cv)} states", baseline=f"{len(bv)} states", detail="different numbers of states")
        for i, (x, y) in enumerate(zip(cv, bv)):
            if x.error or y.error:
                if x.error != y.error:
                    return Finding("export_state", state=i, candidate=x.error or "ok", baseline=y.error or "ok", detail="a query raised")
                continue
            if not _same_value(x.rows, y.rows):
                return Finding("drafter_rows", state=i, candidate=repr(x.rows), baseline=repr(y.rows), detail="drafter_rows differ")
            if not _same_value(x.pair_key, y.pair_key):
                return Finding("last_pair_key", state=i, candidate=repr(x.pair_key), baseline=repr(y.pair_key), detail="last_pair_key differ")
            if x.export.keys() != y.export.keys():
                return Finding("export_state", state=i, candidate=str(sorted(x.export)), baseline=str(sorted(y.export)), detail="key sets differ")
            keys = [k for k in EXPORT_KEYS if k in x.export] + sorted(k for k in x.export if k not in EXPORT_KEYS)
            for k in keys:
                m = first_mismatch(x.export[k], y.export[k])
                if m is not None:
                    row, el = _index_parts(m.index)
                    n = f" ({m.count} elements differ)" if m.count else ""
                    return Finding("export_state", state=i, tensor=k, row=row, element=el, candidate=m.candidate, baseline=m.baseline,
                                   detail=m.detail + n)
        return None

    def _contract(self, label: str, op: Op, out: Outcome, views: list[StateView], before: list[StateView]) -> Finding | None:
        """The side against the spec (``op.expect``, ``op.returns``, ``op.rows_after``) and the export contract."""
        def bad(detail: str, seen: str, spec: str, state: int | None = None) -> Finding:
            c, b = (seen, spec) if label == "candidate" else (spec, seen)
            return Finding("contract", side=label, state=state, candidate=c, baseline=b, detail=detail)

        expect = "ok" if op.expect == "noop" else op.expect
        if out.kind != expect:
            return bad("outcome differs from the spec", str(out), op.expect + (f" ({op.note})" if op.note else ""))
        if out.error is None:
            if op.kind == "info":
                got = {k: out.value[k] for k in op.returns}
                if got != op.returns:
                    return bad("info differs from the spec", repr(got), repr(op.returns))
            elif op.kind == "propose":
                if not isinstance(out.value, list) or len(out.value) != op.returns or not all(
                    type(t) is int and 0 <= t < self.baseline.config.vocab_size for t in out.value
                ):
                    return bad("propose must return a list of num_drafts token ids", repr(out.value), f"{op.returns} ids")
            elif op.kind in ("prefill", "catchup"):
                if type(out.value) is not int or out.value != op.returns:
                    return bad("rows written differ from the spec", repr(out.value), repr(op.returns))
            elif out.value is not None:
                return bad("the call must return None", repr(out.value), "None")
        if op.expect == "noop" and op.state >= 0:
            x, y = before[op.state], views[op.state]
            if x.export is not None and y.export is not None and not snapshots_equal(x.export, y.export):
                return bad("a no-op changed export_state", "changed", "unchanged", op.state)
        for i, v in enumerate(views):
            if v.error:
                return bad("a query raised", v.error, "drafter_rows, last_pair_key and export_state work on any state", i)
            want = None if v.rows == 0 else v.rows - 1
            if v.pair_key != want:
                return bad("last_pair_key must be drafter_rows - 1 (or None)", repr(v.pair_key), repr(want), i)
            if tuple(v.export.keys()) != EXPORT_KEYS and set(v.export) != set(EXPORT_KEYS):
                return bad("export_state keys", str(sorted(v.export)), str(sorted(EXPORT_KEYS)), i)
            if int(v.export["seq_len"]) != v.rows or v.export["kv_rows"].shape[0] != v.rows or v.export["index_rows"].shape[0] != v.rows:
                return bad("export_state rows must match drafter_rows", f"seq_len {int(v.export['seq_len'])}, kv_rows {tuple(v.export['kv_rows'].shape)}",
                           f"{v.rows} rows", i)
        if op.state >= 0 and op.state < len(views) and op.rows_after is not None and views[op.state].rows != op.rows_after:
            return bad("drafter_rows after the call differ from the spec", repr(views[op.state].rows), repr(op.rows_after), op.state)
        return None


# ------------------------------------------------------------------------------------------------


@dataclass
class Harness:
    """Everything two runs of a scenario share: backends, config, weights, device and dtype.

    Args:
        candidate, baseline: backend specs (see ``resolve_backend``).
        preset: an ``MtpConfig`` preset name (or a config).
        dtype, device: of the weights and every hidden argument.
        max_seq_len: what both proposers are built with.
        weights_seed: seed of ``MtpWeights.random``; each side gets its own copy of the same bytes.
    """

    candidate: str | Factory
    baseline: str | Factory
    preset: str | MtpConfig = "tiny"
    dtype: torch.dtype = torch.bfloat16
    device: torch.device | str = "cpu"
    max_seq_len: int = 64
    weights_seed: int = 0

    def __post_init__(self) -> None:
        self.config = self.preset if isinstance(self.preset, MtpConfig) else MtpConfig.preset(self.preset)
        self.device = torch.device(self.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: CUDA is not available here")
        self.dtype = parse_dtype(self.dtype)
        self.candidate_name, self._cand = resolve_backend(self.candidate)
        self.baseline_name, self._base = resolve_backend(self.baseline)
        # Two copies of the same bytes: a backend that writes into its weights cannot move the other.
        self.weights = [MtpWeights.random(self.config, seed=self.weights_seed, dtype=self.dtype, device=self.device) for _ in range(2)]

    def lockstep(self) -> Lockstep:
        """Fresh proposers on both sides (nothing carries over from an earlier scenario)."""
        return Lockstep(
            Side("candidate", self._cand(self.weights[0], self.max_seq_len), self.config, self.dtype, self.device),
            Side("baseline", self._base(self.weights[1], self.max_seq_len), self.config, self.dtype, self.device),
        )


def replay_command(h: Harness, seed: int, index: int, generators: Sequence[str], max_drafts: int, scenario_file: str | None = None) -> str:
    """The one-line CLI call that replays scenario ``index`` of run ``seed`` alone (or the
    scenario saved in ``scenario_file``)."""
    args = [
        "python", "-m", "glm_mtp.conformance",
        "--candidate", h.candidate_name, "--baseline", h.baseline_name,
        "--device", str(h.device), "--dtype", dtype_name(h.dtype),
        "--preset", h.preset if isinstance(h.preset, str) else "<custom MtpConfig>",
        "--max-seq-len", str(h.max_seq_len),
    ]
    args += ["--scenario-file", scenario_file] if scenario_file else ["--seed", str(seed), "--scenario-index", str(index)]
    if h.weights_seed:
        args += ["--weights-seed", str(h.weights_seed)]
    if tuple(generators) != GENERATORS:
        args += ["--generators", ",".join(generators)]
    if max_drafts != MAX_DRAFTS:
        args += ["--max-drafts", str(max_drafts)]
    return " ".join(shlex.quote(a) for a in args)


def run_scenario(h: Harness, sc: Scenario) -> tuple[int, Finding | None, int]:
    """Play one scenario in lockstep; ``(steps run, the first finding, failing step index)``."""
    ls = h.lockstep()
    for i, op in enumerate(sc.ops):
        f = ls.step(op)
        if f is not None:
            return i + 1, f, i
    return len(sc.ops), None, -1


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
        generators: which generators take turns (``realistic``, ``adversarial``).
        weights_seed: seed of the random weights.
        max_drafts: the largest ``num_drafts`` a valid propose uses.
        scenario_file: run the scenario saved in this JSON file alone (``save_scenario``; the
            hypothesis machine writes one on a failure); ``seed`` and ``scenarios`` are ignored.

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
    h = Harness(candidate, baseline, preset, parse_dtype(dtype), device, max_seq_len, weights_seed)
    indices = [0] if scenario_file else [scenario_index] if scenario_index is not None else range(scenarios)
    steps, ran, first = 0, 0, None
    by_gen: Counter[str] = Counter()
    outcomes: dict[str, Counter[str]] = defaultdict(Counter)
    for index in indices:
        sc = load_scenario(scenario_file) if scenario_file else scenario(seed, index, h.config, max_seq_len, generators, max_drafts)
        n, finding, at = run_scenario(h, sc)
        steps, ran = steps + n, ran + 1
        by_gen[sc.generator] += 1
        for op in sc.ops[:n]:
            outcomes[op.kind][op.expect] += 1
        if finding is not None:
            op = sc.ops[at]
            first = Difference(
                **asdict(finding), scenario_index=index, scenario_seed=sc.scenario_seed, generator=sc.generator,
                step=at, op=op.call(), op_args=op.to_dict()["args"], expect=op.expect + (f" ({op.note})" if op.note else ""),
                replay=replay_command(h, seed, index, generators, max_drafts, scenario_file),
            )
            break
    return Report(
        ok=first is None, scenarios_run=ran, steps_run=steps, first_difference=first,
        candidate=h.candidate_name, baseline=h.baseline_name, device=str(h.device), dtype=dtype_name(h.dtype),
        preset=preset if isinstance(preset, str) else "<custom>", max_seq_len=max_seq_len, seed=seed,
        weights_seed=weights_seed, generators=generators, scenario_index=scenario_index,
        seconds=time.perf_counter() - t0, by_generator=dict(by_gen), outcomes={k: dict(v) for k, v in outcomes.items()},
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
        sc = scenario(seed, index, h.config, max_seq_len)
        side = h.lockstep().candidate
        for step, op in enumerate(sc.ops):
            out, _ = side.call(op)
            outcomes.append(f"{index}/{step}: {out.kind} {out.value!r}")
            for i, v in enumerate(side.view()):
                outcomes.append(f"{index}/{step}/{i}: rows {v.rows} key {v.pair_key} {v.error}")
                for k, t in (v.export or {}).items():
                    tensors[f"{index}/{step}/{i}/{k}"] = t.detach().cpu()
    return outcomes, tensors
