"""The lockstep: two sides, the same weights, the same calls, compared byte for byte.

``Lockstep.step(op)`` plays one op on both sides (``side.py``) and, after it, compares:

- the outcome: the value returned (drafts, rows written), or the exception type raised;
- for a refused call, that it left every state's ``export_state`` byte-identical (both sides);
- that no call changed the tensors it was given, and that every grammar's matcher is left as
  the call found it (DESIGN.md §10);
- for every state: ``drafter_rows``, ``last_pair_key``, and every tensor of ``export_state``
  (key set, dtype, shape, device type, bytes), and a pending propose's ``draft_confidence``
  (§12; when both sides take grammars);
- the contract: the baseline's (then the candidate's) outcome, return and rows against what the
  spec predicts (``SpecModel``), exported keys, and ``seq_len`` agreeing with ``drafter_rows``.

It returns the first difference as a ``Finding`` (``report.py``). A ``Harness`` holds what two
runs of a scenario share (backends, config, weights) and builds fresh lockstep pairs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.reference.contract import takes_grammars
from glm_mtp.reference.numerics import acc_dtype
from glm_mtp.registry import parse_dtype

from .backends import BackendError, Factory, resolve_backend
from .compare import EXPORT_KEYS, export_keys, first_mismatch, snapshots_equal
from .grammars import is_matcher
from .report import Finding
from .scenarios import Scenario
from .side import Outcome, Side, StateView, _same_value
from .ops import Hidden, Op

BATCH_KINDS = ("propose_batch", "catchup_batch")


def _same_confidence(a: tuple[Tensor, Tensor] | None, b: tuple[Tensor, Tensor] | None) -> bool:
    """Both None, or (prob, margin) byte-equal."""
    if a is None or b is None:
        return a is b
    return all(first_mismatch(x, y) is None for x, y in zip(a, b))


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
            return Finding("outcome", state=state, candidate=str(out_c), baseline=str(out_b),
                           detail="the calls ended differently")
        if out_c.error is None and not _same_value(out_c.value, out_b.value):
            f = Finding("return", state=state, candidate=repr(out_c.value), baseline=repr(out_b.value),
                        detail="the calls returned different values")
            if op.kind in BATCH_KINDS and isinstance(out_c.value, list) and isinstance(out_b.value, list):
                at = next((i for i, (x, y) in enumerate(zip(out_c.value, out_b.value)) if not _same_value(x, y)), None)
                if at is not None and at < len(op.args["states"]):
                    f.state = op.args["states"][at] if isinstance(op.args["states"][at], int) else None
                    f.detail = (f"the batch returned different values for states[{at}]: {out_c.value[at]!r} vs "
                                f"{out_b.value[at]!r}")
                else:
                    f.detail = f"the batch returned {len(out_c.value)} entries vs {len(out_b.value)}"
            elif isinstance(out_c.value, list) and isinstance(out_b.value, list):
                f.tensor = "drafts"
                f.element = next((i for i, (x, y) in enumerate(zip(out_c.value, out_b.value)) if x != y),
                                 min(len(out_c.value), len(out_b.value)))
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
        matchers = [args["grammar"]] if "grammar" in args else list(args.get("grammars") or ())
        for m in matchers:
            if is_matcher(m) and not m.as_found():
                return Finding("matcher", side=side.label, tensor="grammar", candidate=m.where(),
                               baseline="as the call found it",
                               detail=f"{side.label} left its grammar's matcher moved: a propose rolls back every "
                                      "token it accepted (DESIGN.md §10)")
        return self._tensors_intact(side, op, args)

    def _tensors_intact(self, side: Side, op: Op, args: dict[str, Any]) -> Finding | None:
        fresh = {
            k: side._arg(v, side.drafts[op.state] if 0 <= op.state < len(side.drafts) else [])
            for k, v in op.args.items()
            if isinstance(v, Hidden)
        }
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
            return Finding("refused call changed the state", side=label,
                           detail=f"{out}; states {len(before)} -> {len(after)}")
        for i, (x, y) in enumerate(zip(before, after)):
            rule = "a refused call leaves the state byte-identical"
            if x.rows != y.rows or x.pair_key != y.pair_key or x.error != y.error:
                seen = f"drafter_rows {x.rows} -> {y.rows}, last_pair_key {x.pair_key} -> {y.pair_key}"
                c, b = (seen, rule) if label == "candidate" else (rule, seen)
                return Finding("refused call changed the state", side=label, state=i, candidate=c, baseline=b,
                               detail=f"{label} {out}")
            if not _same_confidence(x.confidence, y.confidence):
                seen = "draft_confidence changed"
                c, b = (seen, rule) if label == "candidate" else (rule, seen)
                return Finding("refused call changed the state", side=label, state=i, tensor="confidence",
                               candidate=c, baseline=b, detail=f"{label} {out}")
            if x.export is not None and y.export is not None and not snapshots_equal(x.export, y.export):
                key = next(
                    k for k in x.export if k not in y.export or first_mismatch(y.export[k], x.export[k]) is not None
                )
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
            return Finding("states", candidate=f"{len(cv)} states", baseline=f"{len(bv)} states",
                           detail="different numbers of states")
        for i, (x, y) in enumerate(zip(cv, bv)):
            if x.error or y.error:
                if x.error != y.error:
                    return Finding("export_state", state=i, candidate=x.error or "ok", baseline=y.error or "ok",
                                   detail="a query raised")
                continue
            if not _same_value(x.rows, y.rows):
                return Finding("drafter_rows", state=i, candidate=repr(x.rows), baseline=repr(y.rows),
                               detail="drafter_rows differ")
            if not _same_value(x.pair_key, y.pair_key):
                return Finding("last_pair_key", state=i, candidate=repr(x.pair_key), baseline=repr(y.pair_key),
                               detail="last_pair_key differ")
            if x.export.keys() != y.export.keys():
                return Finding("export_state", state=i, candidate=str(sorted(x.export)), baseline=str(sorted(y.export)),
                               detail="key sets differ")
            keys = [k for k in EXPORT_KEYS if k in x.export] + sorted(k for k in x.export if k not in EXPORT_KEYS)
            for k in keys:
                m = first_mismatch(x.export[k], y.export[k])
                if m is not None:
                    row, el = _index_parts(m.index)
                    n = f" ({m.count} elements differ)" if m.count else ""
                    return Finding("export_state", state=i, tensor=k, row=row, element=el, candidate=m.candidate,
                                   baseline=m.baseline,
                                   detail=m.detail + n)
            if (x.confidence is None) != (y.confidence is None):
                return Finding("confidence", state=i, candidate=repr(x.confidence), baseline=repr(y.confidence),
                               detail="one side reports the pending propose's confidence, the other does not")
            for k, a, b in zip(("prob", "margin"), x.confidence or (), y.confidence or ()):
                m = first_mismatch(a, b)
                if m is not None:
                    return Finding("confidence", state=i, tensor=k, element=m.index[0] if m.index else None,
                                   candidate=m.candidate, baseline=m.baseline,
                                   detail=f"draft_confidence's {k} differ ({m.detail})")
        return None

    def _contract(self, label: str, op: Op, out: Outcome, views: list[StateView],
                  before: list[StateView]) -> Finding | None:
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
                sampled = "sampling" in op.args
                drafts = getattr(out.value, "drafts", None) if sampled else out.value
                if not isinstance(drafts, list) or len(drafts) != op.returns or not all(
                    type(t) is int and 0 <= t < self.baseline.config.vocab_size for t in drafts
                ):
                    return bad("propose must return a list of num_drafts token ids (fewer where its grammar stops it)",
                               repr(out.value), f"{op.returns} ids")
                q = getattr(out.value, "q", None)
                V, A = self.baseline.config.vocab_size, acc_dtype(self.baseline.dtype)
                if sampled and (not isinstance(q, Tensor) or tuple(q.shape) != (op.returns, V) or q.dtype != A):
                    return bad("propose_sampled's q is (drafts, V) in A", repr(getattr(q, "shape", q)),
                               f"({op.returns}, {V}) {A}")
            elif op.kind in ("prefill", "catchup"):
                if type(out.value) is not int or out.value != op.returns:
                    return bad("rows written differ from the spec", repr(out.value), repr(op.returns))
            elif op.kind == "propose_batch":
                V = self.baseline.config.vocab_size
                if not isinstance(out.value, list) or len(out.value) != len(op.returns) or not all(
                    isinstance(d, list) and len(d) == k and all(type(t) is int and 0 <= t < V for t in d)
                    for d, k in zip(out.value, op.returns)
                ):
                    return bad("propose_batch must return one list of num_drafts token ids per state", repr(out.value),
                               f"{op.returns} ids per state")
            elif op.kind == "catchup_batch":
                if not isinstance(out.value, list) or len(out.value) != len(op.returns) or not all(
                    type(v) is int for v in out.value) or out.value != op.returns:
                    return bad("catchup_batch: rows written per state differ from the spec", repr(out.value),
                               repr(op.returns))
            elif out.value is not None:
                return bad("the call must return None", repr(out.value), "None")
        if op.expect == "noop" and op.state >= 0:
            x, y = before[op.state], views[op.state]
            if x.export is not None and y.export is not None and not snapshots_equal(x.export, y.export):
                return bad("a no-op changed export_state", "changed", "unchanged", op.state)
        for i, v in enumerate(views):
            if v.error:
                return bad("a query raised", v.error, "drafter_rows, last_pair_key and export_state work on any state",
                           i)
            want = None if v.rows == 0 else v.rows - 1
            if v.pair_key != want:
                return bad("last_pair_key must be drafter_rows - 1 (or None)", repr(v.pair_key), repr(want), i)
            keys = export_keys(self.baseline.config)
            if tuple(v.export.keys()) != keys and set(v.export) != set(keys):
                return bad("export_state keys", str(sorted(v.export)), str(sorted(keys)), i)
            if (
                int(v.export["seq_len"]) != v.rows
                or v.export["kv_rows"].shape[0] != v.rows
                or v.export["index_rows"].shape[0] != v.rows
            ):
                return bad("export_state rows must match drafter_rows",
                           f"seq_len {int(v.export['seq_len'])}, kv_rows {tuple(v.export['kv_rows'].shape)}",
                           f"{v.rows} rows", i)
            if v.confidence is not None:
                A, n = acc_dtype(self.baseline.dtype), int(v.export["last_drafted"])
                if any(t.dtype != A or tuple(t.shape) != (n,) for t in v.confidence):
                    return bad("draft_confidence is (prob, margin), each (last_drafted,) in A",
                               str([(t.dtype, tuple(t.shape)) for t in v.confidence]), f"({n},) {A}", i)
            kpool_rule = self.kpool_contract(v)
            if kpool_rule is not None:
                return bad(*kpool_rule, i)
        if (
            op.state >= 0
            and op.state < len(views)
            and op.rows_after is not None
            and views[op.state].rows != op.rows_after
        ):
            return bad("drafter_rows after the call differ from the spec", repr(views[op.state].rows),
                       repr(op.rows_after), op.state)
        if op.kind in BATCH_KINDS:
            for b, (i, rows) in enumerate(zip(op.args["states"], op.rows_after or ())):
                if not isinstance(i, int) or i >= len(views):
                    continue
                if views[i].rows != rows:
                    return bad(f"drafter_rows of states[{b}] after the batch differ from the spec", repr(views[i].rows),
                               repr(rows), i)
                x, y = before[i], views[i]
                if (op.kind == "catchup_batch" and out.error is None and op.returns[b] == 0 and x.export is not None
                        and y.export is not None and not snapshots_equal(x.export, y.export)):
                    return bad(f"a row of states[{b}] that writes nothing (row_base != drafter_rows) changed "
                               "export_state",
                               "changed", "unchanged", i)
        return None

    def kpool_contract(self, v: Any) -> tuple[str, str, str] | None:
        """glm5_next: what the rows held say about the KPool export (DESIGN.md §7): pool p is
        complete exactly when its kpool rows are held (a trim into it made it incomplete), one
        pooled key per complete pool and one gate per row. ``(what, saw, spec says)`` or None."""
        cfg = self.baseline.config
        if not getattr(cfg, "is_next", False) or v.export is None or "pool_complete" not in v.export:
            return None
        kp, n = cfg.index_kpool, v.rows
        want = [True] * (n // kp) + [False] * (-(-n // kp) - n // kp)
        got = v.export["pool_complete"].tolist()
        if got != want:
            return "pool_complete must mark exactly the pools whose rows are all held", repr(got), repr(want)
        if v.export["pool_keys"].shape[0] != n // kp or v.export["pool_gates"].shape[0] != n:
            return ("export_state pool rows must match drafter_rows",
                    f"pool_keys {tuple(v.export['pool_keys'].shape)}, pool_gates {tuple(v.export['pool_gates'].shape)}",
                    f"{n // kp} pools, {n} rows")
        return None


@dataclass
class Harness:
    """Everything two runs of a scenario share: backends, config, weights, device and dtype.

    Args:
        candidate, baseline: backend specs (see ``resolve_backend``).
        preset: an ``MtpConfig`` preset name (or a config).
        dtype, device: of the weights and every hidden argument.
        max_seq_len: what both proposers are built with.
        weights_seed: seed of ``MtpWeights.random``; each side gets its own copy of the same bytes.
        grammars: whether the scenarios draw grammars and sampled proposes and the lockstep
            compares confidences (DESIGN.md §10, §12): None, when both backends take them
            (``contract.takes_grammars``, read off one drafter of each); True, required
            (``BackendError`` naming the backend that does not); False, off. Resolved to a bool.
    """

    candidate: str | Factory
    baseline: str | Factory
    preset: str | MtpConfig = "tiny"
    dtype: torch.dtype = torch.bfloat16
    device: torch.device | str = "cpu"
    max_seq_len: int = 64
    weights_seed: int = 0
    grammars: bool | None = None

    def __post_init__(self) -> None:
        self.config = self.preset if isinstance(self.preset, MtpConfig) else MtpConfig.preset(self.preset)
        self.device = torch.device(self.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: CUDA is not available here")
        self.dtype = parse_dtype(self.dtype)
        self.candidate_name, self._cand = resolve_backend(self.candidate)
        self.baseline_name, self._base = resolve_backend(self.baseline)
        # Two copies of the same bytes: a backend that writes into its weights cannot move the other.
        self.weights = [MtpWeights.random(self.config, seed=self.weights_seed, dtype=self.dtype,
                                          device=self.device) for _ in range(2)]
        lacking = [name for name, factory in ((self.candidate_name, self._cand), (self.baseline_name, self._base))
                   if not takes_grammars(factory(self.weights[0], self.max_seq_len))]
        if self.grammars and lacking:
            raise BackendError(f"grammars: backend {lacking[0]!r} does not take grammars or report confidences (no "
                               "draft_confidence: contract.ConstrainedProposer); run it with grammars off")
        self.grammars = not lacking if self.grammars is None else bool(self.grammars)

    def lockstep(self, index_share: bool | None = None) -> Lockstep:
        """Fresh proposers on both sides (nothing carries over from an earlier scenario). The
        baseline plays a valid batch as single calls on each state alone (``Side.per_state``).
        ``index_share``: both sides' weights with index sharing (DESIGN.md §9) on or off
        (``MtpWeights.with_index_share``; None: as the preset says)."""
        weights = [w.with_index_share(index_share) for w in self.weights]
        return Lockstep(
            Side("candidate", self._cand(weights[0], self.max_seq_len), self.config, self.dtype, self.device,
                 foreign=self._foreign(self._cand, weights[0]), confidences=bool(self.grammars)),
            Side("baseline", self._base(weights[1], self.max_seq_len), self.config, self.dtype, self.device,
                 per_state=True, foreign=self._foreign(self._base, weights[1]), confidences=bool(self.grammars)),
        )

    def _foreign(self, factory: Factory, weights: MtpWeights) -> Callable[[], Any]:
        """A state of another drafter of the same backend: one on a shallow copy of the side's
        weights (the same tensors, another object, so ``use_state`` refuses it with ValueError)."""
        def make() -> Any:
            drafter = factory(copy.copy(weights), self.max_seq_len)
            state = drafter.alloc_state(self.device)
            keep.append(drafter)  # the state's owner holds its weights weakly
            return state

        keep: list[Any] = []
        return make


def run_scenario(h: Harness, sc: Scenario) -> tuple[int, Finding | None, int]:
    """Play one scenario in lockstep; ``(steps run, the first finding, failing step index)``."""
    ls = h.lockstep(sc.index_share)
    for i, op in enumerate(sc.ops):
        f = ls.step(op)
        if f is not None:
            return i + 1, f, i
    return len(sc.ops), None, -1
