"""The experiments: what the MTP drafter buys in speculative decoding, for both families (GLM-5's
``glm_moe_dsa`` and GLM-5.3-Flash's ``glm5_next``: KPool indexer, index sharing across draft
steps), bf16 or fp8 weights, on either backend.

The entry points live here, so ``python -m glm_mtp.experiments.<name>`` finds them:
``acceptance`` (the main job: acceptance rates and the speedup model), ``train`` (the toy target
and its MTP head on the Python stdlib), ``grid`` (a training grid), ``report`` and
``grid_report`` (tables and plots of a sweep), ``bench`` and ``bench_batch`` (latency, memory and
bytes against the bandwidth floor), ``record`` (a trace: the target run once, DESIGN.md §11),
``stop_sweep`` (the stop rules against the hindsight oracle). Everything else is in a subpackage
by concern:

- ``targets``: what the loop verifies against (the toy target, a released checkpoint's own target
  run by transformers, a trace replayed), finding and loading checkpoints, provenance;
- ``traces``: a trace's file format and checks, recording one, replaying one in an acceptance run
  (DESIGN.md §11, docs/traces.md);
- ``acceptance_job``: the acceptance experiment as a library (measure, summarise, write), which
  ``acceptance`` and ``grid`` call;
- ``training``: the training job (``train_run``), the corpus, its BPE tokenizer, the model card,
  the KPool indexer's loss, fine-tuning;
- ``loop``: the speculative loop of DESIGN.md §4, its statistics, the speedup model
  S(k) = tau(k) / (1 + k c + v(k)), the indexer's recall, the grid's feed agreement;
- ``reporting``: W&B (offline by default) or no logger, sweep bookkeeping, the tables' legend;
- ``settings``: the checks of a run's config before any work, the prompts, the Hydra entry shape;
- ``grammars``: grammars compiled with xgrammar (the ``grammar`` extra) for constrained output
  (DESIGN.md §10); the loop's masked verification is ``loop.grammar_verify``.

Results: ``RESULTS.md`` at the repository's top (data in ``results/``). The subpackages import
``glm_mtp.reference``, ``glm_mtp.optimized``, ``glm_mtp.tools`` and each other, never an entry
point; importing this package imports neither Hydra nor W&B (the entry points do).
"""
