"""One side of the lockstep: a proposer, the states a scenario has on it, and how a call ended.

``Side.call(op)`` turns an ``Op``'s arguments (data) into tensors for this side and runs the call;
``Side.view()`` reads every state back (``drafter_rows``, ``last_pair_key``, ``export_state``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from glm_mtp.reference import MtpConfig
from glm_mtp.reference.proposer import DraftProposer

from .compare import first_mismatch
from .spec import Hidden, Op, TokenIds, other_device

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
        if isinstance(v, TokenIds):
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
