"""Stop rules (experiments/loop/stop_rules.py): the verify width from given confidences, the
rules' refusals, the hindsight oracle, calibration bins and the varying-width speedup model."""

import math

import numpy as np
import pytest

from glm_mtp.experiments.loop import speedup as spd
from glm_mtp.experiments.loop.calibration import (
    MARGIN_EDGES, PROB_EDGES, bin_index, calibration, depth_correlation, spearman,
)
from glm_mtp.experiments.loop.oracle import oracle_per_prompt, oracle_widths
from glm_mtp.experiments.loop.stop_rules import RoundRecord, StopRule, check_stop_rule, verify_width
from glm_mtp.experiments.loop.speculative import SpecStats

PROB = [0.9, 0.6, 0.8, 0.3, 0.95]
MARGIN = [3.0, 0.4, math.inf, 1.2, 0.0]


@pytest.mark.parametrize("rule, t, s", [
    ("none", None, 5),
    ("prob", 0.0, 5), ("prob", 0.5, 3), ("prob", 0.6, 3), ("prob", 0.61, 1), ("prob", 0.95, 0), ("prob", 1.5, 0),
    ("cumprob", 0.0, 5), ("cumprob", 0.54, 2), ("cumprob", 0.5, 2), ("cumprob", 0.43, 3), ("cumprob", 0.9, 1),
    ("margin", 0.4, 4), ("margin", 0.41, 1), ("margin", -1.0, 5), ("margin", 3.5, 0), ("margin", 0.0, 5),
])
def test_verify_width_is_the_longest_prefix_on_which_the_rule_holds(rule, t, s):
    assert verify_width(StopRule(rule, t), PROB, MARGIN) == s


def test_cumprob_multiplies_left_to_right_in_float64():
    # 0.6 * 0.9 = 0.54 in exact arithmetic; the float64 product decides the boundary
    product = 0.9 * 0.6
    assert verify_width(StopRule("cumprob", product), PROB, MARGIN) == 2
    assert verify_width(StopRule("cumprob", math.nextafter(product, 1.0)), PROB, MARGIN) == 1


def test_nan_fails_every_rule_and_shapes_must_agree():
    assert verify_width(StopRule("prob", 0.0), [0.9, math.nan, 0.9], [1.0, 1.0, 1.0]) == 1
    assert verify_width(StopRule("margin", -1e30), [0.9, 0.9], [math.nan, 1.0]) == 0
    assert verify_width(StopRule("prob", 0.1), [], []) == 0
    with pytest.raises(ValueError, match="one value per draft"):
        verify_width(StopRule("prob", 0.1), [0.5], [1.0, 2.0])


