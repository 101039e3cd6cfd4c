"""Sampled drafts in lockstep: the optimized drafter's ``propose_sampled`` gives the reference's
drafts and q byte for byte for the same noise (bf16 and fp32, k = 1 and k > 1, the twins and the
Triton kernels) and refuses what the reference refuses. (Its one sync: tests/optimized/test_syncs.py.)"""

from __future__ import annotations

import math

import pytest
import torch

import glm_mtp.optimized.programs as opt_programs
from glm_mtp.optimized.graphs import GraphKey
from glm_mtp.reference import MtpWeights, ReferenceProposer, SampledDrafts
from glm_mtp.reference.bytes import same_bytes
from glm_mtp.reference.numerics import acc_dtype, softmax, up


def noise(weights, k, gen):
    A = acc_dtype(weights.dtype)
    return (
        torch.empty(k, weights.config.vocab_size, dtype=torch.float64)
        .exponential_(generator=gen)
        .to(device=weights.device, dtype=A)
    )


def play(ls, inputs, weights, steps, temperature, seed):
    """A prefill, then ``steps`` sampled proposes (k from 1 to 4) each followed by a verify:
    returns every propose's result (the lockstep compared each one and the states after it)."""
    gen = torch.Generator().manual_seed(seed)
    ls.call("prefill_drafter", inputs.tokens(12), inputs.hiddens(12))
    pos, results = 11, []
    for step in range(steps):
        k = 1 + step % 4
        out = ls.call("propose_sampled", inputs.token(), inputs.hiddens(1), pos, k, temperature, noise(weights, k, gen))
        assert isinstance(out, SampledDrafts) and len(out.drafts) == k and out.q.shape == (k, weights.config.vocab_size)
        results.append(out)
        a = inputs.randint(0, k)
        ls.call("after_verify", a)
        pos += min(k, a + 1)
    assert ls.refused == 0
    return results


@pytest.mark.parametrize("temperature", [1.0, 0.37])
def test_lockstep_sampled(weights, inputs, lockstep, temperature):
    ls = lockstep(weights)
    play(ls, inputs, weights, 6, temperature, seed=5)


@pytest.mark.slow
def test_lockstep_sampled_with_triton_kernels(weights, inputs, lockstep):
    """The head through the GEMV kernel (Triton's CPU interpreter): the same drafts and q."""
    ls = lockstep(weights, kernels="triton")
    play(ls, inputs, weights, 2, 0.8, seed=6)


@pytest.fixture(scope="module")
def weights_f64(tiny_cfg):
    return MtpWeights.random(tiny_cfg, seed=11, dtype=torch.float64)


def test_sampled_confidence_at_float64_is_the_references_bytes(weights_f64, make_inputs):
    """DESIGN.md §12: ``draft_confidence`` is in A (float64 for float64 weights); after a sampled
    propose ``prob`` is ``q[d]``, read from q in A, not cast to float32 (the bug this catches)."""
    from glm_mtp.optimized import OptimizedProposer

    inputs = make_inputs(weights_f64, seed=3)
    ref, opt = ReferenceProposer(weights_f64, 64), OptimizedProposer(weights_f64, 64)
    rs, os_ = ref.alloc_state("cpu"), opt.alloc_state("cpu")
    tokens, hiddens = inputs.tokens(12), inputs.hiddens(12)
    token, hidden, eps = inputs.token(), inputs.hiddens(1), noise(weights_f64, 3, torch.Generator().manual_seed(4))
    for prop, st in ((ref, rs), (opt, os_)):
        prop.prefill_drafter(tokens, hiddens, st)
    r_out = ref.propose_sampled(token, hidden, 11, 3, 0.8, eps, rs)
    o_out = opt.propose_sampled(token, hidden, 11, 3, 0.8, eps, os_)
    assert r_out.drafts == o_out.drafts and same_bytes(r_out.q, o_out.q)
    for name, r, o in zip(("prob", "margin"), ref.draft_confidence(rs), opt.draft_confidence(os_)):
        assert r.dtype == torch.float64 and o.dtype == r.dtype, (name, o.dtype, r.dtype)
        assert same_bytes(r, o), (name, r, o)


