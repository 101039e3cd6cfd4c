"""Block-scaled FP8 weights (DESIGN.md §8): the format released GLM FP8 checkpoints store, how such
a weight is made from a plain one, and which tensors may take it.

A block-scaled weight is ``W8`` (N, K) ``float8_e4m3fn`` with ``scale_inv`` (ceil(N/128),
ceil(K/128)) float32 beside it; the real weight is ``up(W8[n, k]) * scale_inv[n // 128, k // 128]``
(the last block of a dim may be partial). The drafter computes with the bytes and the scales as
they are: the pinned linear over such a weight is ``numerics.linear`` (it dispatches on the type);
nothing here builds a dequantized copy for the drafter (``dequantize`` exists for tests and for the
float32 agreement check).

Stacked routed experts are one ``BlockScaledWeight`` with a leading expert dim: ``W8`` (E, N, K),
``scale_inv`` (E, ceil(N/128), ceil(K/128)); indexing the leading dim gives one expert's weight.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
# The block of W8 one scale covers, (rows, columns); the only block size this drafter reads.
FP8_BLOCK = (128, 128)
# The largest finite e4m3 value: quantize_fp8 maps a block's amax onto it.
E4M3_MAX = 448.0
# The checkpoint name of a weight's scale: ``...proj.weight`` -> ``...proj.weight_scale_inv``.
SCALE_SUFFIX = "_scale_inv"
# The least normal float32 (2^-126): every block's scale is a normal float32 > 0 (check_scales).
SCALE_TINY = 2.0 ** -126

# Which weights may be block-scaled (§8, as zai-org's GLM-5.x FP8 releases store them), as
# patterns over a tensor's layer-relative checkpoint name. Everything else (the embedding,
# lm_head, every norm, the router and its bias, eh_proj, the indexer's weights_proj and k_norm)
# stays bf16 / float32: the release keeps them so and the drafter reads them as plain tensors.
FP8_WEIGHT_PATTERNS = (
    r"self_attn\.q_a_proj\.weight",
    r"self_attn\.q_b_proj\.weight",
    r"self_attn\.kv_a_proj_with_mqa\.weight",
    r"self_attn\.kv_b_proj\.weight",
    r"self_attn\.o_proj\.weight",
    r"self_attn\.indexer\.wq_b\.weight",
    r"self_attn\.indexer\.wk\.weight",
    r"mlp\.shared_experts\.(gate|up|down)_proj\.weight",
    r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight",
)
_FP8_NAME = re.compile(r"(^|\.)(" + "|".join(FP8_WEIGHT_PATTERNS) + r")$")


def may_be_fp8(name: str) -> bool:
    """Whether §8 lets the tensor ``name`` (layer-relative or absolute checkpoint name) be
    block-scaled fp8."""
    return _FP8_NAME.search(name) is not None


def scale_name(name: str) -> str:
    """The checkpoint name of weight ``name``'s scale (``x.weight`` -> ``x.weight_scale_inv``)."""
    return name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scale's shape for a weight of ``shape`` (..., N, K): (..., ceil(N/128), ceil(K/128))."""
    *lead, n, k = shape
    return (*lead, math.ceil(n / FP8_BLOCK[0]), math.ceil(k / FP8_BLOCK[1]))


