"""Readers of an acceptance ``summary.json`` for facts older summaries stored under keys the
summary no longer writes, so one reader serves both:

- ``lossless_greedy`` (removed: ``lossless`` holds it): True when every prompt's greedy output
  equalled the target's own decode, False when one parted, None when the run did not check;
- ``verify_forwards`` (removed: it equalled ``counts.steps``): the verification forwards;
- ``grammar_drafts`` (removed: ``grammar.drafts`` holds it): how the drafter drafted under a
  grammar, None without one.
"""

from __future__ import annotations

from typing import Any


def lossless_greedy(summary: dict[str, Any]) -> bool | None:
    """Whether the run's greedy output equalled the target's on every prompt (None: not checked,
    or checked against the seeded decode: ``verify: match``)."""
    lossless = summary.get("lossless")
    if lossless is None:
        return summary.get("lossless_greedy")  # an older summary may hold the flag alone
    return None if summary.get("verify") == "match" else not lossless["diverged"]


def lossless_seeded(summary: dict[str, Any]) -> bool | None:
    """Whether a ``verify: match`` run's output equalled the target's own seeded sampling on every
    prompt (None: not checked, or not a match run)."""
    lossless = summary.get("lossless")
    if lossless is None or summary.get("verify") != "match":
        return None
    return not lossless["diverged"]


def verify_forwards(summary: dict[str, Any]) -> int:
    """The run's verification forwards: ``counts.steps`` (older summaries: ``verify_forwards``)."""
    counts = summary.get("counts")
    return int(counts["steps"]) if counts is not None else int(summary["verify_forwards"])


def grammar_drafts(summary: dict[str, Any]) -> str | None:
    """``masked`` | ``unmasked`` under a grammar, None without one."""
    grammar = summary.get("grammar")
    return None if grammar is None else grammar.get("drafts", summary.get("grammar_drafts"))
