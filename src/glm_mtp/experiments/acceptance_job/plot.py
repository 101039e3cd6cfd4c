"""``acceptance.png``: one run's conditional and cumulative acceptance per draft position."""

from __future__ import annotations

import math
from typing import Any


def plot_acceptance(summary: dict[str, Any], path: str) -> None:
    """Conditional alpha per position (bars) and cumulative P(accepted >= i) (line), each with
    its bootstrap 95% interval; tau in the title.

    Args:
        summary: the run's summary.json.
        path: the PNG written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas, cum = summary["acceptance_per_position"], summary["cumulative"]
    pos = range(1, len(alphas) + 1)

    def err(xs: list[float], cis: list[list[float]]) -> list[list[float]]:
        return [[0 if math.isnan(x) else x - c[0] for x, c in zip(xs, cis)],
                [0 if math.isnan(x) else c[1] - x for x, c in zip(xs, cis)]]

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(pos, [0 if math.isnan(a) else a for a in alphas], yerr=err(alphas, summary["alpha_ci"]), color="tab:blue",
           capsize=3, label="α_i (conditional)")
    ax.errorbar(pos, cum, yerr=err(cum, summary["cumulative_ci"]), fmt="o-", color="tab:orange", capsize=3,
                label="P(accepted ≥ i)")
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance")
    ax.set_xticks(list(pos))
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"{summary['mode']}, {summary['source']}, {summary['policy']}, T={summary['temperature']:g}: τ = "
                 f"{summary['mean_accepted_length']:.2f}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
