"""Block-scaled FP8 weights (DESIGN.md §8): the e4m3 format, quantize_fp8, and the pinned
block-scaled linear, byte for byte against a written-out statement of its order."""

import math

import pytest
import torch

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference import fp8
from glm_mtp.reference.fp8 import BlockScaledWeight, dequantize, may_be_fp8, quantize_fp8
from glm_mtp.reference.numerics import VENDOR, linear, linear_acc, psum
from glm_mtp.reference.weights import mtp_tensor_shapes, same_bytes

U32 = 2.0**-24  # float32's unit roundoff


def wide_config() -> MtpConfig:
    """tiny with widths above 128, so weights have several scale blocks and a partial last one
    (hidden 200 = 128 + 72, q_lora_rank 136 = 128 + 8, expert width 144 = 128 + 16)."""
    return MtpConfig.preset("tiny").replace(hidden_size=200, q_lora_rank=136, moe_intermediate_size=144)


def e4m3_value(bits: int) -> float:
    """The value of an e4m3fn bit pattern from its definition (bias 7; exponent 0 subnormal;
    S.1111.111 NaN; no inf)."""
    sign = -1.0 if bits & 0x80 else 1.0
    e, m = (bits >> 3) & 0xF, bits & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * m * 2.0**-9
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


def test_every_e4m3_pattern_converts_up_exactly():
    """All 256 patterns: torch's float8_e4m3fn -> float32 is the format's value (so ``up(W8)`` is exact)."""
    got = torch.arange(256, dtype=torch.uint8).view(fp8.FP8_DTYPE).to(torch.float32)
    want = torch.tensor([e4m3_value(b) for b in range(256)], dtype=torch.float32)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and nan.sum() == 2
    assert same_bytes(got[~nan], want[~nan])  # -0.0 (0x80) included


