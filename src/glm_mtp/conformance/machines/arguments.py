"""Hostile arguments as a hypothesis ``RuleBasedStateMachine``: every public call of the drafter
contract (prefill, catch-up, propose, sampled propose, both batches, a second drafter's batches
on the first one's states, after_verify, rewinds, export, free, the queries) with arguments drawn
across types, dtypes, devices, shapes, ranges and special floats, played on two backends at once.

``machine.lockstep_machine`` plays well-formed scenario ops (misuse of the call order, odd
orders) as data; this machine passes raw Python values and tensors, the way a hostile caller
would (integer arguments and weights on the meta device among them), and checks DESIGN.md §4's
promise about bad input after every step:

- either both backends refuse, with the same exception type and message, a ``ValueError`` or
  ``TypeError`` naming an argument (or a ``RuntimeError`` of the lifecycle), and every state
  is byte-identical to before and still usable (not poisoned);
- or both return the same result (drafts, ``q`` and row counts compared by bytes) and hold
  byte-identical states;
- or, only where the call's grammar's own code failed (``grammars.MatcherFailure``) once the
  propose had begun writing, both raise that failure and poison the same states with the same
  message (DESIGN.md §4: a failure midway). A poisoned pair's rows and counters are what the
  failure left (unspecified), so they are not compared; every later call refuses them alike.

Where both drafters take grammars (``contract.takes_grammars``), proposes and batches also get
grammars (a matcher, a matcher that refuses an allowed token, one whose own code fails on its
n-th fill or accept, one of another vocabulary, the matcher class itself, or no matcher at all;
each backend its own, left as found either way) and ``draft_confidence`` is read and compared by
bytes (DESIGN.md §10, §12). States are compared through ``reference.bytes.keyed_bytes``.

    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test
    from glm_mtp.conformance.machines.arguments import argument_machine
    run_state_machine_as_test(argument_machine(), settings=settings(max_examples=50, deadline=None))
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from torch import Tensor

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.bytes import keyed_bytes, raw_bytes
from glm_mtp.reference.contract import SampledDrafts, takes_grammars

from ..grammars import ENDS, FAULTS, Breaks, Grammar, MatcherFailure, is_matcher
from .hostile_values import Draws, devices

# What a refusal may be: arguments (ValueError, TypeError) and the lifecycle (RuntimeError).
REFUSALS = (ValueError, TypeError, RuntimeError)
STATES = 3
# The grammars a propose draws (``grammar_factory``): mostly honest matchers.
GRAMMAR_KINDS = ("matcher", "matcher", "matcher", "liar", "breaks", *FAULTS, "text", "int")


def state_bytes(prop: Any, state: Any) -> dict[str, tuple]:
    """``export_state`` as (shape, dtype, bytes) per key (``keyed_bytes``, the one helper)."""
    return keyed_bytes(prop.export_state(state))


def result_bytes(value: Any) -> Any:
    """A call's result in a form compared by bytes: tensors (``SampledDrafts.q``) as raw bytes."""
    if isinstance(value, SampledDrafts):
        return ("sampled", value.drafts, result_bytes(value.q))
    if isinstance(value, Tensor):
        return (tuple(value.shape), str(value.dtype), raw_bytes(value))
    if isinstance(value, (list, tuple)):
        return [result_bytes(v) for v in value]
    return value


