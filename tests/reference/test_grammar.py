"""Grammar-constrained drafts in the reference (DESIGN.md §10): each draft the lowest-index best
token its step's mask allows, the stop, the rows, the matcher left as found, the refusals."""

import dataclasses
import math

import pytest
import torch

from glm_mtp.conformance.grammars import AutomatonMatcher, Grammar
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.block import draft_logits
from glm_mtp.reference.bytes import same_bytes
from glm_mtp.reference.grammar import allowed_tokens, new_bitmask
from glm_mtp.reference.numerics import acc_dtype

# Grammars with every shape the automaton has: unbounded, both ends, a start past the root, and
# seeds whose first masks exclude the unmasked argmax (checked below, so masking is exercised).
GRAMMARS = [Grammar(1), Grammar(2, depth=2), Grammar(3, depth=3, end="empty", start=1), Grammar(5, depth=6),
            Grammar(7), Grammar(11, depth=4, end="empty")]


def fresh(prop, inputs, n=12):
    state = prop.alloc_state("cpu")
    prop.prefill_drafter(inputs.tokens(n), inputs.hiddens(n), state)
    return state, n - 1


def copy_state(prop, prompt, hiddens):
    state = prop.alloc_state("cpu")
    prop.prefill_drafter(prompt, hiddens, state)
    return state


def mask_of(grammar, drafts, vocab):
    """A_{len(drafts)+1}: the automaton's mask after ``drafts`` (None when the walk stops there)."""
    m = grammar.matcher(vocab)
    for d in drafts:
        assert m.accept_token(d)
    if m.is_terminated():
        return None
    bitmask = new_bitmask(vocab)
    m.fill_next_token_bitmask(bitmask)
    allowed = allowed_tokens(bitmask[0], vocab)
    return allowed if bool(allowed.any()) else None


@pytest.mark.parametrize("grammar", GRAMMARS, ids=str)
def test_each_draft_is_the_best_token_its_steps_mask_allows(prop, inputs, snap, grammar):
    """Draft i is the lowest-index maximum of step i's logits over A_i (the mask after d_1 ..
    d_{i-1}); a propose asked for fewer drafts returns a prefix, and its logits (read from its x)
    are the ones draft i was taken from."""
    V, k = prop.config.vocab_size, 5
    prompt, hiddens, tok, hid = inputs.tokens(12), inputs.hiddens(12), inputs.token(), inputs.hiddens(1)
    state = copy_state(prop, prompt, hiddens)
    matcher = grammar.matcher(V)
    drafts = prop.propose(tok, hid, 11, k, state, grammar=matcher)
    assert matcher.as_found()
    assert len(drafts) == grammar.drafts(k)
    for i in range(1, len(drafts) + 1):
        short = copy_state(prop, prompt, hiddens)
        assert prop.propose(tok, hid, 11, i, short, grammar=grammar.matcher(V)) == drafts[:i]
        logits = draft_logits(prop.weights, short.x[None])[0]  # (V,) of step i
        allowed = mask_of(grammar, drafts[: i - 1], V)
        best = max(float(logits[j]) for j in range(V) if allowed[j])
        assert drafts[i - 1] == min(j for j in range(V) if allowed[j] and float(logits[j]) == best)
    if len(drafts) < k:  # the walk ended: the next mask is none
        assert mask_of(grammar, drafts, V) is None
    # a propose asked for exactly the drafts returned leaves the same bytes
    same = copy_state(prop, prompt, hiddens)
    assert prop.propose(tok, hid, 11, len(drafts), same, grammar=grammar.matcher(V)) == drafts
    assert snap(prop, same) == snap(prop, state)


def test_the_grammars_above_forbid_the_unmasked_argmax_somewhere(prop, inputs):
    """The masked path is exercised: some step's unmasked argmax is forbidden by its mask."""
    V = prop.config.vocab_size
    prompt, hiddens, tok, hid = inputs.tokens(12), inputs.hiddens(12), inputs.token(), inputs.hiddens(1)
    plain = prop.propose(tok, hid, 11, 4, copy_state(prop, prompt, hiddens))
    differ = [g for g in GRAMMARS if prop.propose(tok, hid, 11, 4, copy_state(prop, prompt, hiddens),
                                                grammar=g.matcher(V)) != plain[: g.drafts(4)]]
    assert differ