@pytest.mark.parametrize("rule, t, message", [
    ("prop", 0.5, "stop.rule must be one of none, prob, cumprob, margin"),
    (None, None, "stop.rule must be one of"),
    ("prob", None, "stop.threshold must be a finite number with stop.rule=prob"),
    ("margin", math.nan, "finite number"), ("cumprob", math.inf, "finite number"), ("prob", "0.5", "finite number"),
    ("prob", True, "finite number"), ("none", 0.5, "stop.threshold must be null with stop.rule=none"),
])
def test_bad_rules_are_refused_naming_the_key(rule, t, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        check_stop_rule(rule, t)
    with pytest.raises(ValueError):
        StopRule(rule, t)


def test_spec_stats_count_only_the_verified_drafts():
    st = SpecStats(3)
    st.record(1, 2)  # d1 accepted, d2 rejected, d3 not verified
    st.record(2, 2)  # both verified accepted: d3 never reached
    st.record(0, 0)  # nothing verified: the bonus only
    st.record(3)     # every draft verified and accepted
    assert st.reached == [3, 3, 1] and st.accepted == [3, 2, 1]
    assert st.widths == [1, 0, 2, 1] and st.mean_width == 7 / 4
    assert st.committed == 2 + 3 + 1 + 4 and st.tau == 10 / 4
    with pytest.raises(ValueError, match="a <= width <= k"):
        st.record(2, 1)


def rounds_of(accepted, k=3):
    return [RoundRecord([0.5] * k, [1.0] * k, k, a) for a in accepted]


def test_the_oracle_verifies_exactly_the_accepted_drafts():
    rounds = rounds_of([0, 3, 1, 1, 2])
    assert oracle_widths(rounds, 3) == [1, 2, 1, 1]
    pp = oracle_per_prompt([rounds, rounds_of([3])], 3)
    assert pp == {"committed": [12, 4], "widths": [[1, 2, 1, 1], [0, 0, 0, 1]]}
    with pytest.raises(ValueError, match="verified all 3 drafts"):
        oracle_widths([RoundRecord([0.5] * 3, [1.0] * 3, 2, 1)], 3)


def test_width_speedup_equals_the_fixed_k_model_at_full_width():
    c, v = 0.1, [0.05, 0.12, 0.2]
    tau = [1.7, 2.2, 2.5]
    fixed = spd.predict(tau, c, v)
    steps = 40
    assert spd.width_speedup(tau[2] * steps, [0, 0, 0, steps], c, v) == pytest.approx(fixed[2], rel=1e-12)
    # a mixed width: cost = steps (1 + 3c) + sum n_s v(s), v(0) = 0
    widths = [10, 5, 0, 25]
    expect = 100 / (40 * (1 + 3 * c) + 5 * 0.05 + 25 * 0.2)
    assert spd.width_speedup(100, widths, c, v) == pytest.approx(expect, rel=1e-12)
    # draft steps given: a drafter that stops drafting at the first failed draft
    assert spd.width_speedup(100, widths, c, v, draft_steps=60) == pytest.approx(
        100 / (40 + 60 * c + 5 * 0.05 + 25 * 0.2), rel=1e-12)
    with pytest.raises(ValueError, match="width must be in"):
        spd.verify_cost(4, v)


def test_width_speedup_summary_points_and_intervals():
    pp = {"committed": [30, 50, 20], "widths": [[2, 3, 5, 4], [1, 1, 2, 10], [5, 2, 1, 1]]}
    c, v = 0.05, [0.02, 0.05, 0.1]
    out = spd.width_speedup_summary(pp, c, v, seed=1, replicates=300)
    assert out["width_histogram"] == [8, 6, 8, 15]
    assert out["tau"] == pytest.approx(100 / 37)
    assert out["mean_width"] == pytest.approx((6 + 16 + 45) / 37)
    assert out["predicted"] == pytest.approx(spd.width_speedup(100, [8, 6, 8, 15], c, v))
    for key in ("tau", "predicted", "mean_width"):
        lo, hi = out[f"{key}_ci"]
        assert lo <= out[key] <= hi and lo < hi


def test_bins_and_calibration_counts():
    assert bin_index(np.array([0.0, 0.05, 0.1, 0.999, 1.0, math.nan]), PROB_EDGES).tolist() == [0, 0, 1, 9, 9, -1]
    assert bin_index(np.array([-3.0, 0.0, math.inf]), MARGIN_EDGES).tolist() == [0, 1, 7]
    # prompt 0: two rounds; prompt 1: one round. k = 2.
    r0 = [RoundRecord([0.95, 0.15], [5.0, 0.1], 2, 1), RoundRecord([0.92, 0.85], [9.0, 3.0], 2, 2)]
    r1 = [RoundRecord([0.35, 0.99], [0.3, math.inf], 2, 0)]
    cal = calibration([r0, r1], 2, "prob", PROB_EDGES, replicates=200)
    p1, p2 = cal["per_position"]
    assert p1["reached"][9] == 2 and p1["accepted"][9] == 2 and p1["reached"][3] == 1 and p1["accepted"][3] == 0
    assert p1["mean"][9] == pytest.approx(0.935)
    assert sum(p2["reached"]) == 2 and p2["reached"][1] == 1 and p2["accepted"][1] == 0 and p2["accepted"][8] == 1
    assert cal["all"]["reached"][9] == 2 and sum(cal["all"]["reached"]) == 5
    margin = calibration([r0, r1], 2, "margin", MARGIN_EDGES, replicates=50)
    assert margin["per_position"][1]["reached"][5] == 1  # margin 3.0 in [2, 4)
    assert "ece" not in margin["all"]


def test_ece_and_depth_correlation():
    r = [RoundRecord([0.9], [2.0], 1, 1), RoundRecord([0.9], [2.0], 1, 0), RoundRecord([0.15], [0.1], 1, 0)]
    cal = calibration([r], 1, "prob", PROB_EDGES, replicates=20)
    assert cal["all"]["ece"] == pytest.approx((2 * abs(0.5 - 0.9) + abs(0.0 - 0.15)) / 3)
    assert spearman(np.array([1.0, 2.0, 3.0]), np.array([1.0, 3.0, 9.0])) == pytest.approx(1.0)
    assert spearman(np.array([1.0, 2.0, 3.0]), np.array([3.0, 2.0, 1.0])) == pytest.approx(-1.0)
    assert math.isnan(spearman(np.array([1.0, 1.0]), np.array([0.0, 1.0])))
    dc = depth_correlation([[RoundRecord([0.9, 0.9], [math.inf, 1.0], 2, 2), RoundRecord([0.2, 0.9], [0.1, 1.0], 2, 0),
                             RoundRecord([0.5, 0.1], [1.0, 1.0], 2, 1)]])
    assert dc["rounds"] == 3 and dc["prob_1"] == pytest.approx(1.0) and dc["margin_1"] == pytest.approx(1.0)
