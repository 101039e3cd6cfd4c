"""Measuring tools for the drafter, apart from the production package (``glm_mtp.optimized``
imports none of them):

- ``counters``: kernel launches and the bytes they move per draft step, counted on CPU (Triton's
  interpreter and a ``TorchDispatchMode``); ``python -m glm_mtp.tools.counters``;
- ``floor``: the byte model, the bytes one draft step must read at the least;
- ``timing``: wall-clock and CUDA-event timing, the device's copy bandwidth, a state's bytes;
- ``audit``: every drafter kernel compiled for a CUDA GPU without one, its PTX checked against
  DESIGN.md §5; ``python -m glm_mtp.tools.audit``;
- ``selection_recall``: the share of the dense attention an indexer's selection keeps, and the
  best any selection of that size could keep (the oracle);
- ``step_tables``: docs/performance.md's launch and byte tables, printed from the counters.

The benchmarks that use them are ``glm_mtp.experiments.bench`` and ``.bench_batch``.
"""
