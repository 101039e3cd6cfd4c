"""The hindsight oracle of stop rules: per round, verify exactly the drafts the target accepts.

Given a run that verified all K drafts every round (no stop rule), a round's outcome is ``a``,
the drafts the target accepted. Verifying ``s > a`` drafts commits nothing more and costs more;
verifying ``s < a`` commits ``a - s`` tokens fewer to save ``v(a) - v(s)``, a loss whenever one
more verified token costs less than a token (``v(s + 1) - v(s) < 1 / S``, true of every cost the
package measures or models). So the oracle verifies ``s = a``: it commits what the K-draft run
commits, on the same trajectory, at the least verify width; no rule that decides from the drafter
alone does better, and its S (``speedup.width_speedup``) is the ceiling of the stop-rule sweep.
"""

from __future__ import annotations

from typing import Any, Sequence

from .stop_rules import RoundRecord


def oracle_widths(rounds: Sequence[RoundRecord], num_drafts: int) -> list[int]:
    """Per width s = 0..K, the rounds in which the oracle verifies s drafts (s = accepted).

    Args:
        rounds: one prompt's rounds, each verified at the full width K (a run without a stop rule).
        num_drafts: K.
    """
    widths = [0] * (num_drafts + 1)
    for r in rounds:
        if r.width != num_drafts:
            raise ValueError(f"the oracle reads rounds that verified all {num_drafts} drafts; one verified {r.width} "
                             "(run it on a loop without a stop rule)")
        widths[r.accepted] += 1
    return widths


def oracle_per_prompt(rounds_per_prompt: Sequence[Sequence[RoundRecord]], num_drafts: int) -> dict[str, Any]:
    """``{"committed": [P], "widths": [P x (K + 1)]}`` of the oracle, as
    ``speedup.width_speedup_summary`` reads it: it commits what the K-draft run committed."""
    return {"committed": [sum(r.accepted + 1 for r in rounds) for rounds in rounds_per_prompt],
            "widths": [oracle_widths(rounds, num_drafts) for rounds in rounds_per_prompt]}