@dataclass(frozen=True, eq=False)
class BlockScaledWeight:
    """A weight stored as §8 block-scaled fp8.

    Args:
        w8: (..., N, K) float8_e4m3fn, the stored values.
        scale_inv: (..., ceil(N/128), ceil(K/128)) float32, one per 128 x 128 block (the last
            block of a dim covers what is left); finite.
    """

    w8: Tensor
    scale_inv: Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.w8, Tensor) or self.w8.dtype != FP8_DTYPE or self.w8.dim() < 2:
            raise ValueError(f"BlockScaledWeight.w8 must be a float8_e4m3fn tensor (..., N, K), got "
                             f"{getattr(self.w8, 'dtype', type(self.w8).__name__)} "
                             f"{tuple(getattr(self.w8, 'shape', ()))}")
        want = scale_shape(tuple(self.w8.shape))
        if (
            not isinstance(self.scale_inv, Tensor)
            or self.scale_inv.dtype != torch.float32
            or tuple(self.scale_inv.shape) != want
        ):
            raise ValueError(f"BlockScaledWeight.scale_inv must be float32 of shape {want} (ceil(N/128), "
                             f"ceil(K/128)) for w8 {tuple(self.w8.shape)}, got "
                             f"{getattr(self.scale_inv, 'dtype', None)} {tuple(getattr(self.scale_inv, 'shape', ()))}")
        if self.scale_inv.device != self.w8.device:
            raise ValueError(f"BlockScaledWeight: scale_inv is on {self.scale_inv.device}, w8 on {self.w8.device}")

    # ---- tensor-like facts the drafter's code reads ------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self.w8.shape

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype of the values (float8_e4m3fn); the drafter's S is not this."""
        return self.w8.dtype

    @property
    def device(self) -> torch.device:
        return self.w8.device

    @property
    def nbytes(self) -> int:
        """Bytes a reader of this weight moves: one per value plus the float32 scales."""
        return self.w8.numel() * self.w8.element_size() + self.scale_inv.numel() * self.scale_inv.element_size()

    def __getitem__(self, index: Any) -> BlockScaledWeight:
        """A slice of the leading (expert) dims only: ``w[e]`` is expert ``e``'s weight."""
        if self.w8.dim() < 3:
            raise TypeError("BlockScaledWeight: only a stacked weight (E, N, K) can be indexed (by its leading dim); "
                            "a block-scaled matrix is read whole, as its scales cover 128 x 128 blocks")
        return BlockScaledWeight(self.w8[index], self.scale_inv[index])

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> BlockScaledWeight:
        """On another device. ``dtype`` is the plain weights' storage dtype and leaves this one
        block-scaled (casting it would need a dequantized copy; ``dequantize`` makes one)."""
        return BlockScaledWeight(self.w8.to(device=device), self.scale_inv.to(device=device))

    def contiguous(self) -> BlockScaledWeight:
        return BlockScaledWeight(self.w8.contiguous(), self.scale_inv.contiguous())

    @staticmethod
    def stack(weights: Iterable[BlockScaledWeight]) -> BlockScaledWeight:
        """The routed experts' weights as one (E, N, K) weight."""
        ws = list(weights)
        return BlockScaledWeight(torch.stack([w.w8 for w in ws]), torch.stack([w.scale_inv for w in ws]))


def stack_weights(weights: list[Any], what: str) -> Any:
    """``torch.stack`` for plain tensors, ``BlockScaledWeight.stack`` for block-scaled ones; a
    mix is refused naming ``what`` (one kernel reads all experts of a matrix in one format)."""
    fp8 = [isinstance(w, BlockScaledWeight) for w in weights]
    if all(fp8) and weights:
        return BlockScaledWeight.stack(weights)
    if any(fp8):
        raise ValueError(f"{what}: the routed experts mix block-scaled fp8 and plain weights; all experts of a matrix "
                         "must be stored in one format")
    return torch.stack(weights)


# ------------------------------------------------------------------------------------------------
# Making and undoing the format.


def _padded_blocks(t: Tensor) -> Tensor:
    """``t`` (..., N, K) padded with zeros to whole blocks and viewed as
    (..., N/128 blocks, 128, K/128 blocks, 128)."""
    *lead, n, k = t.shape
    bn, bk = FP8_BLOCK
    rn, rk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(*lead, rn * bn, rk * bk, dtype=t.dtype, device=t.device)
    padded[..., :n, :k] = t
    return padded.reshape(*lead, rn, bn, rk, bk)


def expand_scales(scale_inv: Tensor, n: int, k: int) -> Tensor:
    """Each value's scale: (..., N, K) from (..., ceil(N/128), ceil(K/128))."""
    bn, bk = FP8_BLOCK
    return scale_inv.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


