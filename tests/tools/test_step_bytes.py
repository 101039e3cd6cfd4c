"""``tools.floor.draft_step_bytes`` (sizes only) equals a count over built weights: each tensor's
``nbytes`` of the layer a draft step reads (the chosen experts only), in plain storage and with
block-scaled fp8 weights (1 byte a value plus float32 scales), for both families."""

import re

import pytest
import torch

from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.tools.floor import draft_step_bytes, floor_bytes_per_draft


def layer_bytes_read(w: MtpWeights) -> int:
    """The bytes of the layer's tensors a draft step reads, counted on built weights."""
    read = 0
    for name, t in w.mtp_tensors().items():
        m = re.match(r"mlp\.experts\.(\d+)\.", name)
        if m and int(m.group(1)) >= w.config.num_experts_per_tok:
            continue  # a step reads num_experts_per_tok experts
        read += t.nbytes
    return read


@pytest.mark.parametrize("preset", ["tiny", "small", "glm5next_tiny"])
def test_sizes_give_the_bytes_of_built_weights(preset):
    cfg = MtpConfig.preset(preset)
    w = MtpWeights.random(cfg, seed=0, dtype=torch.bfloat16)
    plain = draft_step_bytes(cfg, 17)
    assert plain.layer == layer_bytes_read(w)
    assert plain.head == w.lm_head.nbytes + w.embed_tokens[0].nbytes
    assert plain.total == floor_bytes_per_draft(cfg, torch.bfloat16, 17)
    scaled = draft_step_bytes(cfg, 17, block_scaled=True)
    assert scaled.layer == layer_bytes_read(w.quantize_fp8()) < plain.layer
    assert scaled.head == plain.head and scaled.cache == plain.cache  # the head and the cache stay in S
