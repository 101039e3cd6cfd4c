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
    names it in messages), after ``check(cfg)``; a ``ValueError`` from ``check`` exits 2. A
    ``LateFailure`` from ``body`` (it failed after it measured, ``reporting.kept``) is one line
    naming what it kept, exit status 1."""
    import hydra
    from hydra.core.hydra_config import HydraConfig

    @hydra.main(version_base="1.3", config_path="pkg://glm_mtp.conf", config_name=config_name)
    def _main(cfg: Any) -> None:
        hc = HydraConfig.get()
        exit_on_bad_config(check, cfg, hc.runtime.output_dir, prog)
        if first_job_of_sweep(hc):  # every later job is checked before the first one works
            exit_on_bad_config(lambda _: check_later_jobs(check, config_name, hc), cfg, hc.runtime.output_dir, prog)
        exit_on_late_failure(prog, lambda: body(cfg, hc))

    _main()


def exit_on_late_failure(prog: str, job: Callable[[], Any]) -> None:
    """Run ``job``; a ``LateFailure`` (it failed after it measured; what it measured is on
    disk) is one line on stderr and exit status 1, not a traceback."""
    import sys

    from ..reporting.measured import LateFailure

    try:
        job()
    except LateFailure as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(1)


def first_job_of_sweep(hc: Any) -> bool:
    """Whether this is job 0 of a Hydra multirun."""
    from hydra.types import RunMode

    return hc.mode == RunMode.MULTIRUN and int(hc.job.num) == 0


def sweep_jobs(hc: Any) -> list[list[str]]:
    """Every job's overrides of this multirun, as Hydra's basic sweeper expands them: the
    config's ``hydra.sweeper.params`` then the command line's overrides (read as ``hydra.main``
    reads them), crossed."""
    import sys

    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (hc.sweeper.get("params") or {}).items()]
    command = get_args_parser().parse_args(sys.argv[1:]).overrides
    overrides = OverridesParser.create().parse_overrides(params + list(command))
    return [list(job) for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def check_later_jobs(check: Callable[[Any], None], config_name: str, hc: Any) -> None:
    """``check`` on the config of every job of the sweep after job 0 (which ``hydra_main`` checked):
    a multirun refuses a bad job before the first one runs, naming its overrides."""
    from hydra import compose

    for num, job in enumerate(sweep_jobs(hc)[1:], start=1):
        try:
            check(compose(config_name, overrides=[o for o in job if not o.startswith("hydra.")]))
        except ValueError as e:
            raise ValueError(f"job {num} of the sweep ({' '.join(job)}): {e}") from None


def command_line(prog: str, hc: Any) -> str:
    """The command that made this run: ``prog`` and its overrides, as a run's files record it."""
    return " ".join([prog, *hc.overrides.task])
