"""The one-step check (glm_mtp.tools.one_step): at a fixed context of the shipped glm5_next toy, both
verifications accept the argmax draft d_1 with probability p(d_1) over seeds, and a match rule
that compared with the target's argmax (or ignored the seed) instead of its seeded sample is caught."""

import math

import pytest
import torch

from glm_mtp.experiments.loop.match_verify import target_samples
from glm_mtp.experiments.loop.sampler import SamplerSettings
from glm_mtp.experiments.settings.windows import build_prompts
from glm_mtp.tools import one_step

SEEDS = range(400)
Z = 4.0  # generous: a correct rule's frequency leaves +-4 standard errors with probability ~6e-5


@pytest.fixture(scope="module")
def context():
    """The first held-out window of 48 tokens, where d_1 is the target's argmax with p(d_1) about 0.26."""
    torch.set_num_threads(1)
    loaded, target, proposer = one_step.load("next_shipped", "pinned")
    window = build_prompts(loaded, 1, 48, 0, "heldout")[0]
    return one_step.fixed_context(target, proposer, window)


def within(accepted: int, n: int, p: float) -> bool:
    """Whether ``accepted / n`` is within Z binomial standard errors of ``p``."""
    return abs(accepted / n - p) <= Z * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("top_p", [None, 0.95])
def test_both_rules_accept_the_argmax_draft_with_its_probability(context, top_p):
    settings = SamplerSettings(1.0, top_p, None, 0)
    p = one_step.exact_acceptance(context, settings)
    assert 0.1 < p["pinned"] < 0.9, p  # a context where a wrong rule (0 or 1) is far from p
    assert abs(p["pinned"] - p["float64"]) < 1e-5  # the two rules' p agree to float32's rounding
    counts = one_step.acceptance_counts(context, settings, SEEDS)
    for rule, k in counts.items():
        assert within(k, len(SEEDS), p["pinned"]), (rule, k, p)


def argmax_samples(out, settings, sha, first, rows):
    """A broken match: the target's argmax instead of its seeded sample."""
    return torch.argmax(out.logits[:rows], dim=-1).tolist()


def seed_blind_samples(out, settings, sha, first, rows):
    """A broken match: the seeded sample, but always keyed by seed 0."""
    return target_samples(out, SamplerSettings(settings.temperature, settings.top_p, settings.top_k, 0), sha,
                          first, rows)


@pytest.mark.parametrize("broken", [argmax_samples, seed_blind_samples])
def test_a_match_rule_without_the_seeded_sample_is_caught(context, broken):
    settings = SamplerSettings(1.0, None, None, 0)
    p = one_step.exact_acceptance(context, settings)["pinned"]
    k = sum(one_step.accepted_once("match", context, settings, s, broken) for s in SEEDS)
    assert not within(k, len(SEEDS), p), (broken.__name__, k, p)


def test_wilson_interval():
    lo, hi = one_step.wilson(5, 10)
    assert abs(lo - 0.236593) < 1e-5 and abs(hi - 0.763407) < 1e-5
    lo, hi = one_step.wilson(0, 20)
    assert lo == 0.0 and 0.15 < hi < 0.17  # Wilson's upper bound at 0 of 20: 0.161
    with pytest.raises(ValueError, match="accepted <= trials"):
        one_step.wilson(3, 2)


@pytest.mark.parametrize("argv, words", [(["--seeds", "0"], "--seeds"), (["--top-p", "1.5"], "top_p"),
                                         (["--temperature", "0"], "temperature"), (["--model", "x"], "--model")])
def test_the_command_refuses_bad_flags(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        one_step.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m glm_mtp.tools.one_step: error: ") and words in err[-1]


def test_the_command_does_not_overwrite_out(tmp_path, capsys):
    out = tmp_path / "r.json"
    out.write_text("kept")
    with pytest.raises(SystemExit) as e:
        one_step.main(["--out", str(out)])
    assert e.value.code == 2 and out.read_text() == "kept"
    assert "--out" in capsys.readouterr().err
