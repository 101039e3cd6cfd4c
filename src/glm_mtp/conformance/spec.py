"""The spec of the drafter's bookkeeping, as data: scenario arguments, ops and the spec model.

A scenario is plain data: a list of ``Op`` (call, state index, arguments) with no tensors in it.
Hidden rows are described by a seed (``Hidden``) and drawn from N(0, 1) when the call runs, so a
scenario is the same on every machine and for every backend, and it can be printed or written
to JSON. Token arguments (``TokenIds``) may name the drafts of the state's latest propose
(``"d1"``..), which each backend resolves from what it returned.

``SpecModel`` tracks what DESIGN.md §4 says each call does to a state (rows, pending, drafted
count, freed) and stamps every op with the expected outcome, so the lockstep checks the baseline
against the spec as well as the candidate against the baseline. The generators that choose the
ops live in ``scenarios.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.state import num_blocks

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
        if self.bad_row() is not None:  # nan@b / inf@b: one element of row b
            b, at = self.bad_row(), int(torch.randint(width, (1,), generator=gen))
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
        return [row_drafts[b][int(i[1:]) - 1] if isinstance(i, str) and b < len(row_drafts) else i for b, i in enumerate(self.ids)]

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


def other_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype != torch.float32 else torch.bfloat16


def other_device(device: torch.device) -> torch.device:
    # A meta tensor has a shape and a dtype but lives nowhere: a wrong device on a CPU-only box.
    return torch.device("meta") if device.type == "cpu" else torch.device("cpu")


def valid_int(v: Any, minimum: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


# ------------------------------------------------------------------------------------------------
# Ops and the model of the spec.


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
        args = {k: (asdict(v) if isinstance(v, (Hidden, TokenIds)) else v) for k, v in self.args.items()}
        return {"kind": self.kind, "state": self.state, "args": args, "expect": self.expect,
                "returns": self.returns, "rows_after": self.rows_after, "note": self.note, "call": self.call()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Op":
        """The inverse of ``to_dict`` (JSON turns tuples into lists; they come back as tuples)."""
        def arg(v: Any) -> Any:
            if isinstance(v, dict) and set(v) == {"seed", "rows", "flat", "fault"}:
                return Hidden(**v)
            if isinstance(v, dict) and set(v) == {"ids", "form"}:
                return TokenIds(tuple(v["ids"]), v["form"])
            return v

        args = {k: arg(v) for k, v in d["args"].items()}
        if "states" in args and isinstance(args["states"], list):
            args["states"] = tuple(args["states"])
        return cls(d["kind"], d["state"], args, d["expect"],
                   d.get("returns"), d.get("rows_after"), d.get("note", ""))


# A batch's ``states`` entry that names a state allocated by another drafter (other weights).
FOREIGN = "foreign"


@dataclass
class SeqModel:
    """What the spec says one state holds."""

    seq_len: int = 0
    pending: bool = False
    last_drafted: int = 0
    released: bool = False
    drafts: int = 0  # drafts of the latest successful propose, which "dN" tokens may name
    # Index sharing (DESIGN.md §9): the row whose selection the pending propose's steps 2..k
    # attend (its first row p), None when no propose is pending, it drafted fewer than 2 rows, or
    # the drafter does not share. It belongs to that propose alone: verify drops it.
    shared_from: int | None = None


@dataclass
class SpecModel:
    """The spec's bookkeeping of a scenario's states; builds ``Op``s stamped with their outcome.

    Args:
        config: the drafter's config (vocabulary, widths, max context).
        max_seq_len: what the proposers are built with (capped at the model's max context).
        index_share: whether the drafters share step 1's selection across a propose (DESIGN.md
            §9; the scenario's draw, ``Scenario.index_share``).
    """

    config: MtpConfig
    max_seq_len: int
    index_share: bool = False
    seqs: list[SeqModel] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.max_seq_len = min(self.max_seq_len, self.config.max_position_embeddings)
        self.capacity = 16 * num_blocks(self.max_seq_len)
        self.vocab = self.config.vocab_size

    # Each builder checks in the order of DESIGN.md §4 (lifecycle, arguments, no-ops), updates
    # the model when the call succeeds, and returns the op.
    def _lifecycle(self, s: SeqModel) -> str | None:
        return "RuntimeError" if s.released or s.pending else None

    def info(self) -> Op:
        lengths = [0, 1, self.max_seq_len - 1, self.max_seq_len, self.max_seq_len + 1, 10 * self.max_seq_len]
        expected = {"prefill_hidden_rows": [min(n, self.max_seq_len) for n in lengths],
                    "prefill_uses_shared_buffers": True}
        return Op("info", -1, {"lengths": lengths}, "ok", returns=expected)

    def alloc(self, device_fault: bool = False) -> Op:
        if device_fault:
            return Op("alloc", -1, {"device": "other"}, "ValueError", note="alloc on another device than the weights'")
        self.seqs.append(SeqModel())
        return Op("alloc", len(self.seqs) - 1, {"device": "same"}, "ok", rows_after=0)

    def free(self, i: int) -> Op:
        s = self.seqs[i]
        if s.released:
            return Op("free", i, {}, "noop", rows_after=0, note="second free_state: a no-op")
        self.seqs[i] = SeqModel(released=True)
        return Op("free", i, {}, "ok", rows_after=0)

    def prefill(self, i: int, tokens: TokenIds, hiddens: Hidden, note: str = "") -> Op:
        s, n = self.seqs[i], len(tokens)
        args = {"prompt_tokens": tokens, "hiddens": hiddens}
        out = self._lifecycle(s)
        if out is None and (not tokens.valid(self.vocab) or n > self.max_seq_len or not hiddens.valid_for(n)):
            out = "ValueError"
        if out is None and (s.seq_len > 0 or n < 2):
            return Op("prefill", i, args, "noop", returns=0, rows_after=s.seq_len, note=note)
        if out is not None:
            return Op("prefill", i, args, out, rows_after=s.seq_len, note=note)
        s.seq_len = n - 1
        return Op("prefill", i, args, "ok", returns=n - 1, rows_after=s.seq_len, note=note)

    def catchup(self, i: int, tokens: TokenIds, hiddens: Hidden, row_base: Any, pos_base: Any, note: str = "") -> Op:
        s, n = self.seqs[i], len(tokens)
        args = {"tokens": tokens, "hiddens": hiddens, "row_base": row_base, "pos_base": pos_base}
        out = self._lifecycle(s)
        if out is None and (
            not tokens.valid(self.vocab) or not valid_int(row_base) or not valid_int(pos_base)
            or not hiddens.valid_for(n) or row_base + n > self.capacity
        ):
            out = "ValueError"
        if out is None and (row_base != s.seq_len or n == 0):
            return Op("catchup", i, args, "noop", returns=0, rows_after=s.seq_len, note=note)
        if out is not None:
            return Op("catchup", i, args, out, rows_after=s.seq_len, note=note)
        s.seq_len += n
        return Op("catchup", i, args, "ok", returns=n, rows_after=s.seq_len, note=note)

    def propose(self, i: int, token: TokenIds, hidden: Hidden, position: Any, num_drafts: Any, note: str = "") -> Op:
        s = self.seqs[i]
        args = {"last_token": token, "target_hidden": hidden, "position": position, "num_drafts": num_drafts}
        out = self._propose_refusal(s, position, num_drafts, token.valid(self.vocab, single=True) and hidden.valid_for(1))
        if out is not None:
            return Op("propose", i, args, out, rows_after=s.seq_len, note=note)
        self._proposed(s, position, num_drafts)
        return Op("propose", i, args, "ok", returns=num_drafts, rows_after=s.seq_len, note=self._shared_note(s, note))

    @staticmethod
    def _shared_note(s: SeqModel, note: str) -> str:
        """The op's note, with the rows a valid propose's later steps attend (§9) when it shares."""
        if s.shared_from is None:
            return note
        shared = f"steps 2..{s.last_drafted} attend row {s.shared_from}'s selection"
        return f"{note}; {shared}" if note else shared

    def _propose_refusal(self, s: Any, position: Any, num_drafts: Any, data_valid: bool) -> str | None:
        """A propose's refusal on one state, in the contract's order: lifecycle, ``position``, the
        rows held, then the arguments (``data_valid``: its token and hidden), ``num_drafts`` and the
        capacity; None when it is valid."""
        out = self._lifecycle(s)
        if out is None and not valid_int(position):
            out = "ValueError"
        if out is None and s.seq_len < position:
            out = "RuntimeError"
        if out is None and (not data_valid or not valid_int(num_drafts) or position + num_drafts > self.capacity):
            out = "ValueError"
        return out

    def _proposed(self, s: Any, position: int, num_drafts: int) -> None:
        """A valid propose's counters: the rewind, the rows drafted, pending, and (§9) the row
        whose selection its later steps share."""
        s.seq_len = position + num_drafts if num_drafts else min(s.seq_len, position)
        s.pending, s.last_drafted, s.drafts = True, num_drafts, num_drafts
        s.shared_from = position if self.index_share and num_drafts >= 2 else None

    def verify(self, i: int, num_accepted: Any, note: str = "") -> Op:
        s = self.seqs[i]
        args = {"num_accepted": num_accepted}
        out = "RuntimeError" if s.released or not s.pending else None
        if out is None and (not valid_int(num_accepted) or num_accepted > s.last_drafted):
            out = "ValueError"
        if out is not None:
            return Op("verify", i, args, out, rows_after=s.seq_len, note=note)
        keep = min(s.last_drafted, num_accepted + 1)
        s.seq_len -= s.last_drafted - keep
        s.pending, s.last_drafted, s.shared_from = False, 0, None
        return Op("verify", i, args, "ok", rows_after=s.seq_len, note=note)

    # ---- batches: many states in one call (reference/contract.py, "batches") ----------------
    # The order of the checks: the batch's states (a list, each once), rule 0 of every state
    # (a state of another drafter is refused), the batch's shapes (one entry per state, (B, H)
    # rows) and ``num_drafts``, then each state's own checks, those of the single call with one
    # row, in index order. A refusal changes no state; a valid batch is each state's single call.

    def _batch_front(self, states: Sequence[Any], lengths: Sequence[int], hiddens: Hidden) -> str | None:
        """The checks before any state's own: ``ValueError`` or None."""
        B = len(states)
        if len(set(states)) != B or FOREIGN in states:
            return "ValueError"
        if any(n != B for n in lengths) or not hiddens.batch_shape_valid(B):
            return "ValueError"
        return None

    def _batch_op(self, kind: str, states: Sequence[Any], args: dict[str, Any], out: str, returns: Any, note: str) -> Op:
        rows = [None if i == FOREIGN else self.seqs[i].seq_len for i in states]
        return Op(kind, -1, {"states": tuple(states), **args}, out, returns=returns if out == "ok" else None, rows_after=rows, note=note)

    def propose_batch(self, states: Sequence[Any], tokens: TokenIds, hiddens: Hidden, positions: TokenIds, num_drafts: Any,
                      note: str = "") -> Op:
        """``propose_batch``: state ``states[b]`` drafts after ``tokens[b]`` from row b of
        ``hiddens`` at ``positions[b]``; ``positions`` is a ``TokenIds`` of ints (its form:
        ``list``, or an integer tensor)."""
        args = {"last_tokens": tokens, "target_hiddens": hiddens, "positions": positions, "num_drafts": num_drafts}
        out = self._batch_front(states, (len(tokens), len(positions)), hiddens)
        if out is None and not valid_int(num_drafts):
            out = "ValueError"
        for b, i in enumerate(states):
            if out is not None:
                break
            tok = tokens.ids[b]
            out = self._propose_refusal(self.seqs[i], positions.ids[b], num_drafts,
                                        (isinstance(tok, str) or 0 <= tok < self.vocab) and hiddens.row_valid(b))
        if out is not None:
            return self._batch_op("propose_batch", states, args, out, None, note)
        for b, i in enumerate(states):
            self._proposed(self.seqs[i], positions.ids[b], num_drafts)
        return self._batch_op("propose_batch", states, args, "ok", [num_drafts] * len(states), note)

    def catchup_batch(self, states: Sequence[Any], tokens: TokenIds, hiddens: Hidden, row_bases: TokenIds, note: str = "") -> Op:
        """``catchup_batch``: state ``states[b]`` gets row ``row_bases[b]`` from ``tokens[b]`` and
        row b of ``hiddens`` when ``row_bases[b]`` is its ``drafter_rows`` (else 0 rows)."""
        args = {"tokens": tokens, "hiddens": hiddens, "row_bases": row_bases}
        out = self._batch_front(states, (len(tokens), len(row_bases)), hiddens)
        for b, i in enumerate(states):
            if out is not None:
                break
            s, base, tok = self.seqs[i], row_bases.ids[b], tokens.ids[b]
            out = self._lifecycle(s)
            if out is None and (
                not (isinstance(tok, str) or 0 <= tok < self.vocab) or not valid_int(base) or not hiddens.row_valid(b)
                or base + 1 > self.capacity
            ):
                out = "ValueError"
        if out is not None:
            return self._batch_op("catchup_batch", states, args, out, None, note)
        written = []
        for b, i in enumerate(states):
            s = self.seqs[i]
            written.append(int(row_bases.ids[b] == s.seq_len))
            s.seq_len += written[-1]
        return self._batch_op("catchup_batch", states, args, "ok", written, note)
