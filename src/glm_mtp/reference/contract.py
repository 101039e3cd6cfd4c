"""The drafter contract's rules that every backend applies the same way (DESIGN.md §3-§4), once:
the constructor's arguments and the row capacity, the argument checks of each call, the no-op
rules and row bookkeeping of prefill and catch-up, the counters of ``after_verify``, and the
exported snapshot. ``ReferenceProposer`` and ``OptimizedProposer`` both call these plain
functions; what differs between them (where rows are computed, which data checks run on the
device) stays in each backend.

Every check raises before anything changes (``ValueError`` for arguments, ``RuntimeError`` for
the lifecycle), naming the argument, in the order the contract documents.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import struct
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Sequence, Union

import torch
from torch import Tensor

from .attention import Rope
from .bytes import raw_bytes
from .kpool import empty_snapshot as empty_kpool_snapshot
from .state import BLOCK_ROWS, DrafterState, check_sound, num_blocks, rewind_rows, writing
from .weights import MtpWeights

logger = logging.getLogger(__name__)

# Set to 1 to log a fingerprint (hash of the bytes) of the target hidden at every propose.
FINGERPRINT_ENV = "GLM_MTP_DEBUG_FINGERPRINT"

Tokens = Union[Sequence[int], Tensor]
FeedHidden = Literal["post_norm", "pre_norm"]
# write_rows(tokens (T,), hiddens (T, H), row_base, state): store context rows, set seq_len.
WriteRows = Callable[[Tensor, Tensor, int, DrafterState], None]


# ---- values ------------------------------------------------------------------------------------


def hidden_fingerprint(hidden: Tensor) -> str:
    """16 hex digits of a hash of the tensor's bytes."""
    return hashlib.blake2b(raw_bytes(hidden), digest_size=8).hexdigest()


def check_int(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum`` (a Python int, or a one-element integer tensor that
    holds data: ``check_strided``); ``ValueError`` naming the argument otherwise."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.dtype.is_floating_point and value.dtype != torch.bool:
        check_strided(name, value)
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_token_id(name: str, value: object, vocab_size: int) -> int:
    """A Python token id checked on the host: an int in ``[0, vocab_size)``, else ``ValueError``
    naming the argument (before torch sees it: an id past int64 would be torch's overflow error)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must hold integer token ids, got {type(value).__name__}")
    if not 0 <= value < vocab_size:
        raise ValueError(f"{name}: token id {value} is outside [0, vocab_size={vocab_size})")
    return value


def check_token_dtype(name: str, tokens: Tensor) -> None:
    """A token tensor must hold integers (not floats, complex numbers or booleans)."""
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")


def check_strided(name: str, t: Tensor) -> None:
    """A tensor argument must be dense (``torch.strided``) and hold data: a sparse or other
    layout has no rows to copy or reshape, and a tensor on the meta device has a shape but no
    values to read (torch would fail deep inside the call, with its own error)."""
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.device.type == "meta":
        raise ValueError(f"{name} must hold data: a tensor on the meta device has a shape but no values")


def check_token_device(name: str, tokens: Tensor, device: torch.device) -> None:
    """A token tensor must be on the state's ``device`` or in host memory (the CPU): both are
    copied into the drafter's rows; any other device (a meta tensor, another accelerator) is a
    ``ValueError`` naming the argument, raised before anything is written."""
    if tokens.device != device and tokens.device.type != "cpu":
        raise ValueError(f"{name} must be on the state's device {device} or the CPU, got {tokens.device}")


def one_token(last_token: int | Tensor) -> int | Tensor:
    """``last_token`` as an int, or as a (1,) tensor when a tensor of one id was given (0-d or
    (1,)); any other tensor shape is a ``ValueError`` naming the argument. The range is checked
    by the caller (on the host, or on the device by the optimized backend)."""
    if isinstance(last_token, Tensor):
        check_strided("last_token", last_token)
        if last_token.dim() > 1 or last_token.numel() != 1:
            raise ValueError(f"last_token must be an int or a tensor of one token id (0-d or (1,)), got shape {tuple(last_token.shape)}")
        return last_token.reshape(1)
    return last_token


def token_ids(name: str, tokens: Tokens, vocab_size: int, device: torch.device) -> Tensor:
    """``tokens`` as an int64 tensor (n,) on ``device``, every id in [0, vocab_size) (a tensor's
    range is read on the host: a sync)."""
    if not isinstance(tokens, Tensor):
        if not isinstance(tokens, (list, tuple, range)):
            raise ValueError(f"{name} must be a list of token ids or a 1-D integer tensor, got {type(tokens).__name__}")
        values = [check_token_id(name, v, vocab_size) for v in tokens]
        return torch.tensor(values, dtype=torch.int64, device=device)
    check_strided(name, tokens)
    check_token_dtype(name, tokens)
    check_token_device(name, tokens, device)
    if tokens.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tokens.shape)}")
    ids = tokens.to(device=device, dtype=torch.int64)
    if ids.numel() and not bool(((ids >= 0) & (ids < vocab_size)).all()):
        bad = ids[(ids < 0) | (ids >= vocab_size)][0].item()
        raise ValueError(f"{name}: token id {bad} is outside [0, vocab_size={vocab_size})")
    return ids


def check_hiddens(name: str, hiddens: object, rows: int, weights: MtpWeights, device: torch.device, finite: bool = True) -> Tensor:
    """``hiddens`` checked to be ``(rows, H)`` of the weights' dtype on ``device`` (the state's),
    and finite unless ``finite`` is false (the optimized propose checks that on the device)."""
    H = weights.config.hidden_size
    if not isinstance(hiddens, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(hiddens).__name__}")
    check_strided(name, hiddens)
    if tuple(hiddens.shape) != (rows, H):
        raise ValueError(f"{name} must have shape ({rows}, {H}), got {tuple(hiddens.shape)}")
    if hiddens.dtype != weights.dtype:
        raise ValueError(f"{name} must have the weights' dtype {weights.dtype}, got {hiddens.dtype}")
    if hiddens.device != device:
        raise ValueError(f"{name} must be on the state's device {device}, got {hiddens.device}")
    if finite and rows and not bool(torch.isfinite(hiddens).all()):
        raise ValueError(f"{name} holds NaN or inf")
    return hiddens


def check_capacity(name: str, end: int, capacity: int) -> None:
    """Rows up to ``end`` must fit the state's ``capacity``."""
    if end > capacity:
        raise ValueError(f"{name}: rows up to {end} would run past the state's capacity of {capacity} rows")


