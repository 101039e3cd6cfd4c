"""MtpConfig of the glm5_next family (GLM-5.3-Flash, DESIGN.md §7): presets, its config.json
forms (nested ``text_config`` and flat ``glm5_next_text``) and the family's rules, each named."""

import json

import pytest

from glm_mtp.reference import MtpConfig


def test_glm5next_preset_has_the_real_values():
    c = MtpConfig.preset("glm5next")
    assert c.family == "glm5_next" and c.is_next
    assert (c.hidden_size, c.vocab_size, c.num_hidden_layers, c.mtp_layer_index) == (4096, 154880, 45, 45)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        1536,
        512,
        256,
        0,
        256,
    )
    assert (c.num_attention_heads, c.n_routed_experts, c.num_experts_per_tok, c.n_group) == (64, 288, 8, 1)
    # the release pools 4 rows (512 pools plus a tail of at most 3) and shares step 1's selection
    assert (c.routed_scaling_factor, c.index_topk, c.index_kpool, c.swiglu_limit) == (2.5, 2048, 4, 10.0)
    assert c.kpool_pools_selected == 512 and c.index_share_for_mtp_iteration
    assert c.index_kpool_always_select_tail and c.max_position_embeddings == 1048576
    assert (
        c.layer_prefix == "model.language_model.layers.45."
        and c.embed_tokens_name == "model.language_model.embed_tokens.weight"
    )
    assert c.qk_head_dim == 256 and c.kv_row_width == 512


@pytest.mark.parametrize("name", ["glm5next_tiny", "glm5next_small"])
def test_small_presets_have_the_structure(name):
    c, real = MtpConfig.preset(name), MtpConfig.preset("glm5next")
    assert c.family == real.family and c.qk_rope_head_dim == 0 and c.index_kpool == 4
    assert c.index_topk % c.index_kpool == 0 and c.index_topk // c.index_kpool >= 2 and c.swiglu_limit > 0
    assert c.n_group == 1 and c.n_shared_experts == 1
    assert c.index_share_for_mtp_iteration  # the small presets share like the release


@pytest.mark.parametrize("name", ["tiny", "small", "glm5", "glm5_shape"])
def test_glm5_presets_do_not_share(name):
    assert not MtpConfig.preset(name).index_share_for_mtp_iteration


@pytest.mark.parametrize("family", ["glm5", "glm5next_tiny"])
def test_index_share_is_read_from_config_json(family):
    c = MtpConfig.preset("tiny" if family == "glm5" else family)
    body = c.to_hf_dict()
    text = body.get("text_config", body)
    for value in (True, False):
        text["index_share_for_mtp_iteration"] = value
        assert MtpConfig.from_hf_config(body).index_share_for_mtp_iteration is value
    del text["index_share_for_mtp_iteration"]
    assert MtpConfig.from_hf_config(body).index_share_for_mtp_iteration is False  # absent = false, as GLM-5 ships
    for bad in ("true", 1, 0, [True]):
        text["index_share_for_mtp_iteration"] = bad
        with pytest.raises(ValueError, match="index_share_for_mtp_iteration must be a JSON boolean"):
            MtpConfig.from_hf_config(body)
    with pytest.raises(ValueError, match="MtpConfig.index_share_for_mtp_iteration must be a boolean"):
        c.replace(index_share_for_mtp_iteration="false")


def test_index_kpool_compress_false_is_refused_by_name():
    body = MtpConfig.preset("glm5next_tiny").to_hf_dict()
    assert body["text_config"]["index_kpool_compress"] is True
    body["text_config"]["index_kpool_compress"] = False
    with pytest.raises(ValueError, match="index_kpool_compress must be true"):
        MtpConfig.from_hf_config(body)
    body["text_config"]["index_kpool_compress"] = "yes"
    with pytest.raises(ValueError, match="index_kpool_compress must be a JSON boolean"):
        MtpConfig.from_hf_config(body)


