"""Byte comparison of exported states, and where two tensors first differ.

Floats are compared as the integers of their bits (``same_bytes``): -0.0 differs from 0.0, and a
NaN equals only the same NaN. When two tensors differ, ``first_mismatch`` names the first element
that does, as (row, element) for 2-D tensors, with both values and their bits.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from glm_mtp.reference.bytes import bits, same_bytes

# The keys export_state returns in both backends (DESIGN.md §4), in this order.
EXPORT_KEYS = ("kv_rows", "index_rows", "x", "seq_len", "last_drafted", "pending", "block_table")
# The glm5_next family's drafter also exports its KPool indexer's state (DESIGN.md §7), after those.
KPOOL_EXPORT_KEYS = ("pool_keys", "pool_complete", "pool_gates")


def export_keys(cfg: object) -> tuple[str, ...]:
    """The keys ``export_state`` returns for a drafter of config ``cfg``, in order."""
    return EXPORT_KEYS + (KPOOL_EXPORT_KEYS if getattr(cfg, "is_next", False) else ())

def describe_value(t: Tensor, index: tuple[int, ...]) -> str:
    """``t[index]`` with its bits in hex, e.g. ``0.125 (0x3e00)``."""
    v = t.detach().cpu()[index]
    b = int(bits(t)[index]) & ((1 << (8 * t.element_size())) - 1)
    if t.dtype.is_floating_point:
        return f"{float(v)!r} (0x{b:0{2 * t.element_size()}x})"
    return f"{v.item()!r}"


@dataclass
class Mismatch:
    """Where two tensors differ: ``index`` of the first differing element (None when the shape,
    dtype or device differ), and both sides described."""

    index: tuple[int, ...] | None
    candidate: str
    baseline: str
    detail: str
    count: int = 0  # differing elements


def first_mismatch(cand: Tensor, base: Tensor) -> Mismatch | None:
    """None when ``cand`` and ``base`` agree in dtype, shape, device type and every byte."""
    if cand.dtype != base.dtype or tuple(cand.shape) != tuple(base.shape):
        return Mismatch(None, f"{cand.dtype} {tuple(cand.shape)}", f"{base.dtype} {tuple(base.shape)}",
                        "dtype or shape differ")
    if cand.device.type != base.device.type:
        return Mismatch(None, str(cand.device), str(base.device), "device differs")
    if same_bytes(cand.detach().cpu(), base.detach().cpu()):
        return None
    ne = bits(cand) != bits(base)
    where = ne.nonzero()
    index = tuple(int(i) for i in where[0]) if where.numel() else ()
    return Mismatch(index, describe_value(cand, index), describe_value(base, index), "bytes differ", int(ne.sum()))


def snapshots_equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    """Same keys, and every tensor byte-equal (dtype and shape included)."""
    return a.keys() == b.keys() and all(first_mismatch(a[k], b[k]) is None for k in a)
