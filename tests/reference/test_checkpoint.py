"""Checkpoints in GLM-5 naming: a round trip bit for bit (single file and sharded), reading only
the MTP layer, and a named error for each kind of broken checkpoint."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glm_mtp.reference import CheckpointError, MtpConfig, MtpWeights
from glm_mtp.reference.weights import layer_tensor_shapes, random_tensor, weights_equal

CFG = MtpConfig.preset("tiny")


def target_layers(cfg, gen):
    """Tensors of the target's own decoder layers (0 .. num_hidden_layers-1), for realism."""
    out = {}
    for i in range(cfg.num_hidden_layers):
        for n, s in layer_tensor_shapes(cfg, sparse=i >= cfg.first_k_dense_replace).items():
            out[f"model.layers.{i}.{n}"] = random_tensor(n, s, gen).to(torch.bfloat16)
    out["model.norm.weight"] = torch.ones(cfg.hidden_size, dtype=torch.bfloat16)
    return out


@pytest.mark.parametrize("shard_size", [None, 7])
def test_round_trip_is_bit_exact(tmp_path, shard_size):
    w = MtpWeights.random(CFG, seed=3, dtype=torch.bfloat16)
    w.save_pretrained(tmp_path, shard_size=shard_size, extra=target_layers(CFG, torch.Generator().manual_seed(0)))
    if shard_size:
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 3
    back = MtpWeights.from_pretrained(tmp_path)
    assert weights_equal(w, back)
    assert back.layer.mlp.e_score_correction_bias.dtype == torch.float32


def test_reads_no_other_layer(tmp_path, monkeypatch):
    w = MtpWeights.random(CFG, seed=4, dtype=torch.bfloat16)
    w.save_pretrained(tmp_path, shard_size=5, extra=target_layers(CFG, torch.Generator().manual_seed(1)))
    read = []
    import glm_mtp.reference.checkpoint as ck

    real = ck.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(ck, "safe_open", Spy)
    MtpWeights.from_pretrained(tmp_path)
    mtp = f"model.layers.{CFG.mtp_layer_index}."
    assert read and all(n.startswith(mtp) or n in ("model.embed_tokens.weight", "lm_head.weight") for n in read)
    assert len(read) == len(w.state_dict())


def test_copies_inside_the_mtp_layer_are_ignored(tmp_path):
    w = MtpWeights.random(CFG, seed=5, dtype=torch.float32)
    p = f"model.layers.{CFG.mtp_layer_index}."
    copies = {p + "embed_tokens.weight": torch.randn_like(w.embed_tokens),
              p + "shared_head.head.weight": torch.randn_like(w.lm_head)}
    w.save_pretrained(tmp_path, extra=copies)
    back = MtpWeights.from_pretrained(tmp_path)
    assert weights_equal(w, back)  # the target's own embedding and head, not the copies


def break_checkpoint(tmp_path, how):
    w = MtpWeights.random(CFG, seed=6, dtype=torch.float32)
    w.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    t = load_file(f)
    p = f"model.layers.{CFG.mtp_layer_index}."
    if how == "missing":
        del t[p + "mlp.experts.3.up_proj.weight"]
    elif how == "extra":
        t[p + "mlp.experts.99.up_proj.weight"] = torch.zeros(2, 2)
    elif how == "shape":
        t[p + "self_attn.kv_b_proj.weight"] = torch.zeros(5, 5)
    elif how == "no_head":
        del t["lm_head.weight"]
    elif how == "head_shape":
        t["lm_head.weight"] = torch.zeros(3, CFG.hidden_size)
    save_file(t, f)
    return tmp_path


@pytest.mark.parametrize(
    "how,match",
    [
        ("missing",
         r"missing tensor 'model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight' \(expected shape \(32, 64\)\)"),
        ("extra", r"unexpected tensor 'model\.layers\.2\.mlp\.experts\.99\.up_proj\.weight'"),
        ("shape", r"'model\.layers\.2\.self_attn\.kv_b_proj\.weight' has shape \(5, 5\), expected \(128, 16\)"),
        ("no_head", r"missing tensor 'lm_head\.weight'"),
        ("head_shape", r"'lm_head\.weight' has shape \(3, 64\), expected \(96, 64\)"),
    ],
)
def test_broken_checkpoints_name_the_tensor(tmp_path, how, match):
    with pytest.raises(CheckpointError, match=match):
        MtpWeights.from_pretrained(break_checkpoint(tmp_path, how))


def test_tied_embeddings_without_head(tmp_path):
    break_checkpoint(tmp_path, "no_head")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    w = MtpWeights.from_pretrained(tmp_path)
    assert w.lm_head is w.embed_tokens


def test_no_weights_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    with pytest.raises(CheckpointError, match="neither"):
        MtpWeights.from_pretrained(tmp_path)


def test_random_is_reproducible_and_seeded():
    a, b, c = (MtpWeights.random(CFG, seed=s, dtype=torch.bfloat16) for s in (9, 9, 10))
    assert weights_equal(a, b) and not weights_equal(a, c)


def test_dtype_override(tmp_path):
    MtpWeights.random(CFG, seed=7, dtype=torch.float32).save_pretrained(tmp_path)
    w = MtpWeights.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert w.dtype == torch.bfloat16 and w.embed_tokens.dtype == torch.bfloat16
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
