"""glm-mtp: the GLM-5 multi-token-prediction draft head.

The subpackages are the card's top-level folders (see pyproject.toml):

- ``glm_mtp.reference``: the eager drafter that pins the semantics;
- ``glm_mtp.optimized``: the same drafter, fused and graph-captured, equal to it bit for bit;
- ``glm_mtp.conformance``: the lockstep suite that proves it;
- ``glm_mtp.experiments``: acceptance-rate experiments, training and benchmarks (Hydra, W&B).
"""

__version__ = "0.1.0"
