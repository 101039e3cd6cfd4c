"""Tables and a plot of an MTP training grid (``python -m glm_mtp.experiments.grid -m``).

    python -m glm_mtp.experiments.grid_report multirun/grid/<time> [--out DIR]
    python -m glm_mtp.experiments.grid_report --feeds shipped [--prompts 8] [--num-drafts 3]   # one checkpoint's feed
    agreement

Reads every ``grid.json`` under the directory and writes ``grid_report.md`` and
``grid_report.png`` into ``--out`` (default: the directory):

- per variant (unroll depth, distillation share) and evaluation mode: alpha_1..alpha_k
  (conditional) and tau, each with its bootstrap 95% interval over prompts, and the final
  held-out MTP losses of the training;
- paired differences against the first variant (depth 1, no distillation by default): the
  variants share their target and prompts, so each difference's interval comes from resampling
  the prompts jointly (``stats.paired_difference``);
- the feed ablation: the share of teacher-forced positions where draft i is the same token under
  the post-norm and the pre-norm feed.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from typing import Any

from .reporting.kept import late_failure, replaced, write_text
from .reporting.sweep_jobs import refuse_incomplete
from .loop.stats import paired_difference


def load_jobs(root: str) -> list[dict[str, Any]]:
    """Every job's ``grid.json`` under ``root``, sorted by (distill, depth)."""
    jobs = []
    for path in sorted(glob.glob(os.path.join(root, "**", "grid.json"), recursive=True)):
        with open(path) as f:
            g = json.load(f)
        g["_dir"] = os.path.relpath(os.path.dirname(path), root)
        jobs.append(g)
    if not jobs:
        raise FileNotFoundError(f"no grid.json under {root}")
    jobs.sort(key=lambda g: (g["mtp_distill"], g["mtp_depth"]))
    return jobs


