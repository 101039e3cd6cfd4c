"""Fine-tune the MTP head from a trace and judge it by replay (DESIGN.md §13).

    python -m glm_mtp.experiments.finetune trace.path=TRACE finetune.out=DIR
    python -m glm_mtp.experiments.finetune model=shipped trace.path=TRACE finetune.out=DIR finetune.depth=3
    python -m glm_mtp.experiments.finetune model=hf model.path=CKPT trace.path=TRACE finetune.out=DIR

The library is ``experiments/training/finetune_*.py``; the settings are conf/finetune.yaml.
"""

from __future__ import annotations

from typing import Any


def main() -> None:
    from .settings.entry import command_line, hydra_main
    from .settings.validate import exit_on_bad_config
    from .training.finetune_checks import check_finetune
    from .training.finetune_run import Prepared, prepare, run_keeping

    prog = "python -m glm_mtp.experiments.finetune"

    def check(cfg: Any) -> None:
        check_finetune(cfg)

    def body(cfg: Any, hc: Any) -> None:
        checked = check_finetune(cfg)
        ready: list[Prepared] = []
        # What reading the trace's shards and the weights, and the forward's agreement with the
        # drafter, refuse is refused as a bad config is: one line, exit 2, nothing written.
        exit_on_bad_config(lambda c: ready.append(prepare(c, checked)), cfg, hc.runtime.output_dir, prog)
        run_keeping(cfg, hc.runtime.output_dir, checked, command_line(prog, hc), ready[0])

    hydra_main("finetune", prog, check, body)


if __name__ == "__main__":
    main()