def logit_bound(weights: MtpWeights) -> float:
    """An upper bound on ``|up(logits)|`` for every row the drafter's head can produce, from the
    weights alone (float64, two reductions: one host read). The head reads ``x =
    rms_norm(pre_norm) * gamma``, and an RMS-normalised row has ``|x_j| <= sqrt(H) * |gamma_j|``,
    so ``|logit| <= H * max|lm_head| * sqrt(H) * max|gamma|``; the factor ``1 + 2**-6`` covers
    the rounding of ``x`` and of the logits to S and the A accumulation. Capped at the largest
    finite S value (a logit is stored in S)."""
    H = weights.config.hidden_size
    head = torch.aminmax(weights.lm_head.detach())
    gamma = torch.aminmax(weights.shared_head_norm.detach())
    max_head = max(-float(head.min), float(head.max))
    max_gamma = max(-float(gamma.min), float(gamma.max))
    bound = H * max_head * math.sqrt(H) * max_gamma * (1 + 2**-6)
    return min(bound, torch.finfo(weights.dtype).max)


def round_to(value: float, acc: torch.dtype) -> float:
    """``value`` rounded to nearest even in ``acc`` (float32 or float64), as a Python float, on
    the host without torch (a sampled propose reads nothing back): inf where it overflows."""
    if acc == torch.float64:
        return value
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def check_temperature(temperature: object, logit_limit: float, acc: torch.dtype) -> float:
    """A sampling temperature, valid when the draft distribution it drives, ``softmax(up(logits)
    / T)`` with ``T`` rounded to the accumulation dtype ``acc``, is defined in ``acc`` for every
    logit the head can produce (``|logit| <= logit_limit``, ``logit_bound``): ``T`` is a real
    number whose value in ``acc`` is a finite normal number (1e39 overflows float32, 1e-45
    rounds to a subnormal) and ``logit_limit / T`` is finite in ``acc`` (a smaller ``T`` turns a
    logit into inf and ``q`` into NaN). Returns ``T`` rounded to ``acc``, as a Python float, so
    that storing it in ``acc`` is exact. ``ValueError`` naming the argument otherwise."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a real number, got {type(temperature).__name__}")
    try:
        value = float(temperature)
    except OverflowError:  # an int past float64
        value = math.inf
    if not value > 0:  # NaN fails too
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    info = torch.finfo(acc)
    rounded = round_to(value, acc)
    if not math.isfinite(rounded):
        raise ValueError(f"temperature must be finite and > 0 in {acc} (its largest value is {info.max:.4g}), got {temperature!r}")
    least = max(info.tiny, logit_limit / info.max)
    if not rounded >= least:
        raise ValueError(f"temperature {temperature!r} is too small for {acc}: the draft distribution softmax(logits / T) "
                         f"needs T >= {least:.3g} (the head's logits reach {logit_limit:.3g}; a smaller T overflows them to inf)")
    return rounded


# ---- the drafter and its states ----------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """A drafter's row budget: ``max_seq_len`` (capped at the model's DSA context), the
    ``blocks`` of 16 rows a state claims and their ``capacity`` in rows."""

    max_seq_len: int
    blocks: int
    capacity: int


def drafter_sizes(weights: MtpWeights, max_seq_len: object, feed_hidden: object) -> Sizes:
    """The constructor's checks (``max_seq_len`` >= 1, ``feed_hidden`` one of ``FeedHidden``)
    and its sizes: ``max_seq_len`` capped at ``max_position_embeddings``, ``num_blocks`` of it."""
    max_seq_len = check_int("max_seq_len", max_seq_len, 1)
    if weights.device.type == "meta":
        raise ValueError("weights must hold data: they are on the meta device (shapes without values); load them "
                         "(MtpWeights.from_pretrained) or move them (MtpWeights.to) to the CPU or a GPU first")
    if feed_hidden not in ("post_norm", "pre_norm"):
        raise ValueError(f"feed_hidden must be 'post_norm' or 'pre_norm', got {feed_hidden!r}")
    capped = min(max_seq_len, weights.config.max_position_embeddings)
    blocks = num_blocks(capped)
    return Sizes(capped, blocks, BLOCK_ROWS * blocks)


def needs_comm(weights: MtpWeights) -> bool:
    """True when the weights are sharded over ranks (``MtpWeights.shard``): every propose then
    runs collectives. ``GLM_MTP_NO_EP_PROPOSE=1`` keeps weights replicated at sharding time, so
    such a drafter needs no communicator."""
    return weights.shard_spec is not None


def state_device(weights: MtpWeights, device: torch.device | str) -> torch.device:
    """``alloc_state``'s device, which must be the weights' device."""
    device = torch.empty(0, device=device).device
    if device != weights.device:
        raise ValueError(f"device must be the weights' device {weights.device}, got {device} (move them with MtpWeights.to)")
    return device


def rope_for(tables: dict[torch.device, Rope], weights: MtpWeights, capacity: int, device: torch.device) -> Rope:
    """The drafter's RoPE table on ``device`` from its cache ``tables`` (built once per device)."""
    if device not in tables:
        tables[device] = Rope.build(weights.config, capacity, device, weights.dtype)
    return tables[device]


