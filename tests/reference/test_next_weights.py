"""MtpWeights of the glm5_next family: random weights, and GLM-5.3-Flash's checkpoint layout
(``model.language_model.layers.{N}.*``, ``model.language_model.embed_tokens.weight``,
``lm_head.weight``; per-expert tensors; a float32 router; the KPool tensors) read and written."""

import json

import pytest
import torch

from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.reference.checkpoint import INDEX_FILE, CheckpointError
from glm_mtp.reference.weights import KPOOL_APE, KPOOL_GATE, weights_equal


@pytest.fixture(scope="module")
def cfg():
    return MtpConfig.preset("glm5next_tiny")


@pytest.fixture(scope="module")
def w(cfg):
    return MtpWeights.random(cfg, seed=3, dtype=torch.bfloat16)


def test_random_builds_either_family(cfg, w):
    ix, moe = w.layer.attn.indexer, w.layer.mlp
    assert ix.kpool_ape.shape == (cfg.index_kpool, cfg.index_head_dim) and ix.kpool_gate.shape == (
        cfg.index_head_dim,
        cfg.hidden_size,
    )
    assert moe.router.dtype == torch.float32 and moe.e_score_correction_bias.dtype == torch.float32
    assert moe.swiglu_limit == cfg.swiglu_limit and w.dtype == torch.bfloat16
    assert w.layer.attn.kv_a_proj_with_mqa.shape == (cfg.kv_lora_rank, cfg.hidden_size)  # NoPE: no rope key
    g5 = MtpWeights.random(MtpConfig.preset("tiny"), seed=3)
    assert (
        g5.layer.attn.indexer.kpool_ape is None
        and g5.layer.mlp.swiglu_limit is None
        and g5.layer.mlp.router.dtype == torch.bfloat16
    )


def test_names_follow_the_real_layout(cfg, w):
    names = set(w.state_dict())
    p = "model.language_model.layers.2."
    assert {"model.language_model.embed_tokens.weight", "lm_head.weight", p + "eh_proj.weight", p + "enorm.weight",
            p + "hnorm.weight", p + "shared_head.norm.weight", p + KPOOL_APE, p + KPOOL_GATE,
            p + "self_attn.indexer.k_norm.weight", p + "self_attn.indexer.k_norm.bias", p + "mlp.gate.weight",
            p + "mlp.gate.e_score_correction_bias", p + "mlp.experts.7.down_proj.weight",
            p + "mlp.shared_experts.up_proj.weight"} <= names
    assert not any(n.startswith("model.layers.") for n in names)


@pytest.mark.parametrize("shard_size", [None, 5])
def test_save_and_load_round_trip(w, tmp_path, shard_size):
    w.save_pretrained(tmp_path / "ck", shard_size=shard_size)
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert config["model_type"] == "glm5_next" and config["text_config"]["index_kpool"] == 4
    back = MtpWeights.from_pretrained(tmp_path / "ck")
    assert weights_equal(w, back) and back.layer.mlp.router.dtype == torch.float32
    assert MtpWeights.from_pretrained(tmp_path / "ck", dtype=torch.float32).layer.mlp.router.dtype == torch.float32


def test_reads_only_the_mtp_layer_embedding_and_head(w, tmp_path):
    """Other layers' tensors sit in a shard whose bytes are garbage: the load never opens it."""
    w.save_pretrained(tmp_path / "ck", shard_size=1000)
    index = json.loads((tmp_path / "ck" / INDEX_FILE).read_text())
    (tmp_path / "ck" / "model-decoder.safetensors").write_bytes(b"not safetensors at all")
    for name in ("model.language_model.layers.0.self_attn.q_a_proj.weight",
                 "model.language_model.layers.1.mlp.gate.weight",
                 "model.visual.blocks.0.attn.qkv.weight", "model.layers.2.eh_proj.weight"):
        index["weight_map"][name] = "model-decoder.safetensors"
    (tmp_path / "ck" / INDEX_FILE).write_text(json.dumps(index))
    assert weights_equal(w, MtpWeights.from_pretrained(tmp_path / "ck"))


@pytest.mark.parametrize("missing", [KPOOL_APE, KPOOL_GATE, "self_attn.indexer.k_norm.bias"])
def test_a_missing_kpool_tensor_is_named(w, tmp_path, missing):
    w.save_pretrained(tmp_path / "ck", shard_size=1000)
    index = json.loads((tmp_path / "ck" / INDEX_FILE).read_text())
    del index["weight_map"]["model.language_model.layers.2." + missing]
    (tmp_path / "ck" / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"missing tensor 'model.language_model.layers.2.{missing}'"):
        MtpWeights.from_pretrained(tmp_path / "ck")


def test_a_wrong_kpool_shape_is_named(cfg, w, tmp_path):
    sd = w.state_dict()
    bad = "model.language_model.layers.2." + KPOOL_APE
    sd[bad] = torch.randn(cfg.index_kpool + 1, cfg.index_head_dim).to(torch.bfloat16)
    from glm_mtp.reference.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "ck", cfg.to_hf_dict(), sd)
    with pytest.raises(CheckpointError, match=rf"tensor '{bad}' has shape \(5, 16\), expected \(4, 16\)"):
        MtpWeights.from_pretrained(tmp_path / "ck")


def test_a_glm5_layout_is_not_read_as_glm5_next(cfg, w, tmp_path):
    """A glm5_next config over GLM-5 names: the MTP layer is missing, by its real name."""
    from glm_mtp.reference.checkpoint import save_checkpoint

    sd = {k.replace("model.language_model.", "model."): t for k, t in w.state_dict().items()}
    save_checkpoint(tmp_path / "ck", cfg.to_hf_dict(), sd)
    with pytest.raises(CheckpointError, match="missing tensor 'model.language_model.layers.2."):
        MtpWeights.from_pretrained(tmp_path / "ck")
