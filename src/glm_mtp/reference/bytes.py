"""Byte equality: the one way this package says two tensors are the same.

Bit for bit means bytes: two tensors are the same when their shapes, dtypes and raw bytes are.
So -0.0 differs from 0.0, a NaN equals only the NaN with the same payload, and no tolerance or
float comparison (``torch.equal`` on floats, ``allclose``) stands in for it. Every package (the
reference's own checks, the optimized drafter's, conformance, the tests) compares through here.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

# The integer dtype of each element size: a float's bits as an integer of its width.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: Tensor) -> Tensor:
    """The tensor's bytes as integers of its element size, on the CPU (shape kept): what a
    comparison that wants to say *where* two tensors differ compares."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.dim() == 0:
        return t.reshape(1).view(_INT_VIEW[t.element_size()]).reshape(())
    return t.view(_INT_VIEW[t.element_size()])


def raw_bytes(t: Tensor) -> bytes:
    """The tensor's elements as bytes, in row-major order (from any device)."""
    return t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes()


def same_bytes(a: Tensor, b: Tensor) -> bool:
    """Byte equality of two tensors on one device (shape and dtype too): -0.0 != 0.0, NaN == the
    same NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def keyed_bytes(tensors: dict[str, Tensor]) -> dict[str, tuple[tuple[int, ...], str, bytes]]:
    """``(shape, dtype, raw bytes)`` per key: a snapshot (e.g. of ``export_state``) that compares
    equal exactly when every tensor is the same bytes."""
    return {k: (tuple(t.shape), str(t.dtype), raw_bytes(t)) for k, t in tensors.items()}


def hidden_fingerprint(hidden: Tensor) -> str:
    """16 hex digits of a hash of the tensor's bytes."""
    return hashlib.blake2b(raw_bytes(hidden), digest_size=8).hexdigest()
