"""The seeded sampler (DESIGN.md §14): the target's sample at a position as a pure function of its
logits there and a key, so any engine, device and batch size give the same token from the same
logits, and a trace recorded with it replays at temperature > 0.

For one row of logits ``l`` (V,) at item position ``p`` of the prompt with sha256 ``h``:

1. ``s = up(l) / T`` in float32, one correctly rounded division per logit (T a float32 tensor).
2. top_k (null: off): keep the k tokens of highest logit, ties to the lower id. They are ranked by
   the raw logit, which orders them as their probability does, so ``top_k = 1`` is the argmax
   exactly (a division by T could round two logits to one scaled value).
3. ``w = masked_softmax(s, kept)``, the pinned softmax (``numerics``: pinned exp, psum).
4. top_p (null or 1: off, every token kept): tokens sorted by ``w`` descending, ties to the lower id; keep the shortest
   prefix whose probability reaches top_p. The prefix sums are exact: each ``w`` is taken as the
   integer ``floor(w * 2^40)`` (int64), whose running sum has no rounding and no order, and the
   token of rank r is kept when the sum of ranks < r is below ``ceil(top_p * 2^40)``.
5. ``w = masked_softmax(s, kept)`` again, over the tokens kept by both.
6. the exponential race: ``y = argmax_j w_j / E_j`` over the kept tokens (float64, ties to the
   lower id), ``E_j = -log(U_j)`` and ``U_j = (bits_j >> 11 + 0.5) * 2^-53``, ``bits_j`` the 64-bit
   counter-based hash ``splitmix64`` of ``(seed, h, p, j)`` (``race_noise``). ``-log`` is float64's
   natural log: an engine within an ulp of it changes a token only where two race scores tie to
   the last bit.

``temperature = 0`` is the argmax (ties to the lower id), whatever the other settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from glm_mtp.reference.layers import restricted_argmax
from glm_mtp.reference.numerics import masked_softmax, up

NAME = "glm-mtp-seeded-race"
VERSION = 1
TOP_P_SCALE = 1 << 40  # w as integers of 2^-40: a row's sum stays below 2^62 for V < 2^22

# splitmix64's constants (Steele, Lea, Flood 2014), as int64 bit patterns.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _i64(x: int) -> int:
    """The int64 with the bits of the unsigned 64-bit ``x``."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def _shr(x: Tensor, n: int) -> Tensor:
    """Logical right shift of int64 ``x`` by ``n`` (torch's ``>>`` is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix64(x: Tensor) -> Tensor:
    """splitmix64's finalizer on int64 ``x`` (elementwise; multiplications wrap modulo 2^64)."""
    x = (x ^ _shr(x, 30)) * _i64(_MIX1)
    x = (x ^ _shr(x, 27)) * _i64(_MIX2)
    return x ^ _shr(x, 31)


