"""Both drafters under a failing matcher (DESIGN.md §4, §10; issue 49 item 6): the same call on the
reference and the optimized drafter (its torch twins on CPU; the fused batch in bf16, the
per-primitive one in float64), single, sampled and batched, compared by exception type, the
message's key words and the resulting state (``keyed_bytes``, the one helper).

The rule: what is no matcher (a class, an int, an object missing a method) or cannot answer
draft step 1's question (a matcher of another vocabulary, whose fill refuses a bitmask of this
drafter's width; any matcher whose own code fails there) is refused before any write, a
``ValueError`` naming ``grammar`` with the state byte-identical, not poisoned, and the matcher
never walked (no accept, no rollback). A matcher whose code fails after that, once the propose
has written rows, fails the propose midway: its own exception, the state (every state of a
batch) poisoned with the same message in both backends, and the matcher rolled back.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from glm_mtp.conformance.grammars import AutomatonMatcher, Breaks, Grammar, MatcherFailure, NoRollback
from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.bytes import keyed_bytes
from glm_mtp.reference.numerics import acc_dtype

CALLS = ("propose", "propose_sampled", "propose_batch")
# (call, weights): the batch on both of the optimized drafter's batch paths (the fused one in bf16,
# the per-primitive one in float64), the single calls in bf16.
CASES = [("propose", "bf16"), ("propose_sampled", "bf16"), ("propose_batch", "bf16"), ("propose_batch", "f64")]
K = 3


class Spy(Breaks):
    """A ``Breaks`` matcher (``at = 0``: it never fails) that logs every method called on it."""

    def __init__(self, grammar: Grammar, vocab_size: int, at: int = 0) -> None:
        super().__init__(grammar, vocab_size, at)
        self.log: list[str] = []

    def is_terminated(self) -> bool:
        self.log.append("is_terminated")
        return super().is_terminated()

    def fill_next_token_bitmask(self, bitmask, index=0):
        self.log.append("fill_next_token_bitmask")
        return super().fill_next_token_bitmask(bitmask, index)

    def accept_token(self, token: int) -> bool:
        self.log.append("accept_token")
        return super().accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        self.log.append("rollback")
        super().rollback(num_tokens)


@pytest.fixture(scope="module")
def pairs() -> dict[str, tuple[ReferenceProposer, OptimizedProposer]]:
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("f64", torch.float64)):
        weights = MtpWeights.random(MtpConfig.preset("tiny"), seed=4, dtype=dtype)
        opt = OptimizedProposer(weights, 32)
        assert (opt.step is not None) == (dtype == torch.bfloat16)  # the batch path each dtype takes
        out[name] = (ReferenceProposer(weights, 32), opt)
    return out


def ready(prop, dtype: torch.dtype, B: int = 2) -> list[Any]:
    """B states with 11 rows each (a 12-token prompt), the same bytes in either backend."""
    gen = torch.Generator().manual_seed(11)
    states = []
    for _ in range(B):
        st = prop.alloc_state("cpu")
        H, V = prop.config.hidden_size, prop.config.vocab_size
        prop.prefill_drafter(torch.randint(V, (12,), generator=gen), torch.randn(12, H, generator=gen).to(dtype), st)
        states.append(st)
    return states


def play(prop, call: str, make, position: int = 11) -> dict[str, Any]:
    """``call`` on fresh states of ``prop`` with the argument ``make(vocab_size)`` as the grammar
    (``grammars[1]`` in a batch of two, ``grammars[0]`` an honest matcher): what it raised, the
    states before and after, their poison, the matchers."""
    dtype = prop.weights.dtype
    states = ready(prop, dtype)
    V, H = prop.config.vocab_size, prop.config.hidden_size
    gen = torch.Generator().manual_seed(12)
    hiddens = torch.randn(2, H, generator=gen).to(dtype)
    before = [keyed_bytes(prop.export_state(st)) for st in states]
    bad, honest = make(V), Spy(Grammar(1), V)
    out: dict[str, Any] = {"error": None, "message": "", "causes": []}
    try:
        if call == "propose":
            prop.propose(5, hiddens[0], position, K, states[0], grammar=bad)
        elif call == "propose_sampled":
            noise = torch.empty(K, V).exponential_(generator=gen).to(acc_dtype(dtype))
            prop.propose_sampled(5, hiddens[0], position, K, 1.0, noise, states[0], grammar=bad)
        else:
            prop.propose_batch([5, 7], hiddens, [position, position], K, states, grammars=[honest, bad])
    except Exception as e:  # noqa: BLE001  compared between the backends below
        causes, cause = [], e.__cause__
        while cause is not None:  # the chain below the refusal (a batch's names its state's)
            causes.append(type(cause))
            cause = cause.__cause__
        out.update(error=type(e), message=str(e), causes=causes)
    touched = states if call == "propose_batch" else states[:1]
    out.update(before=before[: len(touched)], after=[keyed_bytes(prop.export_state(st)) for st in touched],
               poisoned=[st.poisoned for st in touched], bad=bad, honest=honest, states=touched)
    return out


def both(pair, call: str, make, position: int = 11) -> tuple[dict[str, Any], dict[str, Any]]:
    ref, opt = pair
    r, o = play(ref, call, make, position), play(opt, call, make, position)
    # the same message, but for the time of day xgrammar's own errors begin with
    same = [re.sub(r"\[\d\d:\d\d:\d\d\] ", "", side["message"]) for side in (r, o)]
    assert r["error"] is o["error"] and same[0] == same[1], (r["message"], o["message"])
    assert r["causes"] == o["causes"] and r["poisoned"] == o["poisoned"]
    return r, o


def assert_refused_before_any_write(r: dict[str, Any], o: dict[str, Any], call: str, *words: str) -> None:
    """A ``ValueError`` naming the grammar argument (and ``states[1]`` in a batch) and ``words``;
    every state byte-identical to before, alike in both backends, none poisoned."""
    name = "grammars[1]" if call == "propose_batch" else "grammar"
    assert r["error"] is ValueError, r["message"]
    for word in (name, *words, *(["states[1]"] if call == "propose_batch" else [])):
        assert word in r["message"], (word, r["message"])
    for side in (r, o):
        assert side["after"] == side["before"] and side["poisoned"] == [None] * len(side["states"])
    assert r["after"] == o["after"]  # the reference and the optimized states, byte for byte


@pytest.mark.parametrize("call, dtype", CASES)
@pytest.mark.parametrize("kind", ["class", "int", "missing_method"])
def test_no_matcher_is_refused_before_any_write_alike(pairs, call, dtype, kind):
    pair = pairs[dtype]
    make = {"class": lambda V: AutomatonMatcher, "int": lambda V: 3,
            "missing_method": lambda V: NoRollback(Grammar(1), V)}[kind]
    r, o = both(pair, call, make)
    assert_refused_before_any_write(r, o, call, "must be None or a grammar matcher",
                                    {"class": "the class AutomatonMatcher", "int": "no callable",
                                     "missing_method": "no callable rollback"}[kind])
    for side in (r, o):
        assert side["honest"].log == (["is_terminated", "fill_next_token_bitmask"] if call == "propose_batch" else [])


@pytest.mark.parametrize("call, dtype", CASES)
@pytest.mark.parametrize("extra", [32, -32], ids=["wider", "narrower"])
def test_another_vocabularys_matcher_is_refused_before_any_write_alike(pairs, call, dtype, extra):
    """Its fill refuses a bitmask of this drafter's ceil(96 / 32) = 3 words: asked among the
    checks, so nothing was written, and the matcher was only asked (never walked)."""
    pair = pairs[dtype]
    r, o = both(pair, call, lambda V: Spy(Grammar(5), V + extra))
    assert_refused_before_any_write(r, o, call, "draft step 1", "vocab_size=96", "= 3 words", "RuntimeError")
    for side in (r, o):
        assert side["bad"].log == ["is_terminated", "fill_next_token_bitmask"] and side["bad"].as_found()
        assert "accept_token" not in side["honest"].log and side["honest"].as_found()


def test_an_xgrammar_matcher_of_another_vocabulary_is_refused_before_any_write_alike(pairs):
    """The real thing: xgrammar's matcher checks the bitmask's width itself (a RuntimeError)."""
    xgrammar = pytest.importorskip("xgrammar")  # the grammar extra, as tests/reference/test_grammar_xgrammar.py
    pair = pairs["bf16"]
    V = pair[0].config.vocab_size
    info = xgrammar.TokenizerInfo([f"<t{i}>" for i in range(V + 64)])  # 160 tokens: 5 words a row
    compiled = xgrammar.GrammarCompiler(info).compile_regex("(<t1>|<t2>)+")

    def make(vocab_size: int) -> Any:
        return xgrammar.GrammarMatcher(compiled)

    for call in CALLS:
        r, o = both(pair, call, make)
        assert_refused_before_any_write(r, o, call, "GrammarMatcher", "draft step 1", "vocab_size=96")


@pytest.mark.parametrize("call, dtype", CASES)
def test_a_matcher_failing_on_step_1s_question_is_refused_and_the_state_still_works(pairs, call, dtype):
    pair = pairs[dtype]
    r, o = both(pair, call, lambda V: Spy(Grammar(1), V, at=1))
    assert_refused_before_any_write(r, o, call, "Spy", "MatcherFailure", "the grammar's process died")
    assert r["causes"][-1] is MatcherFailure
    for prop, side in zip(pair, (r, o)):
        assert side["bad"].log == ["is_terminated", "fill_next_token_bitmask"]
        hidden = torch.randn(prop.config.hidden_size, generator=torch.Generator().manual_seed(13))
        prop.propose(5, hidden.to(prop.weights.dtype), 11, 2, side["states"][0])  # not poisoned: it drafts


@pytest.mark.parametrize("call, dtype", CASES)
@pytest.mark.parametrize("at, position", [(2, 11), (3, 11), (2, 9)], ids=["accept-2", "fill-2", "accept-2-rewound"])
def test_a_matcher_failing_midway_poisons_alike_and_is_rolled_back(pairs, call, dtype, at, position):
    """Call 2 is step 2's accept of d_1, call 3 step 2's fill: after step 1's row was written (at
    position 9 the rewind wrote first). Both raise the matcher's own failure and poison the same
    states (every state of a batch) with the same message; the matcher is rolled back, and every
    later call but the queries, ``export_state`` and ``free_state`` refuses the state alike."""
    pair = pairs[dtype]
    r, o = both(pair, call, lambda V: Spy(Grammar(1), V, at=at), position)
    assert r["error"] is MatcherFailure and "the grammar's process died" in r["message"]
    assert r["poisoned"][0] is not None and all(p is not None for p in r["poisoned"])
    assert f"{call} failed midway (MatcherFailure: " in r["poisoned"][0]
    later = []
    for prop, side in zip(pair, (r, o)):
        assert side["bad"].as_found()
        assert side["bad"].log[:3] == ["is_terminated", "fill_next_token_bitmask", "accept_token"]
        st = side["states"][0]
        with pytest.raises(RuntimeError, match="the state is unusable") as refused:
            prop.propose(5, torch.zeros(prop.config.hidden_size, dtype=prop.weights.dtype), 11, 1, st)
        later.append(str(refused.value))
        prop.drafter_rows(st), prop.export_state(st)  # still answer
        prop.free_state(st)
    assert later[0] == later[1]
