"""CUDA-graph capture and replay of a state's static programs (the k draft steps, argmax or sampled,
a grammar's redo and masked sampled step, the one-row catch-up).

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

Program = Literal["draft", "sampled", "redo", "masked_sampled_step", "catchup"]


@dataclass(frozen=True)
class GraphKey:
    """Which captured program a graph is: ``program`` (``draft`` the k argmax draft steps,
    ``sampled`` the k sampled ones, and a grammar's (DESIGN.md §10) ``redo`` from a forbidden
    step and ``masked_sampled_step``, one sampled step drawn under its mask; ``catchup`` one
    context row per state), its ``num_drafts`` (0 for a catch-up), the ``rows`` it runs (1 for
    one state; a batch's bucket), and ``step``: the redo's first step, or the sampled step's
    index (0-based; 0 for the others)."""

    program: Program
    num_drafts: int = 0
    rows: int = 1
    step: int = 0

    @classmethod
    def draft(cls, num_drafts: int, *, rows: int = 1) -> GraphKey:
        """The k argmax draft steps' key (of one state, or of a batch's ``rows``)."""
        return cls("draft", num_drafts, rows)

    @classmethod
    def sampled_draft(cls, num_drafts: int) -> GraphKey:
        """The k sampled draft steps' key."""
        return cls("sampled", num_drafts)

    @classmethod
    def redo(cls, num_drafts: int, first: int) -> GraphKey:
        """The key of a k-draft propose's redo from its forbidden step ``first``."""
        return cls("redo", num_drafts, 1, first)

    @classmethod
    def masked_sampled_step(cls, num_drafts: int, step: int) -> GraphKey:
        """The key of a k-draft propose's sampled step ``step`` under its mask."""
        return cls("masked_sampled_step", num_drafts, 1, step)

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
