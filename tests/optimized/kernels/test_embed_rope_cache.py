"""Each Triton kernel against the torch code it replaces: byte equality on fresh random inputs of
several shapes, through Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

import pytest
import torch

from glm_mtp.optimized.kernels import (
    embed_rows_torch, embed_rows_triton, rope_cache_write_torch, rope_cache_write_triton,
)
from glm_mtp.reference import MtpConfig
from glm_mtp.reference.attention import Rope
from glm_mtp.reference.bytes import same_bytes

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("V,H,T", [(96, 64, 1), (50, 70, 5), (33, 1500, 3), (7, 16, 9)])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_embed_rows(dtype, V, H, T, id_dtype):
    gen = torch.Generator().manual_seed(V * 1000 + H + T)
    embed = torch.randn(V, H, generator=gen).to(dtype)
    tokens = torch.randint(V, (T,), generator=gen).to(id_dtype)
    slots = torch.randint(0, 3, (T,), generator=gen) * torch.randint(1, 40, (T,), generator=gen)
    slots[0] = 0  # at least one row-0 row, which must come out as +0.0 everywhere
    want = embed_rows_torch(embed, tokens, slots)
    got = embed_rows_triton(embed, tokens, slots)
    assert same_bytes(want, got)
    assert not same_bytes(want, embed[tokens.long()])  # the zeroing happened (the test can fail)


def _cfg(interleave: bool, index_interleave: bool, R: int, D: int, Lkv: int) -> MtpConfig:
    return MtpConfig.preset("tiny").replace(
        rope_interleave=interleave, indexer_rope_interleave=index_interleave, qk_rope_head_dim=R, index_head_dim=D,
        kv_lora_rank=Lkv
    )


def _write_both(cfg, dtype, T, blocks, gen, ok_value, scale=3.0, poison=False):
    """Run both implementations on the same fresh inputs; returns (torch pools, triton pools, inputs)."""
    Lkv, R, D = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    rope = Rope.build(cfg, 16 * blocks, "cpu")
    kv = (torch.randn(T, Lkv + R, generator=gen) * scale).to(dtype)  # rope key as a strided view, as in the block
    latent = torch.randn(T, Lkv, generator=gen).to(dtype)
    ikey = (torch.randn(T, D, generator=gen) * scale).to(dtype)
    if poison:
        kv[0, Lkv] = float("nan")
        kv[-1, Lkv + 1] = float("inf")
        ikey[0, 0] = float("-inf")
    slots = torch.randperm(16 * blocks, generator=gen)[:T]
    block_table = torch.randperm(blocks, generator=gen).to(torch.int32)
    ok = torch.tensor([ok_value])
    pools = [torch.randn(blocks, 16, Lkv + R, generator=gen).to(dtype),
             torch.randn(blocks, 16, D, generator=gen).to(dtype)]
    mine = [p.clone() for p in pools]
    rope_cache_write_torch(cfg, latent, kv[:, Lkv:], ikey, slots, rope.cos, rope.sin, pools[0], pools[1], block_table,
                           ok)
    rope_cache_write_triton(cfg, latent, kv[:, Lkv:], ikey, slots, rope.cos, rope.sin, mine[0], mine[1], block_table,
                            ok)
    return pools, mine, (kv, rope, slots)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "interleave,index_interleave,R,D,Lkv,T,blocks",
    [(True, True, 8, 16, 16, 1, 3), (True, False, 8, 16, 16, 4, 3), (False, True, 16, 32, 24, 6, 5),
     (False, False, 4, 20, 10, 2, 2)],
)
def test_rope_cache_write(dtype, interleave, index_interleave, R, D, Lkv, T, blocks):
    cfg = _cfg(interleave, index_interleave, R, D, Lkv)
    gen = torch.Generator().manual_seed(R * 7 + D + T)
    for ok_value in (True, False):
        before_gen_state = gen.get_state()
        want, got, _ = _write_both(cfg, dtype, T, blocks, gen, ok_value)
        assert same_bytes(want[0], got[0]) and same_bytes(want[1], got[1])
        if not ok_value:  # nothing written: both still hold their random fill
            gen2 = torch.Generator()
            gen2.set_state(before_gen_state)
            untouched, _, _ = _write_both(cfg, dtype, T, blocks, gen2, True)
            assert not same_bytes(untouched[0], got[0])


def test_rope_cache_write_rounds_to_nearest_even():
    """bf16 RoPE outputs that truncation would get wrong come out as torch rounds them; with
    NaN/inf inputs, infinities match byte for byte and NaNs sit at the same places (torch's own
    NaN payload depends on its code path, see kernels/rope_cache.py)."""
    cfg = _cfg(True, True, 8, 16, 16)
    gen = torch.Generator().manual_seed(11)
    want, got, (kv, rope, slots) = _write_both(cfg, torch.bfloat16, 8, 3, gen, True, scale=5.0)
    assert same_bytes(want[0], got[0]) and same_bytes(want[1], got[1])
    # The inputs exercise rounding: truncating the float32 RoPE values would change some bytes.
    cos, sin = rope.cos[slots], rope.sin[slots]
    x = kv[:, cfg.kv_lora_rank :].float()
    y1 = x[:, 0::2] * cos - x[:, 1::2] * sin
    truncated = (y1.view(torch.int32) >> 16).to(torch.int16)
    assert not torch.equal(truncated, y1.to(torch.bfloat16).view(torch.int16))
    want, got, _ = _write_both(cfg, torch.bfloat16, 4, 2, gen, True, poison=True)
    for w, g in zip(want, got):
        nan = torch.isnan(w.float())
        assert torch.equal(nan, torch.isnan(g.float()))
        assert torch.equal(w.view(torch.int16)[~nan], g.view(torch.int16)[~nan])
    assert torch.isnan(want[0].float()).any() and torch.isinf(want[0].float()).any()
    assert torch.isinf(want[1].float()).any()


def test_rope_cache_write_refuses_other_dtypes():
    cfg = _cfg(True, True, 8, 16, 16)
    with pytest.raises(TypeError):
        rope_cache_write_triton(cfg, *[torch.zeros(1, 16, dtype=torch.float64)] * 3, torch.zeros(1, dtype=torch.int64),
                                torch.zeros(16, 4), torch.zeros(16, 4), torch.zeros(1, 16, 24, dtype=torch.float64),
                                torch.zeros(1, 16, 16, dtype=torch.float64), torch.zeros(1, dtype=torch.int32),
                                torch.ones(1, dtype=torch.bool))
