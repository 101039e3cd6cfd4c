"""MtpWeights: the MTP layer's tensors, named as in a GLM-5 (or GLM-5.3-Flash) checkpoint, and how they load.

One table (``layer_tensor_shapes``) lists every tensor a decoder layer holds under its checkpoint
name; random init, loading, saving and the error messages all read it, so the names live in one
place. Routed experts are stored stacked ``(E, ...)`` so a row's experts are one gather away.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields, is_dataclass
from typing import Iterator

import torch
from torch import Tensor

from . import fp8
from .bytes import same_bytes
from .checkpoint import (
    WEIGHT_DTYPES, check_checkpoint_directory, check_shard_size, count_non_finite, float32_tensor, load_mtp_tensors,
    save_checkpoint,
)
from .config import MtpConfig
from .distributed import ShardSpec, ep_propose_enabled

# The KPool indexer's tensors (glm5_next), relative to the layer: nn.Parameters, so no ".weight".
KPOOL_APE = "self_attn.indexer.index_kpool_compress_ape"
KPOOL_GATE = "self_attn.indexer.index_kpool_compress_gate"


@dataclass
class MlpWeights:
    """A SwiGLU MLP: a dense layer's MLP or the MoE's shared expert."""

    gate_proj: Tensor  # (I, H)
    up_proj: Tensor  # (I, H)
    down_proj: Tensor  # (H, I)


@dataclass
class MoeWeights:
    """Sigmoid-routed experts plus the shared expert. Sharded (``shard`` set), the experts
    tensors hold this rank's block of ``E / world`` experts only."""

    router: Tensor  # (E, H)   checkpoint: mlp.gate.weight
    e_score_correction_bias: Tensor  # (E,) float32, used for selection only
    experts_gate: Tensor  # (E_local, I, H)
    experts_up: Tensor  # (E_local, I, H)
    experts_down: Tensor  # (E_local, H, I)
    shared: MlpWeights | None
    shard: ShardSpec | None = None
    swiglu_limit: float | None = None  # glm5_next: every expert's SwiGLU is clamped (moe.expert_swiglu)


@dataclass
class IndexerWeights:
    """The lightning indexer of DSA attention."""

    wq_b: Tensor  # (n_heads * head_dim, q_lora_rank)
    wk: Tensor  # (head_dim, H)
    k_norm_weight: Tensor  # (head_dim,)
    k_norm_bias: Tensor  # (head_dim,)
    weights_proj: Tensor  # (n_heads, H)
    kpool_ape: Tensor | None = None  # glm5_next: (index_kpool, head_dim), checkpoint: index_kpool_compress_ape
    kpool_gate: Tensor | None = None  # glm5_next: (head_dim, H), checkpoint: index_kpool_compress_gate


@dataclass
class AttentionWeights:
    """MLA attention (low-rank q, compressed kv) with its indexer. With a row-parallel
    ``shard``, ``o_proj`` holds this rank's heads' input columns only."""

    q_a_proj: Tensor  # (q_lora_rank, H)
    q_a_layernorm: Tensor  # (q_lora_rank,)
    q_b_proj: Tensor  # (n_heads * qk_head_dim, q_lora_rank)
    kv_a_proj_with_mqa: Tensor  # (kv_lora_rank + rope_dim, H)
    kv_a_layernorm: Tensor  # (kv_lora_rank,)
    kv_b_proj: Tensor  # (n_heads * (nope_dim + v_dim), kv_lora_rank)
    o_proj: Tensor  # (H, n_heads * v_dim)
    indexer: IndexerWeights
    shard: ShardSpec | None = None


@dataclass
class DecoderLayerWeights:
    """One GLM-5 decoder layer: DSA attention and an MoE (or, in a dense layer, an MLP)."""

    input_layernorm: Tensor  # (H,)
    post_attention_layernorm: Tensor  # (H,)
    attn: AttentionWeights
    mlp: MoeWeights | MlpWeights


# ------------------------------------------------------------------------------------------------
# The name table.