def test_a_grammar_that_allows_everything_drafts_as_none(prop, inputs, snap):
    class Everything(AutomatonMatcher):
        def fill_next_token_bitmask(self, bitmask, index=0):
            bitmask[index] = -1  # every bit set, past V too
            return True

        def accept_token(self, token):
            return True

        def rollback(self, num_tokens):
            pass

    V = prop.config.vocab_size
    prompt, hiddens, tok, hid = inputs.tokens(12), inputs.hiddens(12), inputs.token(), inputs.hiddens(1)
    a, b = copy_state(prop, prompt, hiddens), copy_state(prop, prompt, hiddens)
    assert prop.propose(tok, hid, 11, 4, a) == prop.propose(tok, hid, 11, 4, b, grammar=Everything(Grammar(0), V))
    assert snap(prop, a) == snap(prop, b)
    for x, y in zip(prop.draft_confidence(a), prop.draft_confidence(b)):
        assert same_bytes(x, y)


@pytest.mark.parametrize("end", ["terminated", "empty"])
def test_a_walk_that_ends_before_step_1_only_rewinds(prop, inputs, snap, end):
    """A matcher terminated (or allowing nothing) at the call: no drafts, and the state of a
    propose asked for 0 drafts (rewound to position, pending, last_drafted 0)."""
    V = prop.config.vocab_size
    prompt, hiddens, tok, hid = inputs.tokens(12), inputs.hiddens(12), inputs.token(), inputs.hiddens(1)
    a, b = copy_state(prop, prompt, hiddens), copy_state(prop, prompt, hiddens)
    g = Grammar(4, depth=2, start=2, end=end)
    assert prop.propose(tok, hid, 8, 3, a, grammar=g.matcher(V)) == []
    assert prop.propose(tok, hid, 8, 0, b) == []
    assert snap(prop, a) == snap(prop, b) and prop.drafter_rows(a) == 8
    prob, margin = prop.draft_confidence(a)
    assert prob.shape == margin.shape == (0,)


def test_sampled_drafts_draw_from_the_masked_softmax(prop, inputs):
    """Under a grammar q is 0 exactly off the mask, sums to ~1 on it, the draft is allowed, and a
    propose of unit noise at T = 1 drafts what the greedy masked propose drafts."""
    V, A = prop.config.vocab_size, acc_dtype(prop.weights.dtype)
    prompt, hiddens, tok, hid = inputs.tokens(12), inputs.hiddens(12), inputs.token(), inputs.hiddens(1)
    g = Grammar(5, depth=6)
    noise = torch.empty(4, V, dtype=torch.float64).exponential_(generator=torch.Generator().manual_seed(2)).to(A)
    out = prop.propose_sampled(tok, hid, 11, 4, 0.8, noise, copy_state(prop, prompt, hiddens), grammar=g.matcher(V))
    assert out.q.shape == (len(out.drafts), V) and len(out.drafts) == 4
    for i, d in enumerate(out.drafts):
        allowed = mask_of(g, out.drafts[:i], V)
        assert bool(allowed[d])
        assert same_bytes(out.q[i][~allowed], torch.zeros(int((~allowed).sum()), dtype=A))
        assert abs(float(out.q[i].double().sum()) - 1) < 1e-5
        best = torch.where(allowed, out.q[i] / noise[i], -math.inf)
        assert d == int(torch.argmax(best))
    ones = torch.ones(4, V, dtype=A)
    sampled = prop.propose_sampled(tok, hid, 11, 4, 1.0, ones, copy_state(prop, prompt, hiddens), grammar=g.matcher(V))
    assert sampled.drafts == prop.propose(tok, hid, 11, 4, copy_state(prop, prompt, hiddens), grammar=g.matcher(V))


