"""What a checkpoint's ``quantization_config`` means for the MTP layer this package loads.

- none: plain weights.
- ``quant_method: fp8`` (block-scaled, DESIGN.md §8): read by ``fp8.read_quantization``; the
  weights §8 lists may be ``float8_e4m3fn`` with their ``*_scale_inv``.
- any other method (``modelopt`` NVFP4, ``mxfp4``, ``gptq``, ...): the target is quantized in a
  format this package does not read. Releases keep the MTP layer out of it (GLM-5.2's NVFP4 build
  lists ``model.layers.78*`` in ``exclude_modules`` and stores it in bf16), so the layer loads when
  every tensor it reads (the layer, the embedding, the head) is plain; one stored quantized
  (packed integers or float8 values, or a quantization tensor such as ``weight_scale`` /
  ``weight_scale_2`` / ``*_blocks`` beside a weight) is refused naming the format and the tensor.
  Which tensors are quantized is read from the tensors, not from ``exclude_modules``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from . import fp8

# Tensor-name endings of quantized weights in the formats this package does not read (NVFP4's
# packed uint8 weight carries ``weight_scale`` (float8, one per 16 values) and ``weight_scale_2``
# (float32), MXFP4 ``*_blocks`` and ``*_scales``, GPTQ/AWQ ``qweight``/``qzeros``/``scales``,
# compressed-tensors ``weight_packed``/``weight_global_scale``; a float8 weight's
# ``weight_scale_inv`` outside an fp8 config too).
QUANTIZED_SUFFIXES = (
    ".weight_scale", ".weight_scale_2", ".input_scale", ".weight_scale_inv", ".weight_packed", ".weight_global_scale",
    ".weight_zero_point", "_blocks", "_scales", ".qweight", ".qzeros", ".scales", ".g_idx",
)


@dataclass(frozen=True)
class Quantization:
    """``block_scaled_fp8``: the config declares §8's fp8 weights. ``unread``: the name of a
    quantization format this package does not read (e.g. ``"modelopt NVFP4"``), else None."""

    block_scaled_fp8: bool = False
    unread: str | None = None


def format_name(q: dict[str, Any]) -> str:
    """A quantization format's name from its config: ``quant_method`` and, where given,
    ``quant_algo`` (modelopt nests it under ``quantization``)."""
    nested = q.get("quantization")
    algo = q.get("quant_algo") or (nested.get("quant_algo") if isinstance(nested, dict) else None)
    return f"{q['quant_method']} {algo}" if algo else str(q["quant_method"])


def read_quantization(raw: dict[str, Any], where: str) -> Quantization:
    """The ``quantization_config`` of ``config.json`` (parsed ``raw``, from ``where``).
    ``ValueError`` naming the field for one that is not an object, a ``quant_method`` that is not
    a non-empty string, or (``quant_method: fp8``) a config §8 does not read."""
    q = raw.get("quantization_config")
    if q is None:
        return Quantization()
    if not isinstance(q, dict):
        raise ValueError(f"{where}: quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if not isinstance(method, str) or not method:
        raise ValueError(f"{where}: quantization_config.quant_method must be a non-empty string, got {method!r}")
    if method == fp8.QUANT_METHOD:
        return Quantization(block_scaled_fp8=fp8.read_quantization(raw, where))
    return Quantization(unread=format_name(q))


def quantized_weight_of(name: str) -> str | None:
    """The weight a quantization tensor ``name`` belongs to (``x.weight_scale`` -> ``x.weight``,
    ``x_blocks`` -> ``x.weight``), or None for a name that is no quantization tensor."""
    for suffix in QUANTIZED_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)].removesuffix(".weight") + ".weight"
    return None


def refuse_quantization_tensor(fmt: str, prefix: str, layer_names: set[str], present: set[str]) -> None:
    """Refuse an MTP layer that holds a tensor of ``fmt``'s quantization (``present``: the layer's
    tensor names, layer-relative; ``layer_names``: those the layer's plain weights have).
    ``ValueError`` naming the format, the weight and the quantization tensor."""
    for name in sorted(present - layer_names):
        weight = quantized_weight_of(name)
        if weight is not None:
            raise ValueError(
                f"tensor {prefix + weight!r} is quantized in {fmt} ({prefix + name!r} beside it): this package reads the "
                f"MTP layer as plain weights or block-scaled fp8 (DESIGN.md §8), not {fmt}; a build whose MTP layer is "
                "quantized in that format cannot be drafted from"
            )


def refuse_quantized_dtype(fmt: str, tensors: dict[str, Tensor], where: dict[str, str]) -> None:
    """Refuse a tensor the drafter reads (``tensors``, by checkpoint name) stored in a quantized
    dtype (packed integers, float8) in a checkpoint of ``fmt``: ``ValueError`` naming the file,
    the format and the tensor."""
    for name, t in tensors.items():
        if not t.dtype.is_floating_point or t.dtype.itemsize == 1:
            raise ValueError(
                f"{where[name]}: tensor {name!r} is {t.dtype} {tuple(t.shape)}, quantized in {fmt}: this package reads the "
                f"MTP layer, embedding and head as plain weights or block-scaled fp8 (DESIGN.md §8), not {fmt}"
            )


__all__ = ["Quantization", "QUANTIZED_SUFFIXES", "format_name", "read_quantization", "quantized_weight_of",
           "refuse_quantization_tensor", "refuse_quantized_dtype"]