class Outcome:
    """What a call did on one backend: its result (by bytes), its refusal, or its grammar's own
    failure (``MatcherFailure``)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.error: BaseException | None = None
        self.value: Any = None
        try:
            self.value = result_bytes(fn())
        except (*REFUSALS, MatcherFailure) as e:
            self.error = e

    def describe(self) -> str:
        return (
            f"{type(self.error).__name__}: {self.error}" if self.error is not None else f"returned {self.value!r:.300}"
        )


class HostileCalls(RuleBasedStateMachine):
    """The machine's steps: a rule per public call, each drawing its arguments (``Draws``) and
    playing them on both backends (``play``). ``argument_machine`` binds the two drafters
    (``sides``: the reference, then the candidate), their weights' config, dtype and length."""

    sides: tuple[Any, Any]
    others: tuple[Any, Any]  # a second drafter of each backend on the same weights and length
    cfg: MtpConfig
    dtype: torch.dtype
    max_seq_len: int
    weights: MtpWeights
    candidate: Callable[[MtpWeights, int], Any]
    grammars: bool  # both drafters take grammars and report confidences (DESIGN.md §10, §12)
    grammar_kinds: tuple[str, ...]  # the grammar arguments drawn (GRAMMAR_KINDS, or a test's few)

    def __init__(self) -> None:
        super().__init__()
        self.states = [[p.alloc_state("cpu") for p in self.sides] for _ in range(STATES)]
        self.calls: list[str] = []

    # ---- the one check of every step ------------------------------------------------
    def play(self, call: str, args: dict[str, Any], fn: Callable[[Any, list[Any]], Any], touched: list[int]) -> None:
        """Run ``fn(prop, states_of_that_backend)`` on both backends and check the outcome."""
        self.calls.append(f"{call}({', '.join(f'{k}={short(v)}' for k, v in args.items())})")
        before = [[state_bytes(p, self.states[i][s]) for i in touched] for s, p in enumerate(self.sides)]
        was_poisoned = self.poisoned()
        outcomes = [Outcome(lambda s=s, p=p: fn(p, [pair[s] for pair in self.states]))
                    for s, p in enumerate(self.sides)]
        ref, cand = outcomes
        where = "\n  ".join(self.calls)
        context = f"{call}: reference {ref.describe()}; candidate {cand.describe()}\ncalls:\n  {where}"
        assert (ref.error is None) == (cand.error is None), f"one backend refused, the other did not: {context}"
        if ref.error is not None:
            assert type(ref.error) is type(cand.error) and str(ref.error) == str(cand.error), \
                f"different refusals: {context}"
            if isinstance(ref.error, MatcherFailure):  # the matcher failed after the propose wrote rows (§4)
                now = self.poisoned()
                assert now[0] == now[1], f"the backends poisoned different states ({now}): {context}"
                assert any(p is not None and w is None for p, w in zip(now[0], was_poisoned[0])), \
                    f"a failure midway poisoned no state: {context}"
                return
            if isinstance(ref.error, (ValueError, TypeError)):
                names = [*args, "state", "token id", "temperature", "noise", "hidden"]
                assert any(n in str(ref.error) for n in names), f"a refusal that names no argument: {context}"
            after = [[state_bytes(p, self.states[i][s]) for i in touched] for s, p in enumerate(self.sides)]
            assert after == before, f"a refused call changed a state: {context}"
        else:
            assert ref.value == cand.value, f"different results: {context}"
        assert self.poisoned() == was_poisoned, f"a call that refused or returned poisoned a state: {context}"

    def poisoned(self) -> list[list[str | None]]:
        """Each backend's states' poison (None: sound), state by state."""
        return [[pair[s].poisoned for pair in self.states] for s in range(len(self.sides))]

    @invariant()
    def states_agree(self) -> None:
        for i, (r, c) in enumerate(self.states):
            assert r.poisoned == c.poisoned, f"state {i} poisoned on one backend only, or otherwise: " \
                                             f"{r.poisoned!r} / {c.poisoned!r}"
            if r.poisoned is not None:  # rows and counters as the failure left them: unspecified (§4)
                continue
            assert state_bytes(self.sides[0], r) == state_bytes(self.sides[1], c), \
                f"state {i} differs after:\n  " + "\n  ".join(self.calls)

    def seq_len(self, i: int) -> int:
        return self.sides[0].drafter_rows(self.states[i][0]) if not self.states[i][0].released else 0

    def live(self, i: int) -> bool:
        return not self.states[i][0].released

    # ---- rules ------------------------------------------------------------------------
    @rule(data=st.data())
    def prefill(self, data: Any) -> None:
        i = data.draw(st.integers(0, STATES - 1))
        d = Draws(data, self.cfg, self.dtype)
        n = d.draw(st.sampled_from([0, 1, 2, 5, 9, self.max_seq_len, self.max_seq_len + 1]))
        tokens, hiddens = d.tokens(n), d.hiddens(n)
        self.play("prefill_drafter", {"state": i, "prompt_tokens": tokens, "hiddens": hiddens},
                  lambda p, s: p.prefill_drafter(tokens, hiddens, s[i]), [i])

    @rule(data=st.data())
    def catchup(self, data: Any) -> None:
        i = data.draw(st.integers(0, STATES - 1))
        d = Draws(data, self.cfg, self.dtype)
        n = d.draw(st.sampled_from([0, 1, 1, 2, 3]))
        base = self.seq_len(i)
        row_base = d.integer(st.sampled_from([base, base, base, max(base - 1, 0), base + 1, 60, 63]))
        pos_base = d.integer(st.sampled_from([base]))
        tokens, hiddens = d.tokens(n), d.hiddens(n)
        self.play("catchup_drafter",
                  {"state": i, "tokens": tokens, "hiddens": hiddens, "row_base": row_base, "pos_base": pos_base},
                  lambda p, s: p.catchup_drafter(tokens, hiddens, row_base, pos_base, s[i]), [i])

    def propose_args(self, d: Draws, i: int) -> tuple[Any, Any, Any, Any]:
        base = self.seq_len(i)
        position = d.integer(st.sampled_from([base, base, max(base - 1, 0), max(base - 3, 0), 0, base + 1]))
        num_drafts = d.integer(st.sampled_from([0, 1, 2, 3, 3, 4, 70]))
        return d.token(), d.hiddens(None), position, num_drafts

    @rule(data=st.data())
    def propose(self, data: Any) -> None:
        i = data.draw(st.integers(0, STATES - 1))
        d = Draws(data, self.cfg, self.dtype)
        token, hidden, position, k = self.propose_args(d, i)
        self.play("propose",
                  {"state": i, "last_token": token, "target_hidden": hidden, "position": position, "num_drafts": k},
                  lambda p, s: p.propose(token, hidden, position, k, s[i]), [i])

    @rule(data=st.data())
    def propose_sampled(self, data: Any) -> None:
        i = data.draw(st.integers(0, STATES - 1))
        d = Draws(data, self.cfg, self.dtype)
        token, hidden, position, k = self.propose_args(d, i)
        temperature, noise = d.temperature(), d.noise(k if isinstance(k, int) and not isinstance(k, bool) else 1)
        self.play("propose_sampled", {"state": i, "last_token": token, "target_hidden": hidden, "position": position,
                                      "num_drafts": k, "temperature": temperature, "noise": noise},
                  lambda p, s: p.propose_sampled(token, hidden, position, k, temperature, noise, s[i]), [i])

    def batch(self, d: Draws) -> list[int]:
        order = d.draw(st.permutations(range(STATES)))
        size = d.draw(st.sampled_from([0, 1, 2, 2, 3]))
        picked = list(order[:size])
        if picked and d.draw(st.integers(0, 9)) == 0:
            picked.append(picked[0])  # a state twice
        return picked

    @rule(data=st.data())
    def propose_batch(self, data: Any) -> None:
        d = Draws(data, self.cfg, self.dtype)
        picked = self.batch(d)
        args = [self.propose_args(d, i) for i in picked]
        k = d.integer(st.sampled_from([0, 1, 2, 3]))
        if d.draw(st.booleans()):
            tokens: Any = [a[0] for a in args]
        else:
            tokens = torch.tensor([d.token_id() for _ in picked], dtype=torch.int64)
            if d.draw(st.integers(0, 4)) == 0 and picked:
                tokens[-1] = d.draw(st.sampled_from([-1, self.cfg.vocab_size]))
        H = self.cfg.hidden_size
        rows = [a[1] for a in args]
        if rows and all(isinstance(r, Tensor) and r.layout == torch.strided and r.numel() == H and r.dtype == self.dtype
                        and r.device.type == "cpu" for r in rows):
            hiddens: Any = torch.stack([r.reshape(H) for r in rows])
        else:
            hiddens = d.hiddens(len(picked))
        positions: Any = [self.seq_len(i) for i in picked] if d.draw(st.booleans()) else [a[2] for a in args]
        if d.draw(st.integers(0, 3)) == 0 and all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p < 2**63
                                                  for p in positions):
            positions = torch.tensor(positions, dtype=torch.int64,
                                     device=d.draw(st.sampled_from(devices())))  # (B,), any device
        self.play("propose_batch",
                  {"states": picked, "last_tokens": tokens, "target_hiddens": hiddens, "positions": positions,
                   "num_drafts": k},
                  lambda p, s: p.propose_batch(tokens, hiddens, positions, k, [s[i] for i in picked]),
                  list(range(STATES)))

    @rule(data=st.data())
    def catchup_batch(self, data: Any) -> None:
        d = Draws(data, self.cfg, self.dtype)
        picked = self.batch(d)
        tokens = d.tokens(len(picked))
        hiddens = d.hiddens(len(picked))
        bases = ([self.seq_len(i) for i in picked] if d.draw(st.booleans())
                 else [d.integer(st.integers(0, 8)) for _ in picked])
        self.play("catchup_batch", {"states": picked, "tokens": tokens, "hiddens": hiddens, "row_bases": bases},
                  lambda p, s: p.catchup_batch(tokens, hiddens, bases, [s[i] for i in picked]), list(range(STATES)))

    @rule(data=st.data())
    def after_verify(self, data: Any) -> None:
        i = data.draw(st.integers(0, STATES - 1))
        d = Draws(data, self.cfg, self.dtype)
        drafted = self.states[i][0].last_drafted
        num_accepted = d.integer(st.integers(0, max(drafted, 0) + 1))
        self.play("after_verify", {"state": i, "num_accepted": num_accepted},
                  lambda p, s: p.after_verify(num_accepted, s[i]), [i])

    @rule(data=st.data())
    def free_or_renew(self, data: Any) -> None:
        i = data.draw(st.integers(0, STATES - 1))
        if self.live(i) and data.draw(st.booleans()):
            self.play("free_state", {"state": i}, lambda p, s: p.free_state(s[i]), [i])
        else:
            self.calls.append(f"alloc_state() -> state {i}")
            self.states[i] = [p.alloc_state("cpu") for p in self.sides]

    @rule(data=st.data())
    def construct(self, data: Any) -> None:
        """A drafter built on these weights (or on their meta copy: shapes without data) with a
        drawn ``max_seq_len``: both backends build, or both refuse alike, naming the argument."""
        d = Draws(data, self.cfg, self.dtype)
        weights = self.weights.to("meta") if d.draw(st.integers(0, 3)) == 0 else self.weights
        max_seq_len = d.integer(st.sampled_from([1, 16, self.max_seq_len]))
        outcomes = [Outcome(lambda f=f: (f(weights, max_seq_len).max_seq_len,))
                    for f in (ReferenceProposer, self.candidate)]
        ref, cand = outcomes
        context = f"construct(weights on {weights.device}, max_seq_len={short(max_seq_len)}): " \
                  f"reference {ref.describe()}; candidate {cand.describe()}"
        self.calls.append(context)
        assert (ref.error is None) == (cand.error is None), f"one backend refused, the other did not: {context}"
        if ref.error is not None:
            assert type(ref.error) is type(cand.error) and str(ref.error) == str(cand.error), \
                f"different refusals: {context}"
            assert "max_seq_len" in str(ref.error) or "weights" in str(ref.error), \
                f"a refusal that names no argument: {context}"
        else:
            assert ref.value == cand.value, f"different results: {context}"

    @precondition(lambda self: self.grammars)
    @rule(data=st.data())
    def propose_under_a_grammar(self, data: Any) -> None:
        """A propose (greedy or sampled) whose ``grammar`` is a drawn argument
        (``grammar_factory``), or now and then a batch of them (``propose_batch_under_grammars``);
        each backend gets its own matcher, which must be left as found whether the call drafts,
        refuses or fails midway (§10)."""
        d = Draws(data, self.cfg, self.dtype)
        if d.draw(st.integers(0, 3)) == 0:  # now and then a batch, one grammar argument per state
            self.propose_batch_under_grammars(d)
            return
        i = data.draw(st.integers(0, STATES - 1))
        if d.draw(st.integers(0, 3)):  # mostly well-formed otherwise, so the grammar decides the outcome
            gen = torch.Generator().manual_seed(d.draw(st.integers(0, 2**31 - 1)))
            token, position, k = d.token_id(), self.seq_len(i), d.draw(st.integers(1, 4))
            hidden = torch.randn(self.cfg.hidden_size, generator=gen).to(self.dtype)
        else:
            token, hidden, position, k = self.propose_args(d, i)
        made: list[Any] = []
        grammar, kind = self.grammar_factory(d, made)

        if d.draw(st.booleans()):
            temperature, noise = d.temperature(), d.noise(k if isinstance(k, int) and not isinstance(k, bool) else 1)
            fn: Callable[[Any, list[Any]], Any] = lambda p, s: p.propose_sampled(  # noqa: E731
                token, hidden, position, k, temperature, noise, s[i], grammar=grammar())
        else:
            fn = lambda p, s: p.propose(token, hidden, position, k, s[i], grammar=grammar())  # noqa: E731
        self.play("propose", {"state": i, "last_token": token, "target_hidden": hidden, "position": position,
                              "num_drafts": k, "grammar": kind}, fn, [i])
        assert all(m.as_found() for m in made if is_matcher(m)), "a matcher was not left as found"
        if self.live(i) and self.states[i][0].pending:  # the confidences of the propose just made
            self.play("draft_confidence", {"state": i}, lambda p, s: p.draft_confidence(s[i]), [i])

    def grammar_factory(self, d: Draws, made: list[Any]) -> tuple[Callable[[], Any], str]:
        """A drawn grammar argument: a function making a fresh one per backend (kept in ``made``)
        and its description. ``breaks``: a matcher whose own code fails on its n-th fill or
        accept (n = 1: among the checks, a refusal; later: midway, after rows were written)."""
        kind = d.draw(st.sampled_from(self.grammar_kinds))
        g = Grammar(d.draw(st.integers(0, 2**31 - 1)), d.draw(st.sampled_from([None, 0, 1, 3])), 0,
                    d.draw(st.sampled_from(ENDS)), 0 if kind == "liar" else None, kind if kind in FAULTS else None)
        at = d.draw(st.sampled_from((2, 3, 1, 4))) if kind == "breaks" else 0  # midway first: 1 is the refusal
        V = self.cfg.vocab_size

        def grammar() -> Any:
            if kind == "breaks":
                made.append(Breaks(g, V, at))
            else:
                made.append({"text": "[a-z]+", "int": 3}.get(kind) or g.matcher(V))
            return made[-1]

        return grammar, f"{kind}{f' at call {at}' if at else ''} {g}"

    def propose_batch_under_grammars(self, d: Draws) -> None:
        """``propose_batch`` with one drawn grammar argument (or None) per state, the batch
        otherwise well-formed, so the grammars decide the outcome: the same drafts, refusals
        (naming ``states[b]``, every state and matcher as found) or failure midway (every state
        of the batch poisoned alike) on both backends (§4, §10). A part of
        ``propose_under_a_grammar``, not a rule of its own: a rule more would change which rules
        the derandomized runs of the tests draw."""
        picked = list(d.draw(st.permutations(range(STATES))))[: d.draw(st.integers(1, STATES))]
        gen = torch.Generator().manual_seed(d.draw(st.integers(0, 2**31 - 1)))
        tokens = [d.token_id() for _ in picked]
        hiddens = torch.randn(len(picked), self.cfg.hidden_size, generator=gen).to(self.dtype)
        positions = [self.seq_len(i) for i in picked]
        k = d.draw(st.integers(1, 3))
        made: list[Any] = []
        factories = [self.grammar_factory(d, made) if d.draw(st.integers(0, 3)) else None for _ in picked]
        self.play("propose_batch", {"states": picked, "last_tokens": tokens, "target_hiddens": hiddens,
                                    "positions": positions, "num_drafts": k,
                                    "grammars": [f[1] if f else None for f in factories]},
                  lambda p, s: p.propose_batch(tokens, hiddens, positions, k, [s[i] for i in picked],
                                               grammars=[f[0]() if f else None for f in factories]),
                  list(range(STATES)))
        assert all(m.as_found() for m in made if is_matcher(m)), "a matcher was not left as found"

    @precondition(lambda self: self.grammars)
    @rule(data=st.data())
    def draft_confidence(self, data: Any) -> None:
        """The pending propose's ``(prob, margin)``, by bytes; refused alike when none is pending (§12)."""
        i = data.draw(st.integers(0, STATES - 1))
        self.play("draft_confidence", {"state": i}, lambda p, s: p.draft_confidence(s[i]), [i])

    @rule(data=st.data())
    def second_drafter_batch(self, data: Any) -> None:
        """``propose_batch`` / ``catchup_batch`` of a second drafter on these weights and this
        length, on states the first allocated: served as its single calls serve them (or
        refused alike), never a failure of its own buffers."""
        d = Draws(data, self.cfg, self.dtype)
        picked = self.batch(d)
        other = {id(p): q for p, q in zip(self.sides, self.others)}
        if d.draw(st.booleans()):
            tokens = [d.token_id() for _ in picked]
            hiddens = d.hiddens(len(picked))
            positions = [self.seq_len(i) for i in picked]
            k = d.integer(st.sampled_from([1, 2, 3]))
            self.play("second drafter's propose_batch", {"states": picked, "last_tokens": tokens,
                                                         "target_hiddens": hiddens, "positions": positions,
                                                         "num_drafts": k},
                      lambda p, s: other[id(p)].propose_batch(tokens, hiddens, positions, k, [s[i] for i in picked]),
                      list(range(STATES)))
        else:
            tokens, hiddens = d.tokens(len(picked)), d.hiddens(len(picked))
            bases = [self.seq_len(i) for i in picked]
            self.play("second drafter's catchup_batch",
                      {"states": picked, "tokens": tokens, "hiddens": hiddens, "row_bases": bases},
                      lambda p, s: other[id(p)].catchup_batch(tokens, hiddens, bases, [s[i] for i in picked]),
                      list(range(STATES)))

    @rule(data=st.data())
    def queries(self, data: Any) -> None:
        """The queries, compared; on a poisoned pair (its counters unspecified, §4) they must
        still answer, and only ``prefill_hidden_rows`` is compared."""
        i = data.draw(st.integers(0, STATES - 1))
        n = Draws(data, self.cfg, self.dtype).integer(st.integers(0, 2 * self.max_seq_len))
        if self.states[i][0].poisoned is not None:
            self.play("queries (poisoned)", {"state": i, "max_seq_len": n},
                      lambda p, s: (type(p.drafter_rows(s[i])) is int, type(p.last_pair_key(s[i])) in (int, type(None)),
                                    p.prefill_hidden_rows(n)), [i])
            return
        self.play("queries", {"state": i, "max_seq_len": n},
                  lambda p, s: (p.drafter_rows(s[i]), p.last_pair_key(s[i]), p.prefill_hidden_rows(n)), [i])


