"""The byte model: the bytes one draft step must read, at the least.

The launch counters (``glm_mtp.tools.counters``) compare the bytes a draft step's launches move
with it, the benchmark (``glm_mtp.experiments.bench``) turns it into a time at the device's copy
bandwidth, and the speedup model (``glm_mtp.experiments.loop.speedup``) counts GLM-5's draft step in
parameters from it. It needs only a config (the layer's tensor shapes), so GLM-5's floor is known
without its weights, in plain storage or with the weights DESIGN.md §8 lets be fp8 block-scaled.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from glm_mtp.reference import fp8
from glm_mtp.reference.checkpoint import float32_tensor
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.weights import mtp_tensor_shapes

_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")
# The indexer's query side (DESIGN.md §9): the index query's wq_b and the head weights. A shared
# draft step does not run it, so its floor leaves these weights out.
QUERY_SIDE_WEIGHTS = ("self_attn.indexer.wq_b.weight", "self_attn.indexer.weights_proj.weight")


@dataclass(frozen=True)
class StepBytes:
    """One draft step's floor, split where it goes (bytes).

    Args:
        layer: the MTP layer's weights read (the chosen experts only, the shared one, norms, biases).
        head: ``lm_head`` (V x H in S) and one embedding row.
        cache: what the indexer scores (GLM-5: the index keys of the visible rows; glm5_next: the
            pooled keys of the visible complete pools) and the MLA rows it lists (S).
    """

    layer: int
    head: int
    cache: int

    @property
    def total(self) -> int:
        return self.layer + self.head + self.cache


def draft_step_bytes(cfg: MtpConfig, visible_rows: int, storage_bytes: int = 2, block_scaled: bool = False,
                     selected_at: int | None = None) -> StepBytes:
    """The floor of one draft step at ``visible_rows`` rows visible to it (its own included),
    with weights of ``storage_bytes`` per value (2: bf16):

    - every tensor of the MTP layer (``mtp_tensor_shapes``), of the routed experts only the
      ``num_experts_per_tok`` chosen ones (the others are not read); a tensor that stays float32
      (``checkpoint.float32_tensor``: the routing bias, glm5_next's router) at 4 bytes a value;
      with ``block_scaled``, every weight ``fp8.may_be_fp8`` names at 1 byte a value plus a
      float32 scale per 128 x 128 block;
    - one embedding row and the whole ``lm_head``;
    - the attended rows, in the cache's dtype (S): ``attended_row_bytes``.

    The step's stores (its new cache rows, a hidden, a token) are a few hundred bytes and not
    part of the floor.

    ``selected_at``: a shared draft step (DESIGN.md §9) attending the selection draft step 1 made
    at ``selected_at`` rows visible to it: without the query side's weights
    (``QUERY_SIDE_WEIGHTS``) and with ``shared_row_bytes`` for the cache (no index or pooled
    keys are scored; ``visible_rows`` is then not read)."""
    layer = 0
    for name, shape in mtp_tensor_shapes(cfg).items():
        m = _EXPERT.match(name)
        if m and int(m.group(1)) >= cfg.num_experts_per_tok:
            continue  # a step reads num_experts_per_tok experts' weights (counted as experts 0..k-1)
        if selected_at is not None and name in QUERY_SIDE_WEIGHTS:
            continue
        numel = math.prod(shape)
        if float32_tensor(cfg, name):
            layer += 4 * numel
        elif block_scaled and fp8.may_be_fp8(name):
            sn, sk = fp8.scale_shape(shape)
            layer += numel + 4 * sn * sk
        else:
            layer += storage_bytes * numel
    head = storage_bytes * (cfg.vocab_size + 1) * cfg.hidden_size
    if selected_at is not None:
        return StepBytes(layer, head, shared_row_bytes(cfg, selected_at, storage_bytes))
    return StepBytes(layer, head, attended_row_bytes(cfg, visible_rows, storage_bytes))


def attended_row_bytes(cfg: MtpConfig, visible_rows: int, storage_bytes: int = 2) -> int:
    """The cache bytes a step at ``visible_rows`` rows (its own included, so its slot is
    ``visible_rows - 1``) must read:

    - GLM-5: the index key of every visible row, and the MLA rows of the
      ``min(index_topk, visible_rows)`` rows the indexer lists;
    - glm5_next (KPool): the pooled key of every visible complete pool
      (``floor(visible_rows / kp)``), and the MLA rows of the pools it selects
      (``min(index_topk / kp, pools) * kp``) and of its tail (``visible_rows mod kp``).

    The pooled-key write of a step that completes a pool (its pool's kp index rows and gates,
    once per kp steps) is not part of the floor."""
    if visible_rows <= 0:
        return 0
    if cfg.is_next:
        kp = cfg.index_kpool
        pools = visible_rows // kp
        listed = min(cfg.kpool_pools_selected, pools) * kp + visible_rows % kp
        return storage_bytes * (pools * cfg.index_head_dim + listed * cfg.kv_row_width)
    return storage_bytes * (visible_rows * cfg.index_head_dim + min(cfg.index_topk, visible_rows) * cfg.kv_row_width)


def shared_row_bytes(cfg: MtpConfig, selected_at: int, storage_bytes: int = 2) -> int:
    """The cache bytes a shared draft step (DESIGN.md §9) must read: the MLA rows of draft step
    1's list, made at ``selected_at`` rows visible to step 1 (``attended_row_bytes``' listed rows
    at that count); no index key or pooled key (a shared step scores nothing)."""
    if selected_at <= 0:
        return 0
    if cfg.is_next:
        kp = cfg.index_kpool
        listed = min(cfg.kpool_pools_selected, selected_at // kp) * kp + selected_at % kp
    else:
        listed = min(cfg.index_topk, selected_at)
    return storage_bytes * listed * cfg.kv_row_width


def floor_bytes_per_draft(cfg: MtpConfig, dtype: torch.dtype, visible_rows: int, block_scaled: bool = False,
                          selected_at: int | None = None) -> int:
    """``draft_step_bytes(...).total`` for weights stored in ``dtype`` (``selected_at``: a shared
    step's, as ``draft_step_bytes`` takes it)."""
    return draft_step_bytes(cfg, visible_rows, torch.empty(0, dtype=dtype).element_size(), block_scaled,
                            selected_at).total


# ---- a draft step on an H200, as a model -------------------------------------------------------
# Not a measurement: a step in a CUDA graph costs its bytes at the HBM bandwidth plus a fixed
# cost per launch. 4.8 TB/s is the H200's HBM3e peak; ~1.5 us a launch inside a graph.
H200_BYTES_PER_S = 4.8e12
GRAPH_LAUNCH_S = 1.5e-6
# The full-width preset of each family, the one a projection is made for.
FULL_PRESET = {"glm5": "glm5", "glm5_next": "glm5next"}


@dataclass(frozen=True)
class StepProjection:
    """One draft step at a full-width preset, projected from counts made at a smaller one.

    Args:
        preset: the full-width preset (``glm5``, ``glm5next``).
        counted_at: the preset whose draft step was counted (its kernel/floor ratio and launches).
        visible_rows: rows visible to the step.
        floor_bytes: the floor at ``preset`` (``floor_bytes_per_draft``).
        kernel_floor_ratio / launches: as counted at ``counted_at``; neither grows with the widths
            (the launches are a fixed schedule, and the ratio falls as weights dominate).
        shared: a shared draft step (DESIGN.md §9), its floor ``selected_at`` the rows before it.
    """

    preset: str
    counted_at: str
    visible_rows: int
    floor_bytes: int
    kernel_floor_ratio: float
    launches: int
    shared: bool = False

    @property
    def step_bytes(self) -> float:
        return self.floor_bytes * self.kernel_floor_ratio

    @property
    def step_ms(self) -> float:
        return (self.step_bytes / H200_BYTES_PER_S + self.launches * GRAPH_LAUNCH_S) * 1e3


def project_step(counted_at: str, kernel_floor_ratio: float, launches: int, dtype: torch.dtype,
                 visible_rows: int = 4096, block_scaled: bool = False, shared: bool = False) -> StepProjection:
    """The draft step of ``counted_at``'s family at its full width (``FULL_PRESET``), from the
    kernel/floor ratio and launches counted at ``counted_at`` (a model: see ``H200_BYTES_PER_S``).
    ``shared``: a shared draft step (DESIGN.md §9), whose step 1 selected at ``visible_rows - 1``."""
    full = FULL_PRESET[MtpConfig.preset(counted_at).family]
    floor = floor_bytes_per_draft(MtpConfig.preset(full), dtype, visible_rows, block_scaled,
                                  selected_at=visible_rows - 1 if shared else None)
    return StepProjection(full, counted_at, visible_rows, floor, kernel_floor_ratio, launches, shared)
