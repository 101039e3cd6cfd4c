"""Sampled drafts (``ReferenceProposer.propose_sampled``): draft i = argmax(q_i / noise[i]) with
q_i = softmax(up(logits_i) / T) in the pinned order; the state is written as by ``propose``."""

import math

import pytest
import torch

from glm_mtp.reference import SampledDrafts
from glm_mtp.reference.block import draft_logits
from glm_mtp.reference.layers import draft_probs, sampled_token
from glm_mtp.reference.numerics import acc_dtype, softmax, up


def prefilled(prop, inputs, n=10):
    state = prop.alloc_state("cpu")
    prop.prefill_drafter(inputs.tokens(n), inputs.hiddens(n), state)
    return state, n - 1


def noise_for(prop, k, seed):
    A = acc_dtype(prop.weights.dtype)
    return (
        torch.empty(k, prop.config.vocab_size, dtype=torch.float64)
        .exponential_(generator=torch.Generator().manual_seed(seed))
        .to(A)
    )


def q_bytes(q):
    return q.contiguous().view(torch.int32 if q.dtype == torch.float32 else torch.int64)


def test_q_is_the_pinned_softmax_of_the_last_rows_logits(prop, inputs):
    """k = 1: q is draft_probs of the logits of the row written (its x is the state's x), the
    draft is argmax(q / noise), and q differs from torch's softmax somewhere (so the check of the
    pinned order is not vacuous)."""
    state, pos = prefilled(prop, inputs)
    noise, T = noise_for(prop, 1, 3), 0.7
    out = prop.propose_sampled(inputs.token(), inputs.hiddens(1), pos, 1, T, noise, state)
    logits = draft_logits(prop.weights, state.x[None])
    want = draft_probs(logits, torch.tensor([T], dtype=noise.dtype))
    assert torch.equal(q_bytes(out.q), q_bytes(want))
    assert out.drafts == [int(torch.argmax(want[0] / noise[0]))]
    assert out.q.dtype == acc_dtype(prop.weights.dtype) and out.q.shape == (1, prop.config.vocab_size)
    assert abs(float(out.q.double().sum()) - 1) < 1e-5


def test_unit_noise_drafts_the_argmax_and_writes_the_same_state(prop, inputs, snap):
    """With noise 1 and T = 1, argmax(q) is the logits' argmax (exp is increasing): the sampled
    propose drafts what propose drafts and leaves the same bytes."""
    prompt, hiddens, tok, hid = inputs.tokens(9), inputs.hiddens(9), inputs.token(), inputs.hiddens(1)
    a, b = prop.alloc_state("cpu"), prop.alloc_state("cpu")
    for s in (a, b):
        prop.prefill_drafter(prompt, hiddens, s)
    greedy = prop.propose(tok, hid, 8, 4, a)
    ones = torch.ones(4, prop.config.vocab_size, dtype=acc_dtype(prop.weights.dtype))
    sampled = prop.propose_sampled(tok, hid, 8, 4, 1.0, ones, b)
    assert sampled.drafts == greedy
    assert snap(prop, a) == snap(prop, b)
    prop.after_verify(2, a)
    prop.after_verify(2, b)
    assert snap(prop, a) == snap(prop, b)


def test_noise_decides_the_draft(prop, inputs):
    """Different noise draws different tokens; the same noise the same bytes."""
    prompt, hiddens, tok, hid = inputs.tokens(9), inputs.hiddens(9), inputs.token(), inputs.hiddens(1)
    seen = set()
    outs = []
    for seed in range(6):
        state = prop.alloc_state("cpu")
        prop.prefill_drafter(prompt, hiddens, state)
        outs.append(prop.propose_sampled(tok, hid, 8, 2, 3.0, noise_for(prop, 2, seed % 3), state))
        seen.add(tuple(outs[-1].drafts))
    assert len(seen) > 1
    assert outs[0] == outs[3] and outs[1] == outs[4]


