"""The state rules of DESIGN.md §4 beyond argument checks, in both backends: a call that fails
midway poisons the state, a state has one caller at a time, a state serves only the drafter that
allocated it, no autograd graph reaches a state, and a token id too large for int64 is the same
clean ValueError as any other out-of-range id."""

from __future__ import annotations

import threading

import pytest

import glm_mtp.optimized.programs as opt_programs
import glm_mtp.optimized.proposer as opt_module
import glm_mtp.reference.proposer as ref_module
from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import MtpWeights, ReferenceProposer

from .conftest import state_bytes

BACKENDS = {"reference": ReferenceProposer, "optimized": OptimizedProposer}


def row_fn(prop):
    """Where a drafter computes a row: the reference's ``mtp_rows``; the optimized drafter's
    fused step (``fused_rows``) where it takes one, else its per-primitive ``block_rows``."""
    if isinstance(prop, ReferenceProposer):
        return ref_module, "mtp_rows"
    return opt_programs, "fused_rows" if prop.step is not None else "block_rows"


def draft_fn(prop):
    """Where a drafter turns a row's output into a draft (the fused step: ``fused_head``)."""
    if isinstance(prop, ReferenceProposer):
        return ref_module, "greedy_token"
    return opt_programs, "fused_head" if prop.step is not None else "greedy_token"


CAUSE = "injected failure 7f3a"


class InjectedFailure(Exception):
    pass


def fail_on_call(monkeypatch, module, name, n, exc=InjectedFailure):
    """Make ``module.name`` raise ``exc(CAUSE)`` on its ``n``-th call (0-based) from now on."""
    real, count = getattr(module, name), [0]

    def wrapper(*args, **kwargs):
        count[0] += 1
        if count[0] == n + 1:
            raise exc(CAUSE)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    return request.param


def ready(prop, inputs, rows=12):
    """A state holding ``rows`` rows, nothing pending (a prefill, then one verified round)."""
    st = prop.alloc_state("cpu")
    prop.prefill_drafter(inputs.tokens(rows - 2), inputs.hiddens(rows - 2), st)  # rows - 3 rows
    prop.propose(inputs.token(), inputs.hiddens(1), rows - 3, 3, st)
    prop.after_verify(2, st)  # keeps 3: rows held
    assert prop.drafter_rows(st) == rows
    return st


def state_tensors(st):
    return st.tensors() if hasattr(st, "tensors") else [st.cache.kv_pool, st.cache.index_pool, st.cache.block_table,
                                                        st.x]


# ---- 5: a call that fails midway poisons the state ------------------------------------------------

def later_calls(prop, st, inputs):
    """Every mutating call, each of which a poisoned state must refuse."""
    return {
        "propose": lambda: prop.propose(inputs.token(), inputs.hiddens(1), 12, 2, st),
        "propose_rewind": lambda: prop.propose(inputs.token(), inputs.hiddens(1), 4, 2, st),
        "prefill_drafter": lambda: prop.prefill_drafter(inputs.tokens(4), inputs.hiddens(4), st),
        "catchup_drafter": lambda: prop.catchup_drafter(inputs.tokens(1), inputs.hiddens(1), 12, 12, st),
        "after_verify": lambda: prop.after_verify(0, st),
    }


def check_poisoned(prop, st, inputs, cause_type):
    before = state_bytes(prop, st)  # export_state still works
    rows, key = prop.drafter_rows(st), prop.last_pair_key(st)
    for name, call in later_calls(prop, st, inputs).items():
        with pytest.raises(RuntimeError, match=f"{cause_type}.*{CAUSE}") as e:
            call()
        assert e.value.args[0].startswith(name.split("_rewind")[0]), e.value
        assert state_bytes(prop, st) == before
        assert prop.drafter_rows(st) == rows and prop.last_pair_key(st) == key
    prop.free_state(st)
    with pytest.raises(RuntimeError, match="freed"):
        prop.propose(inputs.token(), inputs.hiddens(1), 0, 1, st)


@pytest.mark.parametrize("where", ["row", "draft"])
@pytest.mark.parametrize("k", [1, 3])
def test_a_propose_failing_at_any_draft_step_poisons_the_state(weights, inputs, backend, monkeypatch, where, k):
    prop = BACKENDS[backend](weights, 64)
    for step in range(k):
        st = ready(prop, inputs)
        with monkeypatch.context() as m:
            module, name = (row_fn if where == "row" else draft_fn)(prop)
            fail_on_call(m, module, name, step)
            with pytest.raises(InjectedFailure):
                prop.propose(inputs.token(), inputs.hiddens(1), 10, k, st)  # rewinds: rows 10, 11 are overwritten
        check_poisoned(prop, st, inputs, "InjectedFailure")


