"""The index-sharing experiment (experiment=index_share, its smoke variant index_share_smoke):
sharing on vs off (DESIGN.md §9), both modes, paired over the same prompts, and the report's
paired differences; the full experiment's slices sit below / above the models' index_topk."""


import pytest
from hydra import compose, initialize_config_module

from glm_mtp.experiments import report
from glm_mtp.experiments.targets.checkpoint import SHIPPED, shipped_checkpoint
from glm_mtp.reference.config import MtpConfig

# Teacher-forced (drafts 2 and 3 scored at every position; a random model's loop rejects draft 1):
# two of the smoke sweep's four jobs, to keep the default run fast.
GRID = [(True, "teacher_forced"), (False, "teacher_forced")]


def config(overrides, hydra_cfg=False):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=hydra_cfg)


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory, acceptance_jobs):
    """``-m experiment=index_share_smoke``'s teacher-forced jobs, run in-process (one directory each)."""
    root = tmp_path_factory.mktemp("index_share_smoke")
    jobs = {(share, mode): ["experiment=index_share_smoke", f"model.index_share={str(share).lower()}", f"mode={mode}"]
            for share, mode in GRID}
    return root, acceptance_jobs(root, jobs)


def test_the_runs_share_or_not_on_the_same_prompts(smoke_runs):
    _, runs = smoke_runs
    assert len({s["prompts_sha256"] for s in runs.values()}) == 1  # paired: the same prompts
    for (share, mode), s in runs.items():
        assert s["index_share"] is share and s["index_share_setting"] is share and s["mode"] == mode
        assert s["recall"]["selection_real_share"] == 1.0  # 16-token prompts at index_topk 8: selection drops rows
    # A shared step attends step 1's selection, not its own: the drafts' rows differ, and with
    # them the recall recorded at drafts 2 and 3 (draft 1 is the same step either way).
    on, off = runs[True, "teacher_forced"]["recall"], runs[False, "teacher_forced"]["recall"]
    assert on["per_position"][0] == off["per_position"][0]
    assert on["per_position"][1:] != off["per_position"][1:]


def test_report_pairs_sharing_on_against_off(smoke_runs):
    root, _ = smoke_runs
    text = report.main([str(root), "--pair", "index_share,mode"])
    rows = [l for l in text.splitlines() if l.startswith("| on − off |")]
    assert len(rows) == 1 and rows[0].split(" | ")[1] == "teacher_forced"
    assert "ΔP(acc ≥ 3)" in text and "reference shared" in text
    assert "mode: run − baseline" not in text  # pairing on mode keeps sharing apart: nothing to pair here


def index_topk(model):
    return MtpConfig.from_hf_config(shipped_checkpoint(model.get("shipped") or SHIPPED) / "config.json").index_topk


@pytest.mark.parametrize("overrides, below", [
    ([], True),
    (["model=shipped", "run.num_prompts=32"], True),
    (["run.num_prompts=8", "run.prompt_tokens=512", "run.max_new_tokens=32"], False),
])
def test_the_experiment_slices_sit_below_or_above_index_topk(overrides, below):
    """Below: every row a run writes (prompt + generated + k drafts) is within index_topk, so
    step 1 selects every row; above: every drafted row sees more than index_topk rows."""
    cfg = config(["experiment=index_share", *overrides], hydra_cfg=True)
    assert dict(cfg.hydra.sweeper.params) == {"model.index_share": "true,false", "mode": "speculative,teacher_forced"}
    rows = cfg.run.prompt_tokens + cfg.run.max_new_tokens + cfg.num_drafts + 1
    topk = index_topk(cfg.model)
    assert (rows <= topk) if below else (cfg.run.prompt_tokens > topk)
    assert rows <= cfg.model.max_seq_len
