"""The target's sampling keys (DESIGN.md §14): ``temperature`` with ``top_p`` and ``top_k`` (null:
off), ``seed`` (the sampler's key), and ``verify`` (``rejection``: speculative sampling against the
target's distribution, the default; ``match``: seeded exact match against the target's own seeded
samples). A config without the new keys means them off and ``verify=rejection``.
"""

from __future__ import annotations

from typing import Any

from ..loop.sampler import SamplerSettings

VERIFIES = ("rejection", "match")


def sampler_settings(cfg: Any) -> SamplerSettings:
    """The seeded sampler's settings of ``cfg``: ``temperature``, ``top_p``, ``top_k``, ``seed``
    (``ValueError`` naming the key that breaks its rule)."""
    return SamplerSettings(float(cfg.temperature), cfg.get("top_p"), cfg.get("top_k"), int(cfg.seed))


def verify_kind(cfg: Any) -> str:
    """``cfg``'s ``verify`` (``rejection`` when absent)."""
    return cfg.get("verify", "rejection")


def decoder_sampling(cfg: Any) -> dict[str, Any]:
    """The loop's sampling arguments of ``cfg`` (``SpeculativeDecoder`` / ``teacher_forced``):
    ``verify``, ``top_p``, ``top_k``."""
    return {"verify": verify_kind(cfg), "top_p": cfg.get("top_p"), "top_k": cfg.get("top_k")}


def check_sampling(cfg: Any) -> None:
    """``top_p``, ``top_k`` and ``verify`` (``temperature`` and ``seed`` are checked beside the
    other keys): each its own rule, then truncation needs temperature > 0 (it truncates the
    sampled distribution; at temperature 0 the argmax is the whole answer)."""
    v = verify_kind(cfg)
    if v not in VERIFIES:
        raise ValueError(f"verify must be one of {', '.join(VERIFIES)}; got {v!r}")
    top_p, top_k = cfg.get("top_p"), cfg.get("top_k")
    SamplerSettings(1.0, top_p, top_k)  # each key's own rule, naming it
    if float(cfg.temperature) == 0 and (top_p is not None or top_k is not None):
        raise ValueError(f"top_p / top_k truncate the sampled distribution: they need temperature > 0 (got top_p="
                         f"{top_p!r}, top_k={top_k!r} at temperature 0)")
