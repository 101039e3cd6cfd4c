"""Timing on this machine: seconds a call takes (CUDA events on a GPU, the wall clock elsewhere),
the device's copy bandwidth, the bytes a drafter state holds, and the dtypes the benches time."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import torch

# The weight dtypes the benches (experiments/bench.py, bench_batch.py) time: names of glm_mtp.registry.DTYPES.
BENCH_DTYPES = ("bfloat16", "float16", "float32")


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 9) -> float:
    """Bytes per second of a device-to-device copy, counting the bytes read and written (as
    STREAM's copy does); the median of ``repeats`` copies."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = [timed(lambda: dst.copy_(src), device) for _ in range(repeats + 1)][1:]
    return 2 * nbytes / statistics.median(times)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call takes: CUDA events on a GPU, the wall clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def state_nbytes(state: Any) -> int:
    """Bytes of the distinct tensor storages reachable from a state's attributes."""
    seen: set[int] = set()
    total = 0

    def visit(obj: Any, depth: int) -> None:
        nonlocal total
        if depth > 4:
            return
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            if st.data_ptr() not in seen and st.nbytes():
                seen.add(st.data_ptr())
                total += st.nbytes()
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                visit(getattr(obj, f.name), depth + 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
            for v in vars(obj).values():
                visit(v, depth + 1)

    visit(state, 0)
    return total