def check_live(state: DrafterState, call: str) -> None:
    """The lifecycle checks of a mutating call: a sound state with no propose pending."""
    check_sound(state, call)
    if state.pending:
        raise RuntimeError(f"{call}: a propose of {state.last_drafted} drafts is pending; call after_verify first")


def snapshot(state: DrafterState, weights: MtpWeights) -> dict[str, Tensor]:
    """``export_state``'s bytes (after the owner checks): every byte the conformance suite
    compares; rows past ``seq_len`` are never exported. Works on a freed or a poisoned state."""
    cfg, dt, dev = weights.config, weights.dtype, state.device
    scalars = {
        "seq_len": torch.tensor(state.seq_len, dtype=torch.int64, device=dev),
        "last_drafted": torch.tensor(state.last_drafted, dtype=torch.int64, device=dev),
        "pending": torch.tensor(state.pending, dtype=torch.bool, device=dev),
    }
    if state.released:
        return {
            "kv_rows": torch.zeros(0, cfg.kv_row_width, dtype=dt, device=dev),
            "index_rows": torch.zeros(0, cfg.index_head_dim, dtype=dt, device=dev),
            "x": torch.zeros(cfg.hidden_size, dtype=dt, device=dev),
            **scalars,
            "block_table": torch.zeros(0, dtype=torch.int32, device=dev),
            **(empty_kpool_snapshot(cfg, dt, dev) if cfg.is_next else {}),
        }
    n = state.seq_len
    kpool = state.cache.kpool
    return {
        "kv_rows": state.cache.kv_rows()[:n].clone(),
        "index_rows": state.cache.index_rows()[:n].clone(),
        "x": state.x.clone(),
        **scalars,
        "block_table": state.cache.block_table.clone(),
        # glm5_next only (GLM-5's keys stay exactly the five above): pooled keys, completeness, gates
        **(kpool.snapshot(n) if kpool is not None else {}),
    }


