"""The Hydra entry points end to end on tiny models: acceptance (W&B offline), a sweep and its
report, a few training steps writing a loadable checkpoint, and a smoke run of the shipped model."""

import json
import math
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_module

from glm_mtp.reference import MtpWeights
from glm_mtp.experiments import report
from glm_mtp.experiments.training import train_run as train
from glm_mtp.experiments.acceptance_job.run import run as run_acceptance
from glm_mtp.experiments.settings.validate import check_acceptance
from glm_mtp.experiments.targets import provenance
from glm_mtp.experiments.targets.checkpoint import shipped_checkpoint
from glm_mtp.experiments.targets.target import TargetWeights
from glm_mtp.experiments.reporting.wandb_log import read_offline_run
from glm_mtp.experiments.reporting.summary_keys import lossless_greedy


def config(name, overrides):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose(name, overrides=overrides)


def test_acceptance_logs_to_wandb_offline_and_reads_back(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = config("config", ["model=tiny_random", "experiment=smoke", "num_drafts=2", "policy=refeed"])
    assert cfg.logger.name == "wandb" and cfg.logger.mode == "offline"  # the default
    summary = run_acceptance(cfg, str(tmp_path))
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    for key in ("acceptance_per_position", "mean_accepted_length", "num_drafts", "policy", "backend", "temperature",
                "prompts", "generated_tokens"):
        assert key in on_disk
    assert lossless_greedy(on_disk) is True and on_disk["generated_tokens"] == 2 * 16
    assert (tmp_path / "acceptance.png").stat().st_size > 0 and (tmp_path / "speedup.png").stat().st_size > 0
    sp = on_disk["speedup"]  # the speedup model: one prediction per k, costs measured on this run's models
    assert len(sp["predicted"]) == len(sp["v"]) == len(sp["predicted_ci"]) == 2
    assert sp["c"] > 0 and sp["costs"] == "measured"
    assert sp["best_k"] in (1, 2) and sp["predicted"][sp["best_k"] - 1] == max(sp["predicted"])
    assert sp["tau"][-1] == pytest.approx(on_disk["mean_accepted_length"]) and len(sp["glm5"]["predicted"]) == 2
    # Beside it, the same counts at the released model's costs (tiny_random is of GLM-5's family), labelled.
    rel = sp["released"]
    # at the family's measured table (GLM-5.2 on 8 x H200), the bytes limit beside it as the bound
    assert rel["model"] == "GLM-5" and rel["preset"] == "glm5" and rel["costs"] == "table:glm52-h200x8-mstar"
    assert rel["table"]["source"].startswith("mstar-project/mstar#272") and rel["tau"] == sp["tau"]
    assert rel["bound"]["costs"] == "bytes:glm5" and rel["bound"]["predicted"] == pytest.approx(sp["glm5"]["predicted"])
    printed = capsys.readouterr().out
    assert "predicted speedup at this run's costs (measured): S(1) = " in printed
    assert "at GLM-5's family's measured costs (table glm52-h200x8-mstar): S(1) = " in printed
    assert "bound at GLM-5's bytes (bytes:glm5, the memory-bound limit): S(1) = " in printed
    run = read_offline_run(str(tmp_path))
    assert run["summary"]["mean_accepted_length"] == pytest.approx(summary["mean_accepted_length"])
    assert run["summary"]["tau"] == pytest.approx(summary["mean_accepted_length"])
    assert run["summary"]["alpha_1"] == pytest.approx(summary["acceptance_per_position"][0])
    assert "time/draft_share" in run["summary"] and "acceptance_table/_type" in run["summary"]
    assert run["summary"]["speedup/best_k"] == sp["best_k"]
    assert run["summary"]["speedup/released_S_2"] == pytest.approx(rel["predicted"][1])
    assert run["config"]["policy"] == "refeed" and run["config"]["num_drafts"] == 2
    # Counts, intervals and the cumulative view, in the file and in the run.
    c = on_disk["counts"]
    assert len(c["reached"]) == len(c["accepted"]) == len(on_disk["alpha_ci"]) == len(on_disk["cumulative"]) == 2
    assert c["reached"][0] == c["steps"] == sum(on_disk["counts_per_prompt"]["steps"])
    assert len(on_disk["counts_per_prompt"]["steps"]) == 2
    assert run["summary"]["counts"] == c and run["summary"]["alpha_ci"] == on_disk["alpha_ci"]
    assert run["summary"]["cumulative"] == on_disk["cumulative"] and "cumulative_1" in run["summary"]
    assert "samples/_type" in run["summary"] and run["summary"]["mode"] == "speculative"
    assert len(run["summary"]["prompts_sha256"]) == 64 and "git_commit" in run["summary"] and "group" in run["summary"]
    # Index sharing (DESIGN.md §9): model.index_share null drafts with the checkpoint's (tiny: off).
    assert on_disk["index_share"] is False and on_disk["index_share_setting"] is None
    assert run["summary"]["index_share"] is False and run["config"]["model"]["index_share"] is None


def test_teacher_forced_mode_and_provenance(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = config("config", ["model=shipped", "experiment=smoke", "mode=teacher_forced", "source=ood", "num_drafts=3",
                            "group=g1"])
    s = run_acceptance(cfg, str(tmp_path))
    assert s["mode"] == "teacher_forced" and s["source"] == "ood" and s["scored_positions"] == 2 * 16
    assert s["counts"]["steps"] == 32 and s["counts"]["reached"][0] == 32 and len(s["alpha_ci"]) == 3
    for x, (lo, hi) in zip(s["cumulative"], s["cumulative_ci"]):
        assert lo <= x <= hi
    path = shipped_checkpoint()
    assert s["checkpoint_sha256"] == provenance.file_sha256(path / "model.safetensors")
    assert s["corpus_sha256"] == json.loads((path / "corpus.json").read_text())["sha256"]
    run = read_offline_run(str(tmp_path))
    assert run["summary"]["checkpoint_sha256"] == s["checkpoint_sha256"] and run["summary"]["group"] == "g1"
    assert run["summary"]["git_commit"] == s["git_commit"]
    with pytest.raises(ValueError, match="mode"):  # validation refuses it; the run itself re-checks nothing
        check_acceptance(config("config", ["experiment=smoke", "logger=none", "mode=forced"]))


def test_sweep_and_report(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "glm_mtp.experiments.acceptance", "-m", "model=tiny_random", "experiment=smoke",
           "logger=none", "num_drafts=1,2", "policy=first_row_kept,trim_all", f"hydra.sweep.dir={sweep}"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    table = report.main([str(sweep)])
    rows = [l for l in table.split("\n\n")[0].splitlines() if l.startswith("| speculative")]  # the first table
    assert len(rows) == 4 and any("trim_all" in r for r in rows)
    # trim_all against first_row_kept, once per k: the same prompts, paired.
    diffs = [l for l in table.splitlines() if l.startswith("| trim_all − first_row_kept")]
    assert len(diffs) == 2 and "Δα_1" in table
    # The predicted speedup per run and k, with the best k (k = 1 runs have S(2) undefined).
    sp_rows = [l for l in table.split("Predicted speedup")[1].splitlines() if l.startswith("| speculative")]
    assert len(sp_rows) == 4 and all(r.count("[") >= 1 for r in sp_rows) and "| best k |" in table
    assert (sweep / "report.md").exists() and (sweep / "report.png").stat().st_size > 0


def test_train_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "ckpt"
    cfg = config("train", [
        "logger=none", f"out={out}", "tokenizer.limit_items=12", "tokenizer.vocab_size=300", "tokenizer.sample_every=1",
        "arch.hidden_size=32", "arch.q_lora_rank=16", "arch.kv_lora_rank=16", "arch.num_attention_heads=2",
        "arch.moe_intermediate_size=16", "arch.intermediate_size=32", "arch.num_hidden_layers=2", "arch.index_topk=32",
        "train.steps=3", "train.batch_size=2", "train.seq_len=24", "train.eval_every=2", "train.eval_windows=2",
        "train.log_every=1", "train.mtp_depth=3",
    ])
    final = train.run(cfg, str(tmp_path / "run"))
    assert final["steps"] == 3 and math.isfinite(final["target_loss"]) and "mtp3_loss" in final
    mtp, target = MtpWeights.from_pretrained(out), TargetWeights.from_pretrained(out)
    assert mtp.config.vocab_size == 300 and len(target.layers) == 2
    assert torch.equal(mtp.embed_tokens, target.embed_tokens)
    card = (out / "README.md").read_text()
    corpus = json.loads((out / "corpus.json").read_text())
    assert corpus["sha256"] in card and "python -m glm_mtp.experiments.train" in card
    assert (tmp_path / "run" / "loss_curve.png").exists() and (out / "tokenizer.json").exists()
    # The acceptance experiment runs on it, prompts from its recorded held-out items.
    acfg = config("config", ["model=shipped", "logger=none", "experiment=smoke", f"model.path={out}"])
    s = run_acceptance(acfg, str(tmp_path / "acc"))
    assert lossless_greedy(s) is True and s["checkpoint"] == str(out)


def test_shipped_checkpoint_smoke(tmp_path):
    path = shipped_checkpoint()
    assert sum(f.stat().st_size for f in path.iterdir()) <= 20 * 2**20
    s = run_acceptance(config("config", ["model=shipped", "logger=none", "experiment=smoke"]), str(tmp_path))
    assert lossless_greedy(s) is True
    assert s["checkpoint"] == str(path) and s["samples"]


def test_source_text_names_the_users_text(tmp_path, capsys):
    """``source=text`` on a folder of the user's files, teacher-forced: the summary records the
    folder and its digest, and the τ line names the text as prompts.path's (it once printed the
    source's name twice, "positions of text text")."""
    from glm_mtp.experiments.settings.prompts import path_sha256

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 4)
    (texts / "b.txt").write_text("import os\nprint(os.path.join('a', 'b'))\n" * 4)
    cfg = config("config", ["model=shipped", "logger=none", "experiment=smoke", "source=text", f"prompts.path={texts}",
                            "mode=teacher_forced", "speedup.costs=glm5"])
    check_acceptance(cfg)
    s = run_acceptance(cfg, str(tmp_path / "run"))
    assert (s["source"], s["prompts"], s["prompts_path"]) == ("text", 2, str(texts))
    assert s["prompts_file_sha256"] == path_sha256(str(texts)) and s["scored_positions"] == 2 * 16
    tau = [line for line in capsys.readouterr().out.splitlines() if line.startswith("τ = ")]
    assert len(tau) == 1 and "32 positions of prompts.path's text from 2 prompts" in tau[0], tau
    assert "text text" not in tau[0]
    assert (tmp_path / "run" / "acceptance.log").read_text().count(tau[0]) == 1  # the log holds what was printed
