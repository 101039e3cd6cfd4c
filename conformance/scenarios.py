"""Scenarios: reproducible sequences of drafter calls, each with the outcome the spec predicts.

A scenario is plain data: a list of ``Op`` (call, state index, arguments) with no tensors in it.
Hidden rows are described by a seed (``Hidden``) and drawn from N(0, 1) when the call runs, so a
scenario is the same on every machine and for every backend, and it can be printed or written
to JSON. Token arguments may name the drafts of the state's latest propose (``"d1"``..), which
each backend resolves from what it returned.

``Model`` tracks what DESIGN.md §4 says each call does to a state (rows, pending, drafted count,
freed) and stamps every op with the expected outcome, so the runner checks the baseline against
the spec as well as the candidate against the baseline.

Two generators, both driven by a ``Chooser`` (where randomness comes from):

- ``realistic``: the spec-decode loop of DESIGN.md §4 on one to three states: prefill, then
  propose -> verify (random acceptance) -> catch-up, with the refeed policy, engine rollbacks,
  capacity edges and double frees mixed in.
- ``adversarial``: a walk over the rules in ``RULES`` (misuse, odd orders, bad inputs, capacity
  edges). ``machine.py`` drives the same rules from hypothesis (a ``RuleBasedStateMachine``).

``scenario(seed, index, ...)`` builds scenario ``index`` of a run seeded ``seed``; it depends on
nothing else, so ``--seed S --scenario-index I`` replays it exactly.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol, Sequence, TypeVar

import torch

from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.state import num_blocks

T = TypeVar("T")

# Drafts per propose the generators use (k in [0, MAX_DRAFTS]); GLM-5 deployments run 1-4.
MAX_DRAFTS = 4
# Outcomes an op may expect. "noop" = the call returns 0 (or nothing) and changes nothing.
OUTCOMES = ("ok", "noop", "RuntimeError", "ValueError")
GENERATORS = ("realistic", "adversarial")


# ------------------------------------------------------------------------------------------------
# Where randomness comes from.


class Chooser(Protocol):
    """A source of choices: a seeded ``random.Random`` here, hypothesis data in ``machine.py``."""

    def int(self, lo: int, hi: int) -> int: ...  # inclusive
    def choice(self, options: Sequence[T]) -> T: ...
    def chance(self, p: float) -> bool: ...
    def seed(self) -> int: ...


class RandomChooser:
    """Choices from ``random.Random(seed)``: the same seed gives the same scenario everywhere."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def seed(self) -> int:
        return self.rng.randrange(2**31)


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
            leading axis), ``int`` (an integer tensor), ``list`` (a Python list, not a tensor).
    """

    seed: int
    rows: int
    flat: bool = False
    fault: str | None = None

    FAULTS = ("nan", "inf", "dtype", "device", "rows", "width", "3d", "int", "list")

    def valid_for(self, rows: int) -> bool:
        return self.fault is None and self.rows == rows

    def materialize(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> Any:
        """The argument as the call receives it."""
        gen = torch.Generator().manual_seed(self.seed)
        rows = self.rows + (self.fault == "rows")
        width = hidden_size + (self.fault == "width")
        v = torch.randn(rows, width, generator=gen)  # (rows, H) float32
        if self.fault in ("nan", "inf") and v.numel():
            at = int(torch.randint(v.numel(), (1,), generator=gen))
            v.view(-1)[at] = float("nan") if self.fault == "nan" else float("-inf") if at % 2 else float("inf")
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
class Tokens:
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

    def materialize(self, drafts: Sequence[int], device: torch.device) -> Any:
        """The argument as the call receives it."""
        ids = self.resolve(drafts)
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
        kind: ``info``, ``alloc``, ``free``, ``prefill``, ``catchup``, ``propose``, ``verify``.
        state: which of the scenario's states (in order of allocation); -1 for ``info`` and
            for an ``alloc`` that is expected to fail.
        args: the call's arguments (``Tokens``, ``Hidden``, ints, or deliberately bad values).
        expect: the outcome the spec predicts, one of ``OUTCOMES``.
        returns: what the call returns when it succeeds: rows written (prefill, catch-up), the
            number of drafts (propose), the expected answers (info); None otherwise.
        rows_after: the state's ``drafter_rows`` after the call.
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
        args = {k: (asdict(v) if isinstance(v, (Hidden, Tokens)) else v) for k, v in self.args.items()}
        return {"kind": self.kind, "state": self.state, "args": args, "expect": self.expect,
                "returns": self.returns, "rows_after": self.rows_after, "note": self.note, "call": self.call()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Op":
        """The inverse of ``to_dict`` (JSON turns tuples into lists; they come back as tuples)."""
        def arg(v: Any) -> Any:
            if isinstance(v, dict) and set(v) == {"seed", "rows", "flat", "fault"}:
                return Hidden(**v)
            if isinstance(v, dict) and set(v) == {"ids", "form"}:
                return Tokens(tuple(v["ids"]), v["form"])
            return v

        return cls(d["kind"], d["state"], {k: arg(v) for k, v in d["args"].items()}, d["expect"],
                   d.get("returns"), d.get("rows_after"), d.get("note", ""))


@dataclass
class SeqModel:
    """What the spec says one state holds."""

    seq_len: int = 0
    pending: bool = False
    last_drafted: int = 0
    released: bool = False
    drafts: int = 0  # drafts of the latest successful propose, which "dN" tokens may name


@dataclass
class Model:
    """The spec's bookkeeping of a scenario's states; builds ``Op``s stamped with their outcome.

    Args:
        config: the drafter's config (vocabulary, widths, max context).
        max_seq_len: what the proposers are built with (capped at the model's max context).
    """

    config: MtpConfig
    max_seq_len: int
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

    def prefill(self, i: int, tokens: Tokens, hiddens: Hidden, note: str = "") -> Op:
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

    def catchup(self, i: int, tokens: Tokens, hiddens: Hidden, row_base: Any, pos_base: Any, note: str = "") -> Op:
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

    def propose(self, i: int, token: Tokens, hidden: Hidden, position: Any, num_drafts: Any, note: str = "") -> Op:
        s = self.seqs[i]
        args = {"last_token": token, "target_hidden": hidden, "position": position, "num_drafts": num_drafts}
        out = self._lifecycle(s)
        if out is None and not valid_int(position):
            out = "ValueError"
        if out is None and s.seq_len < position:
            out = "RuntimeError"
        if out is None and (
            not token.valid(self.vocab, single=True) or not hidden.valid_for(1)
            or not valid_int(num_drafts) or position + num_drafts > self.capacity
        ):
            out = "ValueError"
        if out is not None:
            return Op("propose", i, args, out, rows_after=s.seq_len, note=note)
        s.seq_len = position + num_drafts if num_drafts else min(s.seq_len, position)
        s.pending, s.last_drafted, s.drafts = True, num_drafts, num_drafts
        return Op("propose", i, args, "ok", returns=num_drafts, rows_after=s.seq_len, note=note)

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
        s.pending, s.last_drafted = False, 0
        return Op("verify", i, args, "ok", rows_after=s.seq_len, note=note)


# ------------------------------------------------------------------------------------------------
# Argument helpers shared by the generators.


def random_ids(ch: Chooser, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(ch.int(0, vocab - 1) for _ in range(n))


def token_list(ch: Chooser, m: Model, n: int, drafts: int = 0, fault_p: float = 0.0) -> Tokens:
    """``n`` token ids in a random valid form, some naming drafts; broken with chance ``fault_p``."""
    ids: list[int | str] = [f"d{ch.int(1, drafts)}" if drafts and ch.chance(0.3) else ch.int(0, m.vocab - 1) for _ in range(n)]
    if ch.chance(fault_p):
        kind = ch.choice(("id", "id", "float", "2d", "floats")) if n else ch.choice(("float", "2d"))
        if kind == "id":
            ids[ch.int(0, n - 1)] = ch.choice((-1, m.vocab, m.vocab + 7, -m.vocab))
            return Tokens(tuple(ids), ch.choice(Tokens.LIST_FORMS))
        return Tokens(tuple(ids), kind)
    return Tokens(tuple(ids), ch.choice(Tokens.LIST_FORMS))


def single_token(ch: Chooser, m: Model, drafts: int = 0, fault_p: float = 0.0) -> Tokens:
    tok: int | str = f"d{ch.int(1, drafts)}" if drafts and ch.chance(0.2) else ch.int(0, m.vocab - 1)
    if ch.chance(fault_p):
        kind = ch.choice(("id", "id", "float", "pyfloat", "bool", "2d", "pair", "pair"))
        if kind == "id":
            return Tokens((ch.choice((-1, m.vocab, 10 * m.vocab)),), ch.choice(Tokens.SINGLE_FORMS))
        if kind == "pair":
            return Tokens((tok, ch.int(0, m.vocab - 1)), "tensor")
        return Tokens((tok,), kind)
    return Tokens((tok,), ch.choice(Tokens.SINGLE_FORMS))


def hidden(ch: Chooser, rows: int, fault_p: float = 0.0, single: bool = False) -> Hidden:
    """Fresh rows (a new seed); broken with chance ``fault_p``."""
    fault = None
    if ch.chance(fault_p):
        fault = ch.choice(Hidden.FAULTS)
        if rows == 0 and fault in ("nan", "inf"):
            fault = "rows"  # an empty tensor has no element to poison
    return Hidden(ch.seed(), rows, flat=single and ch.chance(0.5), fault=fault)


# ------------------------------------------------------------------------------------------------
# The realistic generator: the spec-decode loop of DESIGN.md §4.


@dataclass
class _Loop:
    state: int
    m: int  # t_m is the newest committed token; the next propose writes row m - 1
    token: int
    rounds: int


def _prompt_length(ch: Chooser, m: Model) -> int:
    r = ch.int(0, 19)
    if r == 0:
        return 0
    if r == 1:
        return 1
    if r <= 3:
        return m.max_seq_len  # the cap
    return ch.int(2, max(2, m.max_seq_len * 3 // 4))


def _round(ch: Chooser, m: Model, loop: _Loop, max_drafts: int) -> list[Op]:
    """One propose -> verify -> catch-up round of the loop (default or refeed policy)."""
    ops: list[Op] = []
    s = m.seqs[loop.state]
    if loop.m - 1 >= 1 and ch.chance(0.1):
        # An engine rollback: the drafter is ahead of the position and propose rewinds it.
        loop.m -= ch.int(1, min(3, loop.m - 1))
    p = loop.m - 1
    room = m.capacity - p
    if room <= 0 or s.seq_len < p:
        loop.rounds = 0
        return ops
    if ch.chance(0.1):
        k = 0
    elif room <= max_drafts and ch.chance(0.5):
        k = room  # drafts up to the last row of the capacity exactly
    else:
        k = ch.int(1, min(max_drafts, room))
    ops.append(m.propose(loop.state, Tokens((loop.token,), ch.choice(Tokens.SINGLE_FORMS)), hidden(ch, 1, single=True), p, k))
    a = ch.int(0, k)
    pos = lambda row: row if ch.chance(0.75) else row + ch.int(1, 64)  # noqa: E731  pos_base is ignored
    if ch.chance(0.15):  # refeed: keep the first row only, then catch up the accepted rows with the target's hiddens
        ops.append(m.verify(loop.state, 0, note="refeed"))
        if k and a:
            ops.append(m.catchup(loop.state, Tokens(tuple(f"d{j}" for j in range(1, a + 1)), ch.choice(Tokens.LIST_FORMS)),
                                 hidden(ch, a), loop.m, pos(loop.m), note="refeed"))
    else:
        ops.append(m.verify(loop.state, a))
        if k and a == k:  # all accepted: the drafter is one row behind
            ops.append(m.catchup(loop.state, Tokens((f"d{k}",), ch.choice(Tokens.LIST_FORMS)), hidden(ch, 1), p + k, pos(p + k)))
    if k == 0:  # no drafts: the committed token's row is still missing
        ops.append(m.catchup(loop.state, Tokens((loop.token,), ch.choice(Tokens.LIST_FORMS)), hidden(ch, 1), p, pos(p)))
    loop.m = loop.m + (a + 1 if k else 1)
    loop.token = ch.int(0, m.vocab - 1)  # the bonus token
    loop.rounds -= 1
    if s.seq_len != loop.m - 1:  # e.g. a catch-up past the capacity was refused: this sequence ends
        loop.rounds = 0
    return ops


def realistic(ch: Chooser, m: Model, max_drafts: int = MAX_DRAFTS) -> list[Op]:
    """The spec-decode loop on 1-3 states, interleaved; every call is valid except where a
    sequence reaches the capacity."""
    ops = [m.info()]
    loops = []
    for _ in range(ch.choice((1, 1, 2, 3))):
        ops.append(m.alloc())
        i = len(m.seqs) - 1
        n = _prompt_length(ch, m)
        ops.append(m.prefill(i, Tokens(random_ids(ch, m.vocab, n), ch.choice(Tokens.LIST_FORMS)), hidden(ch, n)))
        loops.append(_Loop(i, max(n, 1), ch.int(0, m.vocab - 1), ch.int(2, 14)))
    while loops:
        loop = ch.choice(loops)
        ops.extend(_round(ch, m, loop, max_drafts))
        if loop.rounds <= 0:
            loops.remove(loop)
            ops.append(m.free(loop.state))
            if ch.chance(0.2):
                ops.append(m.free(loop.state))
    return ops


# ------------------------------------------------------------------------------------------------
# The adversarial rules: each draws one or a few ops against a random state.

FAULT_P = 0.2


def _pick(ch: Chooser, m: Model) -> int:
    return ch.int(0, len(m.seqs) - 1)


def rule_alloc(ch: Chooser, m: Model, max_drafts: int) -> list[Op]:
    if len(m.seqs) >= 4 or ch.chance(0.15):
        return [m.alloc(device_fault=True)]
    return [m.alloc()]


def rule_free(ch: Chooser, m: Model, max_drafts: int) -> list[Op]:
    return [m.free(_pick(ch, m))]


def rule_prefill(ch: Chooser, m: Model, max_drafts: int) -> list[Op]:
    i = _pick(ch, m)
    n = ch.choice((0, 1, 2, ch.int(2, m.max_seq_len), m.max_seq_len, m.max_seq_len + 1))
    return [m.prefill(i, token_list(ch, m, n, fault_p=FAULT_P), hidden(ch, n, FAULT_P))]


def rule_catchup(ch: Chooser, m: Model, max_drafts: int) -> list[Op]:
    i = _pick(ch, m)
    s = m.seqs[i]
    n = ch.int(0, 4)
    row_base = ch.choice((
        s.seq_len, s.seq_len, s.seq_len,  # aligned
        max(0, s.seq_len - ch.int(1, 3)), s.seq_len + ch.int(1, 3), 0,  # misaligned
        m.capacity - n, m.capacity - n + 1,  # capacity edge
        -1, 1.0,
    ))
    pos_base = row_base if ch.chance(0.5) else ch.choice((ch.int(0, 3 * m.capacity), -1, row_base + 1 if isinstance(row_base, int) else 0))
    return [m.catchup(i, token_list(ch, m, n, s.drafts, FAULT_P), hidden(ch, n, FAULT_P), row_base, pos_base)]


def rule_propose(ch: Chooser, m: Model, max_drafts: int) -> list[Op]:
    i = _pick(ch, m)
    s = m.seqs[i]
    k = ch.choice((0, ch.int(1, max_drafts), ch.int(1, max_drafts), max_drafts, -1, 1.0))
    kk = k if valid_int(k) else 1
    position = ch.choice((
        s.seq_len, s.seq_len,  # equal to the drafter
        max(0, s.seq_len - ch.int(1, 8)),  # the drafter is ahead: rewind
        s.seq_len + ch.int(1, 3),  # behind: refused
        m.capacity - kk, m.capacity - kk + 1,  # capacity edge
        -1, True,
    ))
    return [m.propose(i, single_token(ch, m, s.drafts, FAULT_P), hidden(ch, 1, FAULT_P, single=True), position, k)]


def rule_verify(ch: Chooser, m: Model, max_drafts: int) -> list[Op]:
    pending = [j for j, s in enumerate(m.seqs) if s.pending]
    # Mostly a pending state, so bad counts meet the argument check, not only the lifecycle one.
    i = ch.choice(pending) if pending and ch.chance(0.7) else _pick(ch, m)
    ld = m.seqs[i].last_drafted
    a = ch.choice((ch.int(0, ld), ch.int(0, ld), ld, ld + 1, -1, "0"))
    return [m.verify(i, a)]


def rule_round(ch: Chooser, m: Model, max_drafts: int) -> list[Op]:
    """A well-formed round from wherever the state is (verifying first if a propose is pending)."""
    i = _pick(ch, m)
    s = m.seqs[i]
    ops = []
    if s.pending:
        ops.append(m.verify(i, ch.int(0, s.last_drafted)))
    if s.released:
        return ops or [m.free(i)]
    loop = _Loop(i, s.seq_len + 1, ch.int(0, m.vocab - 1), 1)
    return ops + _round(ch, m, loop, max_drafts)


def rule_grow(ch: Chooser, m: Model, max_drafts: int) -> list[Op]:
    """A fresh state with a long prompt, so later rules see many rows (and indexer ties)."""
    if len(m.seqs) >= 4:
        return rule_round(ch, m, max_drafts)
    ops = [m.alloc()]
    n = ch.int(m.max_seq_len // 2, m.max_seq_len)
    return ops + [m.prefill(len(m.seqs) - 1, Tokens(random_ids(ch, m.vocab, n)), hidden(ch, n))]


def rule_edge(ch: Chooser, m: Model, max_drafts: int) -> list[Op]:
    """A fresh state filled to a few rows short of its capacity, then a propose or a catch-up
    that ends exactly on the last row, or one row past it."""
    if len(m.seqs) >= 6:
        return rule_round(ch, m, max_drafts)
    ops = [m.alloc()]
    i, n = len(m.seqs) - 1, m.max_seq_len
    ops.append(m.prefill(i, Tokens(random_ids(ch, m.vocab, n)), hidden(ch, n)))
    left = ch.int(0, max_drafts)
    rows = m.seqs[i].seq_len
    fill = m.capacity - rows - left
    ops.append(m.catchup(i, Tokens(random_ids(ch, m.vocab, fill)), hidden(ch, fill), rows, rows))
    over = int(ch.chance(0.5))
    if ch.chance(0.5):
        ops.append(m.propose(i, single_token(ch, m), hidden(ch, 1, single=True), m.capacity - left, left + over, note="capacity edge"))
    else:
        ops.append(m.catchup(i, token_list(ch, m, left + over), hidden(ch, left + over), m.capacity - left, m.capacity - left,
                             note="capacity edge"))
    return ops


# name -> (rule, weight in the seeded walk)
RULES: dict[str, tuple[Callable[[Chooser, Model, int], list[Op]], int]] = {
    "alloc": (rule_alloc, 1),
    "free": (rule_free, 1),
    "prefill": (rule_prefill, 3),
    "catchup": (rule_catchup, 4),
    "propose": (rule_propose, 5),
    "verify": (rule_verify, 4),
    "round": (rule_round, 6),
    "grow": (rule_grow, 1),
    "edge": (rule_edge, 1),
}


def adversarial(ch: Chooser, m: Model, max_drafts: int = MAX_DRAFTS) -> list[Op]:
    """A walk of 10-40 rules chosen by weight: misuse, odd orders, bad inputs, capacity edges."""
    ops = [m.info(), m.alloc()]
    names = [n for n, (_, w) in RULES.items() for _ in range(w)]
    for _ in range(ch.int(10, 40)):
        rule, _ = RULES[ch.choice(names)]
        ops.extend(rule(ch, m, max_drafts))
    return ops


# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """Scenario ``index`` of a run seeded ``seed``: its generator, its own seed, and its ops."""

    seed: int
    index: int
    generator: str
    scenario_seed: int
    ops: tuple[Op, ...]


def save_scenario(path: str, ops: Sequence[Op], origin: str = "") -> None:
    """Write ops to a JSON file that ``load_scenario`` (and ``--scenario-file``) reads back."""
    with open(path, "w") as f:
        json.dump({"origin": origin, "ops": [op.to_dict() for op in ops]}, f, indent=1)


def load_scenario(path: str) -> Scenario:
    """A scenario saved by ``save_scenario`` (e.g. by the hypothesis machine on a failure);
    ``ValueError`` naming the file if it holds anything else (``OSError`` if it cannot be read)."""
    with open(path) as f:
        try:
            raw = json.load(f)
            ops = tuple(Op.from_dict(d) for d in raw["ops"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"scenario file {path}: not a scenario saved by save_scenario ({type(e).__name__}: {e})") from e
    return Scenario(seed=-1, index=0, generator="file", scenario_seed=-1, ops=ops)


def max_drafts_limit(config: MtpConfig, max_seq_len: int) -> int:
    """The largest ``max_drafts`` the generators serve: the rows a state has left after a prompt
    of ``max_seq_len`` tokens (the capacity-edge rules draft from there)."""
    m = Model(config, max_seq_len)
    return m.capacity - (m.max_seq_len - 1)


def scenario_seed(seed: int, index: int) -> int:
    """A 63-bit seed for scenario ``index`` of run ``seed`` (stable across Python versions)."""
    digest = hashlib.blake2b(f"glm-mtp-conformance:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def scenario(
    seed: int, index: int, config: MtpConfig, max_seq_len: int,
    generators: Sequence[str] = GENERATORS, max_drafts: int = MAX_DRAFTS,
) -> Scenario:
    """Build scenario ``index`` of a run seeded ``seed``; generators take turns by index.

    Args:
        seed: the run's seed.
        index: which scenario (0-based).
        config: the drafter's config.
        max_seq_len: the proposers' ``max_seq_len``.
        generators: names from ``GENERATORS``; scenario ``index`` uses ``generators[index % len]``.
        max_drafts: the largest ``num_drafts`` a valid propose uses.
    """
    for g in generators:
        if g not in GENERATORS:
            raise ValueError(f"generators: unknown generator {g!r}; known: {GENERATORS}")
    limit = max_drafts_limit(config, max_seq_len)
    if isinstance(max_drafts, bool) or not isinstance(max_drafts, int) or not 1 <= max_drafts <= limit:
        raise ValueError(f"max_drafts must be an integer in [1, {limit}] (the rows left after a prompt of max_seq_len={max_seq_len} tokens), got {max_drafts!r}")
    gen = generators[index % len(generators)]
    s = scenario_seed(seed, index)
    model = Model(config, max_seq_len)
    ops = (realistic if gen == "realistic" else adversarial)(RandomChooser(s), model, max_drafts)
    return Scenario(seed, index, gen, s, tuple(ops))
