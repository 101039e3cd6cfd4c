"""graphs.run_program's control flow on CPU, with torch.cuda's stream and graph API replaced by
fakes that record what is called (the real capture needs a GPU: tests marked gpu do that).

First use: the program runs once as the warm-up (that run is the call's work), then is captured
on the shared side stream into the state's pool; later uses replay; a failed capture is ended
and reported; free_state resets every graph."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from glm_mtp.optimized import graphs
from glm_mtp.optimized.state import OptimizedState


class FakeGraph:
    capturing: FakeGraph | None = None

    def __init__(self, log: list) -> None:
        self.log, self.recorded, self.was_reset = log, [], False

    def capture_begin(self, pool=None, **kwargs) -> None:
        self.log.append(("capture_begin", pool))
        FakeGraph.capturing = self

    def capture_end(self) -> None:
        self.log.append(("capture_end",))
        FakeGraph.capturing = None

    def replay(self) -> None:
        self.log.append(("replay",))
        for op in self.recorded:
            op()

    def reset(self) -> None:
        self.was_reset = True


@pytest.fixture
def fake_cuda(monkeypatch):
    log: list = []
    monkeypatch.setattr(torch.cuda, "Stream",
                        lambda device=None: SimpleNamespace(name="side",
                                                            wait_stream=lambda s: log.append(("side_waits",))))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(name="main",
                                                            wait_stream=lambda s: log.append(("main_waits",))))

    @contextlib.contextmanager
    def stream(s):
        log.append(("on", s.name))
        yield

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool",))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: FakeGraph(log))
    monkeypatch.setattr(graphs, "_SIDE_STREAMS", {})
    return log


class FakeDevice:
    type = "cuda"


def fake_state() -> OptimizedState:
    return OptimizedState(cache=None, x=None, device=FakeDevice())  # type: ignore[arg-type]


def test_first_use_warms_up_and_captures_then_replays(fake_cuda):
    st, ran = fake_state(), []

    def program():
        if FakeGraph.capturing is not None:  # what a capture records instead of running
            FakeGraph.capturing.recorded.append(lambda: ran.append("replayed"))
        else:
            ran.append("eager")

    graphs.run_program(st, 3, program, capture=True)
    assert ran == ["eager"]  # the warm-up was this call's work; the capture ran nothing
    assert ("capture_begin", ("pool",)) in fake_cuda and ("capture_end",) in fake_cuda
    assert fake_cuda.index(("side_waits",)) < fake_cuda.index(("on", "side")) < fake_cuda.index(("main_waits",))
    assert list(st.graphs) == [3] and st.graph_pool == ("pool",)
    graphs.run_program(st, 3, program, capture=True)
    graphs.run_program(st, 3, program, capture=True)
    assert ran == ["eager", "replayed", "replayed"]
    graphs.run_program(st, 1, program, capture=True)  # another key: its own graph, the same pool
    assert sorted(st.graphs) == [1, 3] and ran[-1] == "eager"
    kept = list(st.graphs.values())
    st.release()
    assert all(g.was_reset for g in kept) and st.graphs == {} and st.graph_pool is None


def test_capture_off_or_cpu_runs_eagerly(fake_cuda):
    st, ran = fake_state(), []
    graphs.run_program(st, 2, lambda: ran.append("eager"), capture=False)
    cpu = OptimizedState(cache=None, x=None, device=torch.device("cpu"))  # type: ignore[arg-type]
    graphs.run_program(cpu, 2, lambda: ran.append("eager"), capture=True)
    assert ran == ["eager", "eager"] and st.graphs == {} and cpu.graphs == {} and fake_cuda == []


def test_a_failed_capture_is_ended_and_reported(fake_cuda):
    st = fake_state()

    def program():
        if FakeGraph.capturing is not None:
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="cuda_graphs=False"):
        graphs.run_program(st, 4, program, capture=True)
    assert ("capture_end",) in fake_cuda and st.graphs == {}
