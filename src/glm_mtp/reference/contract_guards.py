"""The drafter contract's guards of a state (DESIGN.md §4, rule 0 and the lifecycle): whose it
is (``Owner``), one caller at a time (``use_state``), freed or poisoned (``check_sound``), and a
failure midway poisoning it (``writing``, ``writing_all``). Host-side flags only: nothing here
touches a tensor, so the checks cost no device sync.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from .state import DrafterState, Owner

# Held only for the test-and-set of ``DrafterState.user``, never across a call's compute.
_CLAIM = threading.Lock()


@contextmanager
def use_state(
    state: DrafterState, call: str, drafter: str, state_type: type, weights: Any, capacity: int
) -> Iterator[DrafterState]:
    """The guard of every public call on a state: the state must come from this drafter, and it
    has one caller at a time.

    Args:
        state: what the caller passed.
        call: the public call's name, for messages.
        drafter: the drafter's class name, for messages.
        state_type / weights / capacity: what this drafter's ``alloc_state`` makes.

    Raises:
        TypeError: not a state of this backend (``state_type``, exactly).
        ValueError: a state of a drafter with other weights or another capacity.
        RuntimeError: another call (another thread, or a call made from inside one) is using it.
    """
    if type(state) is not state_type:
        raise TypeError(f"{call}: state must come from {drafter}.alloc_state (a {state_type.__name__}), got "
                        f"{type(state).__name__}")
    owner = state.owner
    if owner is None or not owner.serves(weights):
        raise ValueError(f"{call}: the state was allocated by a drafter on other weights; use that drafter's "
                         "states only")
    if owner.capacity != capacity:
        raise ValueError(f"{call}: the state holds {owner.capacity} rows, this drafter's capacity is {capacity} "
                         "(another max_seq_len)")
    me = threading.get_ident()
    with _CLAIM:
        if state.user is not None:
            raise RuntimeError(f"{call}: the state is in use by another call (thread {state.user}); a state has one "
                               "caller at a time")
        state.user = me
    try:
        yield state
    finally:
        state.user = None


def check_sound(state: DrafterState, call: str) -> None:
    """``RuntimeError`` for a freed or a poisoned state (the first lifecycle checks)."""
    if state.released:
        raise RuntimeError(f"{call}: the state was freed (free_state); allocate a new one")
    if state.poisoned is not None:
        raise RuntimeError(f"{call}: the state is unusable: {state.poisoned}; free it (free_state) and allocate "
                           "a new one")


class RefusedMidway(ValueError):
    """A refusal found after the call began writing (a matcher that breaks its contract, DESIGN.md
    §10), raised once the call has put every byte it wrote back: it does not poison the state."""


@contextmanager
def writing(state: DrafterState, call: str) -> Iterator[None]:
    """The part of a call that changes the state, after every check passed.

    It runs without autograd: hiddens (or weights) that require grad would otherwise chain every
    row written into one growing graph. Any exception from it (an interrupt, an out-of-memory, a
    failing kernel) poisons the state: rows may be half-written while the counters say otherwise,
    and restoring them would need a copy on every call, so later calls refuse it instead."""
    with writing_all((state,), call):
        yield


@contextmanager
def writing_all(states: Sequence[DrafterState], call: str) -> Iterator[None]:
    """``writing`` for a batch: a failure midway poisons every state of it (any of them may hold
    half-written rows). A ``RefusedMidway`` passes through: its call restored the states first."""
    try:
        with torch.no_grad():
            yield
    except RefusedMidway:
        raise
    except BaseException as e:
        for state in states:
            state.poisoned = f"{call} failed midway ({type(e).__name__}: {e})"
        raise


# ``Owner`` is the state's (``state.py``, below the guards); the guards' users import it here too.
__all__ = ["Owner", "use_state", "check_sound", "writing", "writing_all"]
