"""Train a small GLM-5-architecture target and its MTP head jointly on the Python stdlib.

    python -m glm_mtp.experiments.train                         # defaults: conf/train.yaml
    python -m glm_mtp.experiments.train out=checkpoints/NAME    # also write the shipped checkpoint

The loss, the expert balancing and the indexer's training are ``experiments.training.train_run``'s
(the job, ``run``); this module only parses the config, checks it and calls it.
"""

from __future__ import annotations

from typing import Any

from .training.train_run import run


def main() -> None:
    from .settings.entry import command_line, hydra_main
    from .settings.validate import check_train

    prog = "python -m glm_mtp.experiments.train"

    def body(cfg: Any, hc: Any) -> None:
        run(cfg, hc.runtime.output_dir, command_line(prog, hc))

    hydra_main("train", prog, check_train, body)


if __name__ == "__main__":
    main()
