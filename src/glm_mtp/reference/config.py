"""MtpConfig: the shape and routing hyper-parameters of a GLM MTP layer, of either family.

Field names follow the Hugging Face ``config.json`` of GLM-5 (``model_type: glm_moe_dsa``) and of
GLM-5.3-Flash (``model_type: glm5_next``, the text model nested under ``text_config``), so a real
checkpoint's config reads straight into this dataclass (``MtpConfig.from_hf_config``). The
``family`` field says which pieces the one drafter uses (DESIGN.md §7): ``glm5`` (RoPE MLA, one
indexer key per row, SwiGLU) or ``glm5_next`` (NoPE MLA, the KPool indexer, clamped SwiGLU).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, TypeGuard

# The MTP layer of a checkpoint sits after the decoder layers: model.layers.{num_hidden_layers}.*
SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")
# GLM-5.3-Flash: the multimodal wrapper (text model under text_config) or the flat text config.
NEXT_MODEL_TYPES = ("glm5_next", "glm5_next_text")
FAMILIES = ("glm5", "glm5_next")
# Fields only the glm5_next family reads; a glm5 config keeps their defaults and never writes them.
NEXT_FIELDS = ("index_kpool", "index_kpool_always_select_tail", "swiglu_limit")
BOOL_FIELDS = ("norm_topk_prob", "rope_interleave", "indexer_rope_interleave", "index_kpool_always_select_tail",
               "index_share_for_mtp_iteration")
FLOAT_FIELDS = ("rope_theta", "routed_scaling_factor", "rms_norm_eps")
# float32's least positive normal (2^-126) and greatest finite value: the range of a float setting.
FLOAT32_TINY = 2.0 ** -126
FLOAT32_MAX = (2.0 - 2.0 ** -23) * 2.0 ** 127


@dataclass(frozen=True)
class MtpConfig:
    """Hyper-parameters of one GLM-5 MTP layer (and of the small targets built from it).

    Args:
        hidden_size: width H of the residual stream.
        vocab_size: rows of ``embed_tokens`` and ``lm_head``.
        q_lora_rank: rank of the low-rank query (``q_a_proj`` output).
        kv_lora_rank: width of the compressed KV latent cached per row.
        qk_nope_head_dim: per-head query/key dims without RoPE.
        qk_rope_head_dim: per-head query/key dims with RoPE (one shared rope key per row).
        v_head_dim: per-head value dims.
        num_attention_heads: MLA heads.
        n_routed_experts: routed experts E of the MoE.
        num_experts_per_tok: experts chosen per row.
        n_shared_experts: shared experts, fused into one SwiGLU of ``n * moe_intermediate_size``.
        moe_intermediate_size: intermediate width of one expert.
        n_group: expert groups for group-limited routing (1 = no limiting).
        topk_group: groups that compete for the experts when ``n_group > 1``.
        routed_scaling_factor: multiplier on the (normalised) routing weights.
        norm_topk_prob: normalise the chosen experts' weights to sum 1.
        index_n_heads: lightning-indexer heads.
        index_head_dim: lightning-indexer head width (its first ``qk_rope_head_dim`` dims rotate).
        index_topk: rows each query attends to after the indexer's selection.
        rope_theta: RoPE base.
        rope_interleave: MLA RoPE rotates adjacent pairs (True) or halves (False).
        indexer_rope_interleave: the same for the indexer.
        rms_norm_eps: epsilon of every RMSNorm.
        max_position_embeddings: the model's max DSA context; caps a drafter's ``max_seq_len``.
        num_hidden_layers: decoder layers of the target; the MTP layer is the one after them.
        first_k_dense_replace: leading target layers with a dense MLP instead of the MoE.
        intermediate_size: width of that dense MLP.
        family: ``glm5`` or ``glm5_next`` (DESIGN.md §7): which attention, indexer and MLP pieces.
        index_kpool: glm5_next only: rows per KPool pool (0 in the glm5 family: one key per row).
        index_kpool_always_select_tail: glm5_next only: a row also attends to the rows of its own
            incomplete pool (true in the release; false is refused, see ``validate``).
        swiglu_limit: glm5_next only: the clamp of every SwiGLU's gate and up projections
            (None in the glm5 family: unclamped).
        index_share_for_mtp_iteration: either family: within one propose only draft step 1 runs the
            indexer, later steps attend its selection (DESIGN.md §9; true in the released configs).
    """

    hidden_size: int
    vocab_size: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_theta: float
    rope_interleave: bool = True
    indexer_rope_interleave: bool = True
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    num_hidden_layers: int = 1
    first_k_dense_replace: int = 0
    intermediate_size: int = 0
    family: str = "glm5"
    index_kpool: int = 0
    index_kpool_always_select_tail: bool = True
    swiglu_limit: float | None = None
    index_share_for_mtp_iteration: bool = False

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_width(self) -> int:
        """Width of one cached KV row: the normalised latent, then the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mtp_layer_index(self) -> int:
        return self.num_hidden_layers

    @property
    def is_next(self) -> bool:
        """The glm5_next family (GLM-5.3-Flash): NoPE MLA, KPool indexer, clamped SwiGLU."""
        return self.family == "glm5_next"

    @property
    def layer_prefix(self) -> str:
        """The checkpoint prefix of the MTP layer's tensors."""
        stem = "model.language_model.layers" if self.is_next else "model.layers"
        return f"{stem}.{self.mtp_layer_index}."

    @property
    def embed_tokens_name(self) -> str:
        """The checkpoint name of the target's embedding (the head is ``lm_head.weight`` in both)."""
        return "model.language_model.embed_tokens.weight" if self.is_next else "model.embed_tokens.weight"

    @property
    def latent_norm_eps(self) -> float:
        """Epsilon of ``q_a_layernorm`` and ``kv_a_layernorm``: fixed at 1e-6 in GLM-5's
        architecture, ``rms_norm_eps`` in GLM-5.3-Flash's (transformers' ``Glm5NextTextAttention``)."""
        return self.rms_norm_eps if self.is_next else 1e-6

    @property
    def kpool_pools_selected(self) -> int:
        """glm5_next: the most complete pools a row selects, ``index_topk / index_kpool``."""
        return self.index_topk // self.index_kpool

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field that is missing, of the wrong type, out of
        range or inconsistent. Types are strict: a flag must be a ``bool`` (the string ``"false"``
        would be truthy), a number an ``int`` or ``float`` (never a string or a bool)."""
        for name in BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"MtpConfig.{name} must be a boolean (true/false), got {value!r}")
        for name in FLOAT_FIELDS:
            check_float32_setting(name, getattr(self, name))
        if not isinstance(self.family, str) or self.family not in FAMILIES:
            raise ValueError(f"MtpConfig.family must be one of {FAMILIES}, got {self.family!r}")
        self.validate_family()
        positive = [
            "hidden_size", "vocab_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            *(() if self.is_next else ("qk_rope_head_dim",)), "v_head_dim", "num_attention_heads", "n_routed_experts",
            "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group",
            "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings",
            "num_hidden_layers",
        ]
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MtpConfig.{name} must be a positive integer, got {value!r}")
        for name in ("n_shared_experts", "first_k_dense_replace", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MtpConfig.{name} must be a non-negative integer, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError("MtpConfig.qk_rope_head_dim must be even (RoPE rotates pairs), got "
                             f"{self.qk_rope_head_dim}")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(
                f"MtpConfig.index_head_dim ({self.index_head_dim}) must hold the "
                f"qk_rope_head_dim ({self.qk_rope_head_dim}) rotated dims"
            )
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"MtpConfig.n_group ({self.n_group}) must divide n_routed_experts ({self.n_routed_experts})"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"MtpConfig.topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ValueError(
                "MtpConfig.n_group: group-limited routing scores a group by its two best experts, "
                f"so every group needs >= 2 experts (n_routed_experts={self.n_routed_experts}, n_group={self.n_group})"
            )
        eligible = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > eligible:
            raise ValueError(
                f"MtpConfig.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the {eligible} experts "
                f"of the topk_group={self.topk_group} groups that may be chosen"
            )
        if self.first_k_dense_replace > 0 and self.intermediate_size < 1:
            raise ValueError("MtpConfig.intermediate_size must be positive when first_k_dense_replace > 0")

    def validate_family(self) -> None:
        """The rules of the family's own fields (DESIGN.md §7), each naming the field."""
        if not self.is_next:
            if self.index_kpool != 0 or self.swiglu_limit is not None:
                raise ValueError(
                    "MtpConfig.index_kpool / swiglu_limit are glm5_next fields: family 'glm5' needs index_kpool=0 "
                    f"and swiglu_limit=None, got {self.index_kpool!r} / {self.swiglu_limit!r}"
                )
            return
        kpool = self.index_kpool
        if isinstance(kpool, bool) or not isinstance(kpool, int) or kpool < 1:
            raise ValueError(f"MtpConfig.index_kpool must be a positive integer in family 'glm5_next', got {kpool!r}")
        topk = self.index_topk
        if not isinstance(topk, bool) and isinstance(topk, int) and topk % kpool:
            raise ValueError(f"MtpConfig.index_topk ({topk}) must be a multiple of index_kpool ({kpool}): rows are "
                             "selected as whole pools")
        rope = self.qk_rope_head_dim
        if isinstance(rope, bool) or not isinstance(rope, int) or rope != 0:
            raise ValueError("MtpConfig.qk_rope_head_dim must be 0 in family 'glm5_next' (NoPE attention: no RoPE "
                             f"dims), got {rope!r}")
        if not self.index_kpool_always_select_tail:
            raise ValueError(
                "MtpConfig.index_kpool_always_select_tail must be true: without the tail a row before its first "
                "complete pool would attend to no row at all"
            )
        check_float32_setting("swiglu_limit", self.swiglu_limit, " in family 'glm5_next'")

    # ----------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> MtpConfig:
        """``tiny`` (tests), ``small`` (experiments), ``glm5`` (GLM-5's real values), ``glm5_shape``
        (GLM-5's widths with 16 routed experts, so one layer fits a CPU's memory); of the glm5_next
        family ``glm5next`` (GLM-5.3-Flash's real values) and ``glm5next_tiny`` / ``glm5next_small``
        (its structure at small widths, ``index_kpool`` 4 so rows cross pools in a few steps)."""
        try:
            return cls(**PRESETS[name])
        except KeyError:
            raise ValueError(f"unknown MtpConfig preset {name!r}; known: {sorted(PRESETS)}") from None

    def replace(self, **changes: Any) -> MtpConfig:
        return dataclasses.replace(self, **changes)

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` body for this config (the inverse of ``from_hf_config``): GLM-5's flat
        form, or GLM-5.3-Flash's with the text model nested under ``text_config``."""
        d = dataclasses.asdict(self)
        del d["family"]
        if self.is_next:
            d.update(model_type="glm5_next_text", qk_head_dim=self.qk_head_dim, hidden_act="silu",
                     index_kpool_compress=True)
            return {"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"],
                    "tie_word_embeddings": False, "text_config": d}
        for name in NEXT_FIELDS:
            del d[name]
        d.update(
            model_type="glm_moe_dsa",
            architectures=["GlmMoeDsaForCausalLM"],
            num_nextn_predict_layers=1,
            qk_head_dim=self.qk_head_dim,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            hidden_act="silu",
        )
        return d

    @classmethod
    def from_hf_config(cls, path: str | os.PathLike[str] | dict[str, Any]) -> MtpConfig:
        """Read a GLM-5 (``glm_moe_dsa``) or DeepSeek-V3.2 style ``config.json``.

        ``path`` is the file, its directory, or the already-parsed dict. Fields the drafter does
        not use are ignored; a missing required field, a value of the wrong JSON type (a flag
        must be ``true``/``false``, a number a JSON number, never a string) or a contradictory
        value raises ``ValueError`` naming the field.
        """
        raw, where = read_hf_json(path)
        model_type = raw.get("model_type")
        next_family = isinstance(model_type, str) and model_type in NEXT_MODEL_TYPES
        if next_family:
            raw, where = next_text_config(raw, where)
        elif not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{where}: model_type must be one of {SUPPORTED_MODEL_TYPES + NEXT_MODEL_TYPES}, got "
                             f"{model_type!r}")
        for name, want in (("scoring_func", "sigmoid"), ("hidden_act", "silu")):
            if name in raw and raw[name] != want:
                raise ValueError(f"{where}: {name} must be {want!r} for this drafter, got {raw[name]!r}")
        for name in ("rope_scaling", "rope_parameters"):
            if raw.get(name) is not None and not isinstance(raw[name], dict):
                raise ValueError(f"{where}: {name} must be a JSON object or null, got {raw[name]!r}")
        rope_scaling = raw.get("rope_scaling") or {}
        rope_params = raw.get("rope_parameters") or {}
        rope_type = (
            rope_scaling.get("type") or rope_scaling.get("rope_type") or rope_params.get("rope_type") or "default"
        )
        if rope_type != "default":
            raise ValueError(f"{where}: rope_scaling / rope_parameters.rope_type {rope_type!r} is not supported "
                             "(default RoPE only)")

        required = [
            "hidden_size", "vocab_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "num_attention_heads", "n_routed_experts",
            "num_experts_per_tok", "moe_intermediate_size", "index_n_heads", "index_head_dim",
            "index_topk", "num_hidden_layers",
        ]
        kwargs: dict[str, Any] = {}
        for name in required:
            if raw.get(name) is None:
                raise ValueError(f"{where}: required field {name!r} is missing")
            kwargs[name] = hf_int(raw, name, None, where)
        rope_theta = raw.get("rope_theta")
        if next_family:  # NoPE: no RoPE anywhere, so no base is needed (a stated one is read and unused)
            kwargs["rope_theta"] = hf_float(raw, "rope_theta", 10000.0, where)
        elif rope_theta is None:
            if rope_params.get("rope_theta") is None:
                raise ValueError(f"{where}: required field 'rope_theta' is missing (also not in rope_parameters)")
            kwargs["rope_theta"] = hf_float(rope_params, "rope_theta", None, f"{where}: rope_parameters")
        else:
            kwargs["rope_theta"] = hf_float(raw, "rope_theta", None, where)
        for name, default in (("n_shared_experts", 1), ("n_group", 1), ("topk_group", 1),
                              ("max_position_embeddings", 4096),
                              ("first_k_dense_replace", 0), ("intermediate_size", 0)):
            kwargs[name] = hf_int(raw, name, default, where)
        # transformers' defaults where a file leaves a field out: GLM-5.3-Flash's eps is 1e-5
        for name, float_default in (("routed_scaling_factor", 1.0), ("rms_norm_eps", 1e-5 if next_family else 1e-6)):
            kwargs[name] = hf_float(raw, name, float_default, where)
        for name in BOOL_FIELDS:
            kwargs[name] = hf_bool(raw, name, True, where)
        # absent = false: GLM-5 ships without it; the GLM-5.2/5.3 and GLM-5.3-Flash releases set it true
        kwargs["index_share_for_mtp_iteration"] = hf_bool(raw, "index_share_for_mtp_iteration", False, where)
        hf_bool(raw, "tie_word_embeddings", False, where)  # read by the loader; checked here with the rest
        if next_family:
            if not hf_bool(raw, "index_kpool_compress", True, where):
                raise ValueError(
                    f"{where}: index_kpool_compress must be true: the package implements pooled (compressed) "
                    "KPool keys only (DESIGN.md §7)"
                )
            layers = raw.get("mlp_layer_types")
            if layers is not None and "first_k_dense_replace" not in raw:  # GLM-5.3-Flash states the schedule
                if not isinstance(layers, list) or not all(v in ("dense", "sparse") for v in layers):
                    raise ValueError(f"{where}: mlp_layer_types must be a list of 'dense' / 'sparse', got {layers!r}")
                kwargs["first_k_dense_replace"] = next((i for i, v in enumerate(layers) if v != "dense"), len(layers))
            kwargs.update(
                family="glm5_next",
                index_kpool=hf_int(raw, "index_kpool", 16, where),
                index_kpool_always_select_tail=hf_bool(raw, "index_kpool_always_select_tail", True, where),
                swiglu_limit=hf_float(raw, "swiglu_limit", 10.0, where),
            )
        if "qk_head_dim" in raw and raw["qk_head_dim"] != kwargs["qk_nope_head_dim"] + kwargs["qk_rope_head_dim"]:
            raise ValueError(
                f"{where}: qk_head_dim ({raw['qk_head_dim']!r}) must equal qk_nope_head_dim + qk_rope_head_dim "
                f"({kwargs['qk_nope_head_dim']} + {kwargs['qk_rope_head_dim']})"
            )
        if hf_int(raw, "num_nextn_predict_layers", 1, where) < 1:
            raise ValueError(f"{where}: num_nextn_predict_layers must be >= 1: this checkpoint has no MTP layer")
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def next_text_config(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], str]:
    """The text model's fields of a GLM-5.3-Flash ``config.json``: ``text_config`` of a
    ``glm5_next`` config (a JSON object; a ``glm5_next`` config without one holds the text fields
    at the top level, as transformers reads it), or the flat ``glm5_next_text`` body itself.
    ``tie_word_embeddings`` lives on the outer config and is read from there when the text
    config does not state it."""
    if raw.get("model_type") == "glm5_next_text" or raw.get("text_config") is None:
        return raw, where
    text = raw["text_config"]
    if not isinstance(text, dict):
        raise ValueError(f"{where}: text_config must be a JSON object, got {text!r}")
    inner = text.get("model_type", "glm5_next_text")
    if inner != "glm5_next_text":
        raise ValueError(f"{where}: text_config.model_type must be 'glm5_next_text', got {inner!r}")
    merged = dict(text)
    if "tie_word_embeddings" not in merged and "tie_word_embeddings" in raw:
        merged["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return merged, f"{where}: text_config"


def read_tie_word_embeddings(path: str | os.PathLike[str] | dict[str, Any]) -> bool:
    """``tie_word_embeddings`` of a ``config.json`` of either family (default false)."""
    raw, where = read_hf_json(path)
    if raw.get("model_type") in NEXT_MODEL_TYPES:
        raw, where = next_text_config(raw, where)
    return hf_bool(raw, "tie_word_embeddings", False, where)


# ------------------------------------------------------------------------------------------------
# Typed reads of a config.json: JSON has one number type and real booleans, so a value of another
# type (a quoted number, "false", 0/1 for a flag) is a mistake in the file, refused by name.


def finite_number(value: object) -> TypeGuard[int | float]:
    """An int or float (not a bool) that a float holds finitely (a 400-digit int does not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def float32_value(value: float) -> float:
    """``value`` rounded to float32 (to nearest even), as a Python float; past float32's range, inf."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def check_float32_setting(name: str, value: object, where: str = "") -> float:
    """A float setting, checked as the float32 value the drafter computes with (DESIGN.md §5:
    constants are rounded once to float32): a real number whose float32 value is finite, normal
    and > 0. 1e-300 rounds to 0 there (an ``rms_norm_eps`` of 0 makes a zero row NaN, a
    ``swiglu_limit`` of 0 zeroes every expert) and 1e300 to inf (a scaling of inf drafts
    garbage, a limit of inf clamps nothing). Returns the float32 value; ``ValueError`` naming
    ``MtpConfig.<name>`` otherwise."""
    if not finite_number(value) or not value > 0:
        raise ValueError(f"MtpConfig.{name} must be a finite number > 0{where}, got {value!r}")
    rounded = float32_value(float(value))
    if not (math.isfinite(rounded) and rounded >= FLOAT32_TINY):
        raise ValueError(f"MtpConfig.{name} must be a finite number > 0{where} as float32, the precision the drafter "
                         f"uses it in (a normal float32, {FLOAT32_TINY:.4g} to {FLOAT32_MAX:.4g}): {value!r} rounds to "
                         f"{rounded!r} there")
    return rounded


def read_hf_json(path: str | os.PathLike[str] | dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The parsed ``config.json`` (``path``: the file, its directory, or a dict) and a name for
    it in error messages. Raises ``ValueError`` naming the file when it is not a JSON object."""
    if isinstance(path, dict):
        return dict(path), "config"
    file = os.fspath(path)
    if os.path.isdir(file):
        file = os.path.join(file, "config.json")
    return read_json_object(file), file


def read_json_object(file: str, error: type[ValueError] = ValueError) -> dict[str, Any]:
    """The JSON object in ``file``; ``error`` naming the file when it is not valid JSON or not an object."""
    with open(file) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise error(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise error(f"{file}: must hold a JSON object, got {type(raw).__name__}")
    return raw


def hf_bool(raw: dict[str, Any], name: str, default: bool, where: str) -> bool:
    """``raw[name]`` as a JSON boolean (``default`` when absent or null)."""
    value = raw.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be a JSON boolean (true/false), got {value!r}")
    return value


def hf_int(raw: dict[str, Any], name: str, default: int | None, where: str) -> int:
    """``raw[name]`` as a JSON integer (``default`` when absent or null)."""
    value = raw.get(name)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {name} must be a JSON integer, got {value!r}")
    return value


def hf_float(raw: dict[str, Any], name: str, default: float | None, where: str) -> float:
    """``raw[name]`` as a finite JSON number, returned as ``float`` (``default`` when absent or null)."""
    value = raw.get(name)
    if value is None and default is not None:
        return default
    if not finite_number(value):
        raise ValueError(f"{where}: {name} must be a finite JSON number, got {value!r}")
    return float(value)


_TINY = dict(
    hidden_size=64, vocab_size=96, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, num_attention_heads=4,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    index_n_heads=2, index_head_dim=16, index_topk=6,
    rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=512,
    num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=128,
)
_SMALL = dict(
    hidden_size=256, vocab_size=2048, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, num_attention_heads=8,
    n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=128,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    index_n_heads=4, index_head_dim=32, index_topk=32,
    rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
    num_hidden_layers=4, first_k_dense_replace=1, intermediate_size=512,
)
_GLM5 = dict(
    hidden_size=6144, vocab_size=154880, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
    qk_rope_head_dim=64, v_head_dim=256, num_attention_heads=64,
    n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
    n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    index_n_heads=32, index_head_dim=128, index_topk=2048,
    rope_theta=1e6, rope_interleave=True, indexer_rope_interleave=True, rms_norm_eps=1e-5,
    max_position_embeddings=202752, num_hidden_layers=78, first_k_dense_replace=3,
    intermediate_size=12288,
)
# GLM-5.3-Flash as released (DESIGN.md §7, §9): pools of 4 rows (16 is only transformers' class
# default) and index sharing across draft steps; the other values are transformers' defaults.
_GLM5NEXT = dict(
    hidden_size=4096, vocab_size=154880, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=256,
    qk_rope_head_dim=0, v_head_dim=256, num_attention_heads=64,
    n_routed_experts=288, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
    n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    index_n_heads=32, index_head_dim=128, index_topk=2048,
    rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=1048576,
    num_hidden_layers=45, first_k_dense_replace=3, intermediate_size=12288,
    family="glm5_next", index_kpool=4, index_kpool_always_select_tail=True, swiglu_limit=10.0,
    index_share_for_mtp_iteration=True,
)
# Its structure at small widths: index_kpool 4 and index_topk 8 (two pools), so rows complete
# pools, select some of them and leave others out within a few dozen rows.
_GLM5NEXT_TINY = dict(
    hidden_size=64, vocab_size=96, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=0, v_head_dim=16, num_attention_heads=4,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
    n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    index_n_heads=2, index_head_dim=16, index_topk=8,
    rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=512,
    num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=128,
    family="glm5_next", index_kpool=4, index_kpool_always_select_tail=True, swiglu_limit=1.0,
    index_share_for_mtp_iteration=True,
)
_GLM5NEXT_SMALL = dict(
    hidden_size=256, vocab_size=2048, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=0, v_head_dim=32, num_attention_heads=8,
    n_routed_experts=18, num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=128,
    n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    index_n_heads=4, index_head_dim=32, index_topk=32,
    rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
    num_hidden_layers=4, first_k_dense_replace=1, intermediate_size=512,
    family="glm5_next", index_kpool=4, index_kpool_always_select_tail=True, swiglu_limit=10.0,
    index_share_for_mtp_iteration=True,
)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "small": _SMALL,
    "glm5": _GLM5,
    "glm5_shape": {**_GLM5, "n_routed_experts": 16},
    "glm5next": _GLM5NEXT,
    "glm5next_tiny": _GLM5NEXT_TINY,
    "glm5next_small": _GLM5NEXT_SMALL,
}