def layer_tensor_shapes(cfg: MtpConfig, sparse: bool = True) -> dict[str, tuple[int, ...]]:
    """Checkpoint name (relative to ``model.layers.{i}.``) -> shape, for one decoder layer."""
    H, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    nh = cfg.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "self_attn.q_a_proj.weight": (cfg.q_lora_rank, H),
        "self_attn.q_a_layernorm.weight": (cfg.q_lora_rank,),
        "self_attn.q_b_proj.weight": (nh * cfg.qk_head_dim, cfg.q_lora_rank),
        "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_row_width, H),
        "self_attn.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "self_attn.o_proj.weight": (H, nh * cfg.v_head_dim),
        "self_attn.indexer.wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
        "self_attn.indexer.wk.weight": (cfg.index_head_dim, H),
        "self_attn.indexer.k_norm.weight": (cfg.index_head_dim,),
        "self_attn.indexer.k_norm.bias": (cfg.index_head_dim,),
        "self_attn.indexer.weights_proj.weight": (cfg.index_n_heads, H),
    }
    if cfg.is_next:
        shapes[KPOOL_APE] = (cfg.index_kpool, cfg.index_head_dim)
        shapes[KPOOL_GATE] = (cfg.index_head_dim, H)
    if not sparse:
        Id = cfg.intermediate_size
        shapes.update({"mlp.gate_proj.weight": (Id, H), "mlp.up_proj.weight": (Id, H), "mlp.down_proj.weight": (H, Id)})
        return shapes
    shapes["mlp.gate.weight"] = (E, H)
    shapes["mlp.gate.e_score_correction_bias"] = (E,)
    for e in range(E):
        shapes[f"mlp.experts.{e}.gate_proj.weight"] = (I, H)
        shapes[f"mlp.experts.{e}.up_proj.weight"] = (I, H)
        shapes[f"mlp.experts.{e}.down_proj.weight"] = (H, I)
    if cfg.n_shared_experts:
        Is = I * cfg.n_shared_experts
        shapes["mlp.shared_experts.gate_proj.weight"] = (Is, H)
        shapes["mlp.shared_experts.up_proj.weight"] = (Is, H)
        shapes["mlp.shared_experts.down_proj.weight"] = (H, Is)
    return shapes


