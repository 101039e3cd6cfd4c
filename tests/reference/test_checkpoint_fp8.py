"""Block-scaled fp8 checkpoints (DESIGN.md §8): ``config.json`` declares
``quantization_config {quant_method: fp8, weight_block_size: [128, 128]}``, each fp8 weight is
float8_e4m3fn with a float32 ``*_scale_inv`` of ceil(N/128) x ceil(K/128) beside it. They load as
saved, byte for byte, and every malformed variant is refused naming the tensor and the rule."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm_mtp.reference import CheckpointError, MtpConfig, MtpWeights
from glm_mtp.reference import fp8
from glm_mtp.reference.weights import mtp_tensor_shapes, weights_equal

def fp8_names(cfg):
    return [n for n in mtp_tensor_shapes(cfg) if fp8.may_be_fp8(n)]


# Widths above 128 (several scale blocks, a partial last one): hidden 200, q_lora_rank 136, experts 144.
CFG = MtpConfig.preset("tiny").replace(hidden_size=200, q_lora_rank=136, moe_intermediate_size=144)
P = f"model.layers.{CFG.mtp_layer_index}."
Q_A = P + "self_attn.q_a_proj.weight"  # (136, 200): scales (2, 2)
EXPERT = P + "mlp.experts.3.gate_proj.weight"
FP8_NAMES = [P + n for n in fp8_names(CFG)]


@pytest.fixture(scope="module")
def quantized() -> MtpWeights:
    return MtpWeights.random(CFG, seed=4).quantize_fp8()


def edit(path, drop=(), config=None, **changes):
    """Rewrite the single-file checkpoint: tensors replaced/added, some dropped, config.json edited."""
    t = load_file(path / "model.safetensors")
    t.update(changes)
    for n in drop:
        del t[n]
    save_file(t, path / "model.safetensors")
    if config is not None:
        body = json.loads((path / "config.json").read_text())
        config(body)
        (path / "config.json").write_text(json.dumps(body))


@pytest.mark.parametrize("shard_size", [None, 7])
def test_a_quantized_checkpoint_round_trips_in_the_release_layout(tmp_path, quantized, shard_size):
    quantized.save_pretrained(tmp_path, shard_size=shard_size)
    body = json.loads((tmp_path / "config.json").read_text())
    assert body["quantization_config"]["quant_method"] == "fp8"
    assert body["quantization_config"]["weight_block_size"] == [128, 128]
    back = MtpWeights.from_pretrained(tmp_path)
    assert back.block_scaled and weights_equal(back, quantized)
    sd = back.state_dict()
    assert sd[Q_A].dtype == torch.float8_e4m3fn and sd[Q_A + "_scale_inv"].shape == (2, 2)
    assert sd[P + "eh_proj.weight"].dtype == torch.bfloat16 and P + "eh_proj.weight_scale_inv" not in sd


def test_a_cast_keeps_the_fp8_weights(tmp_path, quantized):
    quantized.save_pretrained(tmp_path)
    w = MtpWeights.from_pretrained(tmp_path, dtype=torch.float32)
    assert w.dtype == torch.float32 and fp8.is_block_scaled(w.layer.attn.q_a_proj)
    assert torch.equal(w.layer.attn.q_a_proj.w8.view(torch.uint8), quantized.layer.attn.q_a_proj.w8.view(torch.uint8))


def test_plain_weights_in_a_quantized_checkpoint_load_plain(tmp_path, quantized):
    """quantization_config does not force fp8: a bf16 expert (no scale) loads as bf16."""
    quantized.save_pretrained(tmp_path)
    plain = fp8.dequantize(quantized.layer.attn.q_a_proj, torch.bfloat16)
    edit(tmp_path, drop=[Q_A + "_scale_inv"], **{Q_A: plain})
    w = MtpWeights.from_pretrained(tmp_path)
    assert not fp8.is_block_scaled(w.layer.attn.q_a_proj) and fp8.is_block_scaled(w.layer.attn.q_b_proj)


def test_expert_parallel_loading_of_fp8_is_refused(tmp_path, quantized):
    quantized.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sharding block-scaled fp8 weights"):
        MtpWeights.from_pretrained(tmp_path, ep_rank=0, ep_world=2)


def drop_quantization(body):
    del body["quantization_config"]


def set_block(size):
    def change(body):
        body["quantization_config"]["weight_block_size"] = size
    return change


def set_method(body):
    body["quantization_config"]["quant_method"] = "gptq"


BAD = {
    "no quantization_config": (lambda q: dict(config=drop_quantization),
                               r"unexpected tensor .*weight_scale_inv' in the MTP layer: a block scale, but config.json "
                               r"declares no quantization_config"),
    "fp8 without config or scales": (lambda q: dict(config=drop_quantization, drop=[n + "_scale_inv" for n in FP8_NAMES]),
                                     rf"'{P}.*' is torch.float8_e4m3fn, but config.json has no quantization_config"),
    "block 64": (lambda q: dict(config=set_block([64, 64])), r"weight_block_size must be \[128, 128\].*got \[64, 64\]"),
    "block 1d": (lambda q: dict(config=set_block([128])), r"weight_block_size must be \[128, 128\]"),
    # another method's config: its float8 weights are a format this drafter does not read there
    "method": (lambda q: dict(config=set_method), rf"tensor '{P}.*' is quantized in gptq \('{P}.*_scale_inv' beside it\)"),
    "missing scale": (lambda q: dict(drop=[Q_A + "_scale_inv"]), rf"float8 tensor '{Q_A}' has no scale '{Q_A}_scale_inv'"),
    "scale shape": (lambda q: {Q_A + "_scale_inv": torch.ones(1, 2)},
                    rf"scale '{Q_A}_scale_inv' is torch.float32 \(1, 2\), expected float32 \(2, 2\)"),
    "scale dtype": (lambda q: {Q_A + "_scale_inv": torch.ones(2, 2, dtype=torch.bfloat16)},
                    rf"scale '{Q_A}_scale_inv' is torch.bfloat16"),
    "scale nan": (lambda q: {Q_A + "_scale_inv": torch.tensor([[1.0, float("nan")], [1.0, 1.0]])},
                  rf"scale '{Q_A}_scale_inv' holds 1 non-finite"),
    "scale inf": (lambda q: {EXPERT + "_scale_inv": torch.full((2, 2), float("inf"))},
                  rf"scale '{EXPERT}_scale_inv' holds 4 non-finite"),
    "extra scale": (lambda q: {P + "eh_proj.weight_scale_inv": torch.ones(2, 4)},
                    rf"scale '{P}eh_proj.weight_scale_inv' has no float8 weight '{P}eh_proj.weight'.*bfloat16"),
    "orphan scale": (lambda q: {P + "mlp.experts.99.up_proj.weight_scale_inv": torch.ones(2, 2)},
                     r"unexpected tensor .*experts.99.up_proj.weight_scale_inv.*a scale of no weight"),
    "fp8 eh_proj": (lambda q: {P + "eh_proj.weight": q.eh_proj.float().to(torch.float8_e4m3fn),
                               P + "eh_proj.weight_scale_inv": torch.ones(2, 4)},
                    rf"'{P}eh_proj.weight' is float8, but this tensor stays bf16"),
    "fp8 head": (lambda q: {"lm_head.weight": q.lm_head.float().to(torch.float8_e4m3fn)},
                 r"'lm_head.weight' is float8, but this tensor stays bf16"),
    "e5m2": (lambda q: {Q_A: q.layer.attn.q_a_proj.w8.float().to(torch.float8_e5m2)},
             rf"'{Q_A}' is torch.float8_e5m2; block-scaled weights must be float8_e4m3fn"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_fp8_checkpoint_is_refused_naming_the_tensor(tmp_path, quantized, case):
    quantized.save_pretrained(tmp_path)
    make, pattern = BAD[case]
    edit(tmp_path, **make(quantized))
    with pytest.raises(CheckpointError, match=pattern):
        MtpWeights.from_pretrained(tmp_path)


def test_a_nan_fp8_value_is_refused_unless_allowed(tmp_path, quantized):
    quantized.save_pretrained(tmp_path)
    w8 = quantized.layer.attn.q_a_proj.w8.clone()
    w8.view(torch.uint8)[5, 7] = 0xFF  # e4m3fn NaN
    edit(tmp_path, **{Q_A: w8})
    with pytest.raises(CheckpointError, match=rf"'{Q_A}' holds 1 NaN"):
        MtpWeights.from_pretrained(tmp_path)
    assert MtpWeights.from_pretrained(tmp_path, allow_non_finite=True).block_scaled


def test_glm5_next_fp8_round_trips_and_drafts(tmp_path):
    """The glm5_next family: its §8 matrices quantize, save and load in the same layout, and draft
    as their dequantized weights on these inputs (S = float32)."""
    from glm_mtp.reference import ReferenceProposer

    cfg = MtpConfig.preset("glm5next_tiny")
    q = MtpWeights.random(cfg, seed=0, dtype=torch.float32).quantize_fp8()
    q.save_pretrained(tmp_path)
    back = MtpWeights.from_pretrained(tmp_path)
    assert back.block_scaled and weights_equal(back, q)
    drafts = []
    for w in (back, q.dequantize(torch.float32)):
        prop = ReferenceProposer(w, max_seq_len=32)
        st = prop.alloc_state("cpu")
        gen = torch.Generator().manual_seed(1)
        toks = torch.randint(cfg.vocab_size, (6,), generator=gen)
        hid = torch.randn(6, cfg.hidden_size, generator=gen)
        prop.prefill_drafter(toks, hid, st)
        drafts.append(prop.propose(int(toks[-1]), hid[-1], 5, 3, st))
    assert drafts[0] == drafts[1]
