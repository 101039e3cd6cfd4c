"""Acceptance-rate experiments for the GLM-5 MTP drafter.

- ``target``: a small target of the GLM-5 architecture, built from the drafter's own layer code;
- ``speculative``: the speculative-decoding loop of DESIGN.md §4 (greedy and rejection-sampling
  verification, rollback policies, acceptance metrics) over any ``DraftProposer`` backend;
- ``corpus`` / ``bpe``: the offline corpus (the Python standard library) and its BPE tokenizer;
- ``checkpoint``: finding and loading the shipped checkpoint; ``wandb_log``: W&B (offline by
  default) or no logger, and a reader for offline runs;
- ``train``, ``acceptance``, ``grid``: Hydra entry points (``python -m glm_mtp.experiments.X``);
  ``report`` and ``grid_report`` aggregate a sweep (argparse); ``speedup``: the speedup model
  S(k) = tau(k) / (1 + k c + v(k)) and its costs (measured, or GLM-5's from bytes). Results:
  ``RESULTS.md`` at the repository's top (data in ``results/``).

Importing this package imports neither Hydra nor W&B; the entry points do.
"""
