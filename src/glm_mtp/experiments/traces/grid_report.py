"""The table of a drafter grid replayed from one trace (``experiment=trace_grid``), with what it
saved: the target forwards the recording ran against those the same grid runs live (each job: a
prefill per prompt and a forward per verification, ``summary.json``'s ``target_forwards``).

    python -m glm_mtp.experiments.traces grid-report multirun/trace-grid/<time> [--out FILE]
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any


def read_grid(sweep_dir: str) -> list[dict[str, Any]]:
    """Every job's summary.json under ``sweep_dir``, ordered by (index_share, weights_dtype, policy, k)."""
    rows = []
    for path in glob.glob(os.path.join(sweep_dir, "*", "summary.json")):
        with open(path) as f:
            rows.append(json.load(f))
    if not rows:
        raise ValueError(f"{sweep_dir}: no job's summary.json under it (run the grid first)")
    return sorted(rows, key=lambda s: (not s["index_share"], s["weights_dtype"], s["policy"], s["num_drafts"]))


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
