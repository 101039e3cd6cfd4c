"""Which jobs of a Hydra sweep finished, failed or never ran, so a report over a sweep says so
instead of printing a table of the survivors as if it were the whole sweep.

A sweep folder (``multirun/<task>/<time>``, conf/hydra/default.yaml) holds ``multirun.yaml`` and
one folder per job, ``<job number>_<its overrides>``, that gets its result file (an acceptance
run's ``summary.json``, a grid job's ``grid.json``) when the job completes. The jobs the sweep
promised are the product of its sweep overrides (``hydra.sweeper.params`` merged with the
command line's, as Hydra's basic sweeper does); a job folder without the result is a failed (or
unfinished) job, a job number without a folder one that never ran.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
from dataclasses import dataclass, field
from typing import Any

SWEEP_FILE = "multirun.yaml"
JOB_DIR = re.compile(r"^(\d+)(_|$)")


@dataclass
class SweepJobs:
    """A sweep's jobs: ``expected`` (None when the folder is not a Hydra sweep), the job folders
    holding a result (``done``), those without one (``failed``) and the job numbers with no
    folder at all (``missing``)."""

    expected: int | None
    done: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.failed and not self.missing

    def problem(self) -> str:
        """One line naming the failed and missing jobs ('' when complete)."""
        parts = []
        if self.failed:
            parts.append(f"{len(self.failed)} job(s) without a result (failed or unfinished): {', '.join(self.failed)}")
        if self.missing:
            parts.append(f"{len(self.missing)} job(s) never ran: number(s) {', '.join(map(str, self.missing))}")
        done = f"{len(self.done)} of {self.expected}" if self.expected is not None else str(len(self.done))
        return f"{done} jobs finished; " + "; ".join(parts) if parts else ""


def expected_jobs(sweep: dict[str, Any]) -> int:
    """How many jobs a sweep's ``multirun.yaml`` (its composed ``hydra`` node) promised."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydra = sweep.get("hydra") or {}
    params = dict((hydra.get("sweeper") or {}).get("params") or {})
    overrides = {f"{k}": f"{k}={v}" for k, v in params.items()}
    parser = OverridesParser.create()
    for text in (hydra.get("overrides") or {}).get("task") or []:
        o = parser.parse_override(text)
        overrides[o.get_key_element()] = text
    n = 1
    for o in parser.parse_overrides(list(overrides.values())):
        if o.is_sweep_override():
            n *= len(list(o.sweep_string_iterator()))
    return n


def sweep_jobs(root: str, result_file: str) -> SweepJobs:
    """The jobs of the sweep folder ``root`` whose results are ``result_file`` files."""
    path = os.path.join(root, SWEEP_FILE)
    expected = None
    if os.path.isfile(path):
        from omegaconf import OmegaConf

        expected = expected_jobs(OmegaConf.to_container(OmegaConf.load(path), resolve=False))  # type: ignore[arg-type]  # to_container's union: a sweep file's YAML is a mapping
    jobs = SweepJobs(expected)
    numbers = set()
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        m = JOB_DIR.match(name)
        if not m or not os.path.isdir(os.path.join(root, name)):
            continue
        numbers.add(int(m.group(1)))
        found = glob.glob(os.path.join(root, name, "**", result_file), recursive=True)
        (jobs.done if found else jobs.failed).append(name)
    if expected is not None:
        jobs.missing = [i for i in range(expected) if i not in numbers]
    return jobs


def refuse_incomplete(ap: argparse.ArgumentParser, root: str, result_file: str, partial: bool) -> str:
    """A report's check of the sweep at ``root`` before it reads anything: with failed or missing
    jobs it exits with status 2 naming them (a table of the survivors would read as the whole
    sweep) unless ``partial``; returns the problem ("" for a complete sweep) for the report to state."""
    incomplete = sweep_jobs(root, result_file).problem()
    if incomplete and not partial:
        ap.exit(2, f"{ap.prog}: error: {root}: {incomplete} (rerun them, or pass --partial)\n")
    return incomplete