def test_exponential_race_draws_from_q():
    """argmax(q / E), E ~ Exp(1): token frequencies follow q (chi-square), and a mutant that
    divides by uniform noise instead does not."""
    q = softmax(torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]]))
    n, gen = 20000, torch.Generator().manual_seed(0)
    for noise_kind, should_fit in (("exponential", True), ("uniform", False)):
        if noise_kind == "exponential":
            e = torch.empty(n, 6, dtype=torch.float64).exponential_(generator=gen).float()
        else:
            e = torch.rand(n, 6, generator=gen)
        tok = sampled_token(q.expand(n, 6), e)
        counts = torch.bincount(tok, minlength=6).double()
        expected = n * q[0].double()
        stat = float(((counts - expected) ** 2 / expected).sum())
        p = float(torch.special.gammaincc(torch.tensor(2.5, dtype=torch.float64),
                                          torch.tensor(stat / 2, dtype=torch.float64)))
        assert (p > 1e-3) == should_fit, (noise_kind, p)


def test_ties_go_to_the_lower_id():
    q = torch.tensor([[0.25, 0.5, 0.25, 0.0]])
    assert int(sampled_token(q, torch.tensor([[1.0, 2.0, 1.0, 1.0]]))[0]) == 0  # 0.25, 0.25, 0.25: the first
    assert int(sampled_token(q, torch.tensor([[2.0, 1.0, 0.5, 1.0]]))[0]) == 1  # 0.125, 0.5, 0.5: the lower


def test_temperature_division_is_a_correctly_rounded_division():
    """draft_probs divides by the temperature tensor; a multiply by the rounded reciprocal (what
    CUDA does for a host scalar) rounds differently on some logits: the bytes catch it."""
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    t = torch.tensor([0.7], dtype=torch.float32)
    right = draft_probs(logits, t)
    assert torch.equal(right, softmax(up(logits) / t))
    wrong = softmax(up(logits) * (1 / t))
    assert not torch.equal(q_bytes(right), q_bytes(wrong))


@pytest.mark.parametrize("bad, match", [
    ({"temperature": 0.0}, "temperature"), ({"temperature": -1.0}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"), ({"temperature": True}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"noise": "shape"}, "shape"), ({"noise": "dtype"}, "dtype"), ({"noise": "list"}, "tensor"),
    ({"noise": "zero"}, "positive"), ({"noise": "negative"}, "positive"), ({"noise": "nan"}, "positive"),
    ({"noise": "inf"}, "positive"),
])
def test_bad_sampling_arguments_are_refused_before_anything_changes(prop, inputs, snap, bad, match):
    state, pos = prefilled(prop, inputs)
    V, A = prop.config.vocab_size, acc_dtype(prop.weights.dtype)
    noise = noise_for(prop, 3, 1)
    kind = bad.get("noise")
    if kind == "shape":
        noise = noise[:2]
    elif kind == "dtype":
        noise = noise.to(torch.float64 if A == torch.float32 else torch.float32)
    elif kind == "list":
        noise = noise.tolist()
    elif kind in ("zero", "negative", "nan", "inf"):
        noise = noise.clone()
        noise[2, V - 1] = {"zero": 0.0, "negative": -1.0, "nan": math.nan, "inf": math.inf}[kind]
    before = snap(prop, state)
    with pytest.raises(ValueError, match=match):
        prop.propose_sampled(inputs.token(), inputs.hiddens(1), pos, 3, bad.get("temperature", 1.0), noise, state)
    assert snap(prop, state) == before
    prop.propose_sampled(inputs.token(), inputs.hiddens(1), pos, 3, 1.0, noise_for(prop, 3, 1), state)  # still usable


def test_zero_drafts_only_rewinds(prop, inputs):
    state, pos = prefilled(prop, inputs)
    out = prop.propose_sampled(inputs.token(), inputs.hiddens(1), pos, 0, 1.0, noise_for(prop, 0, 0), state)
    assert isinstance(out, SampledDrafts) and out.drafts == [] and out.q.shape == (0, prop.config.vocab_size)
    assert prop.drafter_rows(state) == pos