# ---- the calls, after their owner and lifecycle checks ------------------------------------------


def write_prefill(prompt_tokens: Tokens, hiddens: Tensor, state: DrafterState, write_rows: WriteRows,
                  weights: MtpWeights, max_seq_len: int) -> int:
    """``prefill_drafter`` after its lifecycle checks: the argument checks, the no-op rule
    (rows already held, or fewer than 2 prompt tokens: returns 0), rows ``[0, n-1)`` written
    through ``write_rows`` (which sets ``seq_len``) and the log. Returns the rows written."""
    tokens = token_ids("prompt_tokens", prompt_tokens, weights.config.vocab_size, state.device)
    n = tokens.shape[0]
    if n > max_seq_len:
        raise ValueError(f"prompt_tokens: a prompt of {n} tokens is longer than max_seq_len={max_seq_len}")
    check_hiddens("hiddens", hiddens, n, weights, state.device)
    if state.seq_len > 0 or n < 2:
        return 0
    t0 = time.perf_counter()
    with writing(state, "prefill_drafter"):
        write_rows(tokens[1:], hiddens[:-1], 0, state)
    rows = n - 1
    logger.info("GLM MTP drafter prefill: %d rows (%d prompt tokens) in %.1f ms", rows, n, (time.perf_counter() - t0) * 1e3)
    return rows


def write_catchup(tokens: Tokens, hiddens: Tensor, row_base: object, pos_base: object, state: DrafterState,
                  write_rows: WriteRows, weights: MtpWeights, capacity: int) -> int:
    """``catchup_drafter`` after its lifecycle checks: the argument checks, the no-op rule
    (``row_base != seq_len`` or no tokens: returns 0), then rows ``row_base + i`` through
    ``write_rows``. ``pos_base`` is checked and ignored (a row's position is its slot)."""
    ids = token_ids("tokens", tokens, weights.config.vocab_size, state.device)
    row_base = check_int("row_base", row_base)
    check_int("pos_base", pos_base)
    check_hiddens("hiddens", hiddens, ids.shape[0], weights, state.device)
    check_capacity("catchup_drafter", row_base + ids.shape[0], capacity)
    if row_base != state.seq_len or ids.shape[0] == 0:
        return 0
    with writing(state, "catchup_drafter"):
        write_rows(ids, hiddens, row_base, state)
    return ids.shape[0]


@dataclass
class ProposeArgs:
    """A propose's checked arguments: ``token`` is a Python int (range checked) or a (1,)
    integer tensor (range checked on the host unless the caller checks it on the device),
    ``hidden`` the (1, H) target hidden."""

    position: int
    token: int | Tensor
    hidden: Tensor
    num_drafts: int


def propose_args(call: str, last_token: int | Tensor, target_hidden: Tensor, position: object, num_drafts: object,
                 state: DrafterState, weights: MtpWeights, capacity: int, device_checks: bool = False) -> ProposeArgs:
    """A propose's argument checks, in the contract's order, after its lifecycle checks:
    ``position``, the rows held, ``last_token``, ``target_hidden``, ``num_drafts``, the capacity.

    ``device_checks``: leave the two checks that read the data (a token tensor's range, the
    hidden's finiteness) to the caller, which runs them on the device. When a later check
    refuses, they are read on the host first (on refusal only), so the first failing check in
    the contract's order decides in every backend. Logs the hidden's fingerprint when
    ``FINGERPRINT_ENV`` is 1 (a debugging aid; it syncs)."""
    if device_checks:
        try:
            return _propose_args(call, last_token, target_hidden, position, num_drafts, state, weights, capacity, True)
        except (TypeError, ValueError, RuntimeError):
            _propose_args(call, last_token, target_hidden, position, num_drafts, state, weights, capacity, False)
            raise
    return _propose_args(call, last_token, target_hidden, position, num_drafts, state, weights, capacity, False)


