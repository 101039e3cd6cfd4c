"""The sparse-selection ablation (experiments/loop/recall.py, experiment=sparse_smoke): the drafter's
KPool selection vs every visible row, both rollback policies, paired over the same prompts, with
the indexer's recall per drafted row in summary.json."""

import math

import pytest
from hydra import compose, initialize_config_module

from glm_mtp.experiments import report
from glm_mtp.experiments.acceptance_job.run import run as run_acceptance
from glm_mtp.experiments.loop.recall import quantile, recall_summary
from glm_mtp.experiments.settings.validate import check_acceptance
from glm_mtp.experiments.reporting.wandb_log import read_offline_run

GRID = [(a, p) for a in ("sparse", "dense") for p in ("first_row_kept", "refeed")]


def config(overrides):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory, acceptance_jobs):
    """The four jobs of ``-m experiment=sparse_smoke``, run in-process (one directory each)."""
    root = tmp_path_factory.mktemp("sparse_smoke")
    jobs = {(attention, policy): ["experiment=sparse_smoke", f"attention={attention}", f"policy={policy}"]
            for attention, policy in GRID}
    return root, acceptance_jobs(root, jobs)


def test_summaries_carry_the_selection_and_its_recall(smoke_runs):
    _, runs = smoke_runs
    assert len({s["prompts_sha256"] for s in runs.values()}) == 1  # paired: the same prompts
    for (attention, policy), s in runs.items():
        r = s["recall"]
        assert s["attention"] == attention and s["policy"] == policy
        assert r["rows"] == sum(p["rows"] for p in r["per_position"]) > 0
        assert 0.0 <= r["p10"] <= r["median"] <= 1.0 and 0.0 <= r["min"]
        assert 0.0 <= r["oracle_p10"] <= r["oracle_median"] <= 1.0 and 0.0 < r["entropy_median"] <= 1.0
        assert len(r["per_position"]) == s["num_drafts"] == 2
    for policy in ("first_row_kept", "refeed"):
        dense, sparse = runs["dense", policy]["recall"], runs["sparse", policy]["recall"]
        # Every visible row attended: the recall is exactly 1 and selection never real.
        assert dense["min"] == dense["median"] == dense["p10"] == 1.0 and dense["selection_real_share"] == 0.0
        assert dense["mean_attended"] == dense["mean_visible"]
        # 40-token prompts at index_topk 8: the KPool selection drops most rows, and their mass.
        assert sparse["selection_real_share"] == 1.0 and sparse["mean_attended"] < sparse["mean_visible"]
        assert sparse["median"] < 1.0
        # No KPool selection of the same size keeps more mass than the best pools (the oracle).
        assert sparse["median"] <= sparse["oracle_median"] + 1e-12 and sparse["oracle_median"] < 1.0


def test_report_pairs_the_ablation(smoke_runs):
    root, _ = smoke_runs
    text = report.main([str(root), "--pair", "attention,policy"])
    assert "reference dense" in text and "recall median" in text
    assert "attention: run − baseline" in text and "policy: run − baseline" in text


def test_dense_needs_the_reference_drafter_and_a_glm5_next_model():
    with pytest.raises(ValueError, match=r"attention=dense .*\(backend=reference\)"):
        check_acceptance(config(["experiment=sparse_smoke", "attention=dense", "backend=optimized"]))
    with pytest.raises(ValueError, match="attention=dense .* glm5_next"):
        check_acceptance(config(["model=tiny_random", "experiment=smoke", "attention=dense"]))
    with pytest.raises(ValueError, match="attention must be one of sparse, dense"):
        check_acceptance(config(["experiment=sparse_smoke", "attention=all"]))


def test_quantiles_and_an_empty_summary():
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and quantile([0.0, 1.0], 0.1) == pytest.approx(0.1)
    assert math.isnan(quantile([], 0.5))
    s = recall_summary([], 2)
    assert s["rows"] == 0 and math.isnan(s["median"]) and [p["rows"] for p in s["per_position"]] == [0, 0]


def test_the_shipped_next_model_drafts_past_index_topk(tmp_path):
    """model=next_shipped: one 100-token prompt (index_topk 64, index_kpool 4), so the shipped
    drafter's KPool selection drops rows at every drafted position, and its recall is recorded."""
    cfg = config(["model=next_shipped", "experiment=smoke", "run.num_prompts=1", "run.prompt_tokens=100",
                  "run.max_new_tokens=6",
                  "run.check_lossless=false", "logger=none", "speedup.repeats=1"])
    check_acceptance(cfg)
    s = run_acceptance(cfg, str(tmp_path))
    assert s["checkpoint"].endswith("glm5next-mtp-stdlib") and s["attention"] == "sparse"
    assert s["index_share"] is True and s["index_share_setting"] is None  # the release's sharing, from its config.json
    r = s["recall"]
    assert r["rows"] > 0 and r["selection_real_share"] == 1.0 and r["mean_attended"] < r["mean_visible"]
    assert 0.0 < r["p10"] <= r["median"] <= r["oracle_median"] <= 1.0


def test_the_recall_reaches_the_wandb_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = config(["experiment=sparse_smoke", "logger=wandb", "run.num_prompts=1"])
    assert cfg.logger.mode == "offline"
    summary = run_acceptance(cfg, str(tmp_path))
    run = read_offline_run(str(tmp_path))["summary"]
    r = summary["recall"]
    assert run["recall/median"] == pytest.approx(r["median"]) and run["recall/p10"] == pytest.approx(r["p10"])
    assert run["recall/p10_1"] == pytest.approx(r["per_position"][0]["p10"]) and run[
        "recall/oracle_median"
    ] == pytest.approx(r["oracle_median"])


def test_a_batched_loop_records_the_same_rows(tmp_path):
    """batch_size=2: one propose_batch per round drafts both prompts; the drafts are those of
    batch_size=1 (batch invariance), and so is every recorded row's recall."""
    one = run_acceptance(config(["experiment=sparse_smoke", "attention=sparse", "policy=first_row_kept"]),
                         str(tmp_path / "one"))
    two = run_acceptance(config(["experiment=sparse_smoke", "attention=sparse", "policy=first_row_kept",
                                 "batch_size=2"]),
                         str(tmp_path / "two"))
    assert two["counts"] == one["counts"]
    for key in ("rows", "median", "p10", "oracle_median", "selection_real_share"):
        assert two["recall"][key] == one["recall"][key], key
    assert [p["rows"] for p in two["recall"]["per_position"]] == [p["rows"] for p in one["recall"]["per_position"]]
