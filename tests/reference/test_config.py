"""MtpConfig: presets, reading GLM-5 / DeepSeek-V3.2 config.json, and named errors."""

import json

import pytest

from glm_mtp.reference import MtpConfig


def test_glm5_preset_has_the_real_values():
    c = MtpConfig.preset("glm5")
    assert (c.hidden_size, c.vocab_size, c.q_lora_rank, c.kv_lora_rank) == (6144, 154880, 2048, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.num_attention_heads) == (192, 64, 256, 64)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size) == (256, 8, 1, 2048)
    assert (c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob) == (1, 1, 2.5, True)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (32, 128, 2048)
    assert (c.rope_theta, c.rope_interleave, c.indexer_rope_interleave, c.rms_norm_eps) == (1e6, True, True, 1e-5)
    assert c.num_hidden_layers == 78 and c.mtp_layer_index == 78


def test_tiny_preset_exercises_every_structural_feature():
    c = MtpConfig.preset("tiny")
    capacity = 16 * (64 // 16 + 2)
    assert c.index_n_heads > 1 and c.index_topk < capacity
    assert c.n_routed_experts >= 4 and c.num_experts_per_tok == 2 and c.n_group > 1 and c.topk_group < c.n_group
    assert c.n_shared_experts >= 1


def test_presets_and_unknown():
    for name in ("tiny", "small", "glm5", "glm5_shape"):
        MtpConfig.preset(name)
    with pytest.raises(ValueError, match="unknown MtpConfig preset 'huge'"):
        MtpConfig.preset("huge")


def test_round_trip_through_hf_dict():
    for name in ("tiny", "small", "glm5"):
        c = MtpConfig.preset(name)
        assert MtpConfig.from_hf_config(c.to_hf_dict()) == c


def test_reads_golden_config(tmp_path):
    from pathlib import Path

    c = MtpConfig.from_hf_config(Path(__file__).parents[1] / "data" / "golden" / "dense_topk64_n12")
    assert c.hidden_size == 64 and c.index_topk == 64 and c.n_group == 2 and c.rope_theta == 10000.0
    assert c.mtp_layer_index == 1


def test_deepseek_v32_names_and_rope_parameters(tmp_path):
    d = MtpConfig.preset("tiny").to_hf_dict()
    d["model_type"] = "deepseek_v32"
    del d["rope_theta"]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    for unused in ("rope_interleave", "indexer_rope_interleave", "n_shared_experts"):
        del d[unused]  # defaults apply
    d["some_unused_field"] = [1, 2, 3]
    (tmp_path / "config.json").write_text(json.dumps(d))
    c = MtpConfig.from_hf_config(tmp_path)
    assert c.rope_theta == 5000.0 and c.rope_interleave and c.n_shared_experts == 1


@pytest.mark.parametrize(
    "change,field",
    [
        ({"index_topk": 0}, "index_topk"),
        ({"qk_head_dim": 99}, "qk_head_dim"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"index_head_dim": 4}, "index_head_dim"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 9}, "topk_group"),
        ({"num_experts_per_tok": 7}, "num_experts_per_tok"),
        ({"model_type": "llama"}, "model_type"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"rope_scaling": {"type": "yarn", "factor": 4}}, "rope_scaling"),
        ({"hidden_size": None}, "hidden_size"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"num_nextn_predict_layers": 0}, "num_nextn_predict_layers"),
    ],
)
def test_bad_configs_name_the_field(change, field):
    d = MtpConfig.preset("tiny").to_hf_dict()
    d.update(change)
    if change.get("hidden_size", 0) is None:
        del d["hidden_size"]
    with pytest.raises(ValueError, match=field):
        MtpConfig.from_hf_config(d)


@pytest.mark.parametrize(
    "field,value,rule",
    [
        ("norm_topk_prob", "false", "JSON boolean"),
        ("norm_topk_prob", 0, "JSON boolean"),
        ("rope_interleave", "true", "JSON boolean"),
        ("indexer_rope_interleave", 1, "JSON boolean"),
        ("tie_word_embeddings", "false", "JSON boolean"),
        ("rope_theta", "10000", "number"),
        ("rope_theta", True, "number"),
        ("rope_theta", float("inf"), "finite"),
        ("rope_theta", 10**400, "finite"),
        ("routed_scaling_factor", "2.5", "number"),
        ("rms_norm_eps", [1e-5], "number"),
        ("hidden_size", "64", "integer"),
        ("hidden_size", 64.0, "integer"),
        ("n_group", True, "integer"),
        ("first_k_dense_replace", "1", "integer"),
        ("num_nextn_predict_layers", "1", "integer"),
        ("num_nextn_predict_layers", 1.5, "integer"),
        ("qk_head_dim", "24", "must equal"),
        ("rope_scaling", "yarn", "object"),
        ("rope_scaling", {"type": 3}, "rope_type"),
        ("rope_parameters", ["default"], "object"),
        ("rope_parameters", {"rope_type": "default", "rope_theta": "5e3"}, "number"),
        ("model_type", ["glm_moe_dsa"], "must be one of"),
    ],
)
def test_a_wrong_type_is_a_value_error_naming_the_field(field, value, rule):
    d = MtpConfig.preset("tiny").to_hf_dict()
    d[field] = value
    if field == "rope_parameters" and isinstance(value, dict):
        del d["rope_theta"]
    with pytest.raises(ValueError, match=rf"{field}.*{rule}|{rule}.*{field}"):
        MtpConfig.from_hf_config(d)


@pytest.mark.parametrize("field,value", [("norm_topk_prob", "false"), ("rope_theta", "1e4"), ("rms_norm_eps", None)])
def test_the_dataclass_checks_types_too(field, value):
    with pytest.raises(ValueError, match=field):
        MtpConfig.preset("tiny").replace(**{field: value})


def test_integer_valued_numbers_are_numbers():
    d = MtpConfig.preset("tiny").to_hf_dict()
    d.update(rope_theta=10000, routed_scaling_factor=2, tie_word_embeddings=False)
    c = MtpConfig.from_hf_config(d)
    assert isinstance(c.rope_theta, float) and c.rope_theta == 10000.0 and c.routed_scaling_factor == 2.0


@pytest.mark.parametrize("body,match", [("{oops", "not valid JSON"), ("[1, 2]", "JSON object"), ('"x"', "JSON object")])
def test_an_unreadable_config_file_is_named(tmp_path, body, match):
    (tmp_path / "config.json").write_text(body)
    with pytest.raises(ValueError, match=rf"config\.json.*{match}"):
        MtpConfig.from_hf_config(tmp_path)


def test_any_field_of_any_type_gives_a_config_or_a_value_error_naming_it():
    base = MtpConfig.preset("tiny").to_hf_dict()
    base.update(tie_word_embeddings=False, rope_scaling=None, rope_parameters=None)
    odd = ["x", "1", "true", 1.5, True, False, 0, -3, [], [1], {}, {"type": "default"}, 10**400, float("nan"), None]
    for field in base:
        for value in odd:
            d = {**base, field: value}
            try:
                MtpConfig.from_hf_config(d)
            except ValueError as e:
                assert field in str(e) or (field == "qk_rope_head_dim" and "qk_head_dim" in str(e)), (field, value, e)