def test_argmax_propose_is_unchanged_between_sampled_ones(weights, inputs, lockstep):
    """Greedy and sampled proposes interleave on one state (each its own program)."""
    ls = lockstep(weights)
    gen = torch.Generator().manual_seed(9)
    ls.call("prefill_drafter", inputs.tokens(10), inputs.hiddens(10))
    pos = 9
    for step in range(4):
        if step % 2:
            ls.call("propose_sampled", inputs.token(), inputs.hiddens(1), pos, 3, 1.3, noise(weights, 3, gen))
        else:
            ls.call("propose", inputs.token(), inputs.hiddens(1), pos, 3)
        ls.call("after_verify", 1)
        pos += 2
    assert ls.refused == 0


def test_mutant_library_softmax_is_caught(weights, inputs, lockstep, monkeypatch):
    """A plausible mistake in the optimized drafter (torch's softmax, its own reduction order, in
    place of the pinned one) changes q's bytes: the lockstep comparison fails on it."""
    def library_probs(logits, temperature):
        return torch.softmax(up(logits) / temperature, dim=-1)

    monkeypatch.setattr(opt_programs, "draft_probs", library_probs)
    ls = lockstep(weights)
    with pytest.raises(AssertionError, match="propose_sampled"):
        play(ls, inputs, weights, 4, 1.0, seed=7)


def test_mutant_reciprocal_temperature_is_caught(weights, inputs, lockstep, monkeypatch):
    """Dividing by the temperature as a multiply by its reciprocal (CUDA's path for a host
    scalar) rounds differently: caught."""
    def reciprocal_probs(logits, temperature):
        return softmax(up(logits) * (1 / temperature))

    monkeypatch.setattr(opt_programs, "draft_probs", reciprocal_probs)
    ls = lockstep(weights)
    with pytest.raises(AssertionError, match="propose_sampled"):
        play(ls, inputs, weights, 4, 0.37, seed=8)


@pytest.mark.parametrize("kind", ["zero", "nan", "inf", "negative", "shape", "dtype", "temperature"])
def test_bad_inputs_refused_alike(weights, inputs, lockstep, kind):
    """The reference checks the noise's values on the host, the optimized drafter on the device
    (read back with the drafts): the same exception, no state changed (the lockstep checks)."""
    ls = lockstep(weights)
    ls.call("prefill_drafter", inputs.tokens(10), inputs.hiddens(10))
    e = noise(weights, 3, torch.Generator().manual_seed(1))
    temperature = 1.0
    if kind in ("zero", "nan", "inf", "negative"):
        e[1, 5] = {"zero": 0.0, "nan": math.nan, "inf": math.inf, "negative": -2.0}[kind]
    elif kind == "shape":
        e = e[:, :-1]
    elif kind == "dtype":
        e = e.to(torch.float64)
    else:
        temperature = 0.0
    out = ls.call("propose_sampled", inputs.token(), inputs.hiddens(1), 9, 3, temperature, e)
    assert isinstance(out, ValueError) and ls.refused == 1
    ls.call("propose_sampled", inputs.token(), inputs.hiddens(1), 9, 3, 1.0,
            noise(weights, 3, torch.Generator().manual_seed(2)))
    assert ls.refused == 1


def test_bad_hidden_and_noise_report_the_hidden_first(weights, inputs, lockstep):
    ls = lockstep(weights)
    ls.call("prefill_drafter", inputs.tokens(10), inputs.hiddens(10))
    e = noise(weights, 2, torch.Generator().manual_seed(1))
    e[0, 0] = 0.0
    out = ls.call("propose_sampled", inputs.token(), inputs.bad_hiddens(1, 0, 3, math.nan), 9, 2, 1.0, e)
    assert isinstance(out, ValueError) and "NaN" in str(out)


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_lockstep_sampled_cuda(weights, make_inputs, lockstep, cuda_graphs):
    """On CUDA (graphs captured per k, sampled programs under their own keys): the reference's
    bytes, drafts and q, on the same device."""
    w = weights.to("cuda")
    ls = lockstep(w, device="cuda", cuda_graphs=cuda_graphs)
    results = play(ls, make_inputs(w, seed=3), w, 8, 0.8, seed=11)
    assert all(r.q.is_cuda for r in results)
    if cuda_graphs:
        assert set(ls.os.graphs) <= {GraphKey.sampled_draft(k) for k in range(1, 5)} and ls.os.graphs
