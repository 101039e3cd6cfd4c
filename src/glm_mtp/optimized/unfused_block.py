"""The unfused MTP block for new rows, one kernel per primitive: the optimized drafter's path for
a layer the fused step (``optimized/step.py``) does not take (a dense MLP, sharded weights, float64).

The block is ``glm_mtp.reference.block.mtp_rows`` itself, called with the optimized pieces
(``reference.block.BlockHooks``): every reduction follows the pinned order of DESIGN.md §5
through the reference's own functions, in static shapes (attention reads the whole capacity,
which changes no result). Four pieces differ, all exact by construction:

- the block's GEMVs (eh_proj, q_a/q_b, kv_a, the indexer's wq_b/wk/weights_proj and key scores,
  o_proj, the router, every expert's gate/up/down) in the pinned GEMV kernel (``kernels.linear``:
  the ``psum`` tree over K), through ``PrimitiveKernels.ops``: the pinned primitives with the kernel's
  ``linear``/``linear_acc``/``swiglu``, passed as ``ops`` to the reference's functions (a
  row-parallel ``o_proj`` keeps the reference's own per-rank sum);
- the embedding gather with the row-0 zeroing (``kernels.embed``), which reads token ids from the
  device, so a draft's argmax feeds the next lookup without a host round trip;
- RoPE on the new keys fused with their paged cache write (``kernels.rope_cache_write_triton``), every
  store gated by a device flag ``ok`` so a propose can refuse a bad input without a host sync
  (the ``write_rows`` hook: it gets the raw projections, applies the reference's norms and hands
  the normed latent and the layer-normed index key to the kernel, which rotates and stores);
- the chosen experts' weights gathered on the device rather than read in place through host
  ids (``gathered_expert_outputs``): copies of the same values;
- glm5_next (DESIGN.md §7): the rows are stored as normed (NoPE: no RoPE anywhere), and the
  KPool indexer (the ``kpool`` hook, ``gated_kpool_rows``) writes its gates and pooled keys gated
  by ``ok`` and reads every pool of the capacity in a static shape, the ones a row cannot see
  masked out as the reference masks them (so no host read of the rows' pool count).

Nothing here reads a device value on the host: slots arrive as a device tensor, so the same code
runs eagerly on CPU and under CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property, partial
from typing import Literal

import torch
from torch import Tensor

from glm_mtp.reference.attention import Rope, normed_latent
from glm_mtp.reference.block import BlockHooks, mtp_rows
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.indexer import normed_index_keys
from glm_mtp.reference.moe import expert_swiglu, moe_block
from glm_mtp.reference.numerics import PINNED, Numerics, swiglu
from glm_mtp.reference.sharing import SharedSelection
from glm_mtp.reference.state import LayerCache
from glm_mtp.reference.state import BLOCK_ROWS
from glm_mtp.reference.weights import AttentionWeights, IndexerWeights, MoeWeights, MtpWeights

from .kernels.kpool import (
    KPOOL_DTYPES, pool_keys_write_torch, pool_keys_write_triton, pool_scores_torch, pool_scores_triton,
    select_pool_rows_torch, select_pool_rows_triton,
)
from .kernels.moe import experts_gate_up_triton
from .kernels import (
    KERNEL_DTYPES, embed_rows_torch, embed_rows_triton, linear_acc_torch, linear_acc_triton, linear_torch,
    linear_triton,
    rope_cache_write_torch, rope_cache_write_triton,
)

KernelMode = Literal["auto", "triton", "torch"]


def triton_runs_on(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` in this process, or ``None`` when they
    can: on CUDA they need a CUDA device; elsewhere they need Triton's CPU interpreter, which a
    kernel takes when ``TRITON_INTERPRET=1`` is set before triton compiles it (read from one of
    this package's kernels, so setting the variable too late is caught as well)."""
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "CUDA is not available"
    from triton.runtime.interpreter import InterpretedFunction

    from .kernels import pinned_math

    if isinstance(pinned_math.psum_grid, InterpretedFunction):
        return None
    return (f"the weights are on {device} and Triton has no driver there; its CPU interpreter needs TRITON_INTERPRET=1 "
            "set before triton is imported (set it in the environment, or use kernels='auto' or 'torch', the kernels' "
            "byte-equal torch twins)")


