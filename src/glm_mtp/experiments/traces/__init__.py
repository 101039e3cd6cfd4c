"""Traces (DESIGN.md §11): the target recorded once, replayed for every drafter.

- ``format``: the file format (safetensors shards + ``trace.json``), writing and reading, and the
  checks that refuse a damaged or foreign trace naming the field (docs/traces.md);
- ``recorder``: recording one from a target in two passes (greedy continuation, then one
  teacher-forced forward per item), near-ties truncated and counted;
- ``drafter_only``: a checkpoint directory cut to the drafter's tensors, which a replay runs from;
- ``python -m glm_mtp.experiments.traces check DIR``: the validator's report, field by field.

The replay target itself is ``experiments.targets.replay.ReplayTarget``; the recording entry point
is ``python -m glm_mtp.experiments.record``.
"""
