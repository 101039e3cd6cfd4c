"""``step_bytes.draft_step_bytes`` (sizes only) against ``counters.floor_bytes_per_draft`` on
built weights, plain and block-scaled fp8."""

import pytest
import torch

from glm_mtp.optimized.counters import floor_bytes_per_draft
from glm_mtp.optimized.step_bytes import draft_step_bytes
from glm_mtp.reference import MtpConfig, MtpWeights


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_sizes_give_the_built_weights_floor(preset):
    cfg = MtpConfig.preset(preset)
    w = MtpWeights.random(cfg, seed=0, dtype=torch.bfloat16)
    q = w.quantize_fp8()
    assert draft_step_bytes(cfg, 17).total == floor_bytes_per_draft(w, 17)
    assert draft_step_bytes(cfg, 17, block_scaled=True).total == floor_bytes_per_draft(q, 17)
    assert floor_bytes_per_draft(q, 17) < floor_bytes_per_draft(w, 17)
