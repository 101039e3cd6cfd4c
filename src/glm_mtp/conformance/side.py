"""One side of the lockstep: a proposer, the states a scenario has on it, and how a call ended.

``Side.call(op)`` turns an ``Op``'s arguments (data) into tensors for this side and runs the call;
``Side.view()`` reads every state back (``drafter_rows``, ``last_pair_key``, ``export_state``).

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

from .compare import first_mismatch
from .ops import FOREIGN, Hidden, Op, TokenIds, other_device

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
        per_state: play a batch the spec predicts valid as single calls on each state alone.
        foreign: builds a state of another drafter (same backend, other weights) for the
            ``FOREIGN`` entries of a batch; built on first use, once.
    """

    def __init__(self, label: str, proposer: DraftProposer, config: MtpConfig, dtype: torch.dtype, device: torch.device,
                 per_state: bool = False, foreign: Callable[[], Any] | None = None) -> None:
        self.label, self.proposer, self.config, self.dtype, self.device = label, proposer, config, dtype, device
        self.per_state, self._make_foreign, self._foreign = per_state, foreign, None
        self.states: list[Any] = []
        self.drafts: list[list[int]] = []

    def batch_states(self, op: Op) -> list[Any]:
        """The states a batched op names (a ``FOREIGN`` entry: this side's state of another drafter)."""
        out = []
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
                h = args["target_hiddens"]
                value: Any = [
                    p.propose(ids[b], h[b : b + 1], pos[b], args["num_drafts"], st) for b, st in enumerate(states)
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
            value = p.propose_batch(args["last_tokens"], args["target_hiddens"], args["positions"], args["num_drafts"],
                                    states)
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
        return v

    def call(self, op: Op) -> tuple[Outcome, dict[str, Any]]:
        """Run ``op``; returns the outcome and the arguments passed (to check they are intact)."""
        p = self.proposer
        drafts = self.drafts[op.state] if 0 <= op.state < len(self.drafts) else []
        batch = op.kind in ("propose_batch", "catchup_batch")
        args = self._batch_args(op) if batch else {k: self._arg(v, drafts) for k, v in op.args.items()}
        try:
            if batch:
                value = self._call_batch(op, args)
            elif op.kind == "info":
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
                    value = p.propose(args["last_token"], args["target_hidden"], args["position"], args["num_drafts"],
                                      st)
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
                out.append(StateView(self.proposer.drafter_rows(st), self.proposer.last_pair_key(st),
                                     self.proposer.export_state(st)))
            except Exception as e:  # noqa: BLE001
                out.append(StateView(None, None, None, f"{type(e).__name__}: {e}"))
        return out
