"""The one map from names to drafter backends and to torch dtypes.

The conformance suite, the sharded check, the experiments and the bench all take a backend and a
dtype by name; they all read them here. Importing this module imports torch only: a backend's
package is imported when it is asked for (``glm_mtp.optimized`` pulls Triton), and nothing here
pulls Hydra or W&B.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

# name -> (module, class); every class is built as ``cls(weights, max_seq_len, feed_hidden)``.
BACKENDS: dict[str, tuple[str, str]] = {
    "reference": ("glm_mtp.reference", "ReferenceProposer"),
    "optimized": ("glm_mtp.optimized", "OptimizedProposer"),
}

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}


def backend_class(name: str) -> Any:
    """The proposer class of backend ``name`` (a key of ``BACKENDS``), imported now.

    Raises:
        ValueError: ``name`` is not a known backend.
        ImportError: its package cannot be imported here.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    module, attr = BACKENDS[name]
    return getattr(importlib.import_module(module), attr)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``torch.bfloat16`` from ``"bfloat16"``/``"bf16"`` (a dtype passes through).

    Raises:
        ValueError: ``name`` is not a key of ``DTYPES``.
    """
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype: unknown dtype {name!r}; known: {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16`` (the long name, a key of ``DTYPES``)."""
    return str(dtype).removeprefix("torch.")
