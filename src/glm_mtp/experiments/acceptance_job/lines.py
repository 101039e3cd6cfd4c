"""The lines an acceptance run prints under its table, from its summary: tau and what it counted,
the lossless check, the speedup model's lines, the stop rule's widths, the grammar's, the
recall's."""

from __future__ import annotations

from typing import Any

from ..loop import speedup as spd
from .table import format_table

# How the tau line names a teacher-forced run's text, per source (source=text is the user's text
# files; their name alone once printed "text text").
SOURCE_TEXT = {"heldout": "held-out text", "ood": "out-of-distribution text", "text": "prompts.path's text",
               "jsonl": "prompts.path's prompts"}


def run_lines(summary: dict[str, Any]) -> list[str]:
    """Every line the run prints before it writes its files: the table, then the lines below it."""
    lines = [format_table(summary), tau_line(summary)]
    lossless = summary["lossless"]
    if lossless is not None and lossless["diverged"]:
        lines.append("diverged (prompt, first differing "
                     "token): " + ", ".join(f"({d['prompt']}, {d['token']})" for d in lossless["diverged"]))
    speedup = summary["speedup"]
    lines.append(spd.format_line(speedup, f"predicted speedup at this run's costs ({speedup['costs']}):"))
    lines.append(spd.released_line(speedup["released"], speedup["c"]))
    lines.append(stop_line(summary))
    if summary.get("grammar") is not None:
        lines.append(grammar_line(summary))
    if summary.get("recall") is not None:
        lines.append(recall_line(summary))
    return lines


def tau_line(summary: dict[str, Any]) -> str:
    """``τ = ... tokens per target forward``: what was counted (positions of which text, or tokens
    generated), from how many prompts, how long, the drafting share, and the lossless check."""
    lossless = summary["lossless"]
    what = (f"{summary['counts']['steps']} positions of {SOURCE_TEXT.get(summary['source'], summary['source'])}"
            if summary["mode"] == "teacher_forced" else f"{summary['generated_tokens']} tokens")
    check = ("" if lossless is None else f"; {'greedy' if summary['temperature'] == 0 else 'seeded'} output equals "
                                         f"the target's on {lossless['identical']}/{lossless['prompts']} prompts")
    return (f"τ = {summary['mean_accepted_length']:.3f} tokens per target forward; {what} from {summary['prompts']} "
            f"prompts in {summary['wall_seconds']:.1f}s (drafting {summary['draft_share']:.0%} of the loop)" + check)


def stop_line(summary: dict[str, Any]) -> str:
    """The stop rule, the drafts it verified per step (mean, histogram) and S at that width."""
    width, stop, at, k = summary["verify_width"], summary["stop"], summary["speedup"]["at_width"], summary["num_drafts"]
    return (f"stop.rule={stop['rule']}" + ("" if stop["threshold"] is None else f" threshold={stop['threshold']:g}")
            + f": {width['mean']:.2f} of {k} drafts verified per step (histogram over 0..{k}: {width['histogram']}); "
            f"S at that width = {at['predicted']:.2f} [{at['predicted_ci'][0]:.2f}, {at['predicted_ci'][1]:.2f}]")


def grammar_line(summary: dict[str, Any]) -> str:
    """The printed line of a run under a grammar: its kind, text's sha256 (first 12 digits; per
    prompt: how many prompts had one), how the drafter drafted, forbidden drafts, wasted slots."""
    g = summary["grammar"]
    sha = g["sha256"]
    which = (f"sha256 {sha[:12]}" if isinstance(sha, str)
             else f"per prompt on {sum(x is not None for x in sha)}/{len(sha)} prompts")
    return (f"grammar: {g['kind']} ({which}), drafts {g['drafts']}: forbidden_drafts {summary['forbidden_drafts']}, "
            f"wasted verify slots {summary['wasted_verify_slots']} ({summary['wasted_per_verify']:.3f} per verify)")


def recall_line(summary: dict[str, Any]) -> str:
    """The drafter's selection (glm5_next, reference backend): the recall of its drafted rows
    against the oracle's, the dense attention's entropy, how often the selection was real."""
    recall = summary["recall"]
    return (f"attention={summary['attention']}: recall of the drafted rows median {recall['median']:.4f}, p10 "
            f"{recall['p10']:.4f} (oracle {recall['oracle_median']:.4f}, {recall['oracle_p10']:.4f}; dense entropy / "
            f"log(visible) {recall['entropy_median']:.3f}) ({recall['rows']} rows; selection real in "
            f"{recall['selection_real_share']:.0%}, {recall['mean_attended']:.0f} of {recall['mean_visible']:.0f} "
            "visible rows attended on average)")
