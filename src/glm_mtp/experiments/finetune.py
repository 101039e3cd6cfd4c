"""Fine-tune the MTP head from a trace and judge it by replay (DESIGN.md §13).

    python -m glm_mtp.experiments.finetune trace.path=TRACE finetune.out=DIR
    python -m glm_mtp.experiments.finetune model=shipped trace.path=TRACE finetune.out=DIR finetune.depth=3
    python -m glm_mtp.experiments.finetune model=hf model.path=CKPT trace.path=TRACE finetune.out=DIR

The library is ``experiments/training/finetune_*.py``; the settings are conf/finetune.yaml.
"""

from __future__ import annotations

from typing import Any


def run_keeping(cfg: Any, run_dir: str, checked: Any, command: str) -> Any:
    """``training.finetune_run.run``, with a failure after the training as one ``LateFailure``
    naming what it kept: the losses (``<run_dir>/finetune_loss.json``) and the tuned checkpoint
    in ``finetune.out`` (its ``summary.json``, written last, is there only when the run finished)."""
    import os

    from .reporting.kept import late_failure
    from .training.finetune_run import LOSS_FILE, run

    try:
        return run(cfg, run_dir, checked, command)
    except Exception as e:
        losses = os.path.join(run_dir, LOSS_FILE)
        if not os.path.exists(losses):  # failed before it trained: nothing measured
            raise
        raise late_failure("the fine-tuning run, after its training", e, [losses, cfg.finetune.out]) from e


def main() -> None:
    from .settings.entry import command_line, hydra_main
    from .training.finetune_checks import check_finetune

    prog = "python -m glm_mtp.experiments.finetune"

    def check(cfg) -> None:
        check_finetune(cfg)

    def body(cfg, hc) -> None:
        run_keeping(cfg, hc.runtime.output_dir, check_finetune(cfg), command_line(prog, hc))

    hydra_main("finetune", prog, check, body)


if __name__ == "__main__":
    main()
