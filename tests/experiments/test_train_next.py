"""Training the glm5_next family (training=next_stdlib): windows longer than index_topk, the
KPool indexer trained, and the same command twice gives byte-identical files."""

import hashlib
import json

import pytest
from hydra import compose, initialize_config_module

from glm_mtp.experiments.training import train_run as train
from glm_mtp.experiments.settings.validate import check_train
from glm_mtp.reference.config import MtpConfig

# index_kpool 4 and index_topk 8 under windows of 24 tokens: rows past 11 drop pools.
TINY_NEXT = [
    "training=next_stdlib", "logger=none", "tokenizer.limit_items=6",
    "arch.hidden_size=32", "arch.q_lora_rank=16", "arch.kv_lora_rank=16", "arch.qk_nope_head_dim=8",
    "arch.v_head_dim=8",
    "arch.num_attention_heads=2", "arch.moe_intermediate_size=16", "arch.intermediate_size=32",
    "arch.num_hidden_layers=2",
    "arch.index_head_dim=8", "arch.index_kpool=4", "arch.index_topk=8",
    "train.steps=3", "train.warmup=1", "train.batch_size=2", "train.seq_len=24", "train.eval_every=10",
    "train.eval_windows=1", "train.log_every=1", "train.mtp_depth=2",
]
FILES = ("model.safetensors", "tokenizer.json", "corpus.json", "config.json")


def _cfg(overrides):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose("train", overrides=overrides)


def _run(tmp_path, name, overrides=()):
    cfg = _cfg([*TINY_NEXT, f"out={tmp_path / name}", *overrides])
    check_train(cfg)
    train.run(cfg, str(tmp_path / f"run_{name}"))
    return {f: hashlib.sha256((tmp_path / name / f).read_bytes()).hexdigest() for f in FILES}


def test_next_training_is_reproducible_and_trains_the_indexer(tmp_path):
    first = _run(tmp_path, "a")
    assert _run(tmp_path, "b") == first
    # the check can fail
    assert _run(tmp_path, "s", ["train.seed=1"])["model.safetensors"] != first["model.safetensors"]
    cfg = MtpConfig.from_hf_config(tmp_path / "a")
    assert cfg.is_next and cfg.index_topk == 8 and cfg.index_kpool == 4
    log = json.loads((tmp_path / "a" / "training_log.json").read_text())
    assert all(h["indexer_kl"] > 0 and 0 < h["indexer_recall"] < 1 for h in log["history"])
    card = (tmp_path / "a" / "README.md").read_text()
    assert (
        "## The KPool indexer: trained" in card
        and "Left out of GLM-5.3-Flash" in card
        and "tokenizer.path=shipped" in card
    )


def test_long_windows_need_a_trained_indexer():
    # GLM-5's lightning indexer is not trained: windows past index_topk are refused ...
    glm5 = _cfg(["logger=none", "train.seq_len=300"])
    with pytest.raises(ValueError, match="indexer is not trained"):
        check_train(glm5)
    # ... the glm5_next family's KPool indexer is, so its windows may be 8x index_topk.
    check_train(_cfg(["training=next_stdlib", "logger=none"]))
