"""The drafter contract for many states in one call (``propose_batch``, ``catchup_batch``):
the batch's own argument parsing, then every per-state rule of ``contract`` applied to each
state, a refusal naming its state (``states[b]``) and no state changed unless all passed.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from torch import Tensor

from .contract import (
    ProposeArgs, check_args_data, check_capacity, check_hiddens, check_int, check_strided, check_token_dtype,
    propose_args, token_ids,
)
from .state import DrafterState
from .weights import MtpWeights

# A batched call applies every per-state rule above to each state, names the state of a refusal
# (``states[b]``) and changes no state unless every state passed: the checks of all states run
# before any compute. Rule 0 (the owner and the one caller) is taken for every state first, as
# the guard of the whole call.


def batch_states(call: str, states: object) -> list[DrafterState]:
    """``states`` as a list: a list or tuple, each state at most once (two rows of one state
    would race for its rows)."""
    if not isinstance(states, (list, tuple)):
        raise ValueError(f"{call}: states must be a list or tuple of states, got {type(states).__name__}")
    seen: dict[int, int] = {}
    for b, st in enumerate(states):
        if id(st) in seen:
            raise ValueError(f"{call}: states[{b}] is states[{seen[id(st)]}]; a state appears once in a batch")
        seen[id(st)] = b
    return list(states)


@contextmanager
def batch_item(call: str, b: int) -> Iterator[None]:
    """Checks of ``states[b]``: a refusal keeps its type and says which state it was."""
    try:
        yield
    except (TypeError, ValueError, RuntimeError) as e:
        message = str(e)
        if message.startswith(f"{call}: "):
            message = message[len(call) + 2:]
        raise type(e)(f"{call}: states[{b}]: {message}") from e


def batch_values(call: str, name: str, values: object, B: int) -> list[int | Tensor]:
    """``values``, one per state: a list/tuple of B Python ints or a (B,) integer tensor (each
    row a (1,) view). Ranges are the per-state checks'."""
    if isinstance(values, Tensor):
        check_strided(name, values)
        check_token_dtype(name, values)
        if values.dim() != 1 or values.shape[0] != B:
            raise ValueError(f"{call}: {name} must be a ({B},) tensor, one per state, got shape {tuple(values.shape)}")
        return [values[b : b + 1] for b in range(B)]
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{call}: {name} must be a list of {B} ints or a ({B},) tensor, got {type(values).__name__}")
    if len(values) != B:
        raise ValueError(f"{call}: {name} has {len(values)} entries for {B} states")
    return list(values)


def batch_ints(call: str, name: str, values: object, B: int) -> list[int]:
    """``batch_values`` read on the host as Python ints (a tensor's one read)."""
    rows = batch_values(call, name, values, B)
    if isinstance(values, Tensor):
        return [int(v) for v in values.tolist()]
    return rows  # type: ignore[return-value]  # each checked per state (check_int)


def batch_hiddens(call: str, name: str, hiddens: object, B: int, H: int) -> list[Tensor]:
    """``hiddens`` (B, H), one row per state, as B (1, H) views (dtype, device and values are the
    per-state checks')."""
    if not isinstance(hiddens, Tensor):
        raise ValueError(f"{call}: {name} must be a tensor, got {type(hiddens).__name__}")
    check_strided(f"{call}: {name}", hiddens)
    if hiddens.dim() != 2 or tuple(hiddens.shape) != (B, H):
        raise ValueError(f"{call}: {name} must have shape ({B}, {H}), one row per state, got {tuple(hiddens.shape)}")
    return [hiddens[b : b + 1] for b in range(B)]


def batch_grammars(call: str, grammars: object, B: int) -> list[object]:
    """``propose_batch``'s ``grammars`` (DESIGN.md §10), one per state: None (no state has a
    grammar), or a list or tuple of B entries, each a matcher or None (each checked with its
    state, ``contract.check_grammar``); one matcher serves one state, so a matcher given twice is
    a ``ValueError`` naming both indices."""
    if grammars is None:
        return [None] * B
    if not isinstance(grammars, (list, tuple)):
        raise ValueError(f"{call}: grammars must be None or a list of {B} matchers or None, one per state, got "
                         f"{type(grammars).__name__}")
    if len(grammars) != B:
        raise ValueError(f"{call}: grammars has {len(grammars)} entries for {B} states")
    seen: dict[int, int] = {}
    for b, g in enumerate(grammars):
        if g is None:
            continue
        if id(g) in seen:
            raise ValueError(f"{call}: grammars[{b}] is grammars[{seen[id(g)]}]; a matcher serves one state")
        seen[id(g)] = b
    return list(grammars)


