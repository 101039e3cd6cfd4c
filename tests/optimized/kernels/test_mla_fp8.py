"""The MLA kernels over a block-scaled fp8 ``kv_b_proj`` (DESIGN.md §8): the absorbed query and
the output through W_uv sum over kv_b's rows, across its scale blocks, so each value is read as
``up(W8[r, c]) * s[r // 128, c // 128]`` in float32 (``fp8.weight_values``), byte-equal to the
reference's ``absorb_query`` / ``mla_over_lists`` through Triton's CPU interpreter. The shape puts
heads across scale-row boundaries (nope + v = 88 rows a head, 352 rows: three scale rows, the last
partial) and the latent over two scale columns (Lkv = 136)."""

import torch

from glm_mtp.optimized.kernels import absorbed_query_torch, absorbed_query_triton, sparse_mla_torch, sparse_mla_triton
from glm_mtp.reference import MtpConfig
from glm_mtp.reference.attention import Rope
from glm_mtp.reference.fp8 import quantize_fp8
from glm_mtp.reference.state import LayerCache
from glm_mtp.reference.weights import same_bytes

CFG = MtpConfig.preset("tiny").replace(num_attention_heads=4, qk_nope_head_dim=48, v_head_dim=40, kv_lora_rank=136)


def test_mla_fp8_bytes():
    cfg, gen = CFG, torch.Generator().manual_seed(5)
    nh, nope, R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    Lkv, v = cfg.kv_lora_rank, cfg.v_head_dim
    dtype, T, K = torch.bfloat16, 2, 12
    kv_b = quantize_fp8(torch.randn(nh * (nope + v), Lkv, generator=gen)
                        * torch.exp(torch.randn(nh * (nope + v), Lkv, generator=gen)))
    assert kv_b.scale_inv.shape == (3, 2)
    q = torch.randn(T, nh * (nope + R), generator=gen).to(dtype)
    cos, sin = Rope.build(cfg, 64, "cpu").at(torch.randint(0, 64, (T,), generator=gen))
    got_abs, got_pe = absorbed_query_triton(cfg, q, kv_b, cos, sin)
    want_abs, want_pe = absorbed_query_torch(cfg, q, kv_b, cos, sin)
    assert same_bytes(got_abs, want_abs) and same_bytes(got_pe, want_pe)

    blocks = 3
    pool = torch.randn(blocks, 16, Lkv + R, generator=gen).to(dtype)
    table = torch.randperm(blocks, generator=gen).to(torch.int32)
    cache = LayerCache(pool, torch.zeros(blocks, 16, cfg.index_head_dim, dtype=dtype), table)
    rows = torch.stack([torch.randperm(blocks * 16, generator=gen)[:K].sort().values for _ in range(T)])
    count = torch.tensor([K, 5])
    rows[1, 5:] = 0
    args = (want_abs * 4, want_pe, cache, rows, count, kv_b)
    assert same_bytes(sparse_mla_triton(cfg, *args), sparse_mla_torch(cfg, *args))
