"""Acceptance-rate experiment: per-position acceptance of the drafter on held-out or
out-of-distribution text, with counts and bootstrap intervals over prompts.

    python -m glm_mtp.experiments.acceptance                                   # the shipped model
    python -m glm_mtp.experiments.acceptance mode=teacher_forced source=ood    # natural contexts
    python -m glm_mtp.experiments.acceptance -m num_drafts=1,2,3,4,5 policy=first_row_kept,refeed
    python -m glm_mtp.experiments.report multirun/acceptance/<date>            # one table + plot
    python -m glm_mtp.experiments.acceptance temperature=1 draft=sampled       # drafts sampled from q
    python -m glm_mtp.experiments.acceptance model.dtype=bfloat16 target_numerics=pinned run.check_lossless=true
    python -m glm_mtp.experiments.acceptance batch_size=4                      # 4 prompts per propose_batch
    python -m glm_mtp.experiments.acceptance num_drafts=5 stop.rule=prob stop.threshold=0.6   # trim each round

Modes: ``speculative`` (default) runs the speculative loop from each prompt, so after the prompt
the contexts are the target's own output; ``teacher_forced`` scores one speculative step at
every position of natural text (``speculative.teacher_forced``). Sources: ``heldout`` (the
checkpoint's held-out items) or ``ood`` (the installed hydra and omegaconf sources, never in
training).

Prints a table, writes ``summary.json`` (the counts per prompt and position, conditional and
cumulative acceptance with bootstrap 95% intervals; ``stats``) and ``acceptance.png`` into the
Hydra run directory, and logs to W&B (offline unless ``logger.mode=online``; ``logger=none`` for
no tracker).

``draft``: ``argmax`` (default) or ``sampled`` (each draft drawn from the drafter's softmax at the
temperature, verified by full rejection sampling; needs ``temperature > 0``). ``target_numerics``:
``vendor`` (torch's kernels, default) or ``pinned`` (DESIGN.md §5: batch-invariant). With
``run.check_lossless=true`` (the greedy loop, and ``verify=match`` at temperature > 0, against
the target's own seeded sampling of the prompt) every prompt is also decoded by the target
alone, one token per forward, and ``summary.json`` records ``lossless: {prompts, identical,
diverged}`` (``diverged``: each parting prompt's index and first differing generated token),
against the greedy decode or, under ``verify: match``, the seeded one
(``reporting.summary_keys.lossless_greedy`` / ``lossless_seeded`` read it).

``stop.rule`` / ``stop.threshold`` (``loop/stop_rules.py``): each round verifies only the drafts
1..s on which the rule holds (from the drafter's ``draft_confidence``); ``summary.json`` records the
rule, the verify width per step (``verify_width``: mean and histogram) and the speedup at that
varying width (``speedup.at_width``).

``trace.path=DIR``: replay a trace (DESIGN.md §11; ``python -m glm_mtp.experiments.record``) instead
of running the target: the loop's prompts are the trace's items, the target's answers and hiddens
its record, and only the drafter is loaded (its MTP layer, embedding and head); greedy only.

``batch_size`` (default 1): the loop runs that many prompts together
(``SpeculativeDecoder.generate_batch``: one ``propose_batch`` per round for every live prompt);
greedy, its counts and tokens are those of ``batch_size=1`` (only the timings differ). Batches
need the speculative mode, ``policy=first_row_kept`` and ``draft=argmax``. At ``temperature > 0``
the batched loop draws from the generator in another order, so its samples differ from
``batch_size=1``'s (distributed alike).

The experiment itself is a library, ``experiments.acceptance_job`` (``run``: measure, summarise,
write); this module only parses the config, checks it and calls it.
"""

from __future__ import annotations

import os
from typing import Any

from .acceptance_job.run import run
from .settings.validate import check_acceptance_run


def main() -> None:
    from .settings.entry import hydra_main

    def body(cfg: Any, hc: Any) -> None:
        from omegaconf import open_dict

        if cfg.get("group") is None and hc.mode is not None and hc.mode.name == "MULTIRUN":
            with open_dict(cfg):  # a sweep's runs share a W&B group: its directory's name
                cfg.group = os.path.basename(os.path.normpath(hc.sweep.dir))
        run(cfg, hc.runtime.output_dir)  # a LateFailure is one line, exit 1 (hydra_main)

    hydra_main("config", "python -m glm_mtp.experiments.acceptance", check_acceptance_run, body)


if __name__ == "__main__":
    main()
