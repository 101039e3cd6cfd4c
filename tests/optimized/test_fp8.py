"""Block-scaled fp8 weights (DESIGN.md §8) in the optimized drafter: the fused step reads the
e4m3 bytes and scales (GEMVs, experts, MLA's kv_b), in lockstep with the reference call by call,
every exported state byte-identical, through the torch twins and through every Triton kernel
(the interpreter); fp8 weights the fused step cannot take are refused at construction."""

import pytest
import torch

from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import MtpConfig, MtpWeights

# tiny with widths above 128: several scale blocks, partial last ones.
WIDE = MtpConfig.preset("tiny").replace(hidden_size=200, q_lora_rank=136, moe_intermediate_size=144)


def loop(ls, inp, steps):
    """Prefill, then proposes with partial acceptance, a catch-up after a full one, a refeed."""
    n = 6
    assert ls.call("prefill_drafter", inp.tokens(n), inp.hiddens(n)) == n - 1
    pos = n - 1
    for step in range(steps):
        k = 1 + step % 3
        drafts = ls.call("propose", inp.token(), inp.hiddens(1)[0], pos, k)
        a = (step * 7) % (k + 1)
        if step % 3 == 2 and a > 0:
            ls.call("after_verify", 0)
            assert ls.call("catchup_drafter", inp.tokens(a), inp.hiddens(a), pos + 1, pos + 1) == a
        else:
            ls.call("after_verify", a)
            if a == k:
                assert ls.call("catchup_drafter", [drafts[-1]], inp.hiddens(1), pos + k, pos + k) == 1
        pos += a + 1


def test_fp8_lockstep_torch_twins(lockstep, make_inputs):
    q = MtpWeights.random(WIDE, seed=3, dtype=torch.bfloat16).quantize_fp8()
    ls = lockstep(q, max_seq_len=32, kernels="torch")
    loop(ls, make_inputs(q, seed=4), steps=6)
    assert ls.refused == 0


def test_fp8_lockstep_interpreted_kernels_tiny(lockstep, make_inputs):
    """Every fused piece a Triton kernel (one scale block per matrix at tiny's widths)."""
    q = MtpWeights.random(MtpConfig.preset("tiny"), seed=3, dtype=torch.bfloat16).quantize_fp8()
    ls = lockstep(q, max_seq_len=32, kernels="triton")
    loop(ls, make_inputs(q, seed=5), steps=2)
    assert ls.refused == 0


@pytest.mark.slow
def test_fp8_lockstep_interpreted_kernels_wide(lockstep, make_inputs):
    """As above at widths above 128 (several scale blocks, partial last ones): ~10 minutes."""
    q = MtpWeights.random(WIDE, seed=3, dtype=torch.bfloat16).quantize_fp8()
    ls = lockstep(q, max_seq_len=32, kernels="triton")
    loop(ls, make_inputs(q, seed=4), steps=3)
    assert ls.refused == 0


# glm5_next (NoPE, the KPool indexer, clamped experts) with widths above 128.
NEXT_WIDE = MtpConfig.preset("glm5next_tiny").replace(hidden_size=200, q_lora_rank=136, moe_intermediate_size=144)


def test_fp8_glm5_next_lockstep_torch_twins(lockstep, make_inputs):
    """The family's fp8 layer in the fused step (its gate, index weights and router stay plain)."""
    q = MtpWeights.random(NEXT_WIDE, seed=5, dtype=torch.bfloat16).quantize_fp8()
    ls = lockstep(q, max_seq_len=32, kernels="torch")
    assert ls.opt.step is not None
    loop(ls, make_inputs(q, seed=6), steps=6)
    assert ls.refused == 0


def test_fp8_glm5_next_lockstep_interpreted_kernels(lockstep, make_inputs):
    q = MtpWeights.random(MtpConfig.preset("glm5next_tiny"), seed=5, dtype=torch.bfloat16).quantize_fp8()
    ls = lockstep(q, max_seq_len=32, kernels="triton")
    loop(ls, make_inputs(q, seed=7), steps=2)
    assert ls.refused == 0


def test_fp8_the_fused_step_cannot_take_is_refused():
    q = MtpWeights.random(MtpConfig.preset("tiny"), seed=1, dtype=torch.float64).quantize_fp8()
    with pytest.raises(ValueError, match="OptimizedProposer: block-scaled fp8 weights .* run in the fused step only"):
        OptimizedProposer(q, max_seq_len=32)


@pytest.mark.slow
def test_fp8_step_counts_at_tiny():
    """One draft step through the interpreter: at most 24 launches (one more than bf16: the input
    norm's GEMV in two formats) and kernel bytes within 1.15x the fp8 floor (1 byte a value plus
    the scales)."""
    from glm_mtp.tools.counters import interpreting, measure_draft_step

    assert interpreting()
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=0, dtype=torch.bfloat16)
    fp8, plain = measure_draft_step(w.quantize_fp8(), "triton"), measure_draft_step(w, "triton")
    assert fp8["launches_per_draft"] == plain["launches_per_draft"] + 1 <= 24
    assert fp8["kernel_floor_ratio"] <= 1.15 and fp8["kernel_bytes_per_draft"] < plain["kernel_bytes_per_draft"]
