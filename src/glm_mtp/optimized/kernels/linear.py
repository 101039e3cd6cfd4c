"""The pinned GEMV: ``y[t, n] = psum_k(up(x[t, k]) * up(W[n, k]))``, rounded to S or left in A.

Replaces ``glm_mtp.reference.numerics.linear`` / ``linear_acc`` for the drafter's few rows (a
draft step, a catch-up, a prefill chunk). The sum is ``psum`` (DESIGN.md §5): the balanced tree
over K padded with ``+0.0`` to ``P = next_pow2(K)``, adjacent pairs first. The kernel computes
exactly that tree, cut in two at a power of two:

- K is read in ``NCHUNK = P / BLOCK_K`` chunks of ``BLOCK_K`` (a power of two dividing P), so
  chunk ``c`` is the aligned subtree over ``[c * BLOCK_K, (c + 1) * BLOCK_K)``. Its products (in
  float32, each rounded once: ``enable_fp_fusion=False``; lanes past K load ``+0.0`` for both
  operands, so their products are the padding's ``+0.0``) are reduced in registers level by
  level: ``a, b = split(reshape(p, (..., w / 2, 2)))``, ``p = a + b`` pairs ``p[2i]`` with
  ``p[2i + 1]``. One root per chunk.
- The roots go to column ``c`` of a ``(.., NCHUNK)`` register array that starts at ``+0.0``
  (chunks wholly past K are never loaded: their subtree is ``+0.0``), which the same tree reduces
  to the root of the whole padded tree.

No ``tl.sum``/``tl.dot`` (their order is the compiler's) and no FMA. Each program computes a
``(BLOCK_T, BLOCK_N)`` tile of outputs, so a prefill chunk reads each weight tile once per
``BLOCK_T`` rows. The cast to bfloat16 rounds on the bits (``rounding.round_to_storage``),
because the interpreter truncates; float16 uses Triton's round-to-nearest-even cast (numpy's in
the interpreter). NaN results stay NaN; their payload is not pinned (see ``rounding``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_mtp.reference import numerics
from glm_mtp.reference.config import MtpConfig

from .launch import AuditLaunch, Launch, abstract
from .pinned_math import psum_grid
from .rounding import round_to_storage

# The storage dtypes the kernel reads and writes.
LINEAR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Chunk width cap and products per program per chunk: a (BLOCK_T, BLOCK_N, BLOCK_K) float32 tile
# of 2048 values is 16 per thread at 4 warps, with room for the tree's halves (see the audit).
MAX_BLOCK_K = 256
MAX_BLOCK_T = 4
TILE = 2048
# The cache rows the audit's index-score launch multiplies (see drafter_linears).
SCORED_ROWS = 4096


@triton.jit
def _linear_kernel(
    x_ptr,  # (T, K), row stride stride_x, last dim contiguous
    w_ptr,  # (N, K), row stride stride_w, last dim contiguous
    out_ptr,  # (T, N), row stride stride_out
    T,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LEVELS_K: tl.constexpr,  # log2(BLOCK_K)
    NCHUNK: tl.constexpr,  # next_pow2(K) / BLOCK_K
    LEVELS_C: tl.constexpr,  # log2(NCHUNK)
    TO_BF16: tl.constexpr,
    TO_F16: tl.constexpr,
    NAN_BITS: tl.constexpr,
):
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_in = t < T
    n_in = n < N
    kk = tl.arange(0, BLOCK_K)
    col = tl.arange(0, NCHUNK)
    x_rows = x_ptr + t.to(tl.int64)[:, None] * stride_x  # (BLOCK_T, 1)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w  # (BLOCK_N, 1)
    roots = tl.zeros((BLOCK_T, BLOCK_N, NCHUNK), tl.float32)  # +0.0: the roots of chunks past K
    for c in range(0, tl.cdiv(K, BLOCK_K)):
        k = c * BLOCK_K + kk
        k_in = k < K
        xv = tl.load(x_rows + k[None, :], mask=t_in[:, None] & k_in[None, :], other=0.0).to(tl.float32)
        wv = tl.load(w_rows + k[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0).to(tl.float32)
        p = xv[:, None, :] * wv[None, :, :]  # (BLOCK_T, BLOCK_N, BLOCK_K), +0.0 past K
        root = psum_grid(p, BLOCK_T, BLOCK_N, BLOCK_K, LEVELS_K)  # (BLOCK_T, BLOCK_N)
        roots = tl.where(col[None, None, :] == c, root[:, :, None], roots)
    y = psum_grid(roots, BLOCK_T, BLOCK_N, NCHUNK, LEVELS_C)  # (BLOCK_T, BLOCK_N)
    dst = out_ptr + t.to(tl.int64)[:, None] * stride_out + n[None, :]
    inside = t_in[:, None] & n_in[None, :]
    if TO_F16:
        tl.store(dst, y.to(tl.float16), mask=inside)
    else:
        tl.store(dst, round_to_storage(y, TO_BF16, NAN_BITS), mask=inside)


def linear_torch(x: Tensor, weight: Tensor) -> Tensor:
    """The twin: ``numerics.linear`` itself (x (..., K), weight (N, K) -> (..., N) in x's dtype)."""
    return numerics.linear(x, weight)


def linear_acc_torch(x: Tensor, weight: Tensor) -> Tensor:
    """The twin: ``numerics.linear_acc`` itself (-> (..., N) in A)."""
    return numerics.linear_acc(x, weight)


def linear_blocks(T: int, N: int, K: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_N, BLOCK_K)`` for ``T`` rows, ``N`` outputs, ``K`` inputs: chunks of at
    most ``MAX_BLOCK_K`` (never wider than ``next_pow2(K)``, so they tile the padded tree), and
    about ``TILE`` products per chunk."""
    block_k = min(numerics.next_pow2(K), MAX_BLOCK_K)
    block_t = min(numerics.next_pow2(T), MAX_BLOCK_T)
    block_n = max(1, min(numerics.next_pow2(N), TILE // (block_k * block_t)))
    return block_t, block_n, block_k


def _check(x: Tensor, weight: Tensor, name: str) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"{name}: x must be (T, K) and weight (N, K), got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: x (T, K={x.shape[1]}) and weight (N, K={weight.shape[1]}) must agree on K")
    for arg, t in (("x", x), ("weight", weight)):
        if t.dtype not in LINEAR_DTYPES:
            raise TypeError(f"{name}: {arg} dtype {t.dtype} is not supported (one of {LINEAR_DTYPES})")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: {arg} must have a contiguous last dim (stride {t.stride(1)})")
    if x.device != weight.device:
        raise ValueError(f"{name}: x is on {x.device}, weight on {weight.device}")


def linear_launch(x: Tensor, weight: Tensor, out: Tensor, cuda: bool | None = None) -> Launch:
    """The kernel's launch for ``x`` (T, K) and ``weight`` (N, K), each with a contiguous last
    dim and any row stride, into ``out`` (T, N) (float32 for ``linear_acc``, else x's dtype): the
    one place its grid and constexprs are computed. ``cuda``: whether it runs on CUDA (it picks the
    NaN payload); ``None`` reads it off ``out`` (the audit's abstract tensors are on no device)."""
    (T, K), N = x.shape, weight.shape[0]
    block_t, block_n, block_k = linear_blocks(T, N, K)
    nchunk = numerics.next_pow2(K) // block_k
    cuda = out.is_cuda if cuda is None else cuda
    grid = (triton.cdiv(N, block_n), triton.cdiv(T, block_t))
    args = (x, weight, out, T, N, K, x.stride(0), weight.stride(0), out.stride(0))
    meta = dict(
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        LEVELS_K=block_k.bit_length() - 1,
        NCHUNK=nchunk,
        LEVELS_C=nchunk.bit_length() - 1,
        TO_BF16=out.dtype == torch.bfloat16,
        TO_F16=out.dtype == torch.float16,
        NAN_BITS=0x7FFF if cuda else 0xFFFF,
        enable_fp_fusion=False,
    )
    return Launch(_linear_kernel, grid, args, meta)


def _run(x: Tensor, weight: Tensor, out_dtype: torch.dtype, name: str) -> Tensor:
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)  # a view where it can be; a copy is exact too
    if K > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()  # activations are a few rows: copy them rather than refuse
    _check(x2, weight, name)
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=out_dtype, device=x.device)
    if out.numel() > 0:
        linear_launch(x2, weight, out).run()
    return out.reshape(*lead, weight.shape[0])


def linear_triton(x: Tensor, weight: Tensor) -> Tensor:
    """The kernel for ``numerics.linear``: ``x`` (..., K), ``weight`` (N, K) -> (..., N) in x's
    dtype, byte-equal to it. ``weight`` needs a contiguous last dim (any row stride; it is never
    copied); ``x`` is copied when its last dim is not contiguous. float32, bfloat16 or float16."""
    return _run(x, weight, x.dtype, "linear_triton")


def linear_acc_triton(x: Tensor, weight: Tensor) -> Tensor:
    """The kernel for ``numerics.linear_acc``: as ``linear_triton``, the result left in float32."""
    return _run(x, weight, torch.float32, "linear_acc_triton")


def drafter_linears(cfg: MtpConfig) -> list[tuple[str, int, int, bool, int]]:
    """``(name, N, K, acc, rows)`` for every weight the MTP layer multiplies with ``linear`` (acc:
    the result stays in A, ``linear_acc``; rows: x's rows per new token). Names fit the audit
    table's kernel column (``exp``: each routed expert; ``sh``: the shared expert). The index
    scores multiply each head's query by every cached index key: N is the cache capacity, here
    ``SCORED_ROWS`` (a runtime integer: any multiple of 16 compiles the same)."""
    H, nh, Lq, I = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.moe_intermediate_size
    Hi, D = cfg.index_n_heads, cfg.index_head_dim
    out = [
        ("eh_proj", H, 2 * H, False, 1),
        ("q_a_proj", Lq, H, False, 1),
        ("q_b_proj", nh * cfg.qk_head_dim, Lq, False, 1),
        ("kv_a_proj", cfg.kv_row_width, H, False, 1),
        ("idx_wq_b", Hi * D, Lq, False, 1),
        ("idx_wk", D, H, False, 1),
        ("idx_weights", Hi, H, False, 1),
        ("idx_scores", SCORED_ROWS, D, True, Hi),
        ("o_proj", H, nh * cfg.v_head_dim, False, 1),
        ("router", cfg.n_routed_experts, H, True, 1),
        ("exp_gate_up", I, H, False, 1),
        ("exp_down", H, I, False, 1),
    ]
    if cfg.n_shared_experts:
        Is = I * cfg.n_shared_experts
        out += [("sh_gate_up", Is, H, False, 1), ("sh_down", H, Is, False, 1)]
    return out + [("lm_head", cfg.vocab_size, H, False, 1)]


def audit_launches(cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """The GEMVs of the drafter at ``cfg`` with ``dtype`` weights and activations, on abstract
    tensors (see ``glm_mtp.tools.audit``): every weight of ``drafter_linears``, for a draft
    step (``step``: one token) and a prefill chunk (``rows``: 8 tokens, so BLOCK_T = MAX_BLOCK_T)."""
    launches = []
    for name, N, K, acc, per_token in drafter_linears(cfg):
        weight = abstract((N, K), dtype)
        for variant, tokens in (("step", 1), ("rows", 8)):
            T = tokens * per_token
            out = abstract((T, N), torch.float32 if acc else dtype)
            launches.append(AuditLaunch(f"linear:{name}", variant, linear_launch(abstract((T, K), dtype), weight, out,
                                                                                 cuda=True)))
    return launches
