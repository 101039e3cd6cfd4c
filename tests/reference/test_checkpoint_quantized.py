"""Checkpoints of a target quantized in a format this package does not read (``reference/
quantization.py``): a build whose MTP layer, embedding and head are plain (GLM-5.2's NVFP4 release
keeps ``model.layers.78*`` in bf16 through ``exclude_modules``) loads as plain weights, whatever
the target's layers hold; one whose MTP layer holds a quantized tensor (NVFP4's packed uint8 with
``weight_scale`` / ``weight_scale_2``, MXFP4's ``*_blocks`` / ``*_scales``, any packed or float8
weight) is refused naming the format and the tensor."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm_mtp.reference import CheckpointError, MtpConfig, MtpWeights
from glm_mtp.reference.weights import weights_equal

CFG = MtpConfig.preset("tiny")
P = f"model.layers.{CFG.mtp_layer_index}."
Q_A = P + "self_attn.q_a_proj.weight"  # (32, 64)
DOWN = P + "mlp.experts.3.down_proj.weight"  # (64, 32)
NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
         "exclude_modules": ["lm_head", "model.embed_tokens", f"model.layers.{CFG.mtp_layer_index}*"]}
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head", "model.embed_tokens"]}


def nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``w`` (N, K) in modelopt's NVFP4 layout: two e2m1 codes per uint8 (N, K/2), one float8
    scale per 16 values, a float32 global scale (the values are random codes: only the layout
    matters here)."""
    n, k = w.shape
    g = torch.Generator().manual_seed(n * k)
    return {"": torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
            "_scale": torch.rand(n, k // 16, generator=g).to(torch.float8_e4m3fn),
            "_scale_2": torch.tensor(0.01), ".input_scale": torch.tensor(1.0)}


def packed(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``nvfp4(w)`` under checkpoint names: the packed weight as ``name``, its scales beside it
    (``.weight_scale``, ``.weight_scale_2``, ``.input_scale``)."""
    parts = nvfp4(w)
    module = name.removesuffix(".weight")
    return {name: parts.pop(""), **{module + (".weight" + s if s.startswith("_") else s): t for s, t in parts.items()}}


@pytest.fixture
def plain() -> MtpWeights:
    return MtpWeights.random(CFG, seed=6, dtype=torch.bfloat16)


def write(path, weights: MtpWeights, quantization: dict, changes: dict[str, torch.Tensor], drop=()) -> None:
    weights.save_pretrained(path)
    t = load_file(path / "model.safetensors")
    for n in drop:
        del t[n]
    t.update(changes)
    save_file(t, path / "model.safetensors")
    body = json.loads((path / "config.json").read_text())
    body["quantization_config"] = quantization
    (path / "config.json").write_text(json.dumps(body))


def target_layer_in_nvfp4() -> dict[str, torch.Tensor]:
    """A quantized layer of the target (layer 0), which the drafter never reads."""
    return packed("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 128))


def test_an_nvfp4_build_with_a_plain_mtp_layer_loads_as_plain_weights(tmp_path, plain):
    write(tmp_path, plain, NVFP4, target_layer_in_nvfp4())
    back = MtpWeights.from_pretrained(tmp_path)
    assert weights_equal(back, plain) and not back.block_scaled


def test_an_mxfp4_build_with_a_plain_mtp_layer_loads(tmp_path, plain):
    write(tmp_path, plain, MXFP4, {"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(4, 8, 2, 16, dtype=torch.uint8),
                                   "model.layers.0.mlp.experts.gate_up_proj_scales": torch.zeros(4, 8, 2, dtype=torch.uint8)})
    assert weights_equal(MtpWeights.from_pretrained(tmp_path), plain)


REFUSED = {
    # NVFP4 beside the weight: packed uint8 under the weight's own name, its scales beside it
    "nvfp4 q_a_proj": (NVFP4, lambda w: (packed(Q_A, w.layer.attn.q_a_proj), ()),
                       rf"tensor '{Q_A}' is quantized in modelopt NVFP4 \('{P}self_attn.q_a_proj.(input_scale|weight_scale)' beside it\)"),
    "nvfp4 expert, layer excluded in config": (NVFP4, lambda w: (packed(DOWN, w.layer.mlp.experts_down[3]), ()),
                                               rf"tensor '{DOWN}' is quantized in modelopt NVFP4"),
    # packed weight alone (no scale tensor read): its dtype names it
    "nvfp4 packed weight only": (NVFP4, lambda w: ({Q_A: torch.zeros(32, 32, dtype=torch.uint8)}, ()),
                                 rf"tensor '{Q_A}' is torch.uint8 \(32, 32\), quantized in modelopt NVFP4"),
    "nvfp4 head": (NVFP4, lambda w: ({"lm_head.weight": torch.zeros(96, 32, dtype=torch.uint8)}, ()),
                   r"tensor 'lm_head.weight' is torch.uint8 \(96, 32\), quantized in modelopt NVFP4"),
    # MXFP4: the weight replaced by its blocks and scales
    "mxfp4 expert": (MXFP4, lambda w: ({DOWN.removesuffix(".weight") + ".weight_blocks": torch.zeros(64, 1, 16, dtype=torch.uint8),
                                        DOWN.removesuffix(".weight") + ".weight_scales": torch.zeros(64, 1, dtype=torch.uint8)}, (DOWN,)),
                     rf"tensor '{DOWN}' is quantized in mxfp4 \('{DOWN}_blocks' beside it\)"),
    # float8 values under another method's config
    "float8 under gptq": ({"quant_method": "gptq", "bits": 4}, lambda w: ({Q_A: w.layer.attn.q_a_proj.to(torch.float8_e4m3fn)}, ()),
                          rf"tensor '{Q_A}' is torch.float8_e4m3fn \(32, 64\), quantized in gptq"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_quantized_mtp_layer_is_refused_naming_format_and_tensor(tmp_path, plain, case):
    quantization, make, pattern = REFUSED[case]
    changes, drop = make(plain)
    write(tmp_path, plain, quantization, {**target_layer_in_nvfp4(), **changes}, drop)
    with pytest.raises(CheckpointError, match=pattern):
        MtpWeights.from_pretrained(tmp_path)


def test_a_quant_method_must_be_named(tmp_path, plain):
    write(tmp_path, plain, {"quant_algo": "NVFP4"}, {})
    with pytest.raises(CheckpointError, match="quantization_config.quant_method must be a non-empty string"):
        MtpWeights.from_pretrained(tmp_path)
