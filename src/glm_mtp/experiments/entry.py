"""The Hydra entry points' one shape: compose ``conf/<config_name>.yaml`` with the command line,
refuse a bad config before any work (one line, exit 2, the run directory left clean), then run.

``python -m glm_mtp.experiments.acceptance``, ``.train`` and ``.grid`` each call ``hydra_main``.
Hydra is imported here, when an entry point starts, never by importing the package.
"""

from __future__ import annotations

from typing import Any, Callable

from .validate import exit_on_bad_config


def hydra_main(config_name: str, prog: str, check: Callable[[Any], None], body: Callable[[Any, Any], None]) -> None:
    """Run ``body(cfg, hydra_config)`` as the Hydra app of ``conf/<config_name>.yaml`` (``prog``
    names it in messages), after ``check(cfg)``; a ``ValueError`` from ``check`` exits 2."""
    import hydra
    from hydra.core.hydra_config import HydraConfig

    @hydra.main(version_base="1.3", config_path="pkg://glm_mtp.conf", config_name=config_name)
    def _main(cfg: Any) -> None:
        hc = HydraConfig.get()
        exit_on_bad_config(check, cfg, hc.runtime.output_dir, prog)
        body(cfg, hc)

    _main()


def command_line(prog: str, hc: Any) -> str:
    """The command that made this run: ``prog`` and its overrides, as a run's files record it."""
    return " ".join([prog, *hc.overrides.task])
