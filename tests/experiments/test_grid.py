"""The MTP training grid: a head trained on a frozen base, the feed ablation's draft agreement,
one grid job end to end and its report."""

import copy
import hashlib
import json

import pytest
import torch
from hydra import compose, initialize_config_module

from glm_mtp.experiments import grid, grid_report
from glm_mtp.experiments.loop.feed_agreement import FEEDS, feed_agreement
from glm_mtp.experiments.training import train_run as train
from glm_mtp.experiments.targets.checkpoint import random_model, shipped_checkpoint
from glm_mtp.experiments.loop.speculative import make_proposer
from glm_mtp.experiments.targets.target import Target, TargetWeights
from glm_mtp.reference import MtpWeights


def config(name, overrides=()):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose(name, overrides=list(overrides))


def windows(vocab, n, length, seed):
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()


def test_feed_agreement_counts_what_differs(tiny64):
    target = Target(tiny64.target, 64)
    ws = windows(tiny64.target.config.vocab_size, 2, 14, 5)
    same = {f: make_proposer("reference", tiny64.mtp, 64, "post_norm") for f in FEEDS}
    a = feed_agreement(target, same, ws, 8, 3)
    assert a["same_per_position"] == [1.0, 1.0, 1.0] and a["all_same"] == 1.0 and a["positions"] == 12
    assert a["differing_per_prompt"] == [0, 0]
    feeds = {f: make_proposer("reference", tiny64.mtp, 64, f) for f in FEEDS}
    b = feed_agreement(target, feeds, ws, 8, 3)
    assert b["same_per_position"][0] == 1.0  # draft 1 reads the target's hidden under both feeds
    # The comparison sees a different drafter: another head's first drafts differ.
    other = random_model("tiny", seed=11, dtype=torch.float64).mtp
    other.embed_tokens, other.lm_head = tiny64.mtp.embed_tokens, tiny64.mtp.lm_head
    mixed = {"post_norm": feeds["post_norm"], "pre_norm": make_proposer("reference", other, 64, "post_norm")}
    c = feed_agreement(target, mixed, ws, 8, 3)
    assert c["same_per_position"][0] < 1.0 and sum(c["differing_per_prompt"]) > 0


def test_a_head_trained_on_a_frozen_base(tmp_path):
    out = tmp_path / "ckpt"
    cfg = config("train",
                 ["logger=none", f"out={out}", "train.base=shipped", "tokenizer.limit_items=4", "train.steps=2",
                  "train.batch_size=2", "train.seq_len=16", "train.eval_every=10", "train.eval_windows=1",
                  "train.log_every=1", "train.mtp_depth=2", "train.mtp_distill=0.5", "train.warmup=1"])
    final = train.run(cfg, str(tmp_path / "run"))
    assert final["steps"] == 2 and "mtp2_loss" in final
    base = shipped_checkpoint()
    got, ref = TargetWeights.from_pretrained(out).state_dict(), TargetWeights.from_pretrained(base).state_dict()
    assert got.keys() == ref.keys()
    for name in ref:  # the target, its embedding and head: the base's bytes
        assert torch.equal(got[name], ref[name]), name
    assert (out / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    # The MTP layer was trained from a fresh start: neither the base's nor its random start.
    mtp, base_mtp = MtpWeights.from_pretrained(out), MtpWeights.from_pretrained(base)
    fresh = train.base_models("shipped", 0, limit_items=4)[2]
    assert not torch.equal(mtp.eh_proj, base_mtp.eh_proj) and not torch.equal(mtp.eh_proj, fresh.eh_proj.detach())
    assert "train.base=shipped" in (out / "README.md").read_text()


@pytest.mark.slow
def test_one_grid_job_and_its_report(tmp_path):
    cfg = config("grid", ["experiment=grid_smoke", "train.mtp_depth=2"])
    res = grid.run(cfg, str(tmp_path / "job"))
    on_disk = json.loads((tmp_path / "job" / "grid.json").read_text())
    assert (
        on_disk["mtp_depth"] == 2
        and on_disk["steps"] == 2
        and set(on_disk["evals"]) == {"teacher_forced", "speculative"}
    )
    tf = on_disk["evals"]["teacher_forced"]
    assert tf["mode"] == "teacher_forced" and tf["num_drafts"] == 2 and tf["prompts"] == 2 and len(tf["alpha_ci"]) == 2
    assert on_disk["evals"]["speculative"]["mode"] == "speculative" and "speedup" in tf
    fa = on_disk["feed_agreement"]
    assert fa["same_per_position"][0] == 1.0 and fa["positions"] == 16 and len(fa["same_per_position"]) == 2
    ck = tmp_path / "job" / "checkpoint" / "model.safetensors"
    assert on_disk["checkpoint_sha256"] == hashlib.sha256(ck.read_bytes()).hexdigest() == res["checkpoint_sha256"]
    # The report over this job and a copy posing as depth 1 (the baseline of the paired table).
    other = copy.deepcopy(on_disk)
    other["mtp_depth"] = 1
    (tmp_path / "job1").mkdir()
    (tmp_path / "job1" / "grid.json").write_text(json.dumps(other))
    text = grid_report.main([str(tmp_path)])
    rows = [l for l in text.splitlines() if l.startswith("| 1 | 0 |") or l.startswith("| 2 | 0 |")]
    assert len(rows) == 2 * 2 + 2  # two evaluations per variant, one feed row per variant
    diffs = [l for l in text.splitlines() if l.startswith("| depth 2, distill 0 |")]
    assert len(diffs) == 2 and all("+0.000 [+0.00, +0.00]" in d for d in diffs)  # a copy differs by nothing
    assert (tmp_path / "grid_report.md").exists() and (tmp_path / "grid_report.png").stat().st_size > 0