def mtp_tensor_shapes(cfg: MtpConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name (relative to ``cfg.layer_prefix``) -> shape, MTP layer."""
    H = cfg.hidden_size
    return {
        "enorm.weight": (H,),
        "hnorm.weight": (H,),
        "eh_proj.weight": (H, 2 * H),
        "shared_head.norm.weight": (H,),
        **layer_tensor_shapes(cfg, sparse=True),
    }


def embed_head_tensor_shapes(cfg: MtpConfig) -> dict[str, tuple[int, ...]]:
    """Absolute checkpoint name -> shape for the tensors an MTP drafter reads outside its layer."""
    return {cfg.embed_tokens_name: (cfg.vocab_size, cfg.hidden_size),
            "lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}


def decoder_layer_from_tensors(
    cfg: MtpConfig, t: dict[str, Tensor], sparse: bool = True, experts: range | None = None
) -> DecoderLayerWeights:
    """Build a layer from tensors keyed by their layer-relative checkpoint names (of the routed
    experts, only those in ``experts`` when given: a shard's block)."""
    attn = AttentionWeights(
        q_a_proj=t["self_attn.q_a_proj.weight"],
        q_a_layernorm=t["self_attn.q_a_layernorm.weight"],
        q_b_proj=t["self_attn.q_b_proj.weight"],
        kv_a_proj_with_mqa=t["self_attn.kv_a_proj_with_mqa.weight"],
        kv_a_layernorm=t["self_attn.kv_a_layernorm.weight"],
        kv_b_proj=t["self_attn.kv_b_proj.weight"],
        o_proj=t["self_attn.o_proj.weight"],
        indexer=IndexerWeights(
            wq_b=t["self_attn.indexer.wq_b.weight"],
            wk=t["self_attn.indexer.wk.weight"],
            k_norm_weight=t["self_attn.indexer.k_norm.weight"],
            k_norm_bias=t["self_attn.indexer.k_norm.bias"],
            weights_proj=t["self_attn.indexer.weights_proj.weight"],
            kpool_ape=t[KPOOL_APE] if cfg.is_next else None,
            kpool_gate=t[KPOOL_GATE] if cfg.is_next else None,
        ),
    )
    mlp: MoeWeights | MlpWeights
    if sparse:
        held = experts if experts is not None else range(cfg.n_routed_experts)
        shared = None
        if cfg.n_shared_experts:
            shared = MlpWeights(
                t["mlp.shared_experts.gate_proj.weight"], t["mlp.shared_experts.up_proj.weight"],
                t["mlp.shared_experts.down_proj.weight"]
            )
        mlp = MoeWeights(
            router=t["mlp.gate.weight"],
            e_score_correction_bias=t["mlp.gate.e_score_correction_bias"].float(),
            experts_gate=fp8.stack_weights([t[f"mlp.experts.{e}.gate_proj.weight"] for e in held],
                                           "mlp.experts.*.gate_proj"),
            experts_up=fp8.stack_weights([t[f"mlp.experts.{e}.up_proj.weight"] for e in held], "mlp.experts.*.up_proj"),
            experts_down=fp8.stack_weights([t[f"mlp.experts.{e}.down_proj.weight"] for e in held],
                                           "mlp.experts.*.down_proj"),
            shared=shared,
            swiglu_limit=cfg.swiglu_limit,
        )
    else:
        mlp = MlpWeights(t["mlp.gate_proj.weight"], t["mlp.up_proj.weight"], t["mlp.down_proj.weight"])
    return DecoderLayerWeights(t["input_layernorm.weight"], t["post_attention_layernorm.weight"], attn, mlp)


def decoder_layer_to_tensors(layer: DecoderLayerWeights) -> dict[str, Tensor]:
    """The inverse of ``decoder_layer_from_tensors``: layer-relative checkpoint name -> tensor."""
    a, ix = layer.attn, layer.attn.indexer
    out = {
        "input_layernorm.weight": layer.input_layernorm,
        "post_attention_layernorm.weight": layer.post_attention_layernorm,
        "self_attn.q_a_proj.weight": a.q_a_proj,
        "self_attn.q_a_layernorm.weight": a.q_a_layernorm,
        "self_attn.q_b_proj.weight": a.q_b_proj,
        "self_attn.kv_a_proj_with_mqa.weight": a.kv_a_proj_with_mqa,
        "self_attn.kv_a_layernorm.weight": a.kv_a_layernorm,
        "self_attn.kv_b_proj.weight": a.kv_b_proj,
        "self_attn.o_proj.weight": a.o_proj,
        "self_attn.indexer.wq_b.weight": ix.wq_b,
        "self_attn.indexer.wk.weight": ix.wk,
        "self_attn.indexer.k_norm.weight": ix.k_norm_weight,
        "self_attn.indexer.k_norm.bias": ix.k_norm_bias,
        "self_attn.indexer.weights_proj.weight": ix.weights_proj,
    }
    if ix.kpool_ape is not None and ix.kpool_gate is not None:
        out[KPOOL_APE], out[KPOOL_GATE] = ix.kpool_ape, ix.kpool_gate
    m = layer.mlp
    if (isinstance(m, MoeWeights) and m.shard is not None) or layer.attn.shard is not None:
        raise ValueError("a sharded layer holds part of the tensors; save the unsharded weights instead")
    if isinstance(m, MlpWeights):
        out.update({"mlp.gate_proj.weight": m.gate_proj, "mlp.up_proj.weight": m.up_proj,
                    "mlp.down_proj.weight": m.down_proj})
        return out
    out["mlp.gate.weight"] = m.router
    out["mlp.gate.e_score_correction_bias"] = m.e_score_correction_bias
    for e in range(m.experts_gate.shape[0]):
        out[f"mlp.experts.{e}.gate_proj.weight"] = m.experts_gate[e]
        out[f"mlp.experts.{e}.up_proj.weight"] = m.experts_up[e]
        out[f"mlp.experts.{e}.down_proj.weight"] = m.experts_down[e]
    if m.shared is not None:
        out["mlp.shared_experts.gate_proj.weight"] = m.shared.gate_proj
        out["mlp.shared_experts.up_proj.weight"] = m.shared.up_proj
        out["mlp.shared_experts.down_proj.weight"] = m.shared.down_proj
    return out


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator,
                  device: torch.device | str = "cpu") -> Tensor:
    """A float32 init for a tensor by its name: norms near 1, biases small, matrices ~ 1/sqrt(fan_in)."""
    t = torch.randn(shape, generator=gen, device=device)
    if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
        return t.mul_(0.1)
    if name.endswith("index_kpool_compress_ape"):  # position logits of O(1): the pool softmax is not uniform
        return t
    if len(shape) == 1:  # norm weights
        return t.mul_(0.1).add_(1.0)
    if name.endswith("embed_tokens.weight"):
        return t
    return t.mul_(shape[-1] ** -0.5)


# ---- the rules every made MtpWeights obeys -------------------------------------------------------
# Checked wherever weights are made (``random``, ``to``, ``from_pretrained``, ``shard``, the
# constructor), before the work where an argument decides it: a drafter computes in its weights'
# dtype, so an int8 model would draft zeros for every input instead of failing.

ROUTING_BIAS = "e_score_correction_bias"


def check_weight_dtype(name: str, dtype: object) -> torch.dtype:
    """``dtype`` as a weight dtype (one of ``WEIGHT_DTYPES``); ``ValueError`` naming ``name``."""
    if not isinstance(dtype, torch.dtype) or dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{name} must be a floating torch.dtype ({', '.join(map(str, WEIGHT_DTYPES))}), got {dtype!r}")
    return dtype


def check_device(name: str, device: object) -> torch.device:
    """``device`` as a ``torch.device`` (a device, or a string torch parses); ``ValueError`` naming ``name``."""
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise ValueError(f"{name} must be a torch.device or a device string such as 'cpu' or 'cuda:0', got "
                         f"{type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{name}: {device!r} is not a device ({e})") from None


def check_cast_finite(name: str, before: Tensor, after: Tensor) -> None:
    """A cast must not make a finite weight non-finite (a bfloat16 value past float16's 65504
    becomes inf): ``ValueError`` naming the tensor. One read of ``after`` (``count_non_finite``)."""
    if after.dtype == before.dtype:
        return
    bad = count_non_finite(after)
    if bad and bad > count_non_finite(before):
        raise ValueError(f"tensor {name!r}: casting {before.dtype} to {after.dtype} overflows "
                         f"{bad - count_non_finite(before)} finite value(s) to inf (the largest {after.dtype} value is "
                         f"{torch.finfo(after.dtype).max:g}); keep a wider dtype")


def check_shard_args(call: str, names: tuple[str, str, str], rank: object, world: object,
                     row_parallel_o_proj: object) -> None:
    """The expert-parallel arguments (``names``: how ``call`` calls rank, world and
    row_parallel_o_proj): integers with ``0 <= rank < world`` and a bool flag, checked even when
    ``world == 1`` shards nothing (a rank of 3 in a world of 1 is a mistake, not a no-op)."""
    rank_name, world_name, flag_name = names
    for name, value, least in ((world_name, world, 1), (rank_name, rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{call}: {name} must be an integer, got {type(value).__name__}")
        if value < least:
            raise ValueError(f"{call}: {name} must be >= {least}, got {value}")
    if rank >= world:  # type: ignore[operator]  # rank and world are user input, checked to be ints just above
        raise ValueError(f"{call}: {rank_name} must be in [0, {world_name}={world}), got {rank}")
    if not isinstance(row_parallel_o_proj, bool):
        raise ValueError(f"{call}: {flag_name} must be a bool, got {type(row_parallel_o_proj).__name__}")


def field_tensors(obj: object, prefix: str = "") -> Iterator[tuple[str, Tensor | fp8.BlockScaledWeight]]:
    """Every weight of a weights dataclass and of the dataclasses it holds, by field path
    (``layer.mlp.experts_gate``): a tensor, or a block-scaled fp8 weight as one (its own
    ``__post_init__`` checks its two tensors); a sharded layer's weights are its shard's."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, (Tensor, fp8.BlockScaledWeight)):
            yield prefix + f.name, value
        elif is_dataclass(value) and not isinstance(value, (type, ShardSpec)):
            yield from field_tensors(value, f"{prefix}{f.name}.")


# ------------------------------------------------------------------------------------------------


@dataclass
class MtpWeights:
    """Everything an MTP drafter reads: its layer plus the target's embedding and head.

    Args:
        config: the layer's hyper-parameters.
        embed_tokens: the target's ``model.embed_tokens.weight`` (V, H) (GLM-5.3-Flash:
            ``model.language_model.embed_tokens.weight``).
        lm_head: the target's ``lm_head.weight`` (V, H), read by ``shared_head``.
        enorm / hnorm: RMSNorm weights (H,) for the embedding and the target hidden.
        eh_proj: (H, 2H), applied to ``cat([enorm(e), hnorm(h)])``, embedding first.
        layer: the decoder layer (DSA attention + MoE).
        shared_head_norm: the RMSNorm (H,) before the head; its output is the fed-back ``x``.
    """

    config: MtpConfig
    embed_tokens: Tensor
    lm_head: Tensor
    enorm: Tensor
    hnorm: Tensor
    eh_proj: Tensor
    layer: DecoderLayerWeights
    shared_head_norm: Tensor

    def __post_init__(self) -> None:
        """Every weight in the one weight dtype (``WEIGHT_DTYPES``) on one device, the routing
        bias in float32 (it is used for selection only): checked from the tensors' metadata."""
        dtype, device = self.eh_proj.dtype, self.eh_proj.device
        check_weight_dtype("the weights' dtype (eh_proj's)", dtype)
        for name, t in field_tensors(self):
            # the routing bias, and glm5_next's router (checkpoint.float32_tensor), stay float32
            stays_float32 = name.endswith(ROUTING_BIAS) or (self.config.is_next and name.endswith("mlp.router"))
            want = torch.float32 if stays_float32 else dtype
            # A block-scaled weight is e4m3 values with float32 scales (DESIGN.md §8), checked by its own type.
            if not fp8.is_block_scaled(t) and t.dtype != want:
                raise ValueError(f"tensor {name!r} has dtype {t.dtype}; every weight must be {want}")
            if t.device != device:
                raise ValueError(f"tensor {name!r} is on {t.device}; every weight must be on {device}")

    @property
    def dtype(self) -> torch.dtype:
        return self.eh_proj.dtype

    @property
    def device(self) -> torch.device:
        return self.eh_proj.device

    @property
    def block_scaled(self) -> bool:
        """Whether any weight is block-scaled fp8 (DESIGN.md §8); S is still ``dtype``."""
        return any(fp8.is_block_scaled(t) for _, t in field_tensors(self))  # a sharded layer too

    def with_index_share(self, share: bool | None) -> MtpWeights:
        """These weights drafting with index sharing (DESIGN.md §9) ``share`` on or off: the same
        tensors under a config whose ``index_share_for_mtp_iteration`` is ``share``; None keeps
        the config's (the checkpoint's) value and returns these weights."""
        if share is None:
            return self
        if not isinstance(share, bool):
            raise ValueError(f"index_share must be true, false or null (the checkpoint's), got {share!r}")
        return dataclasses.replace(self, config=self.config.replace(index_share_for_mtp_iteration=share))

    def quantize_fp8(self) -> MtpWeights:
        """A copy with every weight §8 lets be fp8 block-scaled (``fp8.quantize_fp8``: per-block
        amax / 448, nearest e4m3), the rest shared with these weights (S stays ``dtype``). Already
        block-scaled weights are kept."""
        mtp = {n: fp8.quantize_fp8(t, n) if fp8.may_be_fp8(n) and not fp8.is_block_scaled(t) else t
               for n, t in self.mtp_tensors().items()}
        return MtpWeights.from_tensors(self.config, mtp, self.embed_tokens, self.lm_head)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> MtpWeights:
        """Plain weights in ``dtype``: block-scaled ones as ``up(W8) * s`` (``fp8.dequantize``), the
        others cast (the routing bias stays float32). For checks against the plain drafter."""
        mtp = {n: fp8.dequantize(t, dtype) if fp8.is_block_scaled(t)
               else t if n.endswith("e_score_correction_bias") else t.to(dtype) for n, t in self.mtp_tensors().items()}
        return MtpWeights.from_tensors(self.config, mtp, self.embed_tokens.to(dtype), self.lm_head.to(dtype))

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_tensors(
        cls, cfg: MtpConfig, mtp: dict[str, Tensor], embed_tokens: Tensor, lm_head: Tensor,
        shard: ShardSpec | None = None
    ) -> MtpWeights:
        """From MTP-layer tensors keyed by layer-relative names plus the target's embedding and
        head. With ``shard``, keep this rank's experts (the others may be absent from ``mtp``)
        and, when row-parallel, its heads' ``o_proj`` columns."""
        experts = shard.expert_range(cfg.n_routed_experts) if shard else None
        if shard is not None and any(fp8.is_block_scaled(t) for t in mtp.values()):
            # A rank's o_proj columns and the ranks' tree would have to align with the scale blocks.
            raise ValueError("MtpWeights: sharding block-scaled fp8 weights over ranks is not supported; "
                             "shard the bf16 weights, or run fp8 weights on one rank")
        layer = decoder_layer_from_tensors(cfg, mtp, sparse=True, experts=experts)
        if shard is not None:
            layer.mlp.shard = shard  # type: ignore[union-attr]  # a sparse layer's mlp is a MoE, which has shard; the union includes the dense MLP
            if shard.row_parallel_o_proj:
                cols = shard.o_proj_columns(cfg.num_attention_heads * cfg.v_head_dim)
                layer.attn.o_proj = layer.attn.o_proj[:, cols].contiguous()
                layer.attn.shard = shard
        return cls(
            config=cfg,
            embed_tokens=embed_tokens,
            lm_head=lm_head,
            enorm=mtp["enorm.weight"],
            hnorm=mtp["hnorm.weight"],
            eh_proj=mtp["eh_proj.weight"],
            layer=layer,
            shared_head_norm=mtp["shared_head.norm.weight"],
        )

    @property
    def shard_spec(self) -> ShardSpec | None:
        """How these weights are split over ranks, or None when every rank holds them all."""
        mlp = self.layer.mlp
        return mlp.shard if isinstance(mlp, MoeWeights) else None

    def shard(self, rank: int, world: int, group: object = None, row_parallel_o_proj: bool = True) -> MtpWeights:
        """This rank's share: experts ``[rank E/W, (rank+1) E/W)`` and, when
        ``row_parallel_o_proj``, its heads' ``o_proj`` columns; everything else replicated.
        Unchanged (every weight on every rank) when ``world == 1`` or ``GLM_MTP_NO_EP_PROPOSE=1``."""
        check_shard_args("shard", ("rank", "world", "row_parallel_o_proj"), rank, world, row_parallel_o_proj)
        if world == 1 or not ep_propose_enabled():
            return self
        if self.shard_spec is not None:
            raise ValueError("shard: these weights are already a shard; shard the full weights")
        if self.config.n_routed_experts % world:
            raise ValueError(f"shard: world={world} must divide n_routed_experts={self.config.n_routed_experts}")
        spec = ShardSpec(rank, world, group, row_parallel_o_proj)
        return MtpWeights.from_tensors(self.config, self.mtp_tensors(), self.embed_tokens, self.lm_head, spec)

    @classmethod
    def random(
        cls, cfg: MtpConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
    ) -> MtpWeights:
        """Random weights of a sensible scale, the same for the same seed on every device of a
        type. Drawn tensor by tensor on ``device`` and cast at once, so the peak memory is the
        model in ``dtype`` plus one float32 tensor (GLM-5's real widths fit)."""
        check_weight_dtype("dtype", dtype)
        device = check_device("device", device)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {type(seed).__name__}")
        gen = torch.Generator(device).manual_seed(seed)
        made = {}
        for name, shape in {**embed_head_tensor_shapes(cfg), **mtp_tensor_shapes(cfg)}.items():
            t = random_tensor(name, shape, gen, device)
            made[name] = t if float32_tensor(cfg, name) else t.to(dtype)
        embed, head = made.pop(cfg.embed_tokens_name), made.pop("lm_head.weight")
        return cls.from_tensors(cfg, made, embed, head)

    def mtp_tensors(self) -> dict[str, Tensor]:
        """Layer-relative checkpoint name -> tensor for the MTP layer."""
        return {
            "enorm.weight": self.enorm,
            "hnorm.weight": self.hnorm,
            "eh_proj.weight": self.eh_proj,
            "shared_head.norm.weight": self.shared_head_norm,
            **decoder_layer_to_tensors(self.layer),
        }

    def state_dict(self) -> dict[str, Tensor]:
        """Absolute checkpoint names, as a checkpoint of the config's family stores them."""
        prefix = self.config.layer_prefix
        out = {self.config.embed_tokens_name: self.embed_tokens, "lm_head.weight": self.lm_head}
        for n, t in self.mtp_tensors().items():
            out.update(fp8.flatten(prefix + n, t))  # a block-scaled weight is W8 plus its *_scale_inv
        return out

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> MtpWeights:
        """A copy on another device and/or in another dtype (the routing bias, and glm5_next's
        router, stay float32).
        ``dtype`` must be a weight dtype (``WEIGHT_DTYPES``), and a cast that overflows a finite
        weight to inf is refused, naming the tensor (``check_cast_finite``)."""
        if dtype is not None:
            check_weight_dtype("dtype", dtype)
        if device is not None:
            device = check_device("device", device)

        def moved(name: str, t: Tensor) -> Tensor:
            out = t.to(device=device) if float32_tensor(self.config, name) else t.to(device=device, dtype=dtype)
            check_cast_finite(name, t, out)
            return out

        mtp = {n: moved(n, t) for n, t in self.mtp_tensors().items()}
        return MtpWeights.from_tensors(
            self.config, mtp, moved("model.embed_tokens.weight", self.embed_tokens),
            moved("lm_head.weight", self.lm_head)
        )

    # ---- checkpoints ----------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike[str], shard_size: int | None = None,
                        extra: dict[str, Tensor] | None = None) -> None:
        """Write ``config.json`` and safetensors in GLM-5 naming (sharded with an index when
        ``shard_size`` tensors-per-file is given). ``extra`` adds tensors, e.g. a target's layers.

        The checkpoint in ``directory`` is replaced as a whole or, on any failure, not at all;
        other files there (tokenizer, model card) are kept; a non-empty folder holding no
        checkpoint is refused (details: ``checkpoint.save_checkpoint``). A tied embedding and head
        are written as two tensors and load back bit-exact. ``shard_size`` must be a positive
        int or None (``ValueError`` before anything is written)."""
        check_shard_size(shard_size)
        config = self.config.to_hf_dict()
        if self.block_scaled:
            config["quantization_config"] = fp8.quantization_config()
        save_checkpoint(directory, config, {**(extra or {}), **self.state_dict()}, shard_size)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike[str],
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        ep_rank: int = 0,
        ep_world: int = 1,
        group: object = None,
        row_parallel_o_proj: bool = True,
        allow_non_finite: bool = False,
    ) -> MtpWeights:
        """Load the MTP layer (``model.layers.{num_hidden_layers}.*``) with the target's
        ``model.embed_tokens.weight`` and ``lm_head.weight`` from a GLM-5 checkpoint directory,
        reading no other layer's tensors. Errors name the tensor and the expected shape.

        Strict: ``CheckpointError`` (a ``ValueError``) naming the file and the tensor for a
        file that is not safetensors, an index without ``weight_map`` or with an entry that is
        not a plain file name in ``directory``, a weight not stored in float16/bfloat16/
        float32/float64 or, in a block-scaled checkpoint, as float8_e4m3fn with its float32
        ``*_scale_inv`` (``fp8.read_quantization`` and ``fp8.pair_scales`` state the rules: the
        config's ``quantization_config``, the scale's shape, finiteness, and which tensors may be
        fp8; such a weight loads as ``fp8.BlockScaledWeight``), with ``dtype=None``
        a weight whose dtype is not the checkpoint's one dtype (the routing bias may be float32),
        and a NaN/inf in any weight read, unless ``allow_non_finite=True`` (for inspecting a
        broken checkpoint).

        Args:
            dtype: cast every weight to this dtype (float16, bfloat16, float32 or float64; a
                checkpoint mixing those dtypes then loads); None keeps the checkpoint's one
                dtype. The routing bias is always float32; block-scaled fp8 weights stay fp8.
            device: where the weights go.
            ep_rank / ep_world / group / row_parallel_o_proj: with ``ep_world > 1`` (and
                expert-parallel propose not disabled by ``GLM_MTP_NO_EP_PROPOSE=1``), rank
                ``ep_rank`` reads (and checks) only its own routed experts and returns its
                shard (see ``shard``).
            allow_non_finite: skip the NaN/inf check.
        """
        call = "from_pretrained"
        directory = check_checkpoint_directory(call, directory)
        if dtype is not None:
            check_weight_dtype(f"{call}: dtype", dtype)
        device = check_device(f"{call}: device", device)
        check_shard_args(call, ("ep_rank", "ep_world", "row_parallel_o_proj"), ep_rank, ep_world, row_parallel_o_proj)
        if not isinstance(allow_non_finite, bool):
            raise ValueError(f"{call}: allow_non_finite must be a bool, got {type(allow_non_finite).__name__}")
        cfg = MtpConfig.from_hf_config(directory)
        spec = (
            ShardSpec(ep_rank, ep_world, group, row_parallel_o_proj) if ep_world > 1 and ep_propose_enabled() else None
        )
        if spec is not None and cfg.n_routed_experts % ep_world:
            raise ValueError(f"{call}: ep_world={ep_world} must divide the checkpoint's "
                             f"n_routed_experts={cfg.n_routed_experts}")
        mtp, embed, head = load_mtp_tensors(
            directory,
            cfg,
            mtp_tensor_shapes(cfg),
            experts=spec.expert_range(cfg.n_routed_experts) if spec else None,
            allow_non_finite=allow_non_finite,
            cast=dtype is not None,
        )

        def place(name: str, t: Tensor) -> Tensor:
            out = t.to(device=device, dtype=torch.float32 if float32_tensor(cfg, name) else dtype or t.dtype)
            if not allow_non_finite:  # the finite rule holds for the weights returned, not only those read
                check_cast_finite(name, t, out)
            return out

        mtp = {n: place(n, t) for n, t in mtp.items()}
        return cls.from_tensors(cfg, mtp, place("model.embed_tokens.weight", embed), place("lm_head.weight", head),
                                spec)


def weights_equal(a: MtpWeights, b: MtpWeights) -> bool:
    """Byte equality of every tensor and equal configs."""
    sa, sb = a.state_dict(), b.state_dict()
    return (
        a.config == b.config and sa.keys() == sb.keys() and all(same_bytes(sa[k], sb[k].to(sa[k].device)) for k in sa)
    )


__all__ = [
    "MtpWeights",
    "DecoderLayerWeights",
    "AttentionWeights",
    "IndexerWeights",
    "MoeWeights",
    "MlpWeights",
    "layer_tensor_shapes",
    "mtp_tensor_shapes",
    "embed_head_tensor_shapes",
    "decoder_layer_from_tensors",
    "decoder_layer_to_tensors",
    "random_tensor",
    "float32_tensor",
    "KPOOL_APE",
    "KPOOL_GATE",
    "weights_equal",
]
