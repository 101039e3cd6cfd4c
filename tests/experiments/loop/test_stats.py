"""Bootstrap intervals over prompts: they cover the truth when steps within a prompt are
correlated, where a binomial interval over pooled steps does not; paired differences cancel what
prompts share."""

import math

import numpy as np
import pytest

from glm_mtp.experiments.loop.stats import bootstrap, paired_difference, point_stats


def synthetic_counts(rng, prompts=24, steps=40, k=2, a=2.0, b=1.5):
    """Each prompt has its own acceptance probability (Beta(a, b)); steps are Bernoulli chains."""
    p = rng.beta(a, b, size=prompts)
    reached, accepted = np.zeros((prompts, k), int), np.zeros((prompts, k), int)
    for j in range(prompts):
        for _ in range(steps):
            for i in range(k):
                reached[j, i] += 1
                if rng.random() >= p[j]:
                    break
                accepted[j, i] += 1
    return {"reached": reached.tolist(), "accepted": accepted.tolist(), "steps": [steps] * prompts}


def test_prompt_bootstrap_covers_and_a_pooled_binomial_does_not():
    rng = np.random.default_rng(0)
    truth = 2.0 / 3.5  # E[p] of Beta(2, 1.5): alpha_1 over a fresh draw of prompts
    boot_hits = binom_hits = 0
    trials = 120
    for t in range(trials):
        c = synthetic_counts(rng)
        lo, hi = bootstrap(c, replicates=400, seed=t)["alpha_ci"][0]
        boot_hits += lo <= truth <= hi
        n = sum(r[0] for r in c["reached"])
        x = sum(a[0] for a in c["accepted"]) / n
        half = 1.96 * math.sqrt(x * (1 - x) / n)  # treats the steps as independent
        binom_hits += x - half <= truth <= x + half
    assert boot_hits / trials > 0.85
    assert binom_hits / trials < 0.7  # the broken variant under-covers


def test_intervals_bracket_the_point_and_are_reproducible():
    c = synthetic_counts(np.random.default_rng(1), k=3)
    ci, again = bootstrap(c, seed=3), bootstrap(c, seed=3)
    assert ci == again
    pt = point_stats(np.array(c["reached"]), np.array(c["accepted"]), np.array(c["steps"]))
    for x, (lo, hi) in zip(pt["alpha"], ci["alpha_ci"]):
        assert lo <= x <= hi and lo < hi
    for x, (lo, hi) in zip(pt["cumulative"], ci["cumulative_ci"]):
        assert lo <= x <= hi
    assert ci["tau_ci"][0] <= pt["tau"] <= ci["tau_ci"][1]
    # cumulative P(accepted >= i) is the product of the conditional alphas
    assert pt["cumulative"][2] == pytest.approx(pt["alpha"][0] * pt["alpha"][1] * pt["alpha"][2])


def test_paired_difference():
    rng = np.random.default_rng(2)
    c = synthetic_counts(rng, k=2)
    same = paired_difference(c, c)
    assert same["alpha"] == [0.0, 0.0] and same["alpha_ci"] == [[0.0, 0.0], [0.0, 0.0]]
    # B accepts one draft fewer than A on every prompt that accepted any: a small, consistent
    # shift the paired interval resolves while the unpaired intervals overlap.
    worse = {"reached": c["reached"], "steps": c["steps"],
             "accepted": [[max(0, a[0] - 1), min(a[1], max(0, a[0] - 1))] for a in c["accepted"]]}
    d = paired_difference(c, worse)
    assert d["alpha_ci"][0][0] > 0
    ua, ub = bootstrap(c)["alpha_ci"][0], bootstrap(worse)["alpha_ci"][0]
    assert ub[1] > ua[0]  # the separate intervals overlap
    with pytest.raises(ValueError, match="share their prompts"):
        paired_difference(c, {k: v[:-1] for k, v in c.items()})


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="counts"):
        bootstrap({"reached": [[1, 2]], "accepted": [[1]], "steps": [3]})
    with pytest.raises(ValueError, match="counts"):
        bootstrap({"reached": [], "accepted": [], "steps": []})
