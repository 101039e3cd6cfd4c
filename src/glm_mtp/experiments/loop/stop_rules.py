"""Stop rules: how many of a round's drafts the loop verifies, decided from the drafter's
confidence (DESIGN.md §12) before the target runs.

A propose of k drafts also yields, per draft i, ``p_i`` (the pinned softmax's probability of
``d_i``; ``q_i[d_i]`` for sampled drafts) and ``margin_i`` (its logit minus the best other logit).
A rule verifies drafts ``1..s``, ``s`` the longest prefix on which it holds:

- ``none``:    every draft (``s = k``);
- ``prob``:    ``p_i >= t`` for every ``i <= s``;
- ``cumprob``: ``p_1 * .. * p_i >= t`` for every ``i <= s`` (the product in float64, left to right);
- ``margin``:  ``margin_i >= t`` for every ``i <= s``.

A NaN fails every rule. The loop verifies ``[t_m, d_1..d_s]`` and calls ``after_verify(a)`` with
``a <= s``: the drafter's state rules are unchanged. The choice of ``s`` depends on the drafter's
output only, never on the target's, so greedy and rejection-sampled verification of the first s
drafts stay lossless. With ``prob`` or ``cumprob`` at ``t = 0`` every draft is verified (a
probability is never below 0); at ``t > 1`` none is (tau = 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

STOP_RULES = ("none", "prob", "cumprob", "margin")


def check_stop_rule(rule: object, threshold: object, key: str = "stop") -> None:
    """``rule`` one of ``STOP_RULES``; ``threshold`` None for ``none`` and a finite number (not a
    bool) for the others. ``ValueError`` naming ``key.rule`` / ``key.threshold`` and the rule."""
    if rule not in STOP_RULES:
        raise ValueError(f"{key}.rule must be one of {', '.join(STOP_RULES)}; got {rule!r}")
    if rule == "none":
        if threshold is not None:
            raise ValueError(f"{key}.threshold must be null with {key}.rule=none (every draft is verified); got "
                             f"{threshold!r}")
        return
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ValueError(f"{key}.threshold must be a finite number with {key}.rule={rule}; got {threshold!r}")


@dataclass(frozen=True)
class StopRule:
    """A stop rule and its threshold (checked by ``check_stop_rule``).

    Args:
        rule: ``none`` | ``prob`` | ``cumprob`` | ``margin`` (module docstring).
        threshold: t; None for ``none``.
    """

    rule: str = "none"
    threshold: float | None = None

    def __post_init__(self) -> None:
        check_stop_rule(self.rule, self.threshold)

    @property
    def trims(self) -> bool:
        """Whether the rule can verify fewer drafts than were proposed (it needs the confidences)."""
        return self.rule != "none"

    def record(self) -> dict[str, Any]:
        """``{"rule", "threshold"}``, as summary.json stores it."""
        return {"rule": self.rule, "threshold": None if self.threshold is None else float(self.threshold)}


NO_STOP = StopRule()


def stop_rule(cfg: Any) -> StopRule:
    """A run's stop rule from its config (``stop.rule`` / ``stop.threshold``; none without a
    ``stop`` node)."""
    node = cfg.get("stop") or {}
    return StopRule(node.get("rule", "none"), node.get("threshold"))


def verify_width(stop: StopRule, prob: Sequence[float], margin: Sequence[float]) -> int:
    """``s``: the longest prefix of the drafts on which ``stop`` holds (module docstring).

    Args:
        stop: the rule and its threshold.
        prob / margin: per draft, ``p_i`` and ``margin_i`` (host numbers; one per draft proposed).
    """
    k = len(prob)
    if len(margin) != k:
        raise ValueError(f"prob and margin must hold one value per draft: {k} and {len(margin)}")
    if stop.rule == "none":
        return k
    t = float(stop.threshold)  # type: ignore[arg-type]  # threshold is None only for rule none, returned above
    s, product = 0, 1.0
    for p, g in zip(prob, margin):
        product *= float(p)
        value = {"prob": float(p), "cumprob": product, "margin": float(g)}[stop.rule]
        if not value >= t:  # NaN fails
            break
        s += 1
    return s


def read_confidence(proposer: Any, state: object) -> tuple[list[float], list[float]]:
    """The pending propose's ``(prob, margin)`` from ``proposer.draft_confidence(state)``, read
    to the host (one read of the two small device tensors)."""
    prob, margin = proposer.draft_confidence(state)
    return prob.tolist(), margin.tolist()


@dataclass
class RoundRecord:
    """One verification round, as the loop saw it: the drafts' confidences, how many it verified
    (``width``) and how many the target accepted (``accepted <= width``)."""

    prob: list[float]
    margin: list[float]
    width: int
    accepted: int


def round_width(stop: StopRule, proposer: Any, state: object, num_drafts: int,
                read: bool = False) -> tuple[int, list[float], list[float]]:
    """How many of the pending propose's ``num_drafts`` drafts the round verifies, with the
    confidences it read: ``(s, prob, margin)``. A rule that does not trim reads nothing (empty
    lists, unless ``read``: the confidences are recorded) and verifies every draft."""
    if not (stop.trims or read):
        return num_drafts, [], []
    prob, margin = read_confidence(proposer, state)
    if len(prob) != num_drafts:
        raise RuntimeError(f"draft_confidence holds {len(prob)} values for a propose of {num_drafts} drafts")
    return verify_width(stop, prob, margin), prob, margin
