"""The eager reference GLM-5 MTP drafter: the semantics every other backend must reproduce."""

from .checkpoint import CheckpointError
from .config import MtpConfig
from .proposer import DraftProposer, ReferenceProposer, SampledDrafts, SamplingProposer
from .state import DrafterState
from .weights import MtpWeights

__all__ = ["MtpConfig", "MtpWeights", "ReferenceProposer", "DraftProposer", "SamplingProposer", "SampledDrafts", "DrafterState", "CheckpointError"]