def test_an_interrupt_during_the_optimized_read_back_poisons_the_state(weights, inputs, monkeypatch):
    prop = OptimizedProposer(weights, 64)
    st = ready(prop, inputs)
    with monkeypatch.context() as m:
        fail_on_call(m, opt_module, "read_back", 0, KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            prop.propose(inputs.token(), inputs.hiddens(1), 10, 3, st)
    check_poisoned(prop, st, inputs, "KeyboardInterrupt")


@pytest.mark.parametrize("call", ["prefill", "catchup"])
def test_a_context_write_failing_midway_poisons_the_state(weights, inputs, backend, monkeypatch, call):
    prop = BACKENDS[backend](weights, 64)
    st = prop.alloc_state("cpu") if call == "prefill" else ready(prop, inputs)
    with monkeypatch.context() as m:
        fail_on_call(m, *row_fn(prop), 0)
        with pytest.raises(InjectedFailure):
            if call == "prefill":
                prop.prefill_drafter(inputs.tokens(8), inputs.hiddens(8), st)
            else:
                prop.catchup_drafter(inputs.tokens(3), inputs.hiddens(3), 12, 12, st)
    check_poisoned(prop, st, inputs, "InjectedFailure")


def test_a_refused_call_does_not_poison(weights, inputs, backend):
    prop = BACKENDS[backend](weights, 64)
    st = ready(prop, inputs)
    with pytest.raises(ValueError):
        prop.propose(inputs.token(), inputs.bad_hiddens(1, 0, 3, float("nan")), 12, 2, st)
    assert len(prop.propose(inputs.token(), inputs.hiddens(1), 12, 2, st)) == 2


def test_reset_state_clears_the_poison(weights, inputs, monkeypatch):
    prop = OptimizedProposer(weights, 64)
    st = ready(prop, inputs)
    with monkeypatch.context() as m:
        fail_on_call(m, *row_fn(prop), 1)
        with pytest.raises(InjectedFailure):
            prop.propose(inputs.token(), inputs.hiddens(1), 10, 3, st)
    prop.reset_state(st)
    fresh = prop.alloc_state("cpu")
    assert state_bytes(prop, st) == state_bytes(prop, fresh)
    tokens, hiddens = inputs.tokens(9), inputs.hiddens(9)
    for s in (st, fresh):
        prop.prefill_drafter(tokens, hiddens, s)
    tok, hid = inputs.token(), inputs.hiddens(1)
    assert prop.propose(tok, hid, 8, 3, st) == prop.propose(tok, hid, 8, 3, fresh)
    assert state_bytes(prop, st) == state_bytes(prop, fresh)


# ---- 6: one caller at a time -------------------------------------------------------------------------

def test_a_concurrent_call_is_refused(weights, inputs, backend, monkeypatch):
    """The first propose is held inside its compute (at its first row) while this thread calls
    on the same state: every call is refused, the first propose then returns the drafts a lone
    caller gets, and the state ends as after that propose alone."""
    prop = BACKENDS[backend](weights, 64)
    tokens, hiddens = inputs.tokens(10), inputs.hiddens(10)
    st, twin = prop.alloc_state("cpu"), prop.alloc_state("cpu")
    for s in (st, twin):
        prop.prefill_drafter(tokens, hiddens, s)
    tok, hid = inputs.token(), inputs.hiddens(1)
    want = prop.propose(tok, hid, 9, 3, twin)

    inside, release = threading.Event(), threading.Event()
    module, name = row_fn(prop)
    real, first = getattr(module, name), [True]

    def held(*args, **kwargs):
        if first[0] and threading.current_thread() is not threading.main_thread():
            first[0] = False
            inside.set()
            assert release.wait(60), "the test never released the first call"
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, held)
    got: list = []
    worker = threading.Thread(target=lambda: got.append(prop.propose(tok, hid, 9, 3, st)))
    worker.start()
    try:
        assert inside.wait(60), "the first propose never reached its compute"
        calls = {
            "propose": lambda: prop.propose(inputs.token(), inputs.hiddens(1), 9, 2, st),
            "after_verify": lambda: prop.after_verify(0, st),
            "catchup_drafter": lambda: prop.catchup_drafter(inputs.tokens(1), inputs.hiddens(1), 9, 9, st),
            "export_state": lambda: prop.export_state(st),
            "drafter_rows": lambda: prop.drafter_rows(st),
            "free_state": lambda: prop.free_state(st),
        }
        for call_name, call in calls.items():
            with pytest.raises(RuntimeError, match=f"{call_name}: the state is in use by another call"):
                call()
    finally:
        release.set()
        worker.join(60)
    assert got == [want]
    assert state_bytes(prop, st) == state_bytes(prop, twin)
    prop.after_verify(1, st)  # the state is free again
    prop.free_state(st)


