"""Triton kernels of the optimized drafter, each beside the torch code it replaces.

Every kernel here is exact by construction (DESIGN.md §5): gathers, scatters, cache writes,
float32 elementwise chains in the reference's operation order and sums in the ``psum`` tree
(the GEMV, ``linear``), compiled without FMA contraction (``enable_fp_fusion=False``), casts
rounded to nearest even. Each ``*_triton`` function has a ``*_torch`` twin made of the
reference's own ops; tests/optimized/kernels/ prove each pair byte-equal on fresh
random inputs through Triton's CPU interpreter. At run time the proposer calls the kernel on
CUDA and, by default, the twin on CPU (the interpreter is slow).
``glm_mtp.tools.audit`` compiles every kernel in ``AUDITED`` for the GPU without one and
checks the PTX for the instructions DESIGN.md §5 forbids.
"""

from . import (
    confidence, embed, fused_linear, indexer, kpool, linear, linear_fp8, mla, moe, paged, pinned_math, rope_cache,
)
from .confidence import (
    draft_confidence_torch, draft_confidence_triton, masked_argmax_torch, masked_argmax_triton,
)
from .embed import embed_rows_torch, embed_rows_triton
from .fused_linear import (
    argmax_reduce_torch, argmax_reduce_triton, block_input_torch, block_input_triton, head_partials_torch,
    head_partials_triton, linear_residual_torch, linear_residual_triton, norm_linear_torch, norm_linear_triton,
)
from .indexer import index_scores_torch, index_scores_triton, select_rows_torch, select_rows_triton
from .kpool import (
    pool_keys_write_torch, pool_keys_write_triton, pool_scores_torch, pool_scores_triton, pools_forget_torch,
    pools_forget_triton, select_pool_rows_torch, select_pool_rows_triton,
)
from .launch import AuditLaunch, Launch
from .linear import linear_acc_torch, linear_acc_triton, linear_torch, linear_triton
from .mla import absorbed_query_torch, absorbed_query_triton, sparse_mla_torch, sparse_mla_triton
from .moe import (
    experts_down_combine_torch, experts_down_combine_triton, experts_gate_up_torch, experts_gate_up_triton, route_torch,
    route_triton,
)
from .paged import KERNEL_DTYPES, RowCaches, RowTargets, row_caches, scatter_rows_torch, scatter_rows_triton
from .pinned_math import exp_torch, exp_triton
from .rope_cache import (
    cache_rows_write_torch, cache_rows_write_triton, rope_cache_write_torch, rope_cache_write_triton,
)

# Every module here that defines a Triton kernel. Each has ``audit_launches(cfg, dtype)``, its
# launches at a config and weight dtype built by the same function its launcher calls;
# ``python -m glm_mtp.tools.audit`` compiles them for the GPU and checks the PTX. A new
# kernel module joins this tuple (tests/tools/test_audit.py audits every entry). The drafter
# launches them all except ``linear_fp8``'s stand-alone GEMV (its e4m3 decoder and block
# helpers run inside the fused step's fp8 variants; the GEMV is their pattern, tested alone).
AUDITED = (embed, rope_cache, linear, linear_fp8, fused_linear, mla, indexer, pinned_math, moe, paged, kpool,
           confidence)

# Each kernel with its twin, by module (the imports above), then the plumbing.
__all__ = [
    "draft_confidence_torch", "draft_confidence_triton", "masked_argmax_torch", "masked_argmax_triton",
    "embed_rows_torch", "embed_rows_triton",
    "argmax_reduce_torch", "argmax_reduce_triton", "block_input_torch", "block_input_triton", "head_partials_torch",
    "head_partials_triton", "linear_residual_torch", "linear_residual_triton", "norm_linear_torch",
    "norm_linear_triton",
    "index_scores_torch", "index_scores_triton", "select_rows_torch", "select_rows_triton",
    "pool_keys_write_torch", "pool_keys_write_triton", "pool_scores_torch", "pool_scores_triton", "pools_forget_torch",
    "pools_forget_triton", "select_pool_rows_torch", "select_pool_rows_triton",
    "linear_acc_torch", "linear_acc_triton", "linear_torch", "linear_triton",
    "absorbed_query_torch", "absorbed_query_triton", "sparse_mla_torch", "sparse_mla_triton",
    "experts_down_combine_torch", "experts_down_combine_triton", "experts_gate_up_torch", "experts_gate_up_triton",
    "route_torch", "route_triton",
    "scatter_rows_torch", "scatter_rows_triton",
    "exp_torch", "exp_triton",
    "cache_rows_write_torch", "cache_rows_write_triton", "rope_cache_write_torch", "rope_cache_write_triton",
    "KERNEL_DTYPES", "AUDITED", "AuditLaunch", "Launch", "RowCaches", "RowTargets", "row_caches",
]
