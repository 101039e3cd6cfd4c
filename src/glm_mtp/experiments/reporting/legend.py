"""What the acceptance columns of a table count, said under every table that shows them (the
acceptance run's own, ``experiments.acceptance_job.table``, and the sweep report's,
``experiments/report.py``).

Under a stop rule the two differ most: a rule verifies only the drafts it trusts, so alpha_i may
read 1.000 (every verified draft i was accepted) beside a small P(acc >= i) (few rounds verified
i drafts at all)."""

from __future__ import annotations

# alpha_i = accepted / reached at draft i (reached: the rounds that verified draft i)
ALPHA_LEGEND = ("α_i: of the rounds that verified draft i, the share that accepted it (a stop rule verifies only "
                "confident drafts)")
# P(acc >= i) = rounds that accepted at least i drafts / all rounds
CUMULATIVE_LEGEND = ("P(acc ≥ i): of all rounds, the share that accepted at least i drafts (unverified drafts count "
                     "as not accepted)")
ACCEPTANCE_LEGEND = f"{ALPHA_LEGEND}; {CUMULATIVE_LEGEND}"
# Why the two may disagree in one row (said where both columns are shown).
STOP_RULE_NOTE = "under a stop rule they differ: α_i may read 1.000 beside a small P(acc ≥ i)"


def acceptance_legend(view: str = "both") -> str:
    """The legend of the acceptance columns a table shows: ``view`` ``conditional`` (α_i),
    ``cumulative`` (P(acc ≥ i)) or ``both`` (both, and why they differ under a stop rule)."""
    if view == "conditional":
        return ALPHA_LEGEND
    if view == "cumulative":
        return CUMULATIVE_LEGEND
    if view == "both":
        return f"{ACCEPTANCE_LEGEND}; {STOP_RULE_NOTE}"
    raise ValueError(f"view must be 'conditional', 'cumulative' or 'both', got {view!r}")
