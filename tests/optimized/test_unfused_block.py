"""The one block forward: ``reference.block.mtp_rows`` with ``BlockHooks``. The optimized block is
that call with its pieces, and each piece stores or returns the reference's bytes: the fused
``write_rows`` hook against the default ``write_cache_rows`` (and gated by ``ok``), the whole
``block_rows`` against the reference's ``mtp_rows``; and a hook that breaks the rule is caught."""

from __future__ import annotations

import pytest
import torch

from glm_mtp.optimized.unfused_block import PrimitiveKernels, block_rows
from glm_mtp.reference.attention import Rope, cache_rows, row_projections, write_cache_rows
from glm_mtp.reference.block import REFERENCE_HOOKS, BlockHooks, mtp_rows
from glm_mtp.reference.bytes import bits
from glm_mtp.reference.numerics import PINNED
from glm_mtp.reference.state import LayerCache, num_blocks

MAX_SEQ = 40


def pools(cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
    return bits(cache.kv_pool), bits(cache.index_pool)


def fresh(weights):
    cfg = weights.config
    cache = LayerCache.allocate(cfg, num_blocks(MAX_SEQ), weights.dtype, "cpu")
    return cache, Rope.build(cfg, cache.capacity, "cpu", weights.dtype)


def rows(weights, T: int, seed: int):
    cfg, g = weights.config, torch.Generator().manual_seed(seed)
    a = torch.randn(T, cfg.hidden_size, generator=g).to(weights.dtype)
    tokens = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    return a, tokens


@pytest.mark.parametrize("mode", ["torch", "triton"])
@pytest.mark.parametrize("T", [1, 5])
def test_fused_write_rows_hook_stores_the_default_bytes(weights, mode, T):
    attn, cfg = weights.layer.attn, weights.config
    a, _ = rows(weights, T, seed=11 + T)
    slots = torch.arange(3, 3 + T)
    kv, k = row_projections(attn, a)
    (ref, rope), (got, _), (gated, _) = fresh(weights), fresh(weights), fresh(weights)
    write_cache_rows(attn, cfg, kv, k, slots, rope, ref, PINNED)
    fused = PrimitiveKernels(mode)
    fused.write_rows_hook(attn, cfg, kv, k, slots, rope, got, fused.ops, ok=torch.tensor([True]))
    fused.write_rows_hook(attn, cfg, kv, k, slots, rope, gated, fused.ops, ok=torch.tensor([False]))
    assert all(torch.equal(x, y) for x, y in zip(pools(got), pools(ref)))
    assert int(bits(ref.kv_pool).ne(0).sum()) > 0  # something was written
    assert all(int(x.ne(0).sum()) == 0 for x in pools(gated))  # ok false: nothing stored


def test_default_write_rows_is_cache_rows_then_write(weights):
    attn, cfg = weights.layer.attn, weights.config
    a, _ = rows(weights, 4, seed=3)
    slots = torch.tensor([0, 1, 17, 18])  # across a block boundary
    kv, k = row_projections(attn, a)
    (cache, rope) = fresh(weights)
    write_cache_rows(attn, cfg, kv, k, slots, rope, cache)
    kv_rows, index_rows = cache_rows(attn, cfg, kv, k, *rope.at(slots))
    assert torch.equal(bits(cache.kv_rows()[slots]), bits(kv_rows))
    assert torch.equal(bits(cache.index_rows()[slots]), bits(index_rows))


@pytest.mark.parametrize("T", [1, 6])
def test_block_rows_is_mtp_rows(weights, T):
    cfg = weights.config
    _, tokens = rows(weights, T, seed=21 + T)
    hiddens = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(5 + T)).to(weights.dtype)
    slots = torch.arange(T)
    (ref_cache, rope), (opt_cache, _) = fresh(weights), fresh(weights)
    ref = mtp_rows(weights, tokens, hiddens, slots, ref_cache, rope, rows_read=T)
    x, pre_norm = block_rows(weights, tokens, hiddens, slots, opt_cache, rope, torch.tensor([True]),
                             PrimitiveKernels("torch"))
    assert torch.equal(bits(x), bits(ref.x)) and torch.equal(bits(pre_norm), bits(ref.pre_norm))
    assert all(torch.equal(p, q) for p, q in zip(pools(opt_cache), pools(ref_cache)))


def test_a_write_rows_hook_that_skips_the_latent_norm_is_caught(weights):
    # Mutant: the hook stores the raw latent (no kv_a_layernorm): the cached rows and the block's
    # output must differ from the reference's, so the comparisons above can fail.
    cfg = weights.config
    T = 3
    _, tokens = rows(weights, T, seed=8)
    hiddens = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(9)).to(weights.dtype)
    slots = torch.arange(T)

    def raw_latent(attn, cfg, kv, k, slots, rope, cache, ops):
        kv_rows, index_rows = cache_rows(attn, cfg, kv, k, *rope.at(slots), ops)
        kv_rows = torch.cat((kv[:, : cfg.kv_lora_rank], kv_rows[:, cfg.kv_lora_rank :]), dim=-1)  # MUTATION
        cache.write(slots, kv_rows, index_rows)

    (ref_cache, rope), (bad_cache, _) = fresh(weights), fresh(weights)
    ref = mtp_rows(weights, tokens, hiddens, slots, ref_cache, rope, hooks=REFERENCE_HOOKS)
    bad = mtp_rows(weights, tokens, hiddens, slots, bad_cache, rope, hooks=BlockHooks(write_rows=raw_latent))
    assert not torch.equal(bits(bad_cache.kv_pool), bits(ref_cache.kv_pool))
    assert not torch.equal(bits(bad.x), bits(ref.x))
