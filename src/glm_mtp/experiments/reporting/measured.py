"""Nothing measured is lost: a run writes each prompt's counts to ``measured.jsonl`` in its run
folder as the prompt finishes (one JSON object a line, flushed), before any statistics, so a
failure after the loop (the summary, the speedup model's timings, the plots, the logger) leaves
every count behind; the failure itself is one line naming that file (``LateFailure``).

Each line: ``{"prompt": i, "reached": [...], "accepted": [...], "steps": n, "generated": g}``
(``SpecStats``' counts of prompt ``i``; ``generated``: tokens the loop generated, 0 in teacher
forcing). ``read_measured`` reads them back.
"""

from __future__ import annotations

import json
import os
from typing import Any

MEASURED_FILE = "measured.jsonl"


class LateFailure(RuntimeError):
    """A run that failed after it measured: the message is one line naming the measured file."""


class MeasuredFile:
    """``measured.jsonl`` in ``run_dir``, appended to a prompt at a time.

    Args:
        run_dir: the run's folder (made if missing); ``None`` writes nothing (an in-memory run).
    """

    def __init__(self, run_dir: str | None) -> None:
        self.run_dir = run_dir
        self.path = None if run_dir is None else os.path.join(run_dir, MEASURED_FILE)
        self.count = 0

    def append(self, stats: Any, generated: int) -> None:
        """Prompt ``count``'s counts (a ``SpecStats``) and generated tokens, flushed to disk. The
        file (and the run folder) is made by the first prompt's record: a run refused before it
        measures leaves nothing behind; a rerun in the same folder starts the file afresh."""
        if self.path is not None:
            record = {"prompt": self.count, "reached": list(stats.reached), "accepted": list(stats.accepted),
                      "steps": stats.steps, "generated": generated}
            if not self.count:
                os.makedirs(self.run_dir, exist_ok=True)
            with open(self.path, "a" if self.count else "w") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        self.count += 1

    def late_failure(self, error: BaseException, stage: str) -> LateFailure:
        """The one-line failure of ``stage`` after ``count`` prompts were measured."""
        why = str(error).strip().splitlines()[0] if str(error).strip() else ""
        where = f"in {self.path}" if self.path is not None else "not written (no run folder)"
        return LateFailure(f"{stage} failed after {self.count} prompt(s) were measured ({type(error).__name__}: "
                           f"{why}); their per-prompt counts are {where}")


def read_measured(path: str) -> list[dict[str, Any]]:
    """The records of a ``measured.jsonl``, in prompt order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
