"""The optimized GLM-5 MTP drafter: static buffers, a CUDA-graph-captured k-draft propose and
exact fused Triton kernels, equal to ``glm_mtp.reference.ReferenceProposer`` bit for bit.

Imports torch, triton and the reference package only (no Hydra, no W&B): production imports it
alone.
"""

from glm_mtp.reference import DraftProposer, MtpConfig, MtpWeights

from .block import Fused
from .proposer import OptimizedProposer, with_triton_kernels
from .state import OptimizedState

__all__ = ["OptimizedProposer", "with_triton_kernels", "OptimizedState", "Fused", "DraftProposer", "MtpConfig", "MtpWeights"]
