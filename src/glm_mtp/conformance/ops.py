"""Scenario ops as data: the arguments (``Hidden``, ``TokenIds``) and the ``Op`` one call is.

A scenario is plain data: a list of ``Op`` (call, state index, arguments) with no tensors in it.
Hidden rows are described by a seed (``Hidden``) and drawn from N(0, 1) when the call runs, so a
scenario is the same on every machine and for every backend, and it can be printed or written
to JSON. Token arguments (``TokenIds``) may name the drafts of the state's latest propose
(``"d1"``..), which each backend resolves from what it returned. A propose may carry a grammar
(``grammars.Grammar``, a random token automaton as data; a batch one per state) and a sampling
(``Sampling``: the temperature and the noise's seed, for ``propose_sampled``). ``spec.SpecModel``
builds the ops and stamps each with the outcome the spec predicts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from .grammars import Grammar


# Outcomes an op may expect. "noop" = the call returns 0 (or nothing) and changes nothing.
OUTCOMES = ("ok", "noop", "RuntimeError", "ValueError")


# ------------------------------------------------------------------------------------------------
# Arguments as data.


@dataclass(frozen=True)
class Hidden:
    """A hiddens argument: ``rows`` rows of N(0, 1) drawn from ``seed`` (never zeros).

    Args:
        seed: seeds the CPU generator the rows are drawn from (float32, then cast).
        rows: rows the call expects (``len(tokens)``; 1 for a propose).
        flat: pass one row as ``(hidden_size,)`` instead of ``(1, hidden_size)`` (valid for propose).
        fault: how the argument is broken, or None: ``nan``/``inf`` (one element), ``dtype`` (the
            other float dtype), ``device`` (another device: ``meta`` beside CPU, CPU beside
            CUDA), ``rows`` (one row too many), ``width`` (one column too many), ``3d`` (a
            leading axis), ``int`` (an integer tensor), ``list`` (a Python list, not a tensor);
            for a batch's (B, H) rows also ``nan@b``/``inf@b`` (one element of row b; not in
            ``FAULTS``, which the older generators draw from).
    """

    seed: int
    rows: int
    flat: bool = False
    fault: str | None = None

    FAULTS = ("nan", "inf", "dtype", "device", "rows", "width", "3d", "int", "list")

    def valid_for(self, rows: int) -> bool:
        return self.fault is None and self.rows == rows

    def bad_row(self) -> int | None:
        """The row a ``nan@b``/``inf@b`` fault poisons, else None."""
        if self.fault and "@" in self.fault:
            return int(self.fault.split("@")[1])
        return None

    def row_valid(self, b: int) -> bool:
        """Whether row ``b`` of a batch's rows passes a per-state check (dtype, device, finite);
        the batch's shape (``rows``, ``width``, ``3d``, ``list``) is checked before any row."""
        return self.fault is None or (self.bad_row() is not None and self.bad_row() != b)

    def batch_shape_valid(self, rows: int) -> bool:
        """Whether the argument is a (rows, H) tensor (what a batched call checks first)."""
        return self.rows == rows and self.fault not in ("rows", "width", "3d", "list")

    def materialize(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> Any:
        """The argument as the call receives it."""
        gen = torch.Generator().manual_seed(self.seed)
        rows = self.rows + (self.fault == "rows")
        width = hidden_size + (self.fault == "width")
        v = torch.randn(rows, width, generator=gen)  # (rows, H) float32
        if self.fault in ("nan", "inf") and v.numel():
            at = int(torch.randint(v.numel(), (1,), generator=gen))
            v.view(-1)[at] = float("nan") if self.fault == "nan" else float("-inf") if at % 2 else float("inf")
        if (b := self.bad_row()) is not None and self.fault is not None:  # nan@b / inf@b: one element of row b
            at = int(torch.randint(width, (1,), generator=gen))
            v[b, at] = float("nan") if self.fault.startswith("nan") else float("-inf") if at % 2 else float("inf")
        if self.fault == "list":
            return v.tolist()
        if self.fault == "3d":
            v = v[None]
        if self.flat and v.dim() == 2 and v.shape[0] == 1:
            v = v[0]
        if self.fault == "int":
            return (v * 8).to(torch.int32).to(device)
        dt = other_dtype(dtype) if self.fault == "dtype" else dtype
        dev = other_device(device) if self.fault == "device" else device
        return v.to(dt).to(dev)

    def __str__(self) -> str:
        shape = "(H,)" if self.flat else f"({self.rows}, H)"
        return f"Hidden{shape}[seed={self.seed}{', ' + self.fault if self.fault else ''}]"


@dataclass(frozen=True)
class TokenIds:
    """A token argument: ids, or ``"dN"`` for draft N (1-based) of the state's latest propose.

    Args:
        ids: the ids; may lie outside the vocabulary on purpose.
        form: how they are passed. Token lists: ``list``, ``int64``, ``int32`` (tensors on the
            state's device), ``cpu64`` (an int64 tensor on the CPU); bad: ``float`` (a float
            tensor), ``2d`` (shape (1, n)), ``floats`` (a list of Python floats). A propose's
            single token: ``int``, ``tensor`` (shape (1,)), ``scalar`` (0-dim); bad: ``float``,
            ``pyfloat`` (a Python float), ``bool``, ``2d`` (shape (1, 1)), ``tensor`` of two ids.
    """

    ids: tuple[int | str, ...]
    form: str = "list"

    LIST_FORMS = ("list", "int64", "int32", "cpu64")
    SINGLE_FORMS = ("int", "tensor", "scalar")

    def __len__(self) -> int:
        return len(self.ids)

    def resolve(self, drafts: Sequence[int]) -> list[int]:
        return [drafts[int(i[1:]) - 1] if isinstance(i, str) else i for i in self.ids]

    def valid(self, vocab_size: int, single: bool = False) -> bool:
        forms = self.SINGLE_FORMS if single else self.LIST_FORMS
        if self.form not in forms or (single and len(self.ids) != 1):
            return False
        return all(isinstance(i, str) or 0 <= i < vocab_size for i in self.ids)

    def resolve_rows(self, row_drafts: Sequence[Sequence[int]]) -> list[int]:
        """A batch's ids: ``"dN"`` in row b names draft N of the latest propose of the batch's
        state b (``row_drafts[b]``)."""
        return [
            row_drafts[b][int(i[1:]) - 1] if isinstance(i, str) and b < len(row_drafts) else i
            for b, i in enumerate(self.ids)
        ]

    def materialize_rows(self, row_drafts: Sequence[Sequence[int]], device: torch.device) -> Any:
        """A batch's argument (one id per state) as the call receives it."""
        return self._form(self.resolve_rows(row_drafts), device)

    def materialize(self, drafts: Sequence[int], device: torch.device) -> Any:
        """The argument as the call receives it."""
        return self._form(self.resolve(drafts), device)

    def _form(self, ids: list[int], device: torch.device) -> Any:
        f = self.form
        if f == "list":
            return ids
        if f == "int":
            return ids[0]
        if f == "floats":
            return [float(i) for i in ids]
        if f == "pyfloat":
            return float(ids[0])
        if f == "bool":
            return True
        if f == "scalar":
            return torch.tensor(ids[0], dtype=torch.int64, device=device)
        if f == "cpu64":
            return torch.tensor(ids, dtype=torch.int64)
        dtype = {"int32": torch.int32, "float": torch.float32}.get(f, torch.int64)
        t = torch.tensor(ids, dtype=dtype, device=device)
        return t[None] if f == "2d" else t

    def __str__(self) -> str:
        body = ", ".join(str(i) for i in self.ids)
        return f"[{body}]" + ("" if self.form in ("list", "int") else f":{self.form}")


@dataclass(frozen=True)
class Sampling:
    """A sampled propose's own arguments as data: ``temperature``, and ``noise`` (k, V) in A of
    i.i.d. Exponential(1) draws from ``seed`` (positive and finite)."""

    seed: int
    temperature: float

    def noise(self, num_drafts: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        e = torch.empty(max(num_drafts, 0), vocab_size, dtype=torch.float64).exponential_(generator=gen)
        return e.clamp_min(1e-30).to(dtype).to(device)  # (k, V); the clamp keeps a float32 draw above 0

    def __str__(self) -> str:
        return f"Sampling[T={self.temperature}, seed={self.seed}]"


def other_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype != torch.float32 else torch.bfloat16


def other_device(device: torch.device) -> torch.device:
    # A meta tensor has a shape and a dtype but lives nowhere: a wrong device on a CPU-only box.
    return torch.device("meta") if device.type == "cpu" else torch.device("cpu")


def valid_int(v: Any, minimum: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


# ------------------------------------------------------------------------------------------------
# Ops.


@dataclass(frozen=True)
class Op:
    """One call in a scenario.

    Args:
        kind: ``info``, ``alloc``, ``free``, ``prefill``, ``catchup``, ``propose``, ``verify``,
            ``propose_batch``, ``catchup_batch``.
        state: which of the scenario's states (in order of allocation); -1 for ``info``, for
            an ``alloc`` that is expected to fail and for the batched calls, whose states are
            ``args["states"]`` (a tuple of indices, ``FOREIGN`` for a state of another drafter).
        args: the call's arguments (``TokenIds``, ``Hidden``, ints, or deliberately bad values).
        expect: the outcome the spec predicts, one of ``OUTCOMES``.
        returns: what the call returns when it succeeds: rows written (prefill, catch-up), the
            number of drafts (propose), the expected answers (info); per state of a batch, a
            list: drafts per state (propose_batch), rows written per state (catchup_batch);
            None otherwise.
        rows_after: the state's ``drafter_rows`` after the call; for a batch, a list, one per
            entry of ``args["states"]`` (None for a ``FOREIGN`` entry).
        note: why the op is there (for reports).
    """

    kind: str
    state: int
    args: dict[str, Any]
    expect: str
    returns: Any = None
    rows_after: int | None = None
    note: str = ""

    def call(self) -> str:
        """The call as one readable line."""
        parts = [] if self.state < 0 else [f"state={self.state}"]
        parts += [f"{k}={v}" for k, v in self.args.items()]
        return f"{self.kind}({', '.join(parts)})"

    def to_dict(self) -> dict[str, Any]:
        def arg(v: Any) -> Any:
            if isinstance(v, tuple) and any(isinstance(g, Grammar) for g in v):  # a batch's grammars
                return [arg(g) for g in v]
            return asdict(v) if isinstance(v, (Hidden, TokenIds, Grammar, Sampling)) else v

        args = {k: arg(v) for k, v in self.args.items()}
        return {"kind": self.kind, "state": self.state, "args": args, "expect": self.expect,
                "returns": self.returns, "rows_after": self.rows_after, "note": self.note, "call": self.call()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Op:
        """The inverse of ``to_dict`` (JSON turns tuples into lists; they come back as tuples)."""
        def arg(v: Any) -> Any:
            if isinstance(v, dict) and set(v) == {"seed", "rows", "flat", "fault"}:
                return Hidden(**v)
            if isinstance(v, dict) and set(v) == {"ids", "form"}:
                return TokenIds(tuple(v["ids"]), v["form"])
            if isinstance(v, dict) and set(v) == {"seed", "depth", "start", "end", "liar", "fault"}:
                return Grammar(**v)
            if isinstance(v, dict) and set(v) == {"seed", "temperature"}:
                return Sampling(**v)
            return v

        args = {k: arg(v) for k, v in d["args"].items()}
        if isinstance(args.get("grammars"), list):
            args["grammars"] = tuple(arg(g) for g in args["grammars"])
        if "states" in args and isinstance(args["states"], list):
            args["states"] = tuple(args["states"])
        return cls(d["kind"], d["state"], args, d["expect"],
                   d.get("returns"), d.get("rows_after"), d.get("note", ""))


# A batch's ``states`` entry that names a state allocated by another drafter (other weights).
FOREIGN = "foreign"
