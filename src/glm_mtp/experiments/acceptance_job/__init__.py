"""The acceptance experiment as a library (its entry point, ``experiments/acceptance.py``, only
parses the config and calls ``run``): one job, read top to bottom in this order:

- ``run``: the job: measure, summarise, write, each prompt's counts on disk as it finishes;
- ``measure``: load the model (or a trace), build the prompts, run the loop or teacher forcing;
  what it measured is a ``measurement.Measurement``;
- ``run_grammars``: the prompts' grammars (DESIGN.md §10), compiled before the loop starts;
- ``summary``: ``summary.json``, section by section (acceptance, counts, settings, prompts,
  target, timings, grammar, lossless, speedup, provenance);
- ``table``: the run's Markdown table and its legend; ``lines``: the lines printed under it;
  ``plot``: ``acceptance.png``; ``write``: the run's files and its logger.

Imports the other subpackages (``loop``, ``settings``, ``targets``, ``traces``, ``reporting``,
``grammars``) and no entry point; entry points (``acceptance``, ``grid``) import it.
"""
