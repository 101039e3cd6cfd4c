"""Traces (DESIGN.md §11): the target recorded once, replayed for every drafter.

- ``format``: the file format (safetensors shards + ``trace.json``) and its writer;
- ``validate``: a trace read as untrusted data, every rule of the format (bounds before parsing,
  every field, shard headers before arrays, each item's bytes), the one walk both ``check`` and
  the replay run (docs/traces.md "A trace is input");
- ``recorder``: recording one from a target in two passes (greedy continuation, then one
  teacher-forced forward per item), near-ties truncated and counted;
- ``hf_record``: the recording's first pass on transformers' model (``model=hf``), batched;
- ``identity``: what ties a trace to a drafter (the target's configuration, the tokenizer);
- ``drafter_only``: a checkpoint directory cut to the drafter's tensors, which a replay runs from;
- ``replay_run``: what an acceptance run with ``trace.path`` needs (the drafter alone, the trace's
  prompts and budgets, the speedup model's costs);
- ``grid_report``: the table of a drafter grid replayed from one trace (``experiment=trace_grid``);
- ``python -m glm_mtp.experiments.traces check DIR``: the validator's report, field by field.

The replay target itself is ``experiments.targets.replay.ReplayTarget``; the recording entry point
is ``python -m glm_mtp.experiments.record``.
"""
