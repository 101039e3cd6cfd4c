"""Lossless greedy speculation in bf16: the target with pinned numerics (``target_numerics=pinned``)
computes every row as if alone, so a (k+1)-token verification gives the bytes of k+1 one-token
decodes, and greedy speculative decoding is the target's own greedy decode token for token."""

import json

import pytest
import torch
from hydra import compose, initialize_config_module

from glm_mtp.reference import ReferenceProposer
from glm_mtp.reference.bytes import bits
from glm_mtp.reference.numerics import PINNED, VENDOR
from glm_mtp.experiments.acceptance_job import measure as measuring
from glm_mtp.experiments.acceptance_job.run import run as run_acceptance
from glm_mtp.experiments.targets.checkpoint import random_model
from glm_mtp.experiments.loop.speculative import SpeculativeDecoder, target_decode
from glm_mtp.experiments.targets.target import Target
from glm_mtp.experiments.reporting.summary_keys import lossless_greedy, lossless_seeded


def config(overrides):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.fixture(scope="module")
def tiny_bf16():
    return random_model("tiny", seed=5, dtype=torch.bfloat16)


def test_target_numerics_by_name(tiny_bf16):
    assert Target(tiny_bf16.target, 64).ops is VENDOR  # the default: torch's kernels, as training
    assert Target(tiny_bf16.target, 64, numerics="pinned").ops is PINNED
    with pytest.raises(ValueError, match="numerics"):
        Target(tiny_bf16.target, 64, numerics="fast")


def test_pinned_verify_equals_one_token_decodes_in_bf16(tiny_bf16, random_prompt):
    """A 5-token forward after a prompt gives, row for row, the bytes of five 1-token forwards."""
    tg = Target(tiny_bf16.target, 64, numerics="pinned")
    V = tg.config.vocab_size
    prompt, tail = torch.tensor(random_prompt(V, 9, 1)), torch.tensor(random_prompt(V, 5, 2))
    a, b = tg.alloc_state(), tg.alloc_state()
    tg.forward(prompt, a)
    tg.forward(prompt, b)
    batch = tg.forward(tail, a)
    rows = [tg.forward(tail[i : i + 1], b) for i in range(5)]
    assert torch.equal(bits(batch.logits), bits(torch.cat([r.logits for r in rows])))
    assert torch.equal(bits(batch.hidden), bits(torch.cat([r.hidden for r in rows])))


@pytest.mark.parametrize("k", [2, 4])
def test_pinned_greedy_speculation_is_the_greedy_decode_in_bf16(tiny_bf16, random_prompt, k):
    tg = Target(tiny_bf16.target, 96, numerics="pinned")
    prompt = random_prompt(tg.config.vocab_size, 10, k)
    res = SpeculativeDecoder(tg, ReferenceProposer(tiny_bf16.mtp, 96), k).generate(prompt, 24)
    assert res.tokens == target_decode(tg, prompt, 24)
    assert res.stats.steps < 24  # drafts were accepted: verifications of several rows were compared


def test_acceptance_records_lossless_per_prompt(tmp_path, monkeypatch):
    cfg = config(["model=tiny_random", "model.dtype=bfloat16", "experiment=smoke", "logger=none",
                  "target_numerics=pinned"])
    s = run_acceptance(cfg, str(tmp_path / "pinned"))
    assert s["lossless"] == {"prompts": 2, "identical": 2, "diverged": []}
    assert s["target_numerics"] == "pinned" and s["draft"] == "argmax" and s["dtype"] == "bfloat16"
    # A target decode that parts at token 3 of the second prompt: recorded as such (the check can fail).
    real = measuring.target_decode
    calls = []

    def parting(target, prompt, n):
        out = real(target, prompt, n)
        calls.append(1)
        if len(calls) == 2:
            out[3] = (out[3] + 1) % target.config.vocab_size
        return out

    monkeypatch.setattr(measuring, "target_decode", parting)
    s = run_acceptance(cfg, str(tmp_path / "parted"))
    assert s["lossless"] == {"prompts": 2, "identical": 1, "diverged": [{"prompt": 1, "token": 3}]}
    assert lossless_greedy(s) is False and s["lossless"]["diverged"]
    on_disk = json.loads((tmp_path / "parted" / "summary.json").read_text())
    assert on_disk["lossless"] == s["lossless"]


def test_sampled_drafts_through_the_entry_point(tmp_path):
    cfg = config(["model=tiny_random", "experiment=smoke", "logger=none", "temperature=1", "draft=sampled",
                  "backend=optimized"])
    s = run_acceptance(cfg, str(tmp_path))
    assert s["draft"] == "sampled" and s["lossless"] is None and s["counts"]["steps"] > 0


def test_match_runs_check_lossless_against_the_seeded_decode(tmp_path, monkeypatch):
    """verify=match at T = 1, top_p = 0.9 through the entry point (sampled drafts; argmax drafts
    and the loop's own checks are test_speculative's): each prompt's output equals the target's
    own seeded sampling of it; a seeded decode that parts is recorded as parting."""
    base = ["model=tiny_random", "experiment=smoke", "logger=none", "target_numerics=pinned", "temperature=1",
            "top_p=0.9", "verify=match", "run.check_lossless=true", "speedup.costs=glm5"]
    s = run_acceptance(config([*base, "draft=sampled"]), str(tmp_path / "sampled"))
    assert s["lossless"] == {"prompts": 2, "identical": 2, "diverged": []}
    assert lossless_seeded(s) is True and lossless_greedy(s) is None
    assert (s["verify"], s["temperature"], s["top_p"], s["top_k"]) == ("match", 1.0, 0.9, None)
    real = measuring.target_decode

    def parting(target, prompt, n, seeded=None):
        assert seeded is not None and seeded.top_p == 0.9  # the run's sampler, not a greedy decode
        out = real(target, prompt, n, seeded=seeded)
        out[2] = (out[2] + 1) % target.config.vocab_size
        return out

    monkeypatch.setattr(measuring, "target_decode", parting)
    s = run_acceptance(config(base), str(tmp_path / "parted"))
    assert s["lossless"]["identical"] == 0 and lossless_seeded(s) is False
