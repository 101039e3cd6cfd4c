"""CUDA-graph capture and replay of a state's static programs (the k draft steps, argmax or sampled,
the one-row catch-up).

A program reads only the state's static buffers and writes only into them, and running it twice
on the same inputs gives the same bytes (each step rewrites the rows it later reads). So the
first use runs it once eagerly on a side stream (the warm-up, which also compiles the Triton
kernels and initialises cuBLAS on that stream), captures it, and keeps the graph; later uses
replay the graph. Without CUDA (or with graphs switched off) the program simply runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

Program = Literal["draft", "sampled", "catchup"]


@dataclass(frozen=True)
class GraphKey:
    """Which captured program a graph is: ``program`` (``draft`` the k argmax draft steps,
    ``sampled`` the k sampled ones, ``catchup`` one context row per state), its ``num_drafts``
    (0 for a catch-up), the ``rows`` it runs (1 for one state; a batch's bucket), and for a
    grammar's programs (DESIGN.md §10) the steps ``first`` .. ``last - 1`` it runs (a redo from a
    forbidden step, or a sampled step drawn under its mask) and whether it reads the masks."""

    program: Program
    num_drafts: int = 0
    rows: int = 1
    first: int = 0
    last: int | None = None
    masked: bool = False

    @classmethod
    def draft(cls, num_drafts: int, *, sampled: bool = False, rows: int = 1, first: int = 0, last: int | None = None,
              masked: bool = False) -> GraphKey:
        """The k-draft propose's key (argmax, or ``sampled``; steps ``first`` .. ``last - 1``)."""
        return cls("sampled" if sampled else "draft", num_drafts, rows, first,
                   None if last is None or last == num_drafts else last, masked)

    @classmethod
    def catchup(cls, rows: int = 1) -> GraphKey:
        """The one-row catch-up's key (one row for each of ``rows`` states)."""
        return cls("catchup", 0, rows)

# One side stream per device for every warm-up and capture: cuBLAS keeps a workspace per stream
# for the life of the process, so a fresh stream per state would grow memory with every state.
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream this module warms up and captures on, for ``device``."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def run_program(state: Any, key: GraphKey, program: Callable[[], None], capture: bool) -> None:
    """Run ``program`` on ``state``'s buffers (an ``OptimizedState`` or ``BatchBuffers``: its
    ``device``, ``graphs`` and ``graph_pool``): replay its graph under ``key`` if captured, else
    (with ``capture`` on a CUDA state) warm it up, capture it for next time; else run it eagerly."""
    if not capture or state.device.type != "cuda":
        program()
        return
    with torch.cuda.device(state.device):  # Triton launches and captures on the current device
        _run_captured(state, key, program)


def _run_captured(state: Any, key: GraphKey, program: Callable[[], None]) -> None:
    graph = state.graphs.get(key)
    if graph is not None:
        graph.replay()
        return
    # Warm-up: the eager run is this call's work (the capture below does not execute).
    side = side_stream(state.device)
    side.wait_stream(torch.cuda.current_stream(state.device))
    with torch.cuda.stream(side):
        program()
    torch.cuda.current_stream(state.device).wait_stream(side)
    if state.graph_pool is None:
        # One pool per state: its graphs replay one at a time and keep nothing alive between replays.
        state.graph_pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    # capture_begin/end rather than ``torch.cuda.graph``: that context synchronises the device and
    # empties the allocator's cache first, a cost every new state would pay for every num_drafts.
    with torch.cuda.stream(side):
        graph.capture_begin(pool=state.graph_pool)
        try:
            program()
        except Exception as e:  # a host sync or an uncapturable op in the program
            try:
                graph.capture_end()
            except Exception:
                pass
            raise RuntimeError(
                f"capturing program {key} failed ({e}); "
                "OptimizedProposer(..., cuda_graphs=False) runs it uncaptured"
            ) from e
        graph.capture_end()
    state.graphs[key] = graph
