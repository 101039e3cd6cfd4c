"""Each draft's confidence in the reference (DESIGN.md §12): ``draft_confidence(state)`` is the
pinned (masked) softmax probability of each draft and its margin over the best other allowed
logit, for the pending propose, from the logits the draft was taken from."""

import math

import pytest
import torch

from glm_mtp.conformance.grammars import Grammar
from glm_mtp.reference import MtpWeights, ReferenceProposer
from glm_mtp.reference.block import draft_logits
from glm_mtp.reference.bytes import same_bytes
from glm_mtp.reference.grammar import allowed_tokens, new_bitmask
from glm_mtp.reference.layers import draft_probs
from glm_mtp.reference.numerics import acc_dtype, softmax, up


def copy_state(prop, prompt, hiddens):
    state = prop.alloc_state("cpu")
    prop.prefill_drafter(prompt, hiddens, state)
    return state


def step_logits(prop, prompt, hiddens, tok, hid, i, grammar=None, sample=None):
    """Step i's logits (V,) in S: those of the last row of a propose asked for i drafts."""
    st = copy_state(prop, prompt, hiddens)
    m = grammar.matcher(prop.config.vocab_size) if grammar else None
    if sample is None:
        prop.propose(tok, hid, prompt.shape[0] - 1, i, st, grammar=m)
    else:
        T, noise = sample
        prop.propose_sampled(tok, hid, prompt.shape[0] - 1, i, T, noise[:i], st, grammar=m)
    return draft_logits(prop.weights, st.x[None])[0]


def allowed_after(grammar, drafts, V):
    m = grammar.matcher(V)
    for d in drafts:
        m.accept_token(d)
    bitmask = new_bitmask(V)
    m.fill_next_token_bitmask(bitmask)
    return allowed_tokens(bitmask[0], V)


def margin_of(logits, d, allowed=None):
    """up(l_d) - the best other allowed up(l_j), from a sort (an independent way to the max)."""
    s = up(logits)
    keep = [j for j in range(s.shape[0]) if j != d and (allowed is None or bool(allowed[j]))]
    if not keep:
        return torch.tensor(math.inf, dtype=s.dtype)
    return s[d] - s[keep].sort(descending=True).values[0]


@pytest.mark.parametrize("grammar", [None, Grammar(1), Grammar(5, depth=6)], ids=str)
def test_greedy_confidence_is_the_softmax_probability_and_the_margin(prop, inputs, grammar):
    """prob[i] = the §5 softmax of up(logits_i) at d_i with every forbidden logit -inf (exp(-inf)
    is +0, so that is the masked softmax's +0.0 terms); margin[i] its logit minus the best other
    allowed one; both byte for byte, in A, (last_drafted,)."""
    V, A, k = prop.config.vocab_size, acc_dtype(prop.weights.dtype), 4
    prompt, hiddens, tok, hid = inputs.tokens(12), inputs.hiddens(12), inputs.token(), inputs.hiddens(1)
    state = copy_state(prop, prompt, hiddens)
    drafts = prop.propose(tok, hid, 11, k, state, grammar=grammar and grammar.matcher(V))
    prob, margin = prop.draft_confidence(state)
    assert prob.dtype == margin.dtype == A and prob.shape == margin.shape == (len(drafts),)
    for i, d in enumerate(drafts):
        logits = step_logits(prop, prompt, hiddens, tok, hid, i + 1, grammar)
        allowed = allowed_after(grammar, drafts[:i], V) if grammar else torch.ones(V, dtype=torch.bool)
        s = torch.where(allowed, up(logits), -math.inf)
        assert same_bytes(prob[i], softmax(s)[d])
        assert same_bytes(margin[i], margin_of(logits, d, allowed if grammar else None))
        assert float(margin[i]) >= 0
        want = math.exp(float(up(logits)[d])) / sum(math.exp(float(up(logits)[j])) for j in range(V) if allowed[j])
        assert abs(float(prob[i]) - want) < 1e-5