def argument_machine(candidate: Callable[[MtpWeights, int], Any] | None = None, dtype: torch.dtype = torch.bfloat16,
                     max_seq_len: int = 32, weights_seed: int = 0,
                     grammar_kinds: tuple[str, ...] = GRAMMAR_KINDS) -> type[RuleBasedStateMachine]:
    """A machine class playing hostile calls on ``candidate(weights, max_seq_len)`` (default: the
    optimized drafter, which takes its kernels' torch twins on CPU) and the reference.

    Args:
        candidate: a drafter factory; its states must be on the weights' device (the CPU here).
        dtype, max_seq_len, weights_seed: the tiny preset's weights and the drafters' length.
        grammar_kinds: the grammar arguments a propose draws from (``GRAMMAR_KINDS``, each kind
            as often as it is listed); a test aimed at one rule names the few that reach it.
    """
    unknown = set(grammar_kinds) - set(GRAMMAR_KINDS)
    if not grammar_kinds or unknown:
        raise ValueError(f"grammar_kinds must be some of {sorted(set(GRAMMAR_KINDS))}, got {grammar_kinds!r}")
    if candidate is None:
        from glm_mtp.optimized import OptimizedProposer as candidate  # noqa: N813
    weights = MtpWeights.random(MtpConfig.preset("tiny"), seed=weights_seed, dtype=dtype)
    sides = (ReferenceProposer(weights, max_seq_len), candidate(weights, max_seq_len))
    others = (ReferenceProposer(weights, max_seq_len), candidate(weights, max_seq_len))
    return type("ArgumentMachine", (HostileCalls,),
                {"sides": sides, "others": others, "cfg": weights.config, "dtype": dtype, "max_seq_len": max_seq_len,
                 "weights": weights, "candidate": staticmethod(candidate),
                 "grammars": all(takes_grammars(p) for p in sides), "grammar_kinds": tuple(grammar_kinds)})


def short(value: Any) -> str:
    """A call argument for the failure report (tensors by shape, dtype and device)."""
    if isinstance(value, Tensor):
        dense = value.layout == torch.strided and value.device.type != "meta"
        extra = f", {value.tolist()}" if dense and value.numel() <= 4 else ("" if dense else f", {value.layout}")
        return f"tensor({tuple(value.shape)}, {value.dtype}, {value.device}{extra})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