@pytest.mark.parametrize("name", ["glm5next", "glm5next_tiny", "glm5next_small"])
def test_round_trip_nested_and_flat(name, tmp_path):
    c = MtpConfig.preset(name)
    nested = c.to_hf_dict()
    assert nested["model_type"] == "glm5_next" and nested["text_config"]["model_type"] == "glm5_next_text"
    assert MtpConfig.from_hf_config(nested) == c
    assert MtpConfig.from_hf_config(nested["text_config"]) == c  # the flat glm5_next_text form
    assert MtpConfig.from_hf_config({**nested["text_config"], "model_type": "glm5_next"}) == c  # text fields at the top
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert MtpConfig.from_hf_config(tmp_path) == c


def test_glm5_configs_do_not_carry_the_family_fields():
    d = MtpConfig.preset("tiny").to_hf_dict()
    assert "family" not in d and "index_kpool" not in d and "swiglu_limit" not in d


def test_a_real_style_config_reads_with_unused_fields():
    text = MtpConfig.preset("glm5next").to_hf_dict()["text_config"]
    for unused in ("rope_theta", "index_kpool", "swiglu_limit", "index_kpool_always_select_tail", "qk_head_dim"):
        del text[unused]  # transformers' defaults apply
    text.update(layer_types=["linear_attention"] * 45, hc_mult=4, linear_num_heads=64)
    c = MtpConfig.from_hf_config({"model_type": "glm5_next", "text_config": text, "vision_config": {"depth": 24}})
    # transformers' class default pools 16 rows; the release states 4
    assert c == MtpConfig.preset("glm5next").replace(rope_theta=10000.0, index_kpool=16)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"index_topk": 6}, r"index_topk \(6\) must be a multiple of index_kpool \(4\)"),
        ({"qk_rope_head_dim": 8}, r"qk_rope_head_dim must be 0 in family 'glm5_next'"),
        ({"index_kpool": 0}, r"index_kpool must be a positive integer"),
        ({"index_kpool": True}, r"index_kpool must be a positive integer"),
        ({"swiglu_limit": None}, r"swiglu_limit must be a finite number > 0"),
        ({"swiglu_limit": float("inf")}, r"swiglu_limit must be a finite number > 0"),
        ({"swiglu_limit": -1.0}, r"swiglu_limit must be a finite number > 0"),
        ({"index_kpool_always_select_tail": False}, r"index_kpool_always_select_tail must be true"),
        ({"family": "glm6"}, r"family must be one of"),
    ],
)
def test_family_rules_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        MtpConfig.preset("glm5next_tiny").replace(**change)


@pytest.mark.parametrize("change", [{"index_kpool": 4}, {"swiglu_limit": 10.0}])
def test_glm5_family_refuses_next_fields(change):
    with pytest.raises(ValueError, match="are glm5_next fields"):
        MtpConfig.preset("tiny").replace(**change)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["text_config"].update(index_topk=10),
         r"text_config: MtpConfig.index_topk \(10\) must be a multiple"),
        (lambda d: d["text_config"].update(qk_rope_head_dim=64, qk_head_dim=80), r"qk_rope_head_dim must be 0"),
        (lambda d: d["text_config"].update(index_kpool="4"), r"index_kpool must be a JSON integer"),
        (lambda d: d["text_config"].update(swiglu_limit="10"), r"swiglu_limit must be a finite JSON number"),
        (lambda d: d["text_config"].update(index_kpool_always_select_tail="true"), r"must be a JSON boolean"),
        (lambda d: d["text_config"].pop("index_n_heads"), r"required field 'index_n_heads' is missing"),
        (lambda d: d["text_config"].update(model_type="glm_moe_dsa"),
         r"text_config.model_type must be 'glm5_next_text'"),
        (lambda d: d.update(text_config=[1]), r"text_config must be a JSON object"),
    ],
)
def test_hf_config_strictness(edit, message):
    d = MtpConfig.preset("glm5next_tiny").to_hf_dict()
    edit(d)
    with pytest.raises(ValueError, match=message):
        MtpConfig.from_hf_config(d)