def _ci(x: float, ci: list[float], signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    f = "+.3f" if signed else ".3f"
    g = "+.2f" if signed else ".2f"
    return f"{x:{f}} [{ci[0]:{g}}, {ci[1]:{g}}]"


def modes(jobs: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(n for g in jobs for n in g["evals"]))


def acceptance_table(jobs: list[dict[str, Any]]) -> str:
    """One row per (variant, evaluation): alpha_i and tau with intervals, held-out MTP losses."""
    K = max(e["num_drafts"] for g in jobs for e in g["evals"].values())
    lines = ["| depth | distill "
             "| eval | " + " | ".join(f"α_{i + 1}" for i in range(K)) + " | τ | held-out MTP loss by depth | steps |",
             "|" + "---|" * (3 + K + 3)]
    for g in jobs:
        losses = ", ".join(f"{g['final'][f'mtp{d}_loss']:.2f}" for d in range(1, g["mtp_depth"] + 1))
        for name, e in g["evals"].items():
            a = [
                _ci(e["acceptance_per_position"][i], e["alpha_ci"][i]) if i < len(e["acceptance_per_position"]) else "—"
                for i in range(K)
            ]
            lines.append(f"| {g['mtp_depth']} | {g['mtp_distill']:g} | {name} | " + " | ".join(a)
                         + f" | {_ci(e['mean_accepted_length'], e['tau_ci'])} | {losses} | {g['steps']} |")
    return "\n".join(lines)


def paired_table(jobs: list[dict[str, Any]]) -> str:
    """Each variant minus the first, per evaluation, on the same prompts."""
    base = jobs[0]
    K = max(e["num_drafts"] for g in jobs for e in g["evals"].values())
    lines = [f"| variant − depth {base['mtp_depth']}, distill {base['mtp_distill']:g} | eval | "
             + " | ".join(f"Δα_{i + 1}" for i in range(K)) + " | Δτ |", "|" + "---|" * (2 + K + 1)]
    for g in jobs[1:]:
        for name, e in g["evals"].items():
            b = base["evals"].get(name)
            if b is None or b.get("prompts_sha256") != e.get("prompts_sha256"):
                continue
            d = paired_difference(e["counts_per_prompt"], b["counts_per_prompt"])
            cells = [_ci(d["alpha"][i], d["alpha_ci"][i], True) if i < len(d["alpha"]) else "—" for i in range(K)]
            lines.append(f"| depth {g['mtp_depth']}, distill {g['mtp_distill']:g} | {name} | " + " | ".join(cells)
                         + f" | {_ci(d['tau'], d['tau_ci'], True)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def feed_table(jobs: list[dict[str, Any]]) -> str:
    """Share of positions where draft i is the same under both feeds."""
    K = max(g["feed_agreement"]["num_drafts"] for g in jobs)
    lines = ["| depth | "
             "distill | " + " | ".join(f"same draft {i + 1}" for i in range(K)) + " | all k same | positions |",
             "|" + "---|" * (2 + K + 2)]
    for g in jobs:
        fa = g["feed_agreement"]
        lines.append(f"| {g['mtp_depth']} | "
                     f"{g['mtp_distill']:g} | " + " | ".join(f"{x:.3f}" for x in fa["same_per_position"])
                     + f" | {fa['all_same']:.3f} | {fa['positions']} |")
    return "\n".join(lines)


def plot(jobs: list[dict[str, Any]], path: str) -> None:
    """alpha_i with intervals per variant, one panel per evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = modes(jobs)
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        for j, g in enumerate(jobs):
            e = g["evals"].get(name)
            if e is None:
                continue
            a, ci = e["acceptance_per_position"], e["alpha_ci"]
            xs = [i + 1 + (j - len(jobs) / 2) * 0.05 for i in range(len(a))]
            yerr = [[0 if math.isnan(x) else x - c[0] for x, c in zip(a, ci)],
                    [0 if math.isnan(x) else c[1] - x for x, c in zip(a, ci)]]
            ax.errorbar(xs, a, yerr=yerr, fmt="o-", capsize=3,
                        label=f"depth {g['mtp_depth']}, distill {g['mtp_distill']:g}")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("draft position i")
        ax.set_ylabel("α_i (conditional), 95% interval")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def checkpoint_feeds(checkpoint: str, prompts: int, num_drafts: int, prompt_tokens: int = 48,
                     new_tokens: int = 64) -> dict[str, Any]:
    """``loop.feed_agreement.feed_agreement`` of one checkpoint (``shipped`` or a directory) on the first
    ``prompts`` of the acceptance experiment's held-out windows (the same windows as its runs)."""
    import torch

    from .settings.windows import build_prompts
    from .targets.checkpoint import load_checkpoint
    from .loop.feed_agreement import FEEDS, feed_agreement
    from .loop.speculative import make_proposer
    from .targets.target import Target

    torch.set_num_threads(1)
    model = load_checkpoint(None if checkpoint == "shipped" else checkpoint, torch.float32)
    # conf/config.yaml's 32 windows, seed 0
    ws = build_prompts(model, 32, prompt_tokens + new_tokens, 0, "heldout")[:prompts]
    max_seq_len = min(256, model.target.config.max_position_embeddings)
    props = {f: make_proposer("reference", model.mtp, max_seq_len, f) for f in FEEDS}
    return feed_agreement(Target(model.target, max_seq_len), props, ws, prompt_tokens, num_drafts)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(prog="python -m glm_mtp.experiments.grid_report", description=__doc__.split("\n")[0])
    ap.add_argument("grid_dir", nargs="?")
    ap.add_argument("--out", default=None, help="where grid_report.md and grid_report.png go (default: grid_dir)")
    ap.add_argument("--feeds", default=None,
                    help="instead: the feed agreement of one checkpoint (shipped or a directory)")
    ap.add_argument("--prompts", type=int, default=8,
                    help="--feeds: held-out windows (of the acceptance experiment's 32)")
    ap.add_argument("--num-drafts", type=int, default=3)
    ap.add_argument("--partial", action="store_true",
                    help="report a sweep with failed or missing jobs anyway (they are listed first)")
    args = ap.parse_args(argv)
    # Each mode's flags, refused in the other (they would be dropped): --feeds prints its line and
    # writes nothing; a grid report reads its jobs' own prompts and k.
    mine, theirs = (("--feeds", ("grid_dir", "out", "partial")) if args.feeds
                    else ("a grid report", ("prompts", "num_drafts")))
    for name in theirs:
        value = getattr(args, name)
        if value != ap.get_default(name):
            flag = name if name == "grid_dir" else "--" + name.replace("_", "-")
            ap.error(f"{flag} {value}: {mine} does not read it (--feeds CHECKPOINT reads --prompts and --num-drafts; "
                     "a grid report reads grid_dir, --out and --partial)")
    if args.feeds and args.feeds != "shipped":
        from .targets.checkpoint import check_checkpoint_loads

        try:
            check_checkpoint_loads("--feeds", args.feeds, "float32", package_target=True)
        except ValueError as e:
            ap.error(str(e))
    if args.feeds:
        fa = checkpoint_feeds(args.feeds, args.prompts, args.num_drafts)
        text = (f"{args.feeds}: draft i the same under both "
                "feeds at " + ", ".join(f"{x:.3f}" for x in fa["same_per_position"])
                + f" of {fa['positions']} teacher-forced positions; all {args.num_drafts} the same at "
                  f"{fa['all_same']:.3f}")
        print(text)
        return text
    if not args.grid_dir:
        ap.error("grid_dir is required (or --feeds CHECKPOINT)")
    if not os.path.isdir(args.grid_dir):
        ap.error(f"grid_dir: {args.grid_dir} is not a directory")
    incomplete = refuse_incomplete(ap, args.grid_dir, "grid.json", args.partial)
    try:
        jobs = load_jobs(args.grid_dir)
    except FileNotFoundError as e:
        ap.error(str(e))
    out = args.out or args.grid_dir
    os.makedirs(out, exist_ok=True)
    g0 = jobs[0]
    e0 = next(iter(g0["evals"].values()))
    text = (f"{len(jobs)} variants; training: {g0['steps']} steps of {g0['batch_size']} x {g0['seq_len']} tokens "
            f"from base {g0['base']}; evaluation: k = {e0['num_drafts']}, {e0['prompts']} held-out prompts, 95% "
            "bootstrap intervals over prompts.\n\n"
            + acceptance_table(jobs))
    if incomplete:  # --partial: say so before any table
        text = f"**Incomplete sweep:** {incomplete}.\n\n" + text
    pairs = paired_table(jobs)
    if pairs:
        text += "\n\nPaired differences (same target, same prompts):\n\n" + pairs
    text += (
        "\n\nFeed ablation (teacher-forced positions; draft 1 reads the target's hidden under both feeds):\n\n"
        + feed_table(jobs)
    )
    minutes = sum(g["train_minutes"] for g in jobs), sum(g["eval_minutes"] for g in jobs)
    text += f"\n\nWall time: {minutes[0]:.1f} min training, {minutes[1]:.1f} min evaluation (all jobs)."
    md, png = os.path.join(out, "grid_report.md"), os.path.join(out, "grid_report.png")
    try:  # each file whole or not at all (reporting.kept): the table first, then the plot
        write_text(md, f"# MTP training grid: {os.path.abspath(args.grid_dir)}\n\n{text}\n")
        with replaced(png) as tmp:
            plot(jobs, tmp)
    except Exception as e:
        print(text)
        print(f"{ap.prog}: error: {late_failure('writing the report', e, [md])}", file=sys.stderr)
        sys.exit(1)
    print(text)
    return text


if __name__ == "__main__":
    main()
