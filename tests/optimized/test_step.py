"""The fused draft step (``glm_mtp.optimized.step``) against the reference's block and head, byte
for byte: the twins' composition on CPU, and every kernel through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from glm_mtp.optimized.step import StepKernels, fused_head, fused_rows, fusable, step_kernels
from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.reference.attention import Rope
from glm_mtp.reference.block import draft_logits, mtp_rows
from glm_mtp.reference.bytes import bits
from glm_mtp.reference.kpool import KPoolCache
from glm_mtp.reference.layers import greedy_token
from glm_mtp.reference.state import LayerCache


def caches(cfg: MtpConfig, dtype: torch.dtype, blocks: int, seed: int) -> tuple[LayerCache, LayerCache]:
    """Two equal caches over a shuffled block table (rows live in scattered pool blocks)."""
    g = torch.Generator().manual_seed(seed)
    a = LayerCache.allocate(cfg, blocks, dtype, "cpu")
    a.block_table.copy_(torch.randperm(blocks, generator=g).to(torch.int32))
    kp = a.kpool
    b = LayerCache(a.kv_pool.clone(), a.index_pool.clone(), a.block_table.clone(),
                   None if kp is None else KPoolCache(kp.gates.clone(), kp.keys.clone(), kp.complete.clone(), kp.kpool))
    return a, b


def assert_same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    diff = (bits(got) != bits(want)).reshape(-1)
    assert not diff.any(), f"{name}: {int(diff.sum())} of {diff.numel()} values differ"


def run_both(w: MtpWeights, kernel_set: StepKernels, context: int, new_rows: int, seed: int) -> None:
    """Write ``context`` rows with the reference into both caches, then ``new_rows`` more rows
    (one call) with the reference on one and the fused step on the other; compare everything."""
    cfg = w.config
    g = torch.Generator().manual_seed(seed)
    blocks = (context + new_rows) // 16 + 2
    ref_cache, opt_cache = caches(cfg, w.dtype, blocks, seed)
    rope = Rope.build(cfg, blocks * 16, "cpu", w.dtype)
    n = context + new_rows
    tokens = torch.randint(0, cfg.vocab_size, (n,), generator=g)
    hiddens = (torch.randn(n, cfg.hidden_size, generator=g) * 2).to(w.dtype)
    slots = torch.arange(n)
    if context:
        for c in (ref_cache, opt_cache):
            mtp_rows(w, tokens[:context], hiddens[:context], slots[:context], c, rope)
    new = slice(context, n)
    want = mtp_rows(w, tokens[new], hiddens[new], slots[new], ref_cache, rope)
    ok = torch.ones(1, dtype=torch.bool)
    got = fused_rows(w, tokens[new], hiddens[new], slots[new], opt_cache, rope, ok, kernel_set)
    assert_same("pre_norm", got, want.pre_norm)
    assert_same("kv_pool", opt_cache.kv_pool, ref_cache.kv_pool)
    assert_same("index_pool", opt_cache.index_pool, ref_cache.index_pool)
    if cfg.is_next:  # the KPool cache: gates, pooled keys, complete flags
        for name in ("gates", "keys", "complete"):
            assert_same(f"kpool.{name}", getattr(opt_cache.kpool, name), getattr(ref_cache.kpool, name))
    x, token = fused_head(w, got, kernel_set)
    assert_same("x", x, want.x)
    assert torch.equal(token, greedy_token(draft_logits(w, want.x))), "drafts differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("context,new_rows", [(0, 1), (5, 1), (21, 3)])
def test_twins_compose_to_the_reference(dtype, context, new_rows):
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=3, dtype=dtype)
    assert fusable(w)
    run_both(w, step_kernels(triton=False), context, new_rows, seed=context * 7 + new_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("context,new_rows", [(0, 1), (21, 1), (9, 3)])
def test_interpreted_kernels_equal_the_reference_tiny(dtype, context, new_rows):
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=5, dtype=dtype)
    run_both(w, step_kernels(triton=True), context, new_rows, seed=100 + context)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_kernels_equal_the_reference_small(dtype):
    # 40 context rows > index_topk 32: the indexer's choice matters.
    w = MtpWeights.random(MtpConfig.preset("small"), seed=9, dtype=dtype)
    run_both(w, step_kernels(triton=True), 40, 1, seed=11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("context,new_rows", [(0, 1), (14, 1), (21, 3)])
def test_glm5_next_twins_compose_to_the_reference(dtype, context, new_rows):
    """glm5_next (kpool 4, 2 pools listed): a first row, a row completing its pool with 3 pools
    visible (the selection matters), and 3 rows of one call completing a pool mid-call."""
    w = MtpWeights.random(MtpConfig.preset("glm5next_tiny"), seed=4, dtype=dtype)
    assert fusable(w)
    run_both(w, step_kernels(triton=False), context, new_rows, seed=context * 5 + new_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("context,new_rows", [(15, 1), (21, 3)])
def test_glm5_next_interpreted_kernels_equal_the_reference(dtype, context, new_rows):
    w = MtpWeights.random(MtpConfig.preset("glm5next_tiny"), seed=6, dtype=dtype)
    run_both(w, step_kernels(triton=True), context, new_rows, seed=200 + context)