def quantize_fp8(w: Tensor, name: str = "w") -> BlockScaledWeight:
    """``w`` (..., N, K) as the released checkpoints were made: per 128 x 128 block
    ``s = amax(|up(w)|) / 448`` (float32; an all-zero block gets ``s = 1``, and a block whose
    quotient is below float32's least normal, 2^-126 (an amax of subnormal size), gets ``s = 2^-126``,
    so every scale passes ``check_scales`` and the codes stay finite), then ``W8 = e4m3(up(w) / s)``
    rounded to nearest even (the quotient is clamped to +-448 first: its own rounding can put the
    amax a hair above). ``name`` is the tensor's name in error messages."""
    if not isinstance(w, Tensor) or not w.dtype.is_floating_point or w.dtype == FP8_DTYPE or w.dim() < 2:
        raise ValueError(f"quantize_fp8: {name} must be a floating tensor (..., N, K) other than fp8, got "
                         f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    wf = w.to(torch.float32)
    if not bool(torch.isfinite(wf).all()):
        raise ValueError(f"quantize_fp8: tensor {name!r} holds {int((~torch.isfinite(wf)).sum())} NaN/inf value(s) "
                         f"of {wf.numel()}; a block's scale would not be finite")
    n, k = w.shape[-2:]
    amax = _padded_blocks(wf.abs()).amax(dim=(-3, -1))  # (..., nb_N, nb_K)
    s = torch.where(amax > 0, torch.clamp(amax / E4M3_MAX, min=SCALE_TINY), torch.ones_like(amax))
    q = torch.clamp(wf / expand_scales(s, n, k), -E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return BlockScaledWeight(q, s.contiguous())


def dequantize(w: BlockScaledWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The real weight ``up(W8) * s`` (..., N, K) rounded once to ``dtype`` (the product is exact
    in float64: 4 x 24 significant bits; so float32 gets the float32 product, float64 the exact
    value): for tests and the agreement checks, never the drafter's path."""
    n, k = w.shape[-2:]
    return (w.w8.to(torch.float64) * expand_scales(w.scale_inv, n, k).to(torch.float64)).to(dtype)


def weight_values(w: Tensor | BlockScaledWeight, acc: torch.dtype) -> Tensor:
    """A weight's values in A (``acc``) where a product sums over its output dim (MLA's absorbed
    ``kv_b_proj``: a head's rows cross scale blocks, so no scale factors out of the sum): each value
    is ``up(W8[n, k]) * s[n // 128, k // 128]``, one rounding in A. A plain weight comes back as it is
    (its promotion to A is exact)."""
    if isinstance(w, BlockScaledWeight):
        n, k = w.shape[-2:]
        return w.w8.to(acc) * expand_scales(w.scale_inv, n, k).to(acc)
    return w


def is_block_scaled(w: object) -> bool:
    return isinstance(w, BlockScaledWeight)


# ------------------------------------------------------------------------------------------------
# config.json's quantization_config.


QUANT_METHOD = "fp8"


def quantization_config() -> dict[str, Any]:
    """What ``config.json`` says for a block-scaled checkpoint (as zai-org's FP8 releases)."""
    return {"quant_method": QUANT_METHOD, "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK)}


def read_quantization(raw: dict[str, Any], where: str) -> bool:
    """Whether ``config.json`` (parsed ``raw``, from ``where``) declares block-scaled fp8 weights.

    No ``quantization_config`` (or null): False. Otherwise it must be an object with
    ``quant_method: fp8``, ``weight_block_size: [128, 128]`` (the only block this drafter reads)
    and, if given, ``fmt: e4m3``; ``activation_scheme`` and ``modules_to_not_convert`` are accepted
    and not used (activations stay in the drafter's dtype; which tensors are fp8 is read from their
    dtypes). Anything else raises ``ValueError`` naming the field and the rule."""
    q = raw.get("quantization_config")
    if q is None:
        return False
    if not isinstance(q, dict):
        raise ValueError(f"{where}: quantization_config must be an object, got {q!r}")
    if q.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"{where}: quantization_config.quant_method must be {QUANT_METHOD!r} (block-scaled fp8 is "
                         f"the only quantization this drafter reads), got {q.get('quant_method')!r}")
    block = q.get("weight_block_size")
    if not isinstance(block, list) or block != list(FP8_BLOCK):
        raise ValueError(f"{where}: quantization_config.weight_block_size must be {list(FP8_BLOCK)} (one float32 "
                         "scale per 128 x 128 block of the weight; other block sizes are not supported), got "
                         f"{block!r}")
    if "fmt" in q and q["fmt"] != "e4m3":
        raise ValueError(f"{where}: quantization_config.fmt must be 'e4m3' (weights stored as float8_e4m3fn), got "
                         f"{q['fmt']!r}")
    return True


def non_finite_fp8(w8: Tensor) -> int:
    """How many NaN values a float8_e4m3fn tensor holds (e4m3fn has no inf: S.1111.111 is NaN)."""
    return int(((w8.view(torch.uint8) & 0x7F) == 0x7F).sum())


def check_scales(what: str, scale_inv: Tensor) -> None:
    """The rule of a block scale (DESIGN.md §8): every value a normal float32 > 0, that is finite
    and at least 2^-126. A scale of 0 erases its block, a negative one flips its sign, NaN/inf
    poison every row that reads it, and a subnormal one is not what ``quantize_fp8`` writes.
    ``ValueError`` starting with ``what`` (the file and the scale's name), counting the bad values
    and showing the first."""
    bad = ~(torch.isfinite(scale_inv) & (scale_inv >= SCALE_TINY))
    count = int(bad.sum())
    if count:
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{what} holds {count} value(s) that are not a normal float32 > 0 (block {first}: "
                         f"{float(scale_inv[first])!r}); every block's scale must be finite and >= 2^-126 (0 erases "
                         "the block, a negative scale flips its sign)")


def pair_scales(
    tensors: dict[str, Tensor], scales: dict[str, Tensor], where: dict[str, str], quantized: bool,
    check_finite: bool = True
) -> dict[str, Tensor | BlockScaledWeight]:
    """``tensors`` with each float8 weight replaced by its ``BlockScaledWeight`` (weight + its
    ``*_scale_inv`` from ``scales``). Raises ``ValueError`` naming the file and the tensor for a
    float8 tensor in a checkpoint whose config declares no ``quantization_config``, one of a float8
    type other than e4m3fn, fp8 on a tensor §8 keeps bf16 (``may_be_fp8``), a missing scale, a scale
    that is not float32 of shape (ceil(N/128), ceil(K/128)), a scale that breaks ``check_scales``
    (or, with ``check_finite``, a W8 value that is NaN), and a scale with no float8 weight beside it."""
    out: dict[str, Tensor | BlockScaledWeight] = {}
    used = set()
    for name, t in tensors.items():
        if not (t.dtype.is_floating_point and t.dtype.itemsize == 1):
            out[name] = t
            continue
        file = where[name]
        if not quantized:
            raise ValueError(f"{file}: tensor {name!r} is {t.dtype}, but config.json has no quantization_config; "
                             "a float8 weight needs quantization_config {quant_method: fp8, weight_block_size: [128, "
                             f"128]}} and its {scale_name(name)!r}")
        if t.dtype != FP8_DTYPE:
            raise ValueError(f"{file}: tensor {name!r} is {t.dtype}; block-scaled weights must be float8_e4m3fn")
        if not may_be_fp8(name):
            raise ValueError(f"{file}: tensor {name!r} is float8, but this tensor stays bf16 in a block-scaled "
                             "checkpoint (fp8 may be: q_a/q_b/kv_a/kv_b/o_proj, the indexer's wq_b and wk, shared and "
                             "routed experts)")
        sname = scale_name(name)
        if sname not in scales:
            raise ValueError(f"{file}: float8 tensor {name!r} has no scale {sname!r} (float32, one per 128 x "
                             "128 block)")
        s = scales[sname]
        want = scale_shape(tuple(t.shape))
        if s.dtype != torch.float32 or tuple(s.shape) != want:
            raise ValueError(f"{where.get(sname, file)}: scale {sname!r} is {s.dtype} {tuple(s.shape)}, expected "
                             f"float32 {want} (ceil(N/128), ceil(K/128)) for weight {name!r} {tuple(t.shape)}")
        check_scales(f"{where.get(sname, file)}: scale {sname!r}", s)
        if check_finite and non_finite_fp8(t):
            raise ValueError(f"{file}: tensor {name!r} holds {non_finite_fp8(t)} NaN value(s) of {t.numel()}; pass "
                             "allow_non_finite=True to load it anyway")
        out[name] = BlockScaledWeight(t, s)
        used.add(sname)
    for sname in sorted(set(scales) - used):
        base = sname[: -len(SCALE_SUFFIX)]
        raise ValueError(f"{where.get(sname, '?')}: scale {sname!r} has no float8 weight {base!r} beside it "
                         f"({'that tensor is ' + str(tensors[base].dtype) if base in tensors else 'no such weight'})")
    return out


def flatten(name: str, t: Tensor | BlockScaledWeight) -> dict[str, Tensor]:
    """A weight as the checkpoint stores it: ``{name: t}``, or ``{name: W8, name_scale_inv: s}``."""
    if isinstance(t, BlockScaledWeight):
        return {name: t.w8, scale_name(name): t.scale_inv}
    return {name: t}