def test_a_sampled_propose_that_stops_returns_q_of_the_drafts_drawn(prop, inputs):
    V, A = prop.config.vocab_size, acc_dtype(prop.weights.dtype)
    state, pos = fresh(prop, inputs)
    out = prop.propose_sampled(inputs.token(), inputs.hiddens(1), pos, 4, 1.0, torch.ones(4, V, dtype=A), state,
                               grammar=Grammar(2, depth=2).matcher(V))
    assert len(out.drafts) == 2 and out.q.shape == (2, V) and prop.drafter_rows(state) == pos + 2


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_matcher_that_refuses_an_allowed_token_is_a_value_error_with_state_and_matcher_as_found(
        prop, inputs, snap, sampled):
    """The refusal names the draft step; the rows the propose wrote (and the rewind) are put
    back, the state is not poisoned, and the matcher has nothing accepted."""
    V, A = prop.config.vocab_size, acc_dtype(prop.weights.dtype)
    state, pos = fresh(prop, inputs, 14)
    drafts = prop.propose(inputs.token(), inputs.hiddens(1), pos, 3, state)
    prop.after_verify(2, state)  # rows up to pos + 3
    before = snap(prop, state)
    matcher = Grammar(5, liar=2).matcher(V)  # refuses at depth 2: the third draft's accept, before step 4
    with pytest.raises(ValueError, match=r"draft step 3.*AutomatonMatcher|AutomatonMatcher.*draft step 3"):
        if sampled:
            prop.propose_sampled(drafts[1], inputs.hiddens(1), pos - 2, 4, 1.0, torch.ones(4, V, dtype=A), state,
                                 grammar=matcher)
        else:
            prop.propose(drafts[1], inputs.hiddens(1), pos - 2, 4, state, grammar=matcher)
    assert matcher.as_found() and state.poisoned is None
    assert snap(prop, state) == before
    with pytest.raises(RuntimeError):
        prop.draft_confidence(state)  # nothing pending, as before the call
    prop.propose(inputs.token(), inputs.hiddens(1), pos + 3, 2, state)  # the state still works


def test_a_failure_midway_rolls_the_matcher_back_and_poisons_the_state(prop, inputs):
    class Breaks(AutomatonMatcher):
        def fill_next_token_bitmask(self, bitmask, index=0):
            if self.walked:
                raise OSError("the grammar's process died")
            return super().fill_next_token_bitmask(bitmask, index)

    V = prop.config.vocab_size
    state, pos = fresh(prop, inputs)
    matcher = Breaks(Grammar(1), V)
    with pytest.raises(OSError):
        prop.propose(inputs.token(), inputs.hiddens(1), pos, 3, state, grammar=matcher)
    assert matcher.as_found() and state.poisoned is not None


@pytest.mark.parametrize("fault, method", [("no_rollback", "rollback"), ("not_callable", "accept_token")])
def test_an_object_that_is_not_a_matcher_is_refused_naming_the_method(prop, inputs, snap, fault, method):
    V = prop.config.vocab_size
    state, pos = fresh(prop, inputs)
    before = snap(prop, state)
    for bad in (Grammar(1, fault=fault).matcher(V), "a|b", 3):
        with pytest.raises(ValueError, match="grammar must be None or a grammar matcher") as e:
            prop.propose(inputs.token(), inputs.hiddens(1), pos, 2, state, grammar=bad)
        assert snap(prop, state) == before
    assert method in str(e.value) or "int" in str(e.value)
    with pytest.raises(ValueError, match=f"callable {method}"):
        prop.propose(inputs.token(), inputs.hiddens(1), pos, 2, state, grammar=Grammar(1, fault=fault).matcher(V))


def test_the_grammar_is_checked_after_the_other_arguments(prop, inputs):
    """Rule 2's order: a bad num_drafts (or a bad hidden) refuses first, naming itself."""
    state, pos = fresh(prop, inputs)
    with pytest.raises(ValueError, match="num_drafts"):
        prop.propose(inputs.token(), inputs.hiddens(1), pos, -1, state, grammar="not a matcher")
    with pytest.raises(ValueError, match="target_hidden"):
        prop.propose(inputs.token(), inputs.hiddens(2), pos, 1, state, grammar="not a matcher")


