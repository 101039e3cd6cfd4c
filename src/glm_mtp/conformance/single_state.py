"""The single-state generators: ``realistic`` (the spec-decode loop of DESIGN.md §4 on one to
three states, with the refeed policy, engine rollbacks, capacity edges and double frees mixed in)
and ``adversarial`` (a walk over ``RULES``: misuse, odd orders, bad inputs, capacity edges;
``machines/machine.py`` drives the same rules from hypothesis)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .choices import MAX_DRAFTS, Chooser, grammar_arg, hidden, random_ids, sampling_arg, single_token, token_list
from .ops import Op, TokenIds, valid_int
from .spec import SpecModel


# ------------------------------------------------------------------------------------------------
# The realistic generator: the spec-decode loop of DESIGN.md §4.


@dataclass
class Loop:
    state: int
    m: int  # t_m is the newest committed token; the next propose writes row m - 1
    token: int
    rounds: int


def prompt_length(ch: Chooser, m: SpecModel) -> int:
    r = ch.int(0, 19)
    if r == 0:
        return 0
    if r == 1:
        return 1
    if r <= 3:
        return m.max_seq_len  # the cap
    return ch.int(2, max(2, m.max_seq_len * 3 // 4))


def loop_round(ch: Chooser, m: SpecModel, loop: Loop, max_drafts: int) -> list[Op]:
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
    ops.append(m.propose(loop.state, TokenIds((loop.token,), ch.choice(TokenIds.SINGLE_FORMS)),
                         hidden(ch, 1, single=True), p, k, grammar=grammar_arg(ch, m), sampling=sampling_arg(ch, m)))
    if ops[-1].expect != "ok":  # its matcher refused an allowed token (§10): nothing changed, the round ends
        loop.rounds -= 1
        return ops
    k = ops[-1].returns  # the drafts returned: fewer where a grammar stopped the propose
    a = ch.int(0, k)
    pos = lambda row: row if ch.chance(0.75) else row + ch.int(1, 64)  # noqa: E731  pos_base is ignored
    if ch.chance(0.15):  # refeed: keep the first row only, then catch up the accepted rows with the target's hiddens
        ops.append(m.verify(loop.state, 0, note="refeed"))
        if k and a:
            ops.append(m.catchup(loop.state,
                                 TokenIds(tuple(f"d{j}" for j in range(1, a + 1)), ch.choice(TokenIds.LIST_FORMS)),
                                 hidden(ch, a), loop.m, pos(loop.m), note="refeed"))
    else:
        ops.append(m.verify(loop.state, a))
        if k and a == k:  # all accepted: the drafter is one row behind
            ops.append(m.catchup(loop.state, TokenIds((f"d{k}",), ch.choice(TokenIds.LIST_FORMS)), hidden(ch, 1), p + k,
                                 pos(p + k)))
    if k == 0:  # no drafts: the committed token's row is still missing
        ops.append(m.catchup(loop.state, TokenIds((loop.token,), ch.choice(TokenIds.LIST_FORMS)), hidden(ch, 1), p,
                             pos(p)))
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
        n = prompt_length(ch, m)
        ops.append(m.prefill(i, TokenIds(random_ids(ch, m.vocab, n), ch.choice(TokenIds.LIST_FORMS)), hidden(ch, n)))
        loops.append(Loop(i, max(n, 1), ch.int(0, m.vocab - 1), ch.int(2, 14)))
    while loops:
        loop = ch.choice(loops)
        ops.extend(loop_round(ch, m, loop, max_drafts))
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
    pos_base = row_base if ch.chance(0.5) else ch.choice((ch.int(0, 3 * m.capacity), -1,
                                                          row_base + 1 if isinstance(row_base, int) else 0))
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
    return [m.propose(i, single_token(ch, m, s.drafts, FAULT_P), hidden(ch, 1, FAULT_P, single=True), position, k,
                      grammar=grammar_arg(ch, m, FAULT_P), sampling=sampling_arg(ch, m))]


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
    loop = Loop(i, s.seq_len + 1, ch.int(0, m.vocab - 1), 1)
    return ops + loop_round(ch, m, loop, max_drafts)


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
        ops.append(m.propose(i, single_token(ch, m), hidden(ch, 1, single=True), m.capacity - left, left + over,
                             note="capacity edge"))
    else:
        ops.append(m.catchup(i, token_list(ch, m, left + over), hidden(ch, left + over), m.capacity - left,
                             m.capacity - left,
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
