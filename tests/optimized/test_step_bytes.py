"""``step_bytes.draft_step_bytes`` (sizes only): plain storage equals ``tools.floor``'s floor, and
block-scaled fp8 equals a count over built, quantized weights (each tensor's ``nbytes``: an fp8
matrix is 1 byte a value plus its float32 scales)."""

import re

import pytest
import torch

from glm_mtp.optimized.step_bytes import draft_step_bytes
from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.tools.floor import floor_bytes_per_draft


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_sizes_give_the_floor(preset):
    cfg = MtpConfig.preset(preset)
    assert draft_step_bytes(cfg, 17).total == floor_bytes_per_draft(cfg, torch.bfloat16, 17)
    q = MtpWeights.random(cfg, seed=0, dtype=torch.bfloat16).quantize_fp8()
    read = 0
    for name, t in q.mtp_tensors().items():
        m = re.match(r"mlp\.experts\.(\d+)\.", name)
        if m and int(m.group(1)) >= cfg.num_experts_per_tok:
            continue  # a step reads num_experts_per_tok experts
        read += t.nbytes
    got = draft_step_bytes(cfg, 17, block_scaled=True)
    assert got.layer == read and got.layer < draft_step_bytes(cfg, 17).layer
