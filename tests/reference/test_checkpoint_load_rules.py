"""Strict loading: a checkpoint is refused, with the file and the tensor named, when a weight has a
dtype other than the checkpoint's floating dtype, a file is not safetensors, the index is malformed
or points outside the folder, or a weight holds NaN/inf (unless ``allow_non_finite=True``)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm_mtp.reference import CheckpointError, MtpConfig, MtpWeights
from glm_mtp.reference.bytes import same_bytes
from glm_mtp.reference.weights import weights_equal

CFG = MtpConfig.preset("tiny")
P = f"model.layers.{CFG.mtp_layer_index}."
EXPERT = P + "mlp.experts.5.down_proj.weight"


def saved(path, dtype=torch.bfloat16, shard_size=None, seed=0):
    w = MtpWeights.random(CFG, seed=seed, dtype=dtype)
    w.save_pretrained(path, shard_size=shard_size)
    return w


def edit_single(path, **changes):
    """Rewrite ``model.safetensors`` with some tensors replaced."""
    t = load_file(path / "model.safetensors")
    t.update(changes)
    save_file(t, path / "model.safetensors")


@pytest.mark.parametrize("bad", [torch.float32, torch.int8, torch.float16])
def test_a_tensor_of_another_dtype_is_refused(tmp_path, bad):
    w = saved(tmp_path)
    t = w.state_dict()[EXPERT]
    edit_single(tmp_path, **{EXPERT: (t.float() * 10).to(bad)})
    with pytest.raises(CheckpointError, match=rf"model\.safetensors.*{EXPERT}.*{bad}.*torch\.bfloat16"):
        MtpWeights.from_pretrained(tmp_path)


@pytest.mark.parametrize("mixed", [torch.float32, torch.float16])
def test_with_dtype_given_a_mixed_float_checkpoint_is_cast(tmp_path, mixed):
    """An explicit dtype casts every weight to it, so a float32 norm among bfloat16 (as some real
    checkpoints store norms) loads; an int8 weight never does, nor a float8 one without quantization_config (it needs
    scales)."""
    w = saved(tmp_path)
    norm = P + "enorm.weight"
    # Norm weights near 1 are exact in float16; the matrix goes float32 (float16's range is narrower than bfloat16's).
    edit_single(tmp_path, **{norm: w.state_dict()[norm].to(mixed), EXPERT: w.state_dict()[EXPERT].float()})
    with pytest.raises(CheckpointError, match=norm):
        MtpWeights.from_pretrained(tmp_path)
    back = MtpWeights.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert weights_equal(back, w)  # bf16 -> wider float -> bf16 is exact
    for bad, rule in ((torch.int8, "must be floating point"), (torch.float8_e4m3fn, "no quantization_config")):
        edit_single(tmp_path, **{EXPERT: w.state_dict()[EXPERT].to(bad)})
        with pytest.raises(CheckpointError, match=rf"{EXPERT}.*{bad}.*{rule}"):
            MtpWeights.from_pretrained(tmp_path, dtype=torch.bfloat16)


def test_an_integer_checkpoint_is_refused(tmp_path):
    w = saved(tmp_path, dtype=torch.float32)
    edit_single(tmp_path, **{n: (t.detach() * 8).to(torch.int8) for n, t in w.state_dict().items()})
    with pytest.raises(CheckpointError, match=r"'model\.embed_tokens\.weight'.*torch\.int8.*floating"):
        MtpWeights.from_pretrained(tmp_path)


def test_a_float32_routing_bias_among_bf16_is_the_usual_layout(tmp_path):
    w = saved(tmp_path)
    assert w.layer.mlp.e_score_correction_bias.dtype == torch.float32
    assert weights_equal(MtpWeights.from_pretrained(tmp_path), w)


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int8, torch.bool, torch.complex64, torch.uint8, torch.float8_e4m3fn, "bfloat16", 16]
)
def test_a_non_floating_dtype_request_is_refused(tmp_path, dtype):
    saved(tmp_path)
    with pytest.raises(ValueError, match=r"dtype must be a floating torch\.dtype"):
        MtpWeights.from_pretrained(tmp_path, dtype=dtype)


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty"])
@pytest.mark.parametrize("shard_size", [None, 6])
def test_an_unreadable_file_is_named(tmp_path, how, shard_size):
    saved(tmp_path, shard_size=shard_size)
    name = (
        "model.safetensors"
        if shard_size is None
        else sorted(f for f in os.listdir(tmp_path) if f.startswith("model-"))[2]
    )
    f = tmp_path / name
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) * 2 // 3], "garbage": os.urandom(len(data)), "empty": b""}[how])
    with pytest.raises(CheckpointError, match=rf"{name}.*not a readable safetensors file"):
        MtpWeights.from_pretrained(tmp_path)


def write_index(path, body):
    (path / "model.safetensors.index.json").write_text(body if isinstance(body, str) else json.dumps(body))


@pytest.mark.parametrize(
    "body,match",
    [
        ({"metadata": {}}, "weight_map"),
        ({"weight_map": ["a"]}, "weight_map"),
        ({"weight_map": {"lm_head.weight": 3}}, "lm_head"),
        ("{not json", "not valid JSON"),
        ([1, 2], "JSON object"),
    ],
)
def test_a_malformed_index_is_refused(tmp_path, body, match):
    saved(tmp_path, shard_size=8)
    write_index(tmp_path, body)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors\.index\.json.*{match}"):
        MtpWeights.from_pretrained(tmp_path)


@pytest.mark.parametrize("where", ["../other/model.safetensors", "ABSOLUTE", "sub/model.safetensors", "..", ""])
def test_an_index_entry_outside_the_folder_is_refused(tmp_path, where):
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    saved(other, dtype=torch.float32, seed=1)
    saved(ckpt, dtype=torch.float32, seed=2, shard_size=8)
    (ckpt / "sub").mkdir()
    os.link(other / "model.safetensors", ckpt / "sub" / "model.safetensors")
    if where == "ABSOLUTE":
        where = str(other / "model.safetensors")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"][EXPERT] = where  # a complete, valid file: only the path is wrong
    write_index(ckpt, index)
    with pytest.raises(CheckpointError, match=rf"{EXPERT}.*plain file name"):
        MtpWeights.from_pretrained(ckpt)


def test_an_index_naming_a_missing_file_or_tensor(tmp_path):
    saved(tmp_path, shard_size=8)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"][EXPERT] = "model-00099-of-00099.safetensors"
    write_index(tmp_path, index)
    with pytest.raises(CheckpointError, match=rf"model-00099-of-00099\.safetensors.*{EXPERT}"):
        MtpWeights.from_pretrained(tmp_path)
    first = sorted(f for f in os.listdir(tmp_path) if f.startswith("model-0"))[0]
    index["weight_map"][EXPERT] = first  # exists, but holds another tensor set
    write_index(tmp_path, index)
    with pytest.raises(CheckpointError, match=rf"{first}.*{EXPERT}.*not in the file"):
        MtpWeights.from_pretrained(tmp_path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_weights_are_refused_unless_allowed(tmp_path, value, dtype):
    w = saved(tmp_path, dtype=dtype)
    for name in ("model.embed_tokens.weight", EXPERT, P + "mlp.gate.e_score_correction_bias"):
        edit_single(tmp_path, **{n: t for n, t in w.state_dict().items()})  # restore
        t = w.state_dict()[name].clone()
        t.view(-1)[int(torch.randint(t.numel(), ()))] = value
        edit_single(tmp_path, **{name: t})
        with pytest.raises(CheckpointError,
                           match=rf"model\.safetensors.*'{name}'.*1 non-finite.*allow_non_finite=True"):
            MtpWeights.from_pretrained(tmp_path)
        loose = MtpWeights.from_pretrained(tmp_path, allow_non_finite=True)
        assert same_bytes(loose.state_dict()[name], t)


def test_huge_finite_weights_are_not_mistaken_for_inf(tmp_path):
    """Values near the dtype's max overflow a plain sum; the check must not call them non-finite."""
    w = saved(tmp_path, dtype=torch.float32)
    big = torch.full_like(w.state_dict()[EXPERT], 3.0e38)
    edit_single(tmp_path, **{EXPERT: big})
    assert same_bytes(MtpWeights.from_pretrained(tmp_path).layer.mlp.experts_down[5], big)