# ---- 7: a state serves only the drafter that allocated it -------------------------------------------

def foreign_calls(prop, st, inputs):
    return {
        "propose": lambda: prop.propose(inputs.token(), inputs.hiddens(1), 12, 2, st),
        "prefill_drafter": lambda: prop.prefill_drafter(inputs.tokens(4), inputs.hiddens(4), st),
        "catchup_drafter": lambda: prop.catchup_drafter(inputs.tokens(1), inputs.hiddens(1), 12, 12, st),
        "after_verify": lambda: prop.after_verify(0, st),
        "export_state": lambda: prop.export_state(st),
        "drafter_rows": lambda: prop.drafter_rows(st),
        "last_pair_key": lambda: prop.last_pair_key(st),
        "free_state": lambda: prop.free_state(st),
    }


@pytest.mark.parametrize("other", ["other_backend", "other_weights", "smaller", "larger"])
def test_a_state_of_another_drafter_is_refused(weights, inputs, backend, other):
    owner = BACKENDS[backend](weights, 64)
    st = ready(owner, inputs)
    before = state_bytes(owner, st)
    if other == "other_backend":
        prop, exc, match = (
            BACKENDS["optimized" if backend == "reference" else "reference"](weights, 64),
            TypeError,
            "alloc_state",
        )
    elif other == "other_weights":
        twin = MtpWeights.random(weights.config, seed=99, dtype=weights.dtype)
        prop, exc, match = BACKENDS[backend](twin, 64), ValueError, "other weights"
    else:
        prop, exc, match = BACKENDS[backend](weights, 16 if other == "smaller" else 256), ValueError, "capacity"
    for name, call in foreign_calls(prop, st, inputs).items():
        with pytest.raises(exc, match=f"{name}: .*{match}"):
            call()
        assert state_bytes(owner, st) == before, name
    assert not st.released
    assert owner.propose(inputs.token(), inputs.hiddens(1), 12, 2, st)  # still its owner's


# ---- 8: no autograd graph reaches a state --------------------------------------------------------------

def test_hiddens_that_require_grad_leave_no_graph_in_the_state(weights, inputs, backend):
    prop = BACKENDS[backend](weights, 64)
    st, plain = prop.alloc_state("cpu"), prop.alloc_state("cpu")
    tokens, hiddens = inputs.tokens(10), inputs.hiddens(10)
    tok, hid = inputs.token(), inputs.hiddens(1)
    grad = lambda t: t.clone().requires_grad_(True)  # noqa: E731
    prop.prefill_drafter(tokens, grad(hiddens), st)
    prop.prefill_drafter(tokens, hiddens, plain)
    assert prop.propose(tok, grad(hid)[0], 9, 3, st) == prop.propose(tok, hid[0], 9, 3, plain)
    last = inputs.tokens(1)
    for s in (st, plain):
        prop.after_verify(3, s)
        prop.catchup_drafter(last, grad(hiddens[:1]) if s is st else hiddens[:1], 12, 12, s)
    for t in state_tensors(st):
        assert t.grad_fn is None and not t.requires_grad
    assert state_bytes(prop, st) == state_bytes(prop, plain)


# ---- 9: a token id beyond int64 ------------------------------------------------------------------------

@pytest.mark.parametrize("call", ["propose", "prefill", "catchup"])
def test_a_huge_token_id_is_a_clean_value_error(weights, inputs, backend, call):
    prop = BACKENDS[backend](weights, 64)
    st = ready(prop, inputs)
    before = state_bytes(prop, st)
    huge = 2**70
    with pytest.raises(ValueError, match=f"token id {huge} is outside \\[0, vocab_size"):
        if call == "propose":
            prop.propose(huge, inputs.hiddens(1), 12, 2, st)
        elif call == "prefill":
            prop.prefill_drafter([1, huge], inputs.hiddens(2), st)
        else:
            prop.catchup_drafter([huge], inputs.hiddens(1), 12, 12, st)
    assert state_bytes(prop, st) == before
