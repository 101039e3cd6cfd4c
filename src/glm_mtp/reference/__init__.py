"""The eager reference MTP drafter (GLM-5, and GLM-5.3-Flash's ``glm5_next`` family: KPool
indexer, index sharing across draft steps; bf16 or block-scaled fp8 weights): the semantics every
other backend must reproduce."""

from .checkpoint import CheckpointError
from .config import MtpConfig
from .contract import DraftProposer, SampledDrafts, SamplingProposer
from .proposer import ReferenceProposer
from .state import DrafterState
from .weights import MtpWeights

__all__ = ["MtpConfig", "MtpWeights", "ReferenceProposer", "DraftProposer", "SamplingProposer", "SampledDrafts",
           "DrafterState", "CheckpointError"]