def takes_triton(mode: KernelMode, t: Tensor) -> bool:
    """Whether a kernel runs as Triton (else its torch twin, proven byte-equal to it) on tensors
    like ``t`` under ``mode``: ``auto`` takes the kernels on CUDA and the twins on CPU, where
    Triton only has its (slow) interpreter; ``triton`` forces the kernels (on CPU that needs
    ``TRITON_INTERPRET=1`` set before triton is imported); ``torch`` the twins. Only the
    ``KERNEL_DTYPES`` take a kernel. The fused step's kernel set is chosen by it too."""
    if mode == "torch":
        return False
    if mode == "triton":
        return t.dtype in KERNEL_DTYPES
    return t.is_cuda and t.dtype in KERNEL_DTYPES


@dataclass(frozen=True)
class PrimitiveKernels:
    """The per-primitive block's pieces (the pinned GEMV, the embedding gather, the RoPE cache
    write; the ``BlockHooks`` of ``reference.block.mtp_rows``), each the Triton kernel or its twin
    as ``takes_triton(mode, ...)`` says."""

    mode: KernelMode = "auto"

    def use_triton(self, t: Tensor) -> bool:
        return takes_triton(self.mode, t)

    def embed(self, embed: Tensor, tokens: Tensor, slots: Tensor) -> Tensor:
        """``embed[tokens]`` (T, H) with slot-0 rows zeroed."""
        if self.use_triton(embed) and embed.is_contiguous() and tokens.shape[0] > 0:
            return embed_rows_triton(embed, tokens, slots)
        return embed_rows_torch(embed, tokens, slots)

    def rope_cache_write(self, cfg: MtpConfig, latent: Tensor, kpe_raw: Tensor, ikey_raw: Tensor, slots: Tensor,
                         rope: Rope, cache: LayerCache, ok: Tensor) -> None:
        """Rotate and store the new rows' keys at ``slots`` where ``ok``; see kernels.rope_cache."""
        args = (cfg, latent, kpe_raw, ikey_raw, slots, rope.cos, rope.sin, cache.kv_pool, cache.index_pool,
                cache.block_table, ok)
        if self.use_triton(cache.kv_pool) and rope.cos.dtype == torch.float32:
            rope_cache_write_triton(*args)
        else:
            rope_cache_write_torch(*args)

    def _gemv(self, x: Tensor, weight: Tensor) -> bool:
        """Whether ``x @ weight.T`` takes the GEMV kernel: weights the kernels take, 2-D with a
        contiguous last dim (any row stride), activations of a kernel dtype on the same device."""
        return (self.use_triton(weight) and weight.dim() == 2 and weight.stride(-1) == 1 and x.dtype in KERNEL_DTYPES
                and x.device == weight.device and x.shape[-1] == weight.shape[-1])

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """``numerics.linear(x, weight)``: x (..., K), weight (N, K) -> (..., N) in x's dtype."""
        return linear_triton(x, weight) if self._gemv(x, weight) else linear_torch(x, weight)

    def linear_acc(self, x: Tensor, weight: Tensor) -> Tensor:
        """``numerics.linear_acc(x, weight)``: as ``linear``, left in A."""
        return linear_acc_triton(x, weight) if self._gemv(x, weight) else linear_acc_torch(x, weight)

    def swiglu(self, x: Tensor, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor) -> Tensor:
        """``numerics.swiglu`` with this ``linear``."""
        return swiglu(x, gate_proj, up_proj, down_proj, linear=self.linear)

    @cached_property
    def ops(self) -> Numerics:
        """The pinned primitives with this ``linear``, ``linear_acc`` and ``swiglu``: what the
        reference's functions take as ``ops`` here, so each of their GEMVs takes the kernel
        (built once per drafter, not once per draft step)."""
        return replace(PINNED, linear=self.linear, linear_acc=self.linear_acc, swiglu=self.swiglu)

    # ---- the block's hooks (reference.block.BlockHooks) ----------------------------------------
    def embed_hook(self, w: MtpWeights, tokens: Tensor, slots: Tensor) -> Tensor:
        """``BlockHooks.embed``: ``embed`` on the weights' table."""
        return self.embed(w.embed_tokens, tokens, slots)

    def write_rows_hook(self, attn: AttentionWeights, cfg: MtpConfig, kv: Tensor, k: Tensor, slots: Tensor, rope: Rope,
                        cache: LayerCache, ops: Numerics, *, ok: Tensor) -> None:
        """``BlockHooks.write_rows`` gated by ``ok`` (1,) bool: the reference's latent norm and
        index-key norm on the raw projections, then RoPE and the paged write in one kernel."""
        latent = normed_latent(attn, cfg, kv, ops)  # (T, Lkv)
        k_normed = normed_index_keys(attn.indexer, k, ops)  # (T, D), RoPE comes in the write
        if cfg.is_next:  # NoPE: the rows are stored as normed
            gated_write(cache, slots, latent, k_normed, ok)
        else:
            self.rope_cache_write(cfg, latent, kv[:, cfg.kv_lora_rank :], k_normed, slots, rope, cache, ok)

    def moe_hook(self, moe: MoeWeights, cfg: MtpConfig, m: Tensor, ops: Numerics) -> Tensor:
        """``BlockHooks.moe``: ``moe_block`` with the experts' weights gathered on the device; a
        clamped SwiGLU (glm5_next) on the Triton path runs the routed experts' gate/up in the
        experts kernel with the clamp inside (``clamped_expert_outputs``)."""
        if moe.swiglu_limit is not None and self.use_triton(m) and m.dtype == moe.experts_gate.dtype:
            return moe_block(moe, cfg, m, ops, outputs=self.clamped_expert_outputs)
        return moe_block(moe, cfg, m, ops, outputs=gathered_expert_outputs)

    def clamped_expert_outputs(self, moe: MoeWeights, m: Tensor, experts: Tensor, ops: Numerics) -> Tensor:
        """``reference.moe.expert_outputs`` of clamped experts: every row's chosen experts' clamped
        SwiGLU hidden in one launch of ``kernels.moe``'s gate/up kernel (``limit``; ids read on the
        device), then each slot's down projection on its expert's rows gathered on the device."""
        # (T, k, I)
        hidden, _ = experts_gate_up_triton(m, experts, moe.experts_gate, moe.experts_up, limit=moe.swiglu_limit)
        out = []
        for t in range(m.shape[0]):
            down = torch.index_select(moe.experts_down, 0, experts[t])  # (k, H, I)
            out.append(torch.stack([self.linear(hidden[t, j], down[j]) for j in range(experts.shape[1])]))  # (k, H)
        return torch.stack(out)  # (T, k, H)

    def kpool_hook(self, ix: IndexerWeights, cfg: MtpConfig, a: Tensor, q_latent: Tensor, slots: Tensor,
                   cache: LayerCache, ops: Numerics, *, ok: Tensor,
                   shared: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """``BlockHooks.kpool``: ``gated_kpool_rows`` gated by ``ok`` (1,) bool (``shared``, the
        reference's name: an index-shared draft step's kept selection, as
        ``reference.kpool.kpool_rows`` takes it)."""
        return gated_kpool_rows(ix, cfg, a, q_latent, slots, cache, ok, ops, kernel_set=self, index_shared=shared)

    def hooks(self, ok: Tensor) -> BlockHooks:
        """The optimized pieces of ``reference.block.mtp_rows``, cache writes gated by ``ok``."""
        return BlockHooks(ops=self.ops, embed=self.embed_hook, write_rows=partial(self.write_rows_hook, ok=ok),
                          moe=self.moe_hook,
                          kpool=partial(self.kpool_hook, ok=ok))


def gated_write(cache: LayerCache, slots: Tensor, kv_rows: Tensor, index_rows: Tensor, ok: Tensor) -> None:
    """``LayerCache.write`` of rows (T, ·) at ``slots`` (T,), each row kept only where ``ok``
    (1,) bool is set (the old bytes are written back otherwise)."""
    block = cache.block_table[slots // BLOCK_ROWS].long()
    offset = slots % BLOCK_ROWS
    cache.kv_pool[block, offset] = torch.where(ok, kv_rows, cache.kv_pool[block, offset])
    cache.index_pool[block, offset] = torch.where(ok, index_rows, cache.index_pool[block, offset])


def gated_pool_writes(ix: IndexerWeights, cfg: MtpConfig, gates: Tensor, slots: Tensor, cache: LayerCache, ok: Tensor,
                      kernel_set: PrimitiveKernels | None = None) -> None:
    """``reference.kpool.write_pools`` gated by ``ok`` (1,) bool, with no host read: the gates
    ``gates`` (T, D) at ``slots`` (T,), then the key of every pool a row completes
    (``kernels.kpool``: the kernel or its twin, as ``kernel_set`` chooses; the twin without one)."""
    kpc = cache.kpool
    assert kpc is not None, "a glm5_next layer needs a KPool cache"
    kpc.gates[slots] = torch.where(ok, gates, kpc.gates[slots])
    args = (cfg, ix, slots, cache, ok)
    if kernel_set is not None and kernel_set.use_triton(cache.index_pool) and cache.index_pool.dtype in KPOOL_DTYPES:
        pool_keys_write_triton(*args)
    else:
        pool_keys_write_torch(*args)


def gated_forget(cache: LayerCache, n: Tensor, ok: Tensor) -> None:
    """``KPoolCache.forget_from(n)`` for a device row count ``n`` (1,) int64, only where ``ok``
    (1,) bool is set: a propose's rewind to its position, with no host read (a no-op without
    KPool rows)."""
    kpc = cache.kpool
    if kpc is None:
        return
    pools = torch.arange(kpc.complete.shape[0], device=n.device)
    kpc.complete.copy_(kpc.complete & ~(ok & (pools >= n // kpc.kpool)))


def gated_kpool_rows(ix: IndexerWeights, cfg: MtpConfig, a: Tensor, q_latent: Tensor, slots: Tensor, cache: LayerCache,
                     ok: Tensor, ops: Numerics = PINNED, kernel_set: PrimitiveKernels | None = None,
                     index_shared: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``reference.kpool.kpool_rows`` with its writes gated by ``ok`` (1,) bool and the scores over
    every pool of the capacity (a static shape; ``kernels.kpool``'s pool scores, kernel or twin as
    ``kernel_set`` chooses): the pools a row cannot see are ``-inf`` (and loaded by no kernel program),
    as ``select_pool_rows`` masks them (the kernel writes no score there, and its selection reads
none), and a list's values do not depend on its padded width.
    ``index_shared``: an index-shared draft step's kept selection (DESIGN.md §9): the writes, then
    ``index_shared`` returned, none of the query side run.
    Returns ``rows`` (T, K), ``count`` (T,)."""
    kpc = cache.kpool
    assert ix.kpool_gate is not None and kpc is not None, "a glm5_next layer has a KPool gate and cache"
    gated_pool_writes(ix, cfg, ops.linear(a, ix.kpool_gate), slots, cache, ok, kernel_set)
    if index_shared is not None:
        return index_shared
    # (T, Hi * D), (T, Hi): kpool_queries' GEMVs
    q_raw, w_raw = ops.linear(q_latent, ix.wq_b), ops.linear(a, ix.weights_proj)
    keys = kpc.keys
    if kernel_set is not None and kernel_set.use_triton(keys) and keys.dtype in KPOOL_DTYPES:
        scores = pool_scores_triton(cfg, q_raw, w_raw, cache, slots)  # (T, P): written at the visible pools only
        return select_pool_rows_triton(cfg, scores, slots)
    scores = pool_scores_torch(cfg, q_raw, w_raw, cache, slots)
    return select_pool_rows_torch(cfg, scores, slots)


def gathered_expert_outputs(moe: MoeWeights, m: Tensor, experts: Tensor, ops: Numerics = PINNED) -> Tensor:
    """``glm_mtp.reference.moe.expert_outputs`` without a host read of the expert ids (so it can
    be captured): each row's experts are gathered on the device (copies), then run alone."""
    out = []
    swiglu = expert_swiglu(moe, ops)  # clamped in glm5_next
    for t in range(m.shape[0]):
        ids = experts[t]  # (k,)
        gate, up, down = (torch.index_select(x, 0, ids) for x in (moe.experts_gate, moe.experts_up, moe.experts_down))
        out.append(torch.stack([swiglu(m[t], gate[j], up[j], down[j]) for j in range(ids.shape[0])]))  # (k, H)
    return torch.stack(out)  # (T, k, H)


def block_rows(w: MtpWeights, tokens: Tensor, hiddens: Tensor, slots: Tensor, cache: LayerCache, rope: Rope,
               ok: Tensor, kernels: PrimitiveKernels, share: SharedSelection | None = None) -> tuple[Tensor, Tensor]:
    """``glm_mtp.reference.block.mtp_rows`` on rows pairing ``tokens`` (T,) with ``hiddens``
    (T, H) at ``slots`` (T,), with ``kernels``' pieces; cache writes only where ``ok`` (1,) bool
    is set. Reads the whole capacity (a static shape; no result depends on it). ``share``: index
    sharing within a propose, as ``mtp_rows`` takes it (DESIGN.md §9).

    Returns ``(x, pre_norm)``, each (T, H): the post-norm output and the layer output."""
    out = mtp_rows(w, tokens, hiddens, slots, cache, rope, hooks=kernels.hooks(ok), share=share)
    return out.x, out.pre_norm
