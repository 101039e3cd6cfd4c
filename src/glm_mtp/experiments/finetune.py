"""Fine-tune the MTP head from a trace and judge it by replay (DESIGN.md §13).

    python -m glm_mtp.experiments.finetune trace.path=TRACE finetune.out=DIR
    python -m glm_mtp.experiments.finetune model=shipped trace.path=TRACE finetune.out=DIR finetune.depth=3
    python -m glm_mtp.experiments.finetune model=hf model.path=CKPT trace.path=TRACE finetune.out=DIR

The library is ``experiments/training/finetune_*.py``; the settings are conf/finetune.yaml.
"""

from __future__ import annotations


def main() -> None:
    from .settings.entry import command_line, hydra_main
    from .training.finetune_checks import check_finetune
    from .training.finetune_run import run

    prog = "python -m glm_mtp.experiments.finetune"

    def check(cfg) -> None:
        check_finetune(cfg)

    def body(cfg, hc) -> None:
        run(cfg, hc.runtime.output_dir, check_finetune(cfg), command_line(prog, hc))

    hydra_main("finetune", prog, check, body)


if __name__ == "__main__":
    main()