def _propose_args(call: str, last_token: int | Tensor, target_hidden: Tensor, position: object, num_drafts: object,
                  state: DrafterState, weights: MtpWeights, capacity: int, device_checks: bool) -> ProposeArgs:
    position = check_int("position", position)
    if state.seq_len < position:
        raise RuntimeError(f"{call}: the drafter holds {state.seq_len} rows, behind position {position}; catch up first")
    token = one_token(last_token)
    vocab = weights.config.vocab_size
    if not isinstance(token, Tensor):
        check_token_id("last_token", token, vocab)
    elif device_checks:
        check_token_dtype("last_token", token)
        check_token_device("last_token", token, state.device)
    else:
        token = token_ids("last_token", token, vocab, state.device)
    if isinstance(target_hidden, Tensor):
        check_strided("target_hidden", target_hidden)
    hidden = target_hidden.reshape(1, -1) if isinstance(target_hidden, Tensor) and target_hidden.dim() == 1 else target_hidden
    check_hiddens("target_hidden", hidden, 1, weights, state.device, finite=not device_checks)
    num_drafts = check_int("num_drafts", num_drafts)
    check_capacity(call, position + num_drafts, capacity)
    if os.environ.get(FINGERPRINT_ENV) == "1":
        tok = int(token[0]) if isinstance(token, Tensor) else token
        logger.info("GLM_MTP_DBG propose position=%d drafter_rows=%d tok=%d fp_target=%s",
                    position, state.seq_len, tok, hidden_fingerprint(hidden))
    return ProposeArgs(position, token, hidden, num_drafts)


def apply_verify(num_accepted: object, state: DrafterState) -> None:
    """``after_verify`` after its owner checks: its lifecycle and argument checks, then the
    counters: keep the first ``num_accepted + 1`` rows of the pending propose (never fewer than
    one) and trim the rest by lowering ``seq_len``."""
    check_sound(state, "after_verify")
    if not state.pending:
        raise RuntimeError("after_verify: no propose is pending (a second after_verify would trim the kept first row)")
    num_accepted = check_int("num_accepted", num_accepted)
    if num_accepted > state.last_drafted:
        raise ValueError(f"num_accepted must be in [0, {state.last_drafted}] (the drafts proposed), got {num_accepted}")
    keep = min(state.last_drafted, num_accepted + 1)
    rewind_rows(state, state.seq_len - (state.last_drafted - keep))
    state.pending = False
    state.last_drafted = 0


# ---- batches: many states in one call ----------------------------------------------------------
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
                       states: list[DrafterState], weights: MtpWeights, capacity: int, check_live_state: Callable[[DrafterState, str], None],
                       device_checks: bool = False) -> BatchPropose:
    """Every check of ``propose_batch`` after the guards: the batch's own shapes, then each
    state's lifecycle (``check_live_state``) and propose checks (``propose_args``), in index order."""
    B, H = len(states), weights.config.hidden_size
    tokens = batch_values(call, "last_tokens", last_tokens, B)
    hiddens = batch_hiddens(call, "target_hiddens", target_hiddens, B, H)
    pos = batch_ints(call, "positions", positions, B)
    num_drafts = check_int("num_drafts", num_drafts)
    args: list[ProposeArgs] = []
    for b, st in enumerate(states):
        try:
            with batch_item(call, b):
                check_live_state(st, call)
                args.append(propose_args(call, tokens[b], hiddens[b], pos[b], num_drafts, st, weights, capacity, device_checks))
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


def check_args_data(args: ProposeArgs, weights: MtpWeights) -> None:
    """The data checks ``propose_args`` left to the device, for one propose, on the host."""
    if isinstance(args.token, Tensor):
        token_ids("last_token", args.token, weights.config.vocab_size, args.token.device)
    check_hiddens("target_hidden", args.hidden, 1, weights, args.hidden.device)


@dataclass
class CatchupRow:
    """One state's row of ``catchup_batch`` that is written: ``token`` (1,) int64, ``hidden``
    (1, H), at ``row_base``."""

    b: int
    token: Tensor
    hidden: Tensor
    row_base: int


def batch_catchup_args(call: str, tokens: object, hiddens: object, row_bases: object, states: list[DrafterState],
                       weights: MtpWeights, capacity: int, check_live_state: Callable[[DrafterState, str], None]) -> list[CatchupRow]:
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
            token = token_ids("tokens", [ids[b]] if not isinstance(ids[b], Tensor) else ids[b], weights.config.vocab_size, st.device)
            base = check_int("row_base", bases[b])
            check_hiddens("hiddens", rows[b], 1, weights, st.device)
            check_capacity(call, base + 1, capacity)
            if base == st.seq_len:
                out.append(CatchupRow(b, token, rows[b], base))
    return out
