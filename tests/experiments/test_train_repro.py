"""Training is a function of its command: the same config twice gives byte-identical files, even
when one run's clock runs a thousand times slower (the learning rate follows the step alone)."""

import hashlib
import json

import pytest
from hydra import compose, initialize_config_module

from glm_mtp.experiments.training import train_run as train

TINY = [
    "logger=none", "tokenizer.limit_items=8", "tokenizer.vocab_size=280", "tokenizer.sample_every=1",
    "arch.hidden_size=32", "arch.q_lora_rank=16", "arch.kv_lora_rank=16", "arch.num_attention_heads=2",
    "arch.moe_intermediate_size=16", "arch.intermediate_size=32", "arch.num_hidden_layers=2", "arch.index_topk=32",
    "train.steps=4", "train.warmup=2", "train.batch_size=2", "train.seq_len=16", "train.eval_every=10",
    "train.eval_windows=1", "train.log_every=1", "train.mtp_depth=2",
]
FILES = ("model.safetensors", "tokenizer.json", "corpus.json", "config.json")


def _run(tmp_path, name, overrides=()):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        cfg = compose("train", overrides=[*TINY, f"out={tmp_path / name}", *overrides])
    train.run(cfg, str(tmp_path / f"run_{name}"))
    return {f: hashlib.sha256((tmp_path / name / f).read_bytes()).hexdigest() for f in FILES}


def test_same_command_twice_gives_identical_bytes_on_any_clock(tmp_path, monkeypatch):
    first = _run(tmp_path, "a")
    clock = iter(range(0, 10**9, 3))  # 3 s per reading: a very slow machine, well inside the budget
    monkeypatch.setattr(train.time, "perf_counter", lambda: float(next(clock)))
    second = _run(tmp_path, "b")
    assert first == second
    log = json.loads((tmp_path / "b" / "training_log.json").read_text())
    assert [h["lr"] for h in log["history"]] == [train.lr_at(s, 4, 3e-3, 3e-4, 2) for s in range(4)]
    card = (tmp_path / "b" / "README.md").read_text()
    assert "seed 0" in card and json.loads((tmp_path / "b" / "corpus.json").read_text())["sha256"] in card


def test_another_seed_or_schedule_changes_the_bytes(tmp_path):
    # The comparison above can fail: the checkpoint's bytes follow the seed and the schedule.
    base = _run(tmp_path, "a")
    assert _run(tmp_path, "s", ["train.seed=1"])["model.safetensors"] != base["model.safetensors"]
    assert _run(tmp_path, "l", ["train.lr=2e-3"])["model.safetensors"] != base["model.safetensors"]


def test_lr_schedule_depends_on_the_step_alone():
    rates = [train.lr_at(s, 100, 1e-2, 1e-3, 10) for s in range(120)]
    assert rates[0] == pytest.approx(1e-3) and rates[9] == pytest.approx(1e-2)
    assert all(a >= b - 1e-15 for a, b in zip(rates[9:], rates[10:]))  # non-increasing after warm-up
    assert rates[100] == pytest.approx(1e-3) and rates[119] == pytest.approx(1e-3)
