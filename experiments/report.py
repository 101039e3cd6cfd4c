"""Aggregate a sweep of acceptance runs into one Markdown table and one plot.

    python -m glm_mtp.experiments.report multirun/acceptance/<date> [--out DIR]

Reads every ``summary.json`` under the directory; writes ``report.md`` and ``report.png`` into
``--out`` (default: the sweep directory) and prints the table.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
from typing import Any


def load_summaries(root: str) -> list[dict[str, Any]]:
    """Every run's summary under ``root``, sorted by temperature, feed, policy, k."""
    runs = []
    for path in sorted(glob.glob(os.path.join(root, "**", "summary.json"), recursive=True)):
        with open(path) as f:
            s = json.load(f)
        s["_dir"] = os.path.relpath(os.path.dirname(path), root)
        runs.append(s)
    if not runs:
        raise FileNotFoundError(f"no summary.json under {root}")
    order = {"first_row_kept": 0, "refeed": 1, "trim_all": 2}
    runs.sort(key=lambda s: (s["backend"], s["temperature"], s["feed_hidden"] != "post_norm", order.get(s["policy"], 9), s["num_drafts"]))
    return runs


def markdown_table(runs: list[dict[str, Any]]) -> str:
    """One row per run: settings, alpha_1..alpha_K (K the largest k), tau."""
    K = max(s["num_drafts"] for s in runs)
    lines = [
        "| backend | temperature | feed | policy | k | " + " | ".join(f"α_{i + 1}" for i in range(K)) + " | τ | tokens | draft share |",
        "|" + "---|" * (5 + K + 3),
    ]
    for s in runs:
        a = s["acceptance_per_position"]
        cells = [("—" if i >= len(a) or a[i] is None or (isinstance(a[i], float) and math.isnan(a[i])) else f"{a[i]:.3f}") for i in range(K)]
        lines.append(f"| {s['backend']} | {s['temperature']:g} | {s['feed_hidden']} | {s['policy']} | {s['num_drafts']} | "
                     + " | ".join(cells) + f" | {s['mean_accepted_length']:.3f} | {s['generated_tokens']} | {s['draft_share']:.2f} |")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """tau against k (left) and alpha per position at the largest k (right), one line per
    (policy, feed, temperature, backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[dict[str, Any]]] = {}
    for s in runs:
        groups.setdefault(f"{s['policy']}, {s['feed_hidden']}, T={s['temperature']:g}, {s['backend']}", []).append(s)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, ss in groups.items():
        ss = sorted(ss, key=lambda s: s["num_drafts"])
        ax1.plot([s["num_drafts"] for s in ss], [s["mean_accepted_length"] for s in ss], "o-", label=label)
        top = ss[-1]
        a = top["acceptance_per_position"]
        ax2.plot(range(1, len(a) + 1), a, "o-", label=f"{label} (k={top['num_drafts']})")
    ax1.set_xlabel("k (drafts per step)")
    ax1.set_ylabel("τ (tokens per target forward)")
    ax1.grid(alpha=0.3)
    ax2.set_xlabel("draft position i")
    ax2.set_ylabel("α_i")
    ax2.set_ylim(0, 1)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    """CLI entry point; returns the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("sweep_dir")
    ap.add_argument("--out", default=None, help="where report.md and report.png go (default: the sweep directory)")
    args = ap.parse_args(argv)
    runs = load_summaries(args.sweep_dir)
    out = args.out or args.sweep_dir
    os.makedirs(out, exist_ok=True)
    table = markdown_table(runs)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(f"# Acceptance sweep: {os.path.abspath(args.sweep_dir)}\n\n{table}\n")
    plot(runs, os.path.join(out, "report.png"))
    print(table)
    return table


if __name__ == "__main__":
    main()