def test_propose_batch_under_grammars_is_each_states_own_propose(prop, inputs, snap):
    V = prop.config.vocab_size
    prompts = [(inputs.tokens(n), inputs.hiddens(n)) for n in (12, 7, 20)]
    grammars = [Grammar(1), None, Grammar(2, depth=2)]
    toks, hid, pos = [inputs.token() for _ in prompts], inputs.hiddens(3), [11, 6, 19]
    alone = [copy_state(prop, *p) for p in prompts]
    want = [prop.propose(toks[b], hid[b : b + 1], pos[b], 4, st, grammar=g and g.matcher(V))
            for b, (st, g) in enumerate(zip(alone, grammars))]
    batch = [copy_state(prop, *p) for p in prompts]
    matchers = [g and g.matcher(V) for g in grammars]
    assert prop.propose_batch(toks, hid, pos, 4, batch, grammars=matchers) == want
    assert [len(d) for d in want] == [4, 4, 2]
    assert all(m is None or m.as_found() for m in matchers)
    for a, b in zip(alone, batch):
        assert snap(prop, a) == snap(prop, b)
        for x, y in zip(prop.draft_confidence(a), prop.draft_confidence(b)):
            assert same_bytes(x, y)


def test_a_refusal_in_a_batch_names_the_state_and_leaves_every_state_and_matcher_as_found(prop, inputs, snap):
    V = prop.config.vocab_size
    states = [fresh(prop, inputs, n)[0] for n in (12, 9, 15)]
    before = [snap(prop, st) for st in states]
    matchers = [Grammar(1).matcher(V), Grammar(3, liar=0).matcher(V), Grammar(2).matcher(V)]
    hid = inputs.hiddens(3)
    with pytest.raises(ValueError, match=r"propose_batch: states\[1\]: .*draft step 1"):
        prop.propose_batch([1, 2, 3], hid, [11, 8, 14], 3, states, grammars=matchers)
    assert [snap(prop, st) for st in states] == before
    assert all(m.as_found() for m in matchers) and all(st.poisoned is None for st in states)


def test_batch_grammars_are_checked_with_the_batch(prop, inputs, snap):
    V = prop.config.vocab_size
    states = [fresh(prop, inputs, n)[0] for n in (12, 9)]
    before = [snap(prop, st) for st in states]
    hid, m = inputs.hiddens(2), Grammar(1).matcher(V)
    cases = [([m], "grammars has 1 entries for 2 states"), ([m, m], r"grammars\[1\] is grammars\[0\]"),
             ("ab", "grammars must be None or a list"),
             ([None, "x"], r"states\[1\]: grammars\[1\] must be None or a grammar matcher")]
    for grammars, message in cases:
        with pytest.raises(ValueError, match=message):
            prop.propose_batch([1, 2], hid, [11, 8], 2, states, grammars=grammars)
        assert [snap(prop, st) for st in states] == before


def test_bits_past_the_vocabulary_are_never_allowed():
    """V = 100: the last word's bits 4..31 name tokens 100..127. A mask allowing only one token
    below V (and every bit past V, as ``grammars._words`` sets them) drafts that token."""
    cfg = dataclasses.replace(MtpConfig.preset("tiny"), vocab_size=100)
    prop = ReferenceProposer(MtpWeights.random(cfg, seed=3, dtype=torch.float32), 32)

    class OneToken(AutomatonMatcher):
        def fill_next_token_bitmask(self, bitmask, index=0):
            bitmask[index] = 0
            bitmask[index, 3] = -16  # bits 4..31 of word 3: tokens 100..127
            bitmask[index, 0] = 1 << 5  # token 5
            return True

        def accept_token(self, token):
            return token == 5

        def rollback(self, num_tokens):
            pass

    state = prop.alloc_state("cpu")
    g = torch.Generator().manual_seed(0)
    drafts = prop.propose(7, torch.randn(cfg.hidden_size, generator=g), 0, 3, state, grammar=OneToken(Grammar(0), 100))
    assert drafts == [5, 5, 5]
    prob, margin = prop.draft_confidence(state)
    assert prob.tolist() == [1.0] * 3 and margin.tolist() == [math.inf] * 3
    assert allowed_tokens(torch.tensor([0, 0, 0, -16], dtype=torch.int32), 100).sum() == 0
