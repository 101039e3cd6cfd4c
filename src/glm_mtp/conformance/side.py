"""One side of the lockstep: a proposer, the states a scenario has on it, and how a call ended.

``Side.call(op)`` turns an ``Op``'s arguments (data) into tensors for this side and runs the call
(a grammar into a fresh matcher of this side's own, DESIGN.md §10; a sampling into
``propose_sampled``'s temperature and noise); ``Side.view()`` reads every state back
(``drafter_rows``, ``last_pair_key``, ``export_state``, and with ``confidences`` a pending
propose's ``draft_confidence``, §12).

A batched op (``propose_batch``, ``catchup_batch``) is played one of two ways. A side built with
``per_state=True`` (the lockstep's baseline) plays a batch the spec predicts valid as the single
calls (``propose`` / ``catchup_drafter`` of one row) on each state alone, in index order, so the
candidate's batch is compared with what each state's own calls produce; a batch the spec predicts
refused it hands to its own proposer's batched call (the refusal's type and the untouched states
are then checked against the spec too). Every other side calls the batched method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from glm_mtp.reference import MtpConfig
from glm_mtp.reference.contract import DraftProposer
from glm_mtp.reference.numerics import acc_dtype

from .compare import first_mismatch
from .grammars import Grammar
from .ops import FOREIGN, Hidden, Op, Sampling, TokenIds, other_device, valid_int

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
    confidence: tuple[Tensor, Tensor] | None = None  # (prob, margin) of the pending propose (§12)


class Side:
    """A proposer and the states (and latest drafts) a scenario has on it.

    Args:
        label: ``candidate`` or ``baseline``.
        proposer: the drafter.
        config, dtype, device: what its arguments are built for.
        per_state: play a batch the spec predicts valid as single calls on each state alone.
        confidences: read each pending propose's ``draft_confidence`` in ``view`` (both sides take
            grammars and report confidences: ``contract.takes_grammars``).
        foreign: builds a state of another drafter (same backend, other weights) for the
            ``FOREIGN`` entries of a batch; built on first use, once.
    """

    def __init__(self, label: str, proposer: DraftProposer, config: MtpConfig, dtype: torch.dtype, device: torch.device,
                 per_state: bool = False, foreign: Callable[[], Any] | None = None, confidences: bool = False) -> None:
        self.label, self.proposer, self.config, self.dtype, self.device = label, proposer, config, dtype, device
        self.per_state, self._make_foreign, self._foreign = per_state, foreign, None
        self.confidences = confidences
        self.states: list[Any] = []
        self.drafts: list[list[int]] = []

    def batch_states(self, op: Op) -> list[Any]:
        """The states a batched op names (a ``FOREIGN`` entry: this side's state of another drafter)."""
        out: list[Any] = []
        for i in op.args["states"]:
            if i == FOREIGN:
                if self._foreign is None:
                    if self._make_foreign is None:
                        raise AssertionError(f"{self.label}: no foreign drafter to take a state of another "
                                             "drafter from")
                    self._foreign = self._make_foreign()
                out.append(self._foreign)
            else:
                out.append(self.states[i])
        return out

    def _batch_args(self, op: Op) -> dict[str, Any]:
        rows = [self.drafts[i] if i != FOREIGN else [] for i in op.args["states"]]
        out = {}
        for k, v in op.args.items():
            if isinstance(v, TokenIds):
                out[k] = v.materialize_rows(rows, self.device)
            elif k != "states":
                out[k] = self._arg(v, [])
        return out

    def _call_batch(self, op: Op, args: dict[str, Any]) -> Any:
        p, states, idx = self.proposer, self.batch_states(op), op.args["states"]
        if self.per_state and op.expect in ("ok", "noop"):
            # The baseline of a valid batch: each state's own single call, in index order.
            if op.kind == "propose_batch":
                ids, pos = op.args["last_tokens"].resolve_rows([self.drafts[i] for i in idx]), op.args["positions"].ids
                h, matchers = args["target_hiddens"], args.get("grammars") or [None] * len(states)
                value: Any = [
                    p.propose(ids[b], h[b : b + 1], pos[b], args["num_drafts"], st, **grammar_kw(matchers[b]))
                    for b, st in enumerate(states)
                ]
            else:
                ids, bases, h = (
                    op.args["tokens"].resolve_rows([self.drafts[i] for i in idx]),
                    op.args["row_bases"].ids,
                    args["hiddens"],
                )
                value = [
                    p.catchup_drafter([ids[b]], h[b : b + 1], bases[b], bases[b], st) for b, st in enumerate(states)
                ]
        elif op.kind == "propose_batch":
            kw = {"grammars": args["grammars"]} if "grammars" in args else {}
            value = p.propose_batch(args["last_tokens"], args["target_hiddens"], args["positions"], args["num_drafts"],
                                    states, **kw)
        else:
            value = p.catchup_batch(args["tokens"], args["hiddens"], args["row_bases"], states)
        if op.kind == "propose_batch" and isinstance(value, list) and len(value) == len(idx):
            for i, drafts in zip(idx, value):
                if i != FOREIGN and isinstance(drafts, list):
                    self.drafts[i] = list(drafts)
        return value

    def _arg(self, v: Any, drafts: list[int]) -> Any:
        if isinstance(v, Hidden):
            return v.materialize(self.config.hidden_size, self.dtype, self.device)
        if isinstance(v, TokenIds):
            return v.materialize(drafts, self.device)
        if isinstance(v, Grammar):
            return v.matcher(self.config.vocab_size)
        if isinstance(v, tuple) and any(isinstance(g, Grammar) for g in v):  # a batch's grammars
            return [g.matcher(self.config.vocab_size) if g is not None else None for g in v]
        return v

    def _propose(self, args: dict[str, Any], sampling: Sampling | None, st: Any) -> Any:
        """``propose``, or ``propose_sampled`` with the sampling's temperature and noise (k, V) in A;
        with the op's grammar (a matcher of this side's) when it has one."""
        p, k, kw = self.proposer, args["num_drafts"], grammar_kw(args.get("grammar"))
        if sampling is None:
            return p.propose(args["last_token"], args["target_hidden"], args["position"], k, st, **kw)
        noise = sampling.noise(k if valid_int(k) else 0, self.config.vocab_size, acc_dtype(self.dtype), self.device)
        return p.propose_sampled(args["last_token"], args["target_hidden"], args["position"], k,  # type: ignore[attr-defined]  # propose_sampled is not in the base contract; a side runs it only on a drafter that has it
                                 sampling.temperature, noise, st, **kw)

    def call(self, op: Op) -> tuple[Outcome, dict[str, Any]]:
        """Run ``op``; returns the outcome and the arguments passed (to check they are intact)."""
        p = self.proposer
        drafts = self.drafts[op.state] if 0 <= op.state < len(self.drafts) else []
        batch = op.kind in ("propose_batch", "catchup_batch")
        args = self._batch_args(op) if batch else {k: self._arg(v, drafts) for k, v in op.args.items()}
        value: Any
        try:
            if batch:
                value = self._call_batch(op, args)
            elif op.kind == "info":
                value = {
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
                    # kept, not assumed None: a backend returning something differs from one that does not
                    value = p.free_state(st)  # type: ignore[func-returns-value]
                elif op.kind == "prefill":
                    value = p.prefill_drafter(args["prompt_tokens"], args["hiddens"], st)
                elif op.kind == "catchup":
                    value = p.catchup_drafter(args["tokens"], args["hiddens"], args["row_base"], args["pos_base"], st)
                elif op.kind == "propose":
                    value = self._propose(args, op.args.get("sampling"), st)
                    drafts = getattr(value, "drafts", value)  # a sampled propose's SampledDrafts
                    if isinstance(drafts, list):
                        self.drafts[op.state] = list(drafts)
                elif op.kind == "verify":
                    value = p.after_verify(args["num_accepted"], st)  # type: ignore[func-returns-value]  # as free
                else:
                    raise AssertionError(f"unknown op kind {op.kind!r}")
        except Exception as e:  # noqa: BLE001  the exception type is what we compare
            return Outcome(error=type(e), message=str(e).splitlines()[0] if str(e) else ""), args
        return Outcome(value=value), args

    def view(self) -> list[StateView]:
        out = []
        for st in self.states:
            try:
                export = self.proposer.export_state(st)
                v = StateView(self.proposer.drafter_rows(st), self.proposer.last_pair_key(st), export)
                if self.confidences and bool(export["pending"]):
                    v.confidence = self.proposer.draft_confidence(st)  # type: ignore[attr-defined]  # draft_confidence is not in the base contract; asked only with confidences on
                out.append(v)
            except Exception as e:  # noqa: BLE001
                out.append(StateView(None, None, None, f"{type(e).__name__}: {e}"))
        return out


def grammar_kw(matcher: Any) -> dict[str, Any]:
    """``grammar=`` for a propose whose op has a grammar (a matcher, or the broken object a
    faulty grammar makes); a call without one passes nothing, so a drafter without grammars
    plays every other op as it is."""
    return {"grammar": matcher} if matcher is not None else {}
