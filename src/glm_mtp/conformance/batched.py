"""The batched generator: 2-6 states joining and leaving at very different lengths, drafted
together by ``propose_batch`` and caught up by ``catchup_batch``, with single calls interleaved
and batched misuse (``BATCH_MISUSE``)."""

from __future__ import annotations

from typing import Sequence

from .choices import MAX_DRAFTS, Chooser, hidden, random_ids
from .single_state import Loop, loop_round, prompt_length
from .ops import FOREIGN, Hidden, Op, TokenIds, valid_int
from .spec import SpecModel


# ------------------------------------------------------------------------------------------------
# The batched generator: many sequences drafted in lockstep.

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
    return _Batched(ch, m, max_drafts).run()


class _Batched:
    """One batched scenario as it is built: the ops so far and, per live state, the token its
    next propose drafts after. Each step below draws from ``ch`` in a fixed order, so a seed
    gives the same scenario every time."""

    def __init__(self, ch: Chooser, m: SpecModel, max_drafts: int) -> None:
        self.ch, self.m, self.max_drafts = ch, m, max_drafts
        self.ops = [m.info()]
        self.token: dict[int, int] = {}  # live state -> the token its next propose drafts after
        self.target = ch.int(2, 6)

    def run(self) -> list[Op]:
        """States join, then 4-10 turns of joining, leaving, single rounds and batch rounds; a
        state at its last rows leaves after every turn."""
        ch, m = self.ch, self.m
        for _ in range(ch.int(2, self.target)):
            self.join()
        for _ in range(ch.int(4, 10)):
            r = ch.int(0, 99)
            if r < 20 and len(m.seqs) < self.target:
                self.join()
            elif r < 25 and len(self.token) > 2:
                self.leave(ch.choice(sorted(self.token)))
            elif r < 35 and self.token:
                self.single_round(ch.choice(sorted(self.token)))
            elif len(self.token) < 2 and len(m.seqs) < self.target:
                self.join()
            else:
                self.batch_round()
            for i in sorted(self.token):
                if m.capacity - m.seqs[i].seq_len <= 1:
                    self.leave(i)  # at its last rows: the sequence ends
        return self.ops

    # ---- a sequence joins and leaves ----

    def join(self) -> None:
        """alloc and prefill a new state (sometimes filled close to its capacity)."""
        ch, m = self.ch, self.m
        self.ops.append(m.alloc())
        i = len(m.seqs) - 1
        n = prompt_length(ch, m)
        self.ops.append(m.prefill(i, TokenIds(random_ids(ch, m.vocab, n), ch.choice(TokenIds.LIST_FORMS)),
                                  hidden(ch, n)))
        if ch.chance(0.2):  # close to the capacity: the batch's num_drafts reaches its last row
            rows = m.seqs[i].seq_len
            fill = max(0, m.capacity - rows - ch.int(1, self.max_drafts + 1))
            self.ops.append(m.catchup(i, TokenIds(random_ids(ch, m.vocab, fill)), hidden(ch, fill), rows, rows))
        self.token[i] = ch.int(0, m.vocab - 1)

    def leave(self, i: int) -> None:
        """free state ``i`` (sometimes twice)."""
        self.ops.append(self.m.free(i))
        if self.ch.chance(0.1):
            self.ops.append(self.m.free(i))
        del self.token[i]

    # ---- one round of a single state ----

    def single_round(self, i: int) -> None:
        """State ``i``'s own spec-decode round (its pending propose verified first)."""
        ch, m = self.ch, self.m
        s = m.seqs[i]
        if s.pending:
            self.ops.append(m.verify(i, ch.int(0, s.last_drafted)))
        loop = Loop(i, s.seq_len + 1, self.token[i], 1)
        self.ops.extend(loop_round(ch, m, loop, self.max_drafts))
        self.token[i] = loop.token
        if s.seq_len != loop.m - 1 or s.seq_len + 1 >= m.capacity:
            self.leave(i)

    # ---- one batch round: propose_batch, each state's verify, catchup_batch ----

    def batch_round(self) -> None:
        """``propose_batch`` over a random subset, maybe a single round or a batch holding a
        pending state meanwhile, each state's verify, then ``catchup_batch`` of the owed rows."""
        ch = self.ch
        live = sorted(self.token)
        states = [] if ch.chance(0.03) else _subset(ch, live, lo=2)
        pos = self.positions(states)
        k = self.num_drafts(pos)
        tokens = [self.token[i] for i in states]
        hid = Hidden(ch.seed(), len(states))
        self.misuse("propose_batch", states, tokens, hid, pos, k, [])
        self.ops.append(self.m.propose_batch(states, _ids(ch, tokens), hid, _ids(ch, pos), k))
        if self.ops[-1].expect != "ok":
            return
        others = [i for i in live if i not in states]
        if others and ch.chance(0.25):  # a single state's own round while the batch is pending
            self.single_round(ch.choice(others))
        if states and ch.chance(0.2):  # a batch (of either kind) holding a state whose propose is pending
            self.batch_with_pending(states)
        owed = self.verify_each(states, tokens, k)
        rows = self.owed_rows(owed)
        if ch.chance(0.3):  # rows that write nothing: a row base that is not the state's drafter_rows
            self.add_misaligned_rows(rows)
        if not rows and not ch.chance(0.05):
            return
        self.catchup(rows)

    def positions(self, states: list[int]) -> list[int]:
        """Each state's propose position: its rows, or a few rows back (an engine rollback: a rewind)."""
        pos = []
        for i in states:
            n = self.m.seqs[i].seq_len
            pos.append(n - self.ch.int(1, min(3, n)) if n >= 1 and self.ch.chance(0.15) else n)
        return pos

    def num_drafts(self, pos: list[int]) -> int:
        """The batch's k: 0, up to the room every state has left, or exactly that room."""
        ch, max_drafts = self.ch, self.max_drafts
        room = min([self.m.capacity - p for p in pos], default=max_drafts)
        kmax = min(max_drafts, room)
        return 0 if kmax == 0 or ch.chance(0.1) else room if room <= max_drafts and ch.chance(0.5) else ch.int(1, kmax)

    def batch_with_pending(self, states: list[int]) -> None:
        """A batch of either kind holding one of ``states`` while its propose is pending."""
        ch, m, token = self.ch, self.m, self.token
        rest = [i for i in sorted(token) if not m.seqs[i].pending]
        sub = _subset(ch, rest, lo=0) if rest else []
        k2 = ch.int(0, self.max_drafts) if ch.chance(0.5) else None
        broken = _misuse(ch, m, "pending", sub, [token[i] for i in sub], Hidden(ch.seed(), len(sub)),
                         [m.seqs[i].seq_len for i in sub], k2, states)
        if broken is None:
            return
        s2, t2, h2, p2, k2 = broken
        if k2 is None:
            self.ops.append(m.catchup_batch(s2, _ids(ch, t2), h2, _ids(ch, p2), note="a pending state in the batch"))
        else:
            self.ops.append(m.propose_batch(s2, _ids(ch, t2), h2, _ids(ch, p2), k2,
                                            note="a pending state in the batch"))

    def verify_each(self, states: list[int], tokens: list[int], k: int) -> list[tuple[int, int | str]]:
        """Each state's ``after_verify``, in random order, with its own accept count; returns the
        states that accepted every draft, each with the token of the row it is owed."""
        ch, m = self.ch, self.m
        owed: list[tuple[int, int | str]] = []
        for j in _subset(ch, range(len(states)), lo=len(states)):  # each state's verify, in random order
            i = states[j]
            a = k if ch.chance(0.35) else ch.int(0, k)
            self.ops.append(m.verify(i, a))
            self.token[i] = ch.int(0, m.vocab - 1)  # the bonus token
            if a == k:  # every draft accepted (or none drafted): the drafter owes row position + k
                owed.append((i, f"d{k}" if k else tokens[j]))
        return owed

    def owed_rows(self, owed: list[tuple[int, int | str]]) -> list[tuple[int, int | str, int]]:
        """The owed rows that fit, as (state, token, row base); a state with no row left leaves."""
        m = self.m
        rows = [(i, t, m.seqs[i].seq_len) for i, t in owed if m.seqs[i].seq_len + 1 <= m.capacity]
        for i, _t in owed:
            if m.seqs[i].seq_len + 1 > m.capacity:
                self.leave(i)  # no row left for it: the sequence ends
        return rows

    def add_misaligned_rows(self, rows: list[tuple[int, int | str, int]]) -> None:
        """Rows of other idle states at a row base that is not their drafter_rows (they write nothing)."""
        ch, m = self.ch, self.m
        for i in _subset(ch, [i for i in sorted(self.token) if i not in [r[0] for r in rows] and not m.seqs[i].pending],
                         lo=0):
            n = m.seqs[i].seq_len
            base = ch.choice([b for b in (n - 1, n + 1, n + 2, 0) if 0 <= b < m.capacity and b != n] or [n])
            if base != n:
                rows.append((i, ch.int(0, m.vocab - 1), base))

    def catchup(self, rows: list[tuple[int, int | str, int]]) -> None:
        """``catchup_batch`` of ``rows`` in random order (sometimes misused first)."""
        ch = self.ch
        order = _subset(ch, range(len(rows)), lo=len(rows))
        cs, ct, cb = [rows[j][0] for j in order], [rows[j][1] for j in order], [rows[j][2] for j in order]
        ch_hid = Hidden(ch.seed(), len(cs))
        self.misuse("catchup_batch", cs, ct, ch_hid, cb, None, [])
        self.ops.append(self.m.catchup_batch(cs, _ids(ch, ct), ch_hid, _ids(ch, cb)))

    # ---- misuse ----

    def misuse(self, kind: str, states: list, tokens: list, hid: Hidden, pos: list, k: int | None,
               pending: Sequence[int]) -> None:
        """Sometimes, before the real call, the same batch with one or two kinds of misuse."""
        ch, m = self.ch, self.m
        if not ch.chance(0.3):
            return
        broken = _misused(ch, m, states, tokens, hid, pos, k, pending)
        if broken is None:
            return
        s2, t2, h2, p2, k2, note = broken
        if kind == "propose_batch":
            self.ops.append(m.propose_batch(s2, _ids(ch, t2), h2, _ids(ch, p2), k2, note=note))
        else:
            self.ops.append(m.catchup_batch(s2, _ids(ch, t2), h2, _ids(ch, p2), note=note))