def test_an_expert_parallel_rank_checks_what_it_reads(tmp_path):
    w = saved(tmp_path, dtype=torch.float32)
    t = w.state_dict()[EXPERT].clone()
    t[0, 0] = float("nan")
    edit_single(tmp_path, **{EXPERT: t})
    with pytest.raises(CheckpointError, match=EXPERT):
        MtpWeights.from_pretrained(tmp_path, ep_rank=1, ep_world=2, row_parallel_o_proj=False)  # experts 4..7
    r0 = MtpWeights.from_pretrained(tmp_path, ep_rank=0, ep_world=2, row_parallel_o_proj=False)  # never reads expert 5
    assert same_bytes(r0.layer.mlp.experts_down, w.layer.mlp.experts_down[:4])


def test_tie_word_embeddings_must_be_a_boolean(tmp_path):
    saved(tmp_path, dtype=torch.float32)
    t = load_file(tmp_path / "model.safetensors")
    del t["lm_head.weight"]
    save_file(t, tmp_path / "model.safetensors")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["tie_word_embeddings"] = "false"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="tie_word_embeddings must be a JSON boolean"):
        MtpWeights.from_pretrained(tmp_path)


def test_an_index_beside_a_single_file_is_ambiguous(tmp_path):
    """What an older save over a newer one left behind: which weights are current is unknowable."""
    saved(tmp_path / "a", shard_size=8, seed=3)
    saved(tmp_path / "b", seed=4)
    os.link(tmp_path / "b" / "model.safetensors", tmp_path / "a" / "model.safetensors")
    with pytest.raises(CheckpointError, match="both model.safetensors.index.json and model.safetensors"):
        MtpWeights.from_pretrained(tmp_path / "a")