@contextmanager
def guard_all(call: str, states: Sequence[DrafterState], use: Callable[[DrafterState, str], Any]) -> Iterator[None]:
    """Rule 0 for every state of a batch, held for the whole call: ``use(state, call)`` is the
    backend's guard (``use_state``); a refusal names the state and releases the ones taken."""
    with ExitStack() as stack:
        for b, st in enumerate(states):
            with batch_item(call, b):
                stack.enter_context(use(st, call))
        yield


@dataclass
class BatchPropose:
    """``propose_batch``'s checked arguments: one ``ProposeArgs`` per state."""

    states: list[DrafterState]
    args: list[ProposeArgs]
    num_drafts: int


def batch_propose_args(call: str, last_tokens: object, target_hiddens: object, positions: object, num_drafts: object,
                       states: list[DrafterState], weights: MtpWeights, capacity: int,
                       check_live_state: Callable[[DrafterState, str], None],
                       device_checks: bool = False, grammars: object = None) -> BatchPropose:
    """Every check of ``propose_batch`` after the guards: the batch's own shapes (``last_tokens``,
    ``target_hiddens``, ``positions``, ``num_drafts``, ``grammars``: ``batch_grammars``), then
    each state's lifecycle (``check_live_state``) and propose checks (``propose_args``, its
    grammar as ``grammars[b]``), in index order."""
    B, H = len(states), weights.config.hidden_size
    tokens = batch_values(call, "last_tokens", last_tokens, B)
    hiddens = batch_hiddens(call, "target_hiddens", target_hiddens, B, H)
    pos = batch_ints(call, "positions", positions, B)
    num_drafts = check_int("num_drafts", num_drafts)
    matchers = batch_grammars(call, grammars, B)
    args: list[ProposeArgs] = []
    for b, st in enumerate(states):
        try:
            with batch_item(call, b):
                check_live_state(st, call)
                args.append(propose_args(call, tokens[b], hiddens[b], pos[b], num_drafts, st, weights, capacity,
                                         device_checks, matchers[b], f"grammars[{b}]"))
        except (TypeError, ValueError, RuntimeError):
            if device_checks:  # an earlier state's data refuses first (index order): read it now, on refusal only
                check_data(call, args, weights)
            raise
    return BatchPropose(states, args, num_drafts)


def check_data(call: str, args: Sequence[ProposeArgs], weights: MtpWeights) -> None:
    """The data checks ``propose_args`` leaves to the device (a token tensor's range, the hidden's
    finiteness), on the host, for states ``0..len(args)-1`` in order: the first failure raises."""
    for b, a in enumerate(args):
        with batch_item(call, b):
            check_args_data(a, weights)


@dataclass
class CatchupRow:
    """One state's row of ``catchup_batch`` that is written: ``token`` (1,) int64, ``hidden``
    (1, H), at ``row_base``."""

    b: int
    token: Tensor
    hidden: Tensor
    row_base: int


def batch_catchup_args(
    call: str,
    tokens: object,
    hiddens: object,
    row_bases: object,
    states: list[DrafterState],
    weights: MtpWeights,
    capacity: int,
    check_live_state: Callable[[DrafterState, str], None],
) -> list[CatchupRow]:
    """Every check of ``catchup_batch`` after the guards, each state's as ``catchup_drafter``'s
    with one row (``tokens[b]`` = t_{row_base+1}, ``hiddens[b]`` = h_{row_base}); returns the rows
    to write: a state whose ``row_bases[b]`` is not its ``seq_len`` writes nothing (the no-op rule)."""
    B, H = len(states), weights.config.hidden_size
    ids = batch_values(call, "tokens", tokens, B)
    rows = batch_hiddens(call, "hiddens", hiddens, B, H)
    bases = batch_ints(call, "row_bases", row_bases, B)
    out = []
    for b, st in enumerate(states):
        with batch_item(call, b):
            check_live_state(st, call)
            id_b = ids[b]
            token = token_ids("tokens", id_b if isinstance(id_b, Tensor) else [id_b], weights.config.vocab_size,
                              st.device)
            base = check_int("row_base", bases[b])
            check_hiddens("hiddens", rows[b], 1, weights, st.device)
            check_capacity(call, base + 1, capacity)
            if base == st.seq_len:
                out.append(CatchupRow(b, token, rows[b], base))
    return out
