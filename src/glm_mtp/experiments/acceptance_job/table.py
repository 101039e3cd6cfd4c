"""The run's Markdown table (printed first): acceptance per position, conditional and cumulative,
with bootstrap 95% intervals, tau and the run's settings, under a legend saying what each counts."""

from __future__ import annotations

import math
from typing import Any

from ..reporting.legend import ACCEPTANCE_LEGEND

# What each column counts (the acceptance columns as in report.py's table; weights is this table's own).
TABLE_LEGEND = ACCEPTANCE_LEGEND + "; weights: activations' dtype and the drafter's matrices (plain | fp8)"


def fmt_ci(x: float | None, ci: list[float]) -> str:
    """``0.612 [0.55, 0.67]``: a value and its interval; an em dash where the value is undefined
    (None or NaN: no round reached that draft)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.3f} [{ci[0]:.2f}, {ci[1]:.2f}]"


def format_table(summary: dict[str, Any]) -> str:
    """A Markdown table of one run (``summary``: its summary.json): conditional and cumulative
    acceptance per position with their bootstrap 95% intervals, tau and the run's settings, and
    the legend (``TABLE_LEGEND``) under it."""
    k = summary["num_drafts"]
    head = ("| mode | source | backend | weights | policy | feed | "
            "temperature | k | " + " | ".join(f"α_{i + 1}" for i in range(k)) + " | "
            + " | ".join(f"P(acc ≥ {i + 1})" for i in range(k)) + " | τ | draft share |")
    sep = "|" + "---|" * (8 + 2 * k + 2)
    alphas = " | ".join(fmt_ci(a, c) for a, c in zip(summary["acceptance_per_position"], summary["alpha_ci"]))
    cums = " | ".join(fmt_ci(a, c) for a, c in zip(summary["cumulative"], summary["cumulative_ci"]))
    row = (f"| {summary['mode']} | {summary['source']} | {summary['backend']} | "
           f"{summary.get('dtype', '?')} {summary.get('weights_dtype', 'plain')} | {summary['policy']} | "
           f"{summary['feed_hidden']} | {summary['temperature']:g} | {k} | {alphas} | {cums} | "
           f"{fmt_ci(summary['mean_accepted_length'], summary['tau_ci'])} | {summary['draft_share']:.2f} |")
    return "\n".join([head, sep, row, TABLE_LEGEND])