def test_quantize_rounds_to_the_nearest_e4m3_with_per_block_amax_scales():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(300, 200, generator=gen) * torch.rand(300, 1, generator=gen)  # rows of different scales
    w[130:140, 150:] = 0.0  # part of a block zero: the block's scale comes from the rest
    w[256:, 128:] = 0.0  # a whole (partial) block zero: its scale is 1
    q = quantize_fp8(w.to(torch.bfloat16))
    assert q.w8.shape == (300, 200) and q.scale_inv.shape == (3, 2)
    wf = w.to(torch.bfloat16).float()
    for bi in range(3):
        for bj in range(2):
            blk = wf[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]
            amax = blk.abs().max()
            want = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            assert same_bytes(q.scale_inv[bi, bj], want.float())
    # Nearest e4m3 (ties to an even significand) of the quotient, by brute force over the finite values.
    finite = torch.arange(256, dtype=torch.uint8).view(fp8.FP8_DTYPE).float()
    codes = torch.arange(256)[~finite.isnan()]
    values = finite[codes].double()
    quotient = (wf / fp8.expand_scales(q.scale_inv, 300, 200)).double().clamp(-448, 448).reshape(-1)
    dist = (quotient[:, None] - values[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    # among equally near values prefer an even code (even significand), then a sign matching the quotient
    tie_rank = (dist == best).double() * (
        2 + (codes % 2 == 0).double() + 0.5 * ((values < 0) == (quotient[:, None] < 0)).double()
    )
    want = values[tie_rank.argmax(dim=1)]
    got = q.w8.float().double().reshape(-1)
    assert torch.equal(got, want)
    assert float(q.w8.float().abs().amax()) == 448.0  # each block's amax lands on the largest value


def test_quantize_and_the_weight_type_refuse_bad_input():
    with pytest.raises(ValueError, match="quantize_fp8: w must be a floating tensor"):
        quantize_fp8(torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="NaN/inf"):
        quantize_fp8(torch.tensor([[1.0, math.inf]]))
    q = quantize_fp8(torch.randn(130, 10))
    with pytest.raises(ValueError, match=r"scale_inv must be float32 of shape \(2, 1\)"):
        BlockScaledWeight(q.w8, q.scale_inv[:1])
    with pytest.raises(ValueError, match="w8 must be a float8_e4m3fn"):
        BlockScaledWeight(q.w8.float(), q.scale_inv)
    with pytest.raises(TypeError, match="only a stacked weight"):
        q[0]
    with pytest.raises(ValueError, match="vendor.*plain weights only"):
        VENDOR.linear(torch.randn(2, 10), q)


def written_out(x: torch.Tensor, w: BlockScaledWeight) -> torch.Tensor:
    """§8's order by explicit loops: per output column, per 128-wide block, the tree over the
    block's products padded to 128 lanes with +0.0, times that block's scale, then the tree over
    the blocks (padded to a power of two); rounded to x's dtype."""
    T, K = x.shape
    N = w.shape[0]
    xs, ws = x.float(), w.w8.float()
    out = torch.empty(T, N)
    for n in range(N):
        parts = []
        for b in range(math.ceil(K / 128)):
            lanes = torch.zeros(T, 128)
            k1 = min(K, b * 128 + 128)
            lanes[:, : k1 - b * 128] = xs[:, b * 128 : k1] * ws[n, b * 128 : k1]
            while lanes.shape[1] > 1:
                lanes = lanes[:, 0::2] + lanes[:, 1::2]
            parts.append(lanes[:, 0] * w.scale_inv[n // 128, b])
        level = torch.stack(parts, dim=1)
        width = 1 << (level.shape[1] - 1).bit_length()
        level = torch.cat((level, torch.zeros(T, width - level.shape[1])), dim=1)
        while level.shape[1] > 1:
            level = level[:, 0::2] + level[:, 1::2]
        out[:, n] = level[:, 0]
    return out.to(x.dtype)


@pytest.mark.parametrize("K", [72, 200, 384])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_scaled_linear_follows_the_written_order(K, dtype):
    gen = torch.Generator().manual_seed(K)
    w = quantize_fp8(torch.randn(130, K, generator=gen))
    x = torch.randn(3, K, generator=gen).to(dtype)
    y = linear(x, w)
    assert y.dtype == dtype and same_bytes(y, written_out(x, w))
    # Row and batch invariance: a row alone gives its bytes in the batch.
    assert same_bytes(linear(x[1:2], w), y[1:2])


def test_the_order_is_not_the_dequantized_linear():
    """The test above can fail: the scale applied per value (the dequantized weight's linear) gives
    other bytes on these inputs, and so does a plain tree over all K (no per-block tree)."""
    gen = torch.Generator().manual_seed(0)
    w = quantize_fp8(torch.randn(64, 200, generator=gen))
    x = torch.randn(8, 200, generator=gen)
    y = linear_acc(x, w)
    assert not same_bytes(y, linear_acc(x, dequantize(w)))
    scaled_rows = w.w8.float() * w.scale_inv[0, 0]  # one scale, one tree over K
    assert not same_bytes(y, linear_acc(x, scaled_rows))


def test_block_scaled_linear_error_bound_against_float32_dequantized():
    """Agreement with the dequantized float32 linear, within a bound derived per element.

    Both compute, in float32, ``sum_k x_k W8_k s_b`` (the same real number). The fp8 order rounds
    each product x_k W8_k (<= u relative), the block's tree (depth 7: 7 additions on any path),
    the scale product (1), and the tree over nb blocks (ceil(log2 nb)); the dequantized one rounds
    W8_k s_b (1), the product (1) and the tree over next_pow2(K) lanes (ceil(log2 K)). By the
    usual first-order bound each lies within ``m u sum_k |x_k W8_k s_b|`` of the real sum, with m
    its rounding depth, so their difference is within ``(m1 + m2) u sum_k |x_k w_k|`` (+ one
    float32 ulp-level second-order term, covered by a factor 1.01)."""
    gen = torch.Generator().manual_seed(1)
    K = 200
    w = quantize_fp8(torch.randn(256, K, generator=gen) * 3)
    x = torch.randn(16, K, generator=gen)
    a = linear_acc(x, w).double()
    deq = dequantize(w)
    b = linear_acc(x, deq).double()
    nb = math.ceil(K / 128)
    m1 = 1 + 7 + 1 + math.ceil(math.log2(nb))
    m2 = 1 + 1 + math.ceil(math.log2(K))
    magnitude = x.abs().double() @ deq.abs().double().T  # sum_k |x_k w_k|, (T, N)
    bound = 1.01 * (m1 + m2) * U32 * magnitude
    assert ((a - b).abs() <= bound).all()
    assert (a - b).abs().max() > 0  # the two orders do differ


def test_may_be_fp8_follows_the_design_list():
    cfg = MtpConfig.preset("tiny")
    fp8_names = {n for n in mtp_tensor_shapes(cfg) if may_be_fp8(n)}
    bf16 = set(mtp_tensor_shapes(cfg)) - fp8_names
    assert bf16 == {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                    "input_layernorm.weight", "post_attention_layernorm.weight",
                    "self_attn.q_a_layernorm.weight", "self_attn.kv_a_layernorm.weight",
                    "self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias",
                    "self_attn.indexer.weights_proj.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias"}
    assert not may_be_fp8("model.embed_tokens.weight") and not may_be_fp8("lm_head.weight")
    assert may_be_fp8("model.layers.2.mlp.experts.7.down_proj.weight")


def test_quantized_weights_draft_through_the_reference():
    """Every §8 matrix of quantize_fp8's copy is block-scaled (S stays bf16), the reference drafter
    runs on it, and a bf16 tensor stays the very same tensor."""
    w = MtpWeights.random(wide_config(), seed=2)
    q = w.quantize_fp8()
    assert q.block_scaled and not w.block_scaled and q.dtype == torch.bfloat16
    kinds = {n: fp8.is_block_scaled(t) for n, t in q.mtp_tensors().items()}
    assert kinds == {n: may_be_fp8(n) for n in kinds}
    assert q.layer.attn.indexer.weights_proj is w.layer.attn.indexer.weights_proj
    assert q.layer.mlp.experts_gate.scale_inv.shape == (8, 2, 2)  # (E, ceil(144/128), ceil(200/128))
    prop = ReferenceProposer(q, max_seq_len=32)
    st = prop.alloc_state("cpu")
    gen = torch.Generator().manual_seed(5)
    toks = torch.randint(q.config.vocab_size, (6,), generator=gen)
    hid = torch.randn(6, 200, generator=gen).to(torch.bfloat16)
    prop.prefill_drafter(toks, hid, st)
    drafts = prop.propose(int(toks[-1]), hid[-1], 5, 3, st)
    assert len(drafts) == 3


def test_sharding_block_scaled_weights_is_refused():
    q = MtpWeights.random(MtpConfig.preset("tiny"), seed=2).quantize_fp8()
    with pytest.raises(ValueError, match="sharding block-scaled fp8 weights"):
        MtpWeights.from_tensors(q.config, q.mtp_tensors(), q.embed_tokens, q.lm_head,
                                shard=__import__("glm_mtp.reference.distributed",
                                                 fromlist=["ShardSpec"]).ShardSpec(0, 2))


def test_a_partial_block_is_the_128_lane_tree():
    """A K below 128 is one partial block, summed as the 128-lane tree: it equals psum over the
    block's K lanes except that the wider tree adds +0.0 at the top, turning a -0.0 sum into +0.0."""
    x = torch.tensor([[1.0, 1.0]])
    w = BlockScaledWeight(torch.tensor([[-0.0, -0.0]]).to(fp8.FP8_DTYPE), torch.ones(1, 1))
    assert same_bytes(psum(x * w.w8.float()), torch.tensor([-0.0]))
    assert same_bytes(linear_acc(x, w), torch.tensor([[0.0]]))
