"""The bytes a draft step must read, from a config's sizes alone (no weights are built, so
GLM-5's real widths are cheap): the same floor as ``counters.floor_bytes_per_draft``, in plain
storage or with the weights DESIGN.md §8 lets be fp8 block-scaled (1 byte per value plus a
float32 scale per 128 x 128 block).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from glm_mtp.reference import fp8
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.weights import mtp_tensor_shapes

_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")


@dataclass(frozen=True)
class StepBytes:
    """One draft step's floor, split where it goes (bytes).

    Args:
        layer: the MTP layer's weights read (the chosen experts only, the shared one, norms, biases).
        head: ``lm_head`` (V x H in S) and one embedding row.
        cache: the indexer keys of the visible rows and the listed MLA rows (S).
    """

    layer: int
    head: int
    cache: int

    @property
    def total(self) -> int:
        return self.layer + self.head + self.cache


def draft_step_bytes(cfg: MtpConfig, visible_rows: int, storage_bytes: int = 2, block_scaled: bool = False) -> StepBytes:
    """The floor of one draft step at ``visible_rows`` visible rows with weights of
    ``storage_bytes`` per value (2: bf16), the routing bias float32; with ``block_scaled``, every
    weight ``fp8.may_be_fp8`` names at 1 byte per value plus 4 per scale."""
    layer = 0
    for name, shape in mtp_tensor_shapes(cfg).items():
        m = _EXPERT.match(name)
        if m and int(m.group(1)) >= cfg.num_experts_per_tok:
            continue  # a step reads num_experts_per_tok experts' weights (counted as experts 0..k-1)
        numel = 1
        for d in shape:
            numel *= d
        if name.endswith("e_score_correction_bias"):
            layer += 4 * numel
        elif block_scaled and fp8.may_be_fp8(name):
            sn, sk = fp8.scale_shape(shape)
            layer += numel + 4 * sn * sk
        else:
            layer += storage_bytes * numel
    head = storage_bytes * (cfg.vocab_size + 1) * cfg.hidden_size
    cache = storage_bytes * (visible_rows * cfg.index_head_dim + min(cfg.index_topk, visible_rows) * cfg.kv_row_width)
    return StepBytes(layer, head, cache)
