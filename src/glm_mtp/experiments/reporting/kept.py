"""Nothing measured is lost, nothing half written looks complete (issue 49 item 7): the helpers
every command writes its results with.

- ``RecordLog``: a JSON-lines file a command appends each measured record to as it is measured
  (flushed and fsynced), so a failure later (the next measurement, the summary, a plot, the
  logger) leaves every record before it on disk. The acceptance run's ``measured.jsonl``
  (``reporting.measured``) is the same rule for its per-prompt counts.
- ``write_text`` / ``write_json`` / ``replaced``: a result file is written under a temporary
  name in its folder and renamed over its own name only once whole (``os.replace`` is atomic on
  one filesystem), so a crash or a failing write leaves no truncated ``summary.json`` that reads
  as a finished run: either the old file, the new one, or none.
- ``late_failure(stage, error, kept)``: the one-line error of a command that failed after it
  measured, naming what it kept (a ``measured.LateFailure``; the entry points print it as one
  line and exit 1).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

from .measured import LateFailure


def temporary_name(path: str) -> str:
    """A name beside ``path`` for its content while it is written: the same folder (so the rename
    stays on one filesystem) and the same extension (matplotlib picks the format from it)."""
    folder, name = os.path.split(path)
    root, ext = os.path.splitext(name)
    return os.path.join(folder, f".{root}.partial-{os.getpid()}{ext}")


@contextlib.contextmanager
def replaced(path: str) -> Iterator[str]:
    """Yield a temporary path to write ``path``'s content into; on success it is renamed to
    ``path``, on any exception removed (``path`` is left as it was) and the exception raised."""
    tmp = temporary_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_text(path: str, text: str) -> None:
    """``text`` into ``path``, whole or not at all (``replaced``), fsynced before the rename."""
    with replaced(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def write_json(path: str, obj: Any, indent: int | None = 1) -> None:
    """``obj`` as JSON into ``path``, whole or not at all. The text is made before the file is
    opened, so a value JSON cannot hold fails with nothing written."""
    write_text(path, json.dumps(obj, indent=indent))


class RecordLog:
    """A JSON-lines file appended a record at a time, each flushed to disk before the next
    measurement starts.

    Args:
        path: the file (its folder is made by the first record); ``None`` writes nothing.
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.count = 0

    def append(self, record: dict[str, Any]) -> None:
        """Write ``record`` as one line; the first record starts the file afresh (a rerun into the
        same folder does not mix its records with an earlier run's)."""
        if self.path is not None:
            line = json.dumps(record) + "\n"
            if not self.count:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "a" if self.count else "w") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        self.count += 1


def read_records(path: str) -> list[dict[str, Any]]:
    """The records of a ``RecordLog`` file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def late_failure(stage: str, error: BaseException, kept: list[str | None]) -> LateFailure:
    """The one-line failure of ``stage`` after the command measured: the error's type and first
    line, then the files that hold what it measured (``kept``: those that exist; None skipped)."""
    why = str(error).strip().splitlines()[0] if str(error).strip() else ""
    there = [k for k in kept if k is not None and os.path.exists(k)]
    where = ("what it measured is in " + ", ".join(there)) if there else "nothing it measured was written"
    return LateFailure(f"{stage} failed ({type(error).__name__}: {why}); {where}")


@contextlib.contextmanager
def keeping(stage: str, log: RecordLog, unit: str = "record(s)", also: list[str | None] | None = None
            ) -> Iterator[None]:
    """The measuring ``stage``, appending to ``log``: a failure once ``log`` holds a record is one
    ``LateFailure`` naming ``log``'s file (and ``also``, those that exist); a failure before the
    first record measured nothing and is raised as it is."""
    try:
        yield
    except Exception as e:
        if not log.count:
            raise
        raise late_failure(f"{stage}, after {log.count} {unit}", e, [*(also or []), log.path]) from e
