"""The acceptance experiment's one job: measure, summarise, write; a failure once a prompt is
measured says where its counts are (``reporting.measured``)."""

from __future__ import annotations

from typing import Any

from ..reporting.measured import MeasuredFile
from .measure import measure
from .summary import summarise
from .write import write


def run(cfg: Any, run_dir: str) -> dict[str, Any]:
    """Run the experiment of ``cfg`` (conf/config.yaml; it has passed
    ``settings.validate.check_acceptance``): measure, summarise, write its files into ``run_dir``.
    Returns the summary. Each prompt's counts are written to ``run_dir`` as it finishes
    (``reporting.measured``); a failure once one is measured is a ``LateFailure`` naming that file.

    Args:
        cfg: the run's config.
        run_dir: the run's folder.
    """
    measured = MeasuredFile(run_dir)
    try:
        m = measure(cfg, measured)
    except Exception as e:
        if not measured.count:
            raise
        raise measured.late_failure(e, "the loop") from e
    try:
        summary = summarise(cfg, m)
        write(cfg, summary, run_dir)
    except Exception as e:
        raise measured.late_failure(e, "the summary") from e
    return summary
