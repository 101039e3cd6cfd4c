"""glm-mtp: the multi-token-prediction draft head of GLM-5-class models (GLM-5 and GLM-5.3-Flash).

The subpackages are the card's top-level folders (see pyproject.toml):

- ``glm_mtp.reference``: the eager drafter that pins the semantics;
- ``glm_mtp.optimized``: the same drafter, fused and graph-captured, equal to it bit for bit;
- ``glm_mtp.conformance``: the lockstep suite that proves it;
- ``glm_mtp.tools``: measuring tools (counters, the byte floor, timing, the PTX audit);
- ``glm_mtp.experiments``: acceptance-rate experiments, the speedup model, training and benchmarks
  (Hydra, W&B).
"""

__version__ = "0.1.0"