def test_sampled_confidence_is_q_of_the_draft_at_the_temperature_drawn_from(prop, inputs):
    V, A, k, T = prop.config.vocab_size, acc_dtype(prop.weights.dtype), 4, 0.6
    prompt, hiddens, tok, hid = inputs.tokens(12), inputs.hiddens(12), inputs.token(), inputs.hiddens(1)
    noise = torch.empty(k, V, dtype=torch.float64).exponential_(generator=torch.Generator().manual_seed(4)).to(A)
    for grammar in (None, Grammar(7)):
        state = copy_state(prop, prompt, hiddens)
        out = prop.propose_sampled(tok, hid, 11, k, T, noise, state, grammar=grammar and grammar.matcher(V))
        prob, margin = prop.draft_confidence(state)
        for i, d in enumerate(out.drafts):
            assert same_bytes(prob[i], out.q[i, d])
            logits = step_logits(prop, prompt, hiddens, tok, hid, i + 1, grammar, (T, noise))
            allowed = allowed_after(grammar, out.drafts[:i], V) if grammar else None
            assert same_bytes(out.q[i], draft_probs(logits[None], torch.tensor([T], dtype=A), allowed)[0])
            assert same_bytes(margin[i], margin_of(logits, d, allowed))


def test_a_sampled_draft_can_have_a_negative_margin(prop, inputs):
    V, A = prop.config.vocab_size, acc_dtype(prop.weights.dtype)
    state = copy_state(prop, inputs.tokens(12), inputs.hiddens(12))
    noise = torch.empty(4, V, dtype=torch.float64).exponential_(generator=torch.Generator().manual_seed(9)).to(A)
    prop.propose_sampled(inputs.token(), inputs.hiddens(1), 11, 4, 3.0, noise, state)
    assert float(prop.draft_confidence(state)[1].min()) < 0


def test_confidence_belongs_to_the_pending_propose(prop, inputs):
    state = copy_state(prop, inputs.tokens(12), inputs.hiddens(12))
    with pytest.raises(RuntimeError, match="draft_confidence: no propose is pending"):
        prop.draft_confidence(state)
    prop.propose(inputs.token(), inputs.hiddens(1), 11, 0, state)
    prob, margin = prop.draft_confidence(state)
    assert prob.shape == margin.shape == (0,)
    prop.after_verify(0, state)
    with pytest.raises(RuntimeError, match="no propose is pending"):
        prop.draft_confidence(state)
    prop.propose(inputs.token(), inputs.hiddens(1), 11, 3, state)
    assert prop.draft_confidence(state)[0].shape == (3,)
    prop.free_state(state)
    with pytest.raises(RuntimeError, match="freed"):
        prop.draft_confidence(state)


def test_confidence_checks_the_states_drafter_first(prop, weights, inputs):
    other = ReferenceProposer(MtpWeights.random(weights.config, seed=5, dtype=weights.dtype), 64)
    state = other.alloc_state("cpu")
    with pytest.raises(ValueError, match="other weights"):
        prop.draft_confidence(state)
    with pytest.raises(TypeError):
        prop.draft_confidence(object())


def test_batched_confidence_is_each_states_own(prop, inputs):
    prompts = [(inputs.tokens(n), inputs.hiddens(n)) for n in (12, 5, 17)]
    toks, hid, pos = [inputs.token() for _ in prompts], inputs.hiddens(3), [11, 4, 16]
    alone = [copy_state(prop, *p) for p in prompts]
    for b, st in enumerate(alone):
        prop.propose(toks[b], hid[b : b + 1], pos[b], 3, st)
    batch = [copy_state(prop, *p) for p in prompts]
    prop.propose_batch(toks, hid, pos, 3, batch[::-1][::-1])
    for a, b in zip(alone, batch):
        for x, y in zip(prop.draft_confidence(a), prop.draft_confidence(b)):
            assert same_bytes(x, y)