@dataclass(frozen=True)
class SamplerSettings:
    """The sampler's settings: ``temperature`` (>= 0; 0 is the argmax), ``top_p`` (None: off, else
    in (0, 1]), ``top_k`` (None: off, else >= 1) and ``seed`` (an int64)."""

    temperature: float
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        t, p, k = self.temperature, self.top_p, self.top_k
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ValueError(f"top_p must be null (off) or a number in (0, 1], got {p!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"top_k must be null (off) or an integer >= 1, got {k!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(1 << 63) <= self.seed < (1 << 63):
            raise ValueError(f"seed must be an int64, got {self.seed!r}")

    def record(self) -> dict[str, Any]:
        """The generation record's sampler fields (a trace's, a summary's)."""
        return {"temperature": float(self.temperature), "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "sampler": {"name": NAME, "version": VERSION}}


def truncates(settings: SamplerSettings | None) -> bool:
    """Whether ``settings`` truncate (top_p below 1 or a top_k): the kept set may be smaller than
    the vocabulary."""
    return settings is not None and ((settings.top_p is not None and settings.top_p < 1) or settings.top_k is not None)


def race_noise(seed: int, prompt_sha256: str, positions: Tensor, vocab_size: int) -> Tensor:
    """``E`` (T, V) float64, Exponential(1) from the counter-based hash of (seed, prompt, position,
    token): ``key = mix64(mix64(mix64(seed + G) ^ h64 + G) ^ p + G)``, ``bits_j = mix64(key + (j + 1)
    G)`` (splitmix64's stream from ``key``), G the golden-ratio constant, ``h64`` the first 16 hex
    digits of ``prompt_sha256`` as an int64. ``positions`` (T,) int64 item positions."""
    device = positions.device
    g = _i64(_GOLDEN)
    h64 = _i64(int(prompt_sha256[:16], 16))
    key = mix64(torch.tensor([seed], dtype=torch.int64, device=device) + g)  # (1,)
    key = mix64((key ^ h64) + g)
    key = mix64((positions.to(torch.int64) ^ key) + g)  # (T,)
    j = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=device)  # (V,)
    bits = mix64(key[:, None] + j[None, :] * g)  # (T, V)
    u = (_shr(bits, 11).to(torch.float64) + 0.5) * 2.0**-53  # (T, V) in (0, 1)
    return -torch.log(u)


def kept_tokens(logits: Tensor, settings: SamplerSettings) -> Tensor:
    """The tokens top_k then top_p keep (T, V) bool, for ``logits`` (T, V) (steps 1-4)."""
    T, V = logits.shape
    raw = up(logits)  # (T, V) in A
    s = raw / torch.tensor(settings.temperature, dtype=raw.dtype, device=raw.device)
    kept = torch.ones(T, V, dtype=torch.bool, device=logits.device)
    if settings.top_k is not None and settings.top_k < V:
        order = torch.sort(raw, dim=-1, descending=True, stable=True).indices  # ties: the lower id first
        kept = torch.zeros_like(kept).scatter_(-1, order[:, : settings.top_k], True)
    if settings.top_p is not None and settings.top_p < 1:  # 1 keeps all (float32 w may sum past 1 before the tail)
        w = masked_softmax(s, kept)  # (T, V)
        w = torch.where(kept, w, 0.0)
        order = torch.sort(w, dim=-1, descending=True, stable=True).indices  # (T, V)
        ints = torch.floor(w.gather(-1, order).double() * TOP_P_SCALE).to(torch.int64)  # exact: a power-of-two scale
        before = torch.cumsum(ints, dim=-1) - ints  # (T, V) the sum of the ranks before, exact in int64
        need = math.ceil(settings.top_p * TOP_P_SCALE)
        in_prefix = before < need
        kept = kept & torch.zeros_like(kept).scatter_(-1, order, in_prefix)
    return kept


def seeded_sample(logits: Tensor, settings: SamplerSettings, prompt_sha256: str, positions: Tensor) -> Tensor:
    """The seeded samples (T,) int64 of ``logits`` (T, V), row t at item position ``positions[t]``
    of the prompt with sha256 ``prompt_sha256`` (module docstring: steps 1-6). A pure function of
    each row and its key: rows never mix, so a batch or a longer verify gives each row's own token.
    Temperature 0 gives ``restricted_argmax(logits)`` (the argmax, ties to the lower id)."""
    if logits.dim() != 2 or positions.shape != logits.shape[:1]:
        raise ValueError(f"logits must be (T, V) with positions (T,), got {tuple(logits.shape)} and "
                         f"{tuple(positions.shape)}")
    if settings.temperature == 0:
        return restricted_argmax(up(logits), None)
    kept = kept_tokens(logits, settings)
    s = up(logits) / torch.tensor(settings.temperature, dtype=up(logits).dtype, device=logits.device)
    w = masked_softmax(s, kept)  # (T, V)
    noise = race_noise(settings.seed, prompt_sha256, positions, logits.shape[1])  # (T, V) float64
    return restricted_argmax(w.double() / noise, kept)
