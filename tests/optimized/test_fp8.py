"""Block-scaled fp8 weights and the optimized drafter: until its kernels read fp8 bytes and
scales, it refuses such weights at construction (never a silent misread)."""

import pytest
import torch

from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import MtpConfig, MtpWeights


def test_block_scaled_weights_are_refused_at_construction():
    q = MtpWeights.random(MtpConfig.preset("tiny"), seed=1).quantize_fp8()
    with pytest.raises(ValueError, match="OptimizedProposer: block-scaled fp8 weights"):
        OptimizedProposer(q, max_seq_len=32)
    OptimizedProposer(q.dequantize(torch.bfloat16), max_seq_len=32)  # the way round it the message names
