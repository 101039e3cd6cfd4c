"""Tiny random checkpoints of both families in the release layout, for the HF-target tests.

transformers builds the target (``Glm5NextForConditionalGeneration``: KDA linear layers and DSA
layers inside mHC hyper-connections, one DSA layer reusing the previous one's selection through
``indexer_types``; ``GlmMoeDsaForCausalLM``: DSA layers), ``save_pretrained`` writes it, and a
random MTP layer of the package (``MtpWeights.random``) is written under
``layers.{num_hidden_layers}``, beside the target's tensors, in one sharded checkpoint (config.json
with ``num_nextn_predict_layers: 1``, ``model.safetensors.index.json``), as the releases hold it.
A character-level tokenizer with a chat template goes beside it, so prompts are text.

    python tests/experiments/hf_checkpoints.py DIR glm5_next|glm_moe_dsa   # writes one (the docs' demo)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
from safetensors.torch import load_file

from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.reference.checkpoint import save_checkpoint

FAMILIES = ("glm5_next", "glm_moe_dsa")
# A character per token: the 95 printable ASCII characters and a padding token, 96 ids (the
# tiny presets' vocabulary).
CHARS = [chr(c) for c in range(32, 127)]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def next_hf_config(cfg: MtpConfig) -> dict:
    """GLM-5.3-Flash's structure at the preset's widths: 6 layers, KDA at 0, 1, 4, 5 and DSA at
    2, 3 (layer 3 reuses layer 2's selection), 2 mHC streams, a tiny vision tower."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig

    text = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=6,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, n_shared_experts=cfg.n_shared_experts,
        n_routed_experts=cfg.n_routed_experts,
        routed_scaling_factor=cfg.routed_scaling_factor, kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=0, v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim, n_group=cfg.n_group,
        topk_group=cfg.topk_group, num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps, index_topk=cfg.index_topk,
        index_head_dim=cfg.index_head_dim, index_n_heads=cfg.index_n_heads, swiglu_limit=cfg.swiglu_limit,
        index_kpool=cfg.index_kpool, index_kpool_always_select_tail=True, pad_token_id=None, initializer_range=0.1,
        mlp_layer_types=["dense"] + ["sparse"] * 5,
        layer_types=["linear_attention", "linear_attention", "indexed_attention", "indexed_attention",
                     "linear_attention",
                     "linear_attention"],
        indexer_types=["full", "full", "full", "shared", "full", "full"],
        linear_head_dim=16, linear_num_heads=2, hc_mult=2,
        index_share_for_mtp_iteration=cfg.index_share_for_mtp_iteration, num_nextn_predict_layers=1,
    )
    vision = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=cfg.hidden_size, intermediate_size=32,
                  projection_intermediate_size=32)
    return Glm5NextConfig(text_config=text, vision_config=vision).to_dict()


def dsa_hf_config(cfg: MtpConfig) -> dict:
    """GLM-5 at the preset's widths: 3 DSA layers, the first dense."""
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig

    return GlmMoeDsaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=3,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, n_shared_experts=cfg.n_shared_experts,
        n_routed_experts=cfg.n_routed_experts,
        routed_scaling_factor=cfg.routed_scaling_factor, kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.n_group, topk_group=cfg.topk_group, num_experts_per_tok=cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        index_topk=cfg.index_topk, index_head_dim=cfg.index_head_dim, index_n_heads=cfg.index_n_heads,
        first_k_dense_replace=1, initializer_range=0.1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, num_nextn_predict_layers=1,
    ).to_dict()


def randomise_constants(model: torch.nn.Module, gen: torch.Generator) -> None:
    """transformers initialises norms, the routing bias and the KPool gate and position table to
    constants; draw them, so every tensor of the target matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * r)
            elif name.endswith("index_kpool_compress_ape"):
                p.copy_(r)
            elif name.endswith("index_kpool_compress_gate"):
                p.copy_(r * p.shape[-1] ** -0.5)
            elif p.dim() == 1 and (name.endswith("norm.weight") or name.endswith("layernorm.weight")):
                p.copy_(1.0 + 0.1 * r)


def write_tokenizer(directory: str) -> None:
    """A character-level tokenizer (``tokenizers``' WordLevel) with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)} | {"<pad>": len(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def write_hf_checkpoint(directory: str | os.PathLike[str], family: str, seed: int = 0) -> MtpConfig:
    """A tiny random checkpoint of ``family`` (``glm5_next`` or ``glm_moe_dsa``) in the release
    layout in ``directory``; returns the drafter's config as read back from it."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    from transformers import AutoModelForCausalLM
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    preset = MtpConfig.preset("glm5next_tiny" if family == "glm5_next" else "tiny")
    config = next_hf_config(preset) if family == "glm5_next" else dsa_hf_config(preset)
    torch.manual_seed(seed)
    if family == "glm5_next":
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig

        model = Glm5NextForConditionalGeneration(Glm5NextConfig.from_dict(config))
    else:
        from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig

        model = AutoModelForCausalLM.from_config(GlmMoeDsaConfig.from_dict(config))
    randomise_constants(model.float(), torch.Generator().manual_seed(seed + 1))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        with open(os.path.join(tmp, "config.json")) as f:
            saved = json.load(f)
        tensors = load_file(os.path.join(tmp, "model.safetensors"))
    cfg = MtpConfig.from_hf_config(saved)
    mtp = MtpWeights.random(cfg, seed=seed + 2, dtype=torch.float32)
    layer = {n: t for n, t in mtp.state_dict().items() if n.startswith(cfg.layer_prefix)}
    save_checkpoint(directory, saved, {**tensors, **layer}, shard_size=len(tensors) // 2 + 1)
    write_tokenizer(os.fspath(directory))
    return cfg


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    write_hf_checkpoint(sys.argv[1], sys.argv[2])
    print(f"wrote a tiny {sys.argv[2]} checkpoint to {sys.argv[1]}")
