"""The table of a drafter grid replayed from one trace (``experiment=trace_grid``), with what it
saved: the target forwards the recording ran against those the same grid runs live (each job: a
prefill per prompt and a forward per verification, ``summary.json``'s ``target_forwards``).

    python -m glm_mtp.experiments.traces grid-report multirun/trace-grid/<time> [--out FILE]
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Any


def _number(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def _count(x: Any, lo: int = 0) -> bool:
    return not isinstance(x, bool) and isinstance(x, int) and x >= lo


def check_summary(path: str, s: Any) -> dict[str, Any]:
    """One job's summary.json as this table reads it, field by field (a bool is no integer, a
    null no number): ``ValueError`` naming the file and the field."""
    def bad(name: str, rule: str, got: Any) -> ValueError:
        return ValueError(f"{path}: {name} must be {rule}, got {got!r}"[:300])

    if not isinstance(s, dict):
        raise bad("the summary", "a JSON object", type(s).__name__)
    for name, rule, ok in (("index_share", "true or false", lambda v: isinstance(v, bool)),
                           ("weights_dtype", "a string", lambda v: isinstance(v, str)),
                           ("policy", "a string", lambda v: isinstance(v, str)),
                           ("num_drafts", "an integer >= 1", lambda v: _count(v, 1)),
                           ("mean_accepted_length", "a finite number >= 0", lambda v: _number(v) and v >= 0),
                           ("target_forwards", "an integer >= 0", _count)):
        if name not in s or not ok(s[name]):
            raise bad(name, rule, s.get(name, "nothing (missing)"))
    k = s["num_drafts"]
    cumulative = s.get("cumulative")
    if not (isinstance(cumulative, list) and len(cumulative) >= k and all(_number(x) and 0 <= x <= 1
                                                                           for x in cumulative)):
        raise bad("cumulative", f"a list of >= num_drafts={k} rates in [0, 1]", cumulative)
    predicted = (s.get("speedup") or {}).get("predicted") if isinstance(s.get("speedup"), dict) else None
    if not (isinstance(predicted, list) and len(predicted) >= k and all(_number(x) for x in predicted)):
        raise bad("speedup.predicted", f"a list of >= num_drafts={k} finite numbers", predicted)
    trace = s.get("trace")
    if trace is not None:
        total = (trace.get("forwards") or {}).get("total") if isinstance(trace, dict) and isinstance(
            trace.get("forwards"), dict) else None
        if not (isinstance(trace, dict) and isinstance(trace.get("sha256"), str) and _count(total)):
            raise bad("trace", "null or an object with sha256 (a string) and forwards.total (an integer >= 0)", trace)
    return s


def read_grid(sweep_dir: str) -> list[dict[str, Any]]:
    """Every job's summary.json under ``sweep_dir``, each checked (``check_summary``), ordered by
    (index_share, weights_dtype, policy, k). ``ValueError`` naming the folder or the file."""
    if not os.path.isdir(sweep_dir):
        raise ValueError(f"sweep_dir: {sweep_dir} is not a folder")
    rows = []
    for path in sorted(glob.glob(os.path.join(sweep_dir, "*", "summary.json"))):
        try:
            with open(path, "rb") as f:
                rows.append(check_summary(path, json.loads(f.read().decode("utf-8"))))
        except OSError as e:
            raise ValueError(f"{path}: not readable ({e.strerror})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})"[:300]) from None
        except RecursionError:
            raise ValueError(f"{path}: nested too deep to be a summary") from None
    if not rows:
        raise ValueError(f"{sweep_dir}: no job's summary.json under it (run the grid first)")
    return sorted(rows, key=lambda s: (not s["index_share"], s["weights_dtype"], s["policy"], s["num_drafts"]))


def check_report_out(out: str | None, sweep_dir: str) -> None:
    """``--out`` (the table's Markdown file): a new file in a writable folder; an existing path
    (another file, a summary of the sweep) is never overwritten. ``ValueError`` naming ``--out``."""
    from ..settings.validate import unwritable_dir

    if out is None:
        return
    if not out or os.path.lexists(out):
        raise ValueError(f"--out: {out!r} exists (nothing is overwritten): choose a new file")
    why = unwritable_dir(os.path.dirname(os.path.abspath(out)))
    if why is not None:
        raise ValueError(f"--out must be in a writable folder: {why}")


def forwards(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The grid's target forwards: ``live`` (what the jobs asked of the target, summed),
    ``recorded`` (the traces' recordings, each trace counted once; 0 for a live grid)."""
    traces = {s["trace"]["sha256"]: s["trace"] for s in rows if s.get("trace")}
    recorded = sum(t["forwards"]["total"] for t in traces.values())
    live = sum(s["target_forwards"] for s in rows)
    return {"jobs": len(rows), "live": live, "recorded": recorded, "traces": len(traces),
            "ratio": live / recorded if recorded else None}


def format_pivot(rows: list[dict[str, Any]]) -> str:
    """τ per k (columns) for each drafter configuration (rows: index sharing, weights, policy)."""
    ks = sorted({s["num_drafts"] for s in rows})
    cells: dict[tuple[Any, ...], dict[int, float]] = {}
    for s in rows:
        cells.setdefault((s["index_share"], s["weights_dtype"], s["policy"]), {})[s["num_drafts"]] = \
            s["mean_accepted_length"]
    lines = ["| index share | weights | policy | " + " | ".join(f"τ (k={k})" for k in ks) + " |",
             "|---|---|---|" + "---|" * len(ks)]
    for (share, weights, policy), tau in cells.items():
        lines.append(f"| {'on' if share else 'off'} | {weights} | {policy} | "
                     + " | ".join(f"{tau[k]:.3f}" if k in tau else "—" for k in ks) + " |")
    return "\n".join(lines)


def format_grid(rows: list[dict[str, Any]]) -> str:
    """A Markdown table (one row per job: its drafter keys, tau, P(acc >= k), the predicted S(k)
    at the run's costs) and the forwards line."""
    lines = ["| index share | weights | policy | k | τ | P(acc ≥ k) | S(k) | target forwards (live) |",
             "|---|---|---|---|---|---|---|---|"]
    for s in rows:
        k = s["num_drafts"]
        lines.append(f"| {'on' if s['index_share'] else 'off'} | {s['weights_dtype']} | {s['policy']} | {k} | "
                     f"{s['mean_accepted_length']:.3f} | {s['cumulative'][k - 1]:.3f} | "
                     f"{s['speedup']['predicted'][k - 1]:.2f} | {s['target_forwards']} |")
    f = forwards(rows)
    if f["recorded"]:
        lines.append(f"\n{f['jobs']} jobs from {f['traces']} trace(s): the target ran {f['recorded']} forwards to "
                     f"record; the same grid run live runs {f['live']} ({f['ratio']:.1f}x).")
    else:
        lines.append(f"\n{f['jobs']} live jobs: the target ran {f['live']} forwards.")
    return "\n".join(lines)
