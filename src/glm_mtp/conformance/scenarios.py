"""Scenarios: reproducible sequences of drafter calls, each with the outcome the spec predicts.

A scenario is plain data: a list of ``Op`` (see ``spec.py``: the arguments as data, and
``SpecModel``, which stamps every op with the outcome DESIGN.md §4 predicts).

Two generators, both driven by a ``Chooser`` (where randomness comes from):

- ``realistic``: the spec-decode loop of DESIGN.md §4 on one to three states: prefill, then
  propose -> verify (random acceptance) -> catch-up, with the refeed policy, engine rollbacks,
  capacity edges and double frees mixed in.
- ``adversarial``: a walk over the rules in ``RULES`` (misuse, odd orders, bad inputs, capacity
  edges). ``machine.py`` drives the same rules from hypothesis (a ``RuleBasedStateMachine``).
- ``batched`` (not a default; ``--generators batched``): 2-6 states joining and leaving at very
  different lengths, drafted together by ``propose_batch`` and caught up by ``catchup_batch``,
  with single calls interleaved and batched misuse (issue 12).

``scenario(seed, index, ...)`` builds scenario ``index`` of a run seeded ``seed``; it depends on
nothing else, so ``--seed S --scenario-index I`` replays it exactly.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, TypeVar

from glm_mtp.reference.config import MtpConfig

from .spec import FOREIGN, Hidden, Op, SpecModel, TokenIds, valid_int

T = TypeVar("T")

# Drafts per propose the generators use (k in [0, MAX_DRAFTS]); GLM-5 deployments run 1-4.
MAX_DRAFTS = 4
# The generators a run uses unless told otherwise, and every generator a run may name.
GENERATORS = ("realistic", "adversarial")
ALL_GENERATORS = GENERATORS + ("batched",)


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


# Argument helpers shared by the generators.


def random_ids(ch: Chooser, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(ch.int(0, vocab - 1) for _ in range(n))


def token_list(ch: Chooser, m: SpecModel, n: int, drafts: int = 0, fault_p: float = 0.0) -> TokenIds:
    """``n`` token ids in a random valid form, some naming drafts; broken with chance ``fault_p``."""
    ids: list[int | str] = [f"d{ch.int(1, drafts)}" if drafts and ch.chance(0.3) else ch.int(0, m.vocab - 1) for _ in range(n)]
    if ch.chance(fault_p):
        kind = ch.choice(("id", "id", "float", "2d", "floats")) if n else ch.choice(("float", "2d"))
        if kind == "id":
            ids[ch.int(0, n - 1)] = ch.choice((-1, m.vocab, m.vocab + 7, -m.vocab))
            return TokenIds(tuple(ids), ch.choice(TokenIds.LIST_FORMS))
        return TokenIds(tuple(ids), kind)
    return TokenIds(tuple(ids), ch.choice(TokenIds.LIST_FORMS))


def single_token(ch: Chooser, m: SpecModel, drafts: int = 0, fault_p: float = 0.0) -> TokenIds:
    tok: int | str = f"d{ch.int(1, drafts)}" if drafts and ch.chance(0.2) else ch.int(0, m.vocab - 1)
    if ch.chance(fault_p):
        kind = ch.choice(("id", "id", "float", "pyfloat", "bool", "2d", "pair", "pair"))
        if kind == "id":
            return TokenIds((ch.choice((-1, m.vocab, 10 * m.vocab)),), ch.choice(TokenIds.SINGLE_FORMS))
        if kind == "pair":
            return TokenIds((tok, ch.int(0, m.vocab - 1)), "tensor")
        return TokenIds((tok,), kind)
    return TokenIds((tok,), ch.choice(TokenIds.SINGLE_FORMS))


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


def _prompt_length(ch: Chooser, m: SpecModel) -> int:
    r = ch.int(0, 19)
    if r == 0:
        return 0
    if r == 1:
        return 1
    if r <= 3:
        return m.max_seq_len  # the cap
    return ch.int(2, max(2, m.max_seq_len * 3 // 4))


def _round(ch: Chooser, m: SpecModel, loop: _Loop, max_drafts: int) -> list[Op]:
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
    ops.append(m.propose(loop.state, TokenIds((loop.token,), ch.choice(TokenIds.SINGLE_FORMS)), hidden(ch, 1, single=True), p, k))
    a = ch.int(0, k)
    pos = lambda row: row if ch.chance(0.75) else row + ch.int(1, 64)  # noqa: E731  pos_base is ignored
    if ch.chance(0.15):  # refeed: keep the first row only, then catch up the accepted rows with the target's hiddens
        ops.append(m.verify(loop.state, 0, note="refeed"))
        if k and a:
            ops.append(m.catchup(loop.state, TokenIds(tuple(f"d{j}" for j in range(1, a + 1)), ch.choice(TokenIds.LIST_FORMS)),
                                 hidden(ch, a), loop.m, pos(loop.m), note="refeed"))
    else:
        ops.append(m.verify(loop.state, a))
        if k and a == k:  # all accepted: the drafter is one row behind
            ops.append(m.catchup(loop.state, TokenIds((f"d{k}",), ch.choice(TokenIds.LIST_FORMS)), hidden(ch, 1), p + k, pos(p + k)))
    if k == 0:  # no drafts: the committed token's row is still missing
        ops.append(m.catchup(loop.state, TokenIds((loop.token,), ch.choice(TokenIds.LIST_FORMS)), hidden(ch, 1), p, pos(p)))
    loop.m = loop.m + (a + 1 if k else 1)
    loop.token = ch.int(0, m.vocab - 1)  # the bonus token
    loop.rounds -= 1
    if s.seq_len != loop.m - 1:  # e.g. a catch-up past the capacity was refused: this sequence ends
        loop.rounds = 0
    return ops


def realistic(ch: Chooser, m: SpecModel, max_drafts: int = MAX_DRAFTS) -> list[Op]:
    """The spec-decode loop on 1-3 states, interleaved; every call is valid except where a
    sequence reaches the capacity."""
    ops = [m.info()]
    loops = []
    for _ in range(ch.choice((1, 1, 2, 3))):
        ops.append(m.alloc())
        i = len(m.seqs) - 1
        n = _prompt_length(ch, m)
        ops.append(m.prefill(i, TokenIds(random_ids(ch, m.vocab, n), ch.choice(TokenIds.LIST_FORMS)), hidden(ch, n)))
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


def _pick(ch: Chooser, m: SpecModel) -> int:
    return ch.int(0, len(m.seqs) - 1)


def rule_alloc(ch: Chooser, m: SpecModel, max_drafts: int) -> list[Op]:
    if len(m.seqs) >= 4 or ch.chance(0.15):
        return [m.alloc(device_fault=True)]
    return [m.alloc()]


def rule_free(ch: Chooser, m: SpecModel, max_drafts: int) -> list[Op]:
    return [m.free(_pick(ch, m))]


def rule_prefill(ch: Chooser, m: SpecModel, max_drafts: int) -> list[Op]:
    i = _pick(ch, m)
    n = ch.choice((0, 1, 2, ch.int(2, m.max_seq_len), m.max_seq_len, m.max_seq_len + 1))
    return [m.prefill(i, token_list(ch, m, n, fault_p=FAULT_P), hidden(ch, n, FAULT_P))]


def rule_catchup(ch: Chooser, m: SpecModel, max_drafts: int) -> list[Op]:
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


def rule_propose(ch: Chooser, m: SpecModel, max_drafts: int) -> list[Op]:
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


def rule_verify(ch: Chooser, m: SpecModel, max_drafts: int) -> list[Op]:
    pending = [j for j, s in enumerate(m.seqs) if s.pending]
    # Mostly a pending state, so bad counts meet the argument check, not only the lifecycle one.
    i = ch.choice(pending) if pending and ch.chance(0.7) else _pick(ch, m)
    ld = m.seqs[i].last_drafted
    a = ch.choice((ch.int(0, ld), ch.int(0, ld), ld, ld + 1, -1, "0"))
    return [m.verify(i, a)]


def rule_round(ch: Chooser, m: SpecModel, max_drafts: int) -> list[Op]:
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


def rule_grow(ch: Chooser, m: SpecModel, max_drafts: int) -> list[Op]:
    """A fresh state with a long prompt, so later rules see many rows (and indexer ties)."""
    if len(m.seqs) >= 4:
        return rule_round(ch, m, max_drafts)
    ops = [m.alloc()]
    n = ch.int(m.max_seq_len // 2, m.max_seq_len)
    return ops + [m.prefill(len(m.seqs) - 1, TokenIds(random_ids(ch, m.vocab, n)), hidden(ch, n))]


def rule_edge(ch: Chooser, m: SpecModel, max_drafts: int) -> list[Op]:
    """A fresh state filled to a few rows short of its capacity, then a propose or a catch-up
    that ends exactly on the last row, or one row past it."""
    if len(m.seqs) >= 6:
        return rule_round(ch, m, max_drafts)
    ops = [m.alloc()]
    i, n = len(m.seqs) - 1, m.max_seq_len
    ops.append(m.prefill(i, TokenIds(random_ids(ch, m.vocab, n)), hidden(ch, n)))
    left = ch.int(0, max_drafts)
    rows = m.seqs[i].seq_len
    fill = m.capacity - rows - left
    ops.append(m.catchup(i, TokenIds(random_ids(ch, m.vocab, fill)), hidden(ch, fill), rows, rows))
    over = int(ch.chance(0.5))
    if ch.chance(0.5):
        ops.append(m.propose(i, single_token(ch, m), hidden(ch, 1, single=True), m.capacity - left, left + over, note="capacity edge"))
    else:
        ops.append(m.catchup(i, token_list(ch, m, left + over), hidden(ch, left + over), m.capacity - left, m.capacity - left,
                             note="capacity edge"))
    return ops


# name -> (rule, weight in the seeded walk)
RULES: dict[str, tuple[Callable[[Chooser, SpecModel, int], list[Op]], int]] = {
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


def adversarial(ch: Chooser, m: SpecModel, max_drafts: int = MAX_DRAFTS) -> list[Op]:
    """A walk of 10-40 rules chosen by weight: misuse, odd orders, bad inputs, capacity edges."""
    ops = [m.info(), m.alloc()]
    names = [n for n, (_, w) in RULES.items() for _ in range(w)]
    for _ in range(ch.int(10, 40)):
        rule, _ = RULES[ch.choice(names)]
        ops.extend(rule(ch, m, max_drafts))
    return ops


# ------------------------------------------------------------------------------------------------
# The batched generator: many sequences drafted in lockstep (issue 12).

# Misuse a batch may carry (one, sometimes two at once; the spec model predicts which refusal):
# a state whose propose is pending, a freed state, a state twice, a state of another drafter, a
# list or the hiddens of the wrong length, a token id outside the vocabulary in one row, NaN/inf
# in one row's hidden, a position ahead of the state's rows (for catchup_batch: a row base < 0),
# one state's rows past its capacity.
BATCH_MISUSE = ("pending", "freed", "duplicate", "foreign", "lengths", "token", "nan", "ahead", "capacity")


def _subset(ch: Chooser, items: Sequence[int], lo: int = 1) -> list[int]:
    """A random subset of ``items`` (at least ``lo`` when there are that many) in random order."""
    pool = list(items)
    n = ch.int(min(lo, len(pool)), len(pool))
    out = []
    for _ in range(n):
        out.append(pool.pop(ch.int(0, len(pool) - 1)))
    return out


def _misuse(ch: Chooser, m: SpecModel, kind: str, states: list, tokens: list, hid: Hidden, pos: list,
            num_drafts: int | None, pending: Sequence[int]) -> tuple[list, list, Hidden, list, int | None] | None:
    """One batch argument broken in the way ``kind`` names, or None when this batch cannot carry it.

    ``pos`` are positions (propose_batch, ``num_drafts`` an int) or row bases (catchup_batch,
    ``num_drafts`` None)."""
    states, tokens, pos = list(states), list(tokens), list(pos)
    B = len(states)
    if len(tokens) != B or len(pos) != B or hid.rows != B or hid.fault in ("rows", "width", "3d"):
        return None  # a first misuse broke the batch's shape: a second one would index past it
    if kind == "pending":
        if not pending:
            return None
        at = ch.int(0, B)
        states.insert(at, ch.choice(pending))
        tokens.insert(at, ch.int(0, m.vocab - 1))
        i = states[at]
        pos.insert(at, m.seqs[i].seq_len)
        return states, tokens, Hidden(ch.seed(), B + 1, fault=hid.fault), pos, num_drafts
    if kind == "freed":
        freed = [i for i, s in enumerate(m.seqs) if s.released]
        if not freed:
            return None
        at = ch.int(0, B)
        states.insert(at, ch.choice(freed))
        tokens.insert(at, ch.int(0, m.vocab - 1))
        pos.insert(at, ch.int(0, 3))
        return states, tokens, Hidden(ch.seed(), B + 1, fault=hid.fault), pos, num_drafts
    if kind == "foreign":
        at = ch.int(0, B)
        states.insert(at, FOREIGN)
        tokens.insert(at, ch.int(0, m.vocab - 1))
        pos.insert(at, 0)
        return states, tokens, Hidden(ch.seed(), B + 1, fault=hid.fault), pos, num_drafts
    if not B:
        return None
    b = ch.int(0, B - 1)
    if kind == "duplicate":
        at = ch.int(0, B)
        states.insert(at, states[b])
        tokens.insert(at, tokens[b] if isinstance(tokens[b], int) else ch.int(0, m.vocab - 1))
        pos.insert(at, pos[b])
        return states, tokens, Hidden(ch.seed(), B + 1, fault=hid.fault), pos, num_drafts
    if kind == "lengths":
        which = ch.choice(("tokens", "positions", "hiddens"))
        if which == "tokens":
            tokens = tokens[:-1] if ch.chance(0.5) else tokens + [ch.int(0, m.vocab - 1)]
        elif which == "positions":
            pos = pos[:-1] if ch.chance(0.5) else pos + [pos[-1]]
        else:
            hid = Hidden(hid.seed, B, fault=ch.choice(("rows", "width", "3d")))
        return states, tokens, hid, pos, num_drafts
    if kind == "token":
        tokens[b] = ch.choice((-1, m.vocab, m.vocab + 7))
        return states, tokens, hid, pos, num_drafts
    if kind == "nan":
        return states, tokens, Hidden(hid.seed, B, fault=f"{ch.choice(('nan', 'inf'))}@{b}"), pos, num_drafts
    i = states[b]
    if i == FOREIGN:
        return None
    if kind == "ahead":
        if num_drafts is None:  # a row base that is no integer >= 0
            pos[b] = -ch.int(1, 3)
        else:
            pos[b] = m.seqs[i].seq_len + ch.int(1, 3)
        return states, tokens, hid, pos, num_drafts
    # capacity: rows past the state's last one
    if num_drafts is None:
        pos[b] = m.capacity + ch.int(0, 1)  # row_base + 1 > capacity
        return states, tokens, hid, pos, num_drafts
    room = m.capacity - pos[b]
    return states, tokens, hid, pos, room + 1 if valid_int(pos[b]) else num_drafts


def _misused(ch: Chooser, m: SpecModel, states: list, tokens: list, hid: Hidden, pos: list,
             num_drafts: int | None, pending: Sequence[int]) -> tuple[list, list, Hidden, list, int | None, str] | None:
    """A batch broken once (sometimes twice: the spec's check order decides the refusal), and
    how (the op's note)."""
    names = []
    kinds = [k for k in BATCH_MISUSE if pending or k != "pending"]
    for _ in range(1 + ch.chance(0.25)):
        kind = ch.choice(kinds)
        broken = _misuse(ch, m, kind, states, tokens, hid, pos, num_drafts, pending)
        if broken is None:
            continue
        states, tokens, hid, pos, num_drafts = broken
        names.append(kind)
    if not names:
        return None
    return states, tokens, hid, pos, num_drafts, "batched misuse: " + " + ".join(names)


def _ids(ch: Chooser, values: Sequence[int | str]) -> TokenIds:
    """A batch's ids (tokens, positions or row bases) in a random valid form: a list, or an
    integer tensor (int64 or int32 on the device, int64 on the CPU)."""
    return TokenIds(tuple(values), ch.choice(TokenIds.LIST_FORMS))


def batched(ch: Chooser, m: SpecModel, max_drafts: int = MAX_DRAFTS) -> list[Op]:
    """Sequences drafted together: 2-6 states join (alloc + prefill at very different prompt
    lengths, some filled close to their capacity) and leave (free), rounds of ``propose_batch``
    over a random subset in random order, ``after_verify`` per state with its own accept count,
    ``catchup_batch`` for the fully accepted ones (with misaligned rows that write nothing),
    single-state rounds interleaved, and batched misuse: a pending, freed, duplicate or foreign
    state, wrong lengths, a bad token id, a NaN/inf hidden, a position ahead of the rows, a
    capacity overflow, in one row."""
    ops = [m.info()]
    token: dict[int, int] = {}  # live state -> the token its next propose drafts after
    target = ch.int(2, 6)

    def join() -> None:
        ops.append(m.alloc())
        i = len(m.seqs) - 1
        n = _prompt_length(ch, m)
        ops.append(m.prefill(i, TokenIds(random_ids(ch, m.vocab, n), ch.choice(TokenIds.LIST_FORMS)), hidden(ch, n)))
        if ch.chance(0.2):  # close to the capacity: the batch's num_drafts reaches its last row
            rows = m.seqs[i].seq_len
            fill = max(0, m.capacity - rows - ch.int(1, max_drafts + 1))
            ops.append(m.catchup(i, TokenIds(random_ids(ch, m.vocab, fill)), hidden(ch, fill), rows, rows))
        token[i] = ch.int(0, m.vocab - 1)

    def leave(i: int) -> None:
        ops.append(m.free(i))
        if ch.chance(0.1):
            ops.append(m.free(i))
        del token[i]

    def misuse(kind: str, states: list, tokens: list, hid: Hidden, pos: list, k: int | None, pending: Sequence[int]) -> None:
        if not ch.chance(0.3):
            return
        broken = _misused(ch, m, states, tokens, hid, pos, k, pending)
        if broken is None:
            return
        s2, t2, h2, p2, k2, note = broken
        if kind == "propose_batch":
            ops.append(m.propose_batch(s2, _ids(ch, t2), h2, _ids(ch, p2), k2, note=note))
        else:
            ops.append(m.catchup_batch(s2, _ids(ch, t2), h2, _ids(ch, p2), note=note))

    def batch_round() -> None:
        live = sorted(token)
        states = [] if ch.chance(0.03) else _subset(ch, live, lo=2)
        pos = []
        for i in states:
            n = m.seqs[i].seq_len
            pos.append(n - ch.int(1, min(3, n)) if n >= 1 and ch.chance(0.15) else n)  # an engine rollback: a rewind
        room = min([m.capacity - p for p in pos], default=max_drafts)
        kmax = min(max_drafts, room)
        k = 0 if kmax == 0 or ch.chance(0.1) else room if room <= max_drafts and ch.chance(0.5) else ch.int(1, kmax)
        tokens = [token[i] for i in states]
        hid = Hidden(ch.seed(), len(states))
        misuse("propose_batch", states, tokens, hid, pos, k, [])
        ops.append(m.propose_batch(states, _ids(ch, tokens), hid, _ids(ch, pos), k))
        if ops[-1].expect != "ok":
            return
        others = [i for i in live if i not in states]
        if others and ch.chance(0.25):  # a single state's own round while the batch is pending
            single_round(ch.choice(others))
        if states and ch.chance(0.2):  # a batch (of either kind) holding a state whose propose is pending
            rest = [i for i in sorted(token) if not m.seqs[i].pending]
            sub = _subset(ch, rest, lo=0) if rest else []
            k2 = ch.int(0, max_drafts) if ch.chance(0.5) else None
            broken = _misuse(ch, m, "pending", sub, [token[i] for i in sub], Hidden(ch.seed(), len(sub)),
                             [m.seqs[i].seq_len for i in sub], k2, states)
            if broken is not None:
                s2, t2, h2, p2, k2 = broken
                if k2 is None:
                    ops.append(m.catchup_batch(s2, _ids(ch, t2), h2, _ids(ch, p2), note="a pending state in the batch"))
                else:
                    ops.append(m.propose_batch(s2, _ids(ch, t2), h2, _ids(ch, p2), k2, note="a pending state in the batch"))
        owed = []
        for j in _subset(ch, range(len(states)), lo=len(states)):  # each state's verify, in random order
            i = states[j]
            a = k if ch.chance(0.35) else ch.int(0, k)
            ops.append(m.verify(i, a))
            token[i] = ch.int(0, m.vocab - 1)  # the bonus token
            if a == k:  # every draft accepted (or none drafted): the drafter owes row position + k
                owed.append((i, f"d{k}" if k else tokens[j]))
        rows = [(i, t, m.seqs[i].seq_len) for i, t in owed if m.seqs[i].seq_len + 1 <= m.capacity]
        for i, _t in owed:
            if m.seqs[i].seq_len + 1 > m.capacity:
                leave(i)  # no row left for it: the sequence ends
        if ch.chance(0.3):  # rows that write nothing: a row base that is not the state's drafter_rows
            for i in _subset(ch, [i for i in sorted(token) if i not in [r[0] for r in rows] and not m.seqs[i].pending], lo=0):
                n = m.seqs[i].seq_len
                base = ch.choice([b for b in (n - 1, n + 1, n + 2, 0) if 0 <= b < m.capacity and b != n] or [n])
                if base != n:
                    rows.append((i, ch.int(0, m.vocab - 1), base))
        if not rows and not ch.chance(0.05):
            return
        order = _subset(ch, range(len(rows)), lo=len(rows))
        cs, ct, cb = [rows[j][0] for j in order], [rows[j][1] for j in order], [rows[j][2] for j in order]
        ch_hid = Hidden(ch.seed(), len(cs))
        misuse("catchup_batch", cs, ct, ch_hid, cb, None, [])
        ops.append(m.catchup_batch(cs, _ids(ch, ct), ch_hid, _ids(ch, cb)))

    def single_round(i: int) -> None:
        s = m.seqs[i]
        if s.pending:
            ops.append(m.verify(i, ch.int(0, s.last_drafted)))
        loop = _Loop(i, s.seq_len + 1, token[i], 1)
        ops.extend(_round(ch, m, loop, max_drafts))
        token[i] = loop.token
        if s.seq_len != loop.m - 1 or s.seq_len + 1 >= m.capacity:
            leave(i)

    for _ in range(ch.int(2, target)):
        join()
    for _ in range(ch.int(4, 10)):
        r = ch.int(0, 99)
        if r < 20 and len(m.seqs) < target:
            join()
        elif r < 25 and len(token) > 2:
            leave(ch.choice(sorted(token)))
        elif r < 35 and token:
            single_round(ch.choice(sorted(token)))
        elif len(token) < 2 and len(m.seqs) < target:
            join()
        else:
            batch_round()
        for i in sorted(token):
            if m.capacity - m.seqs[i].seq_len <= 1:
                leave(i)  # at its last rows: the sequence ends
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
    m = SpecModel(config, max_seq_len)
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
        if g not in ALL_GENERATORS:
            raise ValueError(f"generators: unknown generator {g!r}; known: {ALL_GENERATORS}")
    limit = max_drafts_limit(config, max_seq_len)
    if isinstance(max_drafts, bool) or not isinstance(max_drafts, int) or not 1 <= max_drafts <= limit:
        raise ValueError(f"max_drafts must be an integer in [1, {limit}] (the rows left after a prompt of max_seq_len={max_seq_len} tokens), got {max_drafts!r}")
    gen = generators[index % len(generators)]
    s = scenario_seed(seed, index)
    model = SpecModel(config, max_seq_len)
    ops = {"realistic": realistic, "adversarial": adversarial, "batched": batched}[gen](RandomChooser(s), model, max_drafts)
    return Scenario(seed, index, gen, s, tuple(ops))
