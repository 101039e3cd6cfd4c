"""One kernel launch as a value, shared by the launcher and the PTX audit.

Each kernel module builds its launch (grid, arguments, constexprs, compile options) in one
function. The ``*_triton`` wrapper runs it; the module's ``audit_launches(cfg, dtype)`` calls the
same function on abstract tensors with the drafter's real shapes, strides and alignments, and
``glm_mtp.tools.audit`` compiles what it returns for a GPU without needing one. So the audit
sees exactly the constexprs and argument types the drafter launches with, never a hand copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Launch:
    """``kernel[grid](*args, **meta)``.

    Args:
        kernel: the ``@triton.jit`` function.
        grid: the launch grid.
        args: the positional arguments (tensors and ints), in the kernel's order.
        meta: constexprs and compile options (every drafter kernel has ``enable_fp_fusion=False``).
    """

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.meta)


@dataclass(frozen=True)
class AuditLaunch:
    """A launch the drafter makes, as the audit names it in its table.

    Args:
        kernel: a short name of the kernel, e.g. ``embed_rows``.
        variant: which call sites launch it this way, e.g. ``aligned`` (Triton compiles one
            kernel per argument specialisation: dtypes, 16-byte alignment, ints equal to 1).
        launch: the launch, on abstract tensors.
    """

    kernel: str
    variant: str
    launch: Launch


def abstract(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A tensor with a shape, a dtype and strides but no storage (``device="meta"``): enough for
    Triton's argument specialisation, which reads the dtype and the pointer's alignment. A view
    of it keeps its byte offset, so ``abstract((9,), torch.int64)[1:]`` is 8 bytes off a 16-byte
    boundary, as a real slice would be (CUDA allocations start 256-byte aligned)."""
    return torch.empty(shape, dtype=dtype, device="meta")
