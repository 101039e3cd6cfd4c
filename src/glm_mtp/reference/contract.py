"""The drafter contract (DESIGN.md §3-§4), once for every backend: what an engine calls
(``DraftProposer``, ``SamplingProposer``) and what a sampled propose returns (``SampledDrafts``);
the constructor's arguments, the argument checks of each call (sampling's included), the no-op
rules and row bookkeeping of prefill and catch-up, and the counters of ``after_verify``.
``ReferenceProposer`` and ``OptimizedProposer`` both call these plain functions; what differs
between them (where rows are computed, which data checks run on the device) stays in each
backend. The rest of the contract is beside it: ``contract_guards`` (a state's owner, its one
caller, freed and poisoned states) and ``contract_batch`` (many states in one call).

Every check raises before anything changes (``ValueError`` for arguments, ``RuntimeError`` for
the lifecycle), naming the argument, in the order the contract documents.
"""

from __future__ import annotations

import logging
import math
import os
import struct
import time
from dataclasses import dataclass
from typing import Callable, Literal, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from .bytes import hidden_fingerprint, same_bytes
from .contract_guards import check_sound, writing
from .grammar import MATCHER_METHODS, FirstStep, ask_first_step, missing_method
from .numerics import acc_dtype
from .state import DrafterState, Sizes, rewind_rows
from .weights import MtpWeights

logger = logging.getLogger(__name__)

# Set to 1 to log a fingerprint (hash of the bytes) of the target hidden at every propose.
FINGERPRINT_ENV = "GLM_MTP_DEBUG_FINGERPRINT"

Tokens = Sequence[int] | Tensor
FeedHidden = Literal["post_norm", "pre_norm"]
# write_rows(tokens (T,), hiddens (T, H), row_base, state): store context rows, set seq_len.
WriteRows = Callable[[Tensor, Tensor, int, DrafterState], None]


# ---- the protocol and its results ------------------------------------------------------------


class Matcher(Protocol):
    """A grammar's matcher (DESIGN.md §10): xgrammar's ``GrammarMatcher`` methods, so an xgrammar
    matcher passes as it is. ``bitmask`` is a CPU int32 tensor ``(rows, ceil(V / 32))``, bit
    ``j % 32`` of word ``j // 32`` set = token j allowed; ``fill_next_token_bitmask`` writes row
    ``index``."""

    def fill_next_token_bitmask(self, bitmask: Tensor, index: int = 0) -> object: ...
    def accept_token(self, token: int) -> bool: ...
    def rollback(self, num_tokens: int) -> object: ...
    def is_terminated(self) -> bool: ...


@runtime_checkable
class DraftProposer(Protocol):
    """What an engine calls on a drafter (the engine's ``DraftProposer`` trait, in snake_case)."""

    max_seq_len: int

    def prefill_hidden_rows(self, max_seq_len: int) -> int: ...
    def alloc_state(self, device: torch.device | str) -> DrafterState: ...
    def free_state(self, state: DrafterState) -> None: ...
    def needs_comm(self) -> bool: ...
    def prefill_uses_shared_buffers(self) -> bool: ...
    def drafter_rows(self, state: DrafterState) -> int: ...
    def last_pair_key(self, state: DrafterState) -> int | None: ...
    def prefill_drafter(self, prompt_tokens: Tokens, hiddens: Tensor, state: DrafterState) -> int: ...
    def catchup_drafter(self, tokens: Tokens, hiddens: Tensor, row_base: int, pos_base: int,
                        state: DrafterState) -> int: ...
    def propose(self, last_token: int | Tensor, target_hidden: Tensor, position: int, num_drafts: int,
                state: DrafterState, grammar: Matcher | None = None) -> list[int]: ...
    def after_verify(self, num_accepted: int, state: DrafterState) -> None: ...
    def propose_batch(self, last_tokens: Tokens, target_hiddens: Tensor, positions: Tokens, num_drafts: int,
                      states: list[DrafterState],
                      grammars: Sequence[Matcher | None] | None = None) -> list[list[int]]: ...
    def catchup_batch(self, tokens: Tokens, hiddens: Tensor, row_bases: Tokens,
                      states: list[DrafterState]) -> list[int]: ...
    def export_state(self, state: DrafterState) -> dict[str, Tensor]: ...


@dataclass(eq=False)
class SampledDrafts:
    """What ``propose_sampled`` returns: the drafts and each draft's distribution. Two are equal
    when their drafts are and their ``q`` have the same shape, dtype and bytes (-0.0 != 0.0).

    Args:
        drafts: the k' drafted token ids, ``drafts[i] = argmax(q[i] / noise[i])`` over the
            allowed tokens (k' < k when a grammar stopped the propose, DESIGN.md §10).
        q: (k', V) in A, ``q[i] = softmax(up(logits_i) / temperature)`` (``layers.draft_probs``;
            the masked softmax under a grammar), on the state's device.
    """

    drafts: list[int]
    q: Tensor

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SampledDrafts):
            return NotImplemented
        return self.drafts == other.drafts and same_bytes(self.q.detach().cpu(), other.q.detach().cpu())


@runtime_checkable
class SamplingProposer(DraftProposer, Protocol):
    """A ``DraftProposer`` that can also draft by sampling (both backends of this package)."""

    def propose_sampled(self, last_token: int | Tensor, target_hidden: Tensor, position: int, num_drafts: int,
                        temperature: float, noise: Tensor, state: DrafterState,
                        grammar: Matcher | None = None) -> SampledDrafts: ...


@runtime_checkable
class ConstrainedProposer(SamplingProposer, Protocol):
    """A ``SamplingProposer`` whose proposes take a grammar's matcher (DESIGN.md §10) and report
    each draft's confidence (§12): ``draft_confidence(state)`` is ``(prob, margin)``, each
    ``(last_drafted,)`` in A on the state's device, for the pending propose."""

    def draft_confidence(self, state: DrafterState) -> tuple[Tensor, Tensor]: ...


def takes_grammars(proposer: object) -> bool:
    """Whether ``proposer`` drafts under grammars and reports confidences (a ``ConstrainedProposer``:
    it has ``draft_confidence``, with ``propose_sampled``, ``propose_batch`` and the rest)."""
    return isinstance(proposer, ConstrainedProposer)


def check_noise_shape(noise: object, num_drafts: int, vocab_size: int, dtype: torch.dtype,
                      device: torch.device) -> Tensor:
    """The noise of a sampled propose: a ``(num_drafts, vocab_size)`` tensor of the acc dtype
    ``dtype`` on ``device`` (its values, positive and finite, are checked by the backend)."""
    if not isinstance(noise, Tensor):
        raise ValueError(f"noise must be a tensor, got {type(noise).__name__}")
    check_strided("noise", noise)
    if tuple(noise.shape) != (num_drafts, vocab_size):
        raise ValueError(f"noise must have shape ({num_drafts}, {vocab_size}) (num_drafts, vocab_size), got "
                         f"{tuple(noise.shape)}")
    if noise.dtype != dtype:
        raise ValueError(f"noise must have the accumulation dtype {dtype}, got {noise.dtype}")
    if noise.device != device:
        raise ValueError(f"noise must be on the state's device {device}, got {noise.device}")
    return noise


def sampling_inputs(temperature: object, noise: object, num_drafts: int, weights: MtpWeights,
                    device: torch.device, logit_limit: float) -> tuple[float, Tensor]:
    """The checks of ``propose_sampled``'s own arguments that read no data, shared by both
    drafters: ``(temperature, noise)``, the temperature rounded to A (``check_temperature``
    against the head's ``logit_limit``, ``logit_bound``)."""
    return (check_temperature(temperature, logit_limit, acc_dtype(weights.dtype)),
            check_noise_shape(noise, num_drafts, weights.config.vocab_size, acc_dtype(weights.dtype), device))


NOISE_MESSAGE = "noise must hold positive finite values (Exponential(1) draws)"


# ---- values ------------------------------------------------------------------------------------


def prefill_hidden_rows(max_seq_len: object, capacity: int) -> int:
    """How many hidden rows the target must capture at prefill for a sequence of up to
    ``max_seq_len`` positions: ``min(max_seq_len, capacity)``. ``max_seq_len`` is a count (the
    engine's ``usize``): an integer >= 0, ``ValueError`` naming it otherwise."""
    return min(check_int("max_seq_len", max_seq_len, 0), capacity)


def check_int(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum`` (a Python int, or a one-element integer tensor that
    holds data: ``check_strided``); ``ValueError`` naming the argument otherwise."""
    if (isinstance(value, Tensor) and value.numel() == 1 and not value.dtype.is_floating_point
            and value.dtype != torch.bool):
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


def check_grammar(name: str, grammar: object) -> object:
    """A propose's grammar (DESIGN.md §10): None, or a matcher, an instance with the four methods
    of ``Matcher`` (``MATCHER_METHODS``), each callable; else ``ValueError`` naming the argument
    and the rule: a class (its methods are callable, but unbound: the first call would fail
    midway), or the method the object lacks. Returns it."""
    if grammar is None:
        return None
    if isinstance(grammar, type):
        raise ValueError(f"{name} must be None or a grammar matcher (an instance with the methods "
                         f"{', '.join(MATCHER_METHODS)}, as xgrammar's GrammarMatcher); got the class "
                         f"{grammar.__name__} itself, not an instance of it")
    missing = missing_method(grammar)
    if missing is not None:
        raise ValueError(f"{name} must be None or a grammar matcher with the methods {', '.join(MATCHER_METHODS)} "
                         f"(xgrammar's GrammarMatcher); a {type(grammar).__name__} has no callable {missing}")
    return grammar


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
            raise ValueError("last_token must be an int or a tensor of one token id (0-d or (1,)), got shape "
                             f"{tuple(last_token.shape)}")
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


def check_hiddens(name: str, hiddens: object, rows: int, weights: MtpWeights, device: torch.device,
                  finite: bool = True) -> Tensor:
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
        raise ValueError(f"temperature must be finite and > 0 in {acc} (its largest value is {info.max:.4g}), got "
                         f"{temperature!r}")
    least = max(info.tiny, logit_limit / info.max)
    if not rounded >= least:
        raise ValueError(f"temperature {temperature!r} is too small for {acc}: the draft distribution "
                         f"softmax(logits / T) needs T >= {least:.3g} (the head's logits reach {logit_limit:.3g}; a "
                         "smaller T overflows them to inf)")
    return rounded


# ---- the drafter and its states ----------------------------------------------------------------


def drafter_sizes(weights: MtpWeights, max_seq_len: object, feed_hidden: object) -> Sizes:
    """The constructor's checks (``max_seq_len`` >= 1, ``feed_hidden`` one of ``FeedHidden``)
    and its sizes: ``max_seq_len`` capped at ``max_position_embeddings``, ``num_blocks`` of it."""
    max_seq_len = check_int("max_seq_len", max_seq_len, 1)
    if weights.device.type == "meta":
        raise ValueError("weights must hold data: they are on the meta device (shapes without values); load them "
                         "(MtpWeights.from_pretrained) or move them (MtpWeights.to) to the CPU or a GPU first")
    if feed_hidden not in ("post_norm", "pre_norm"):
        raise ValueError(f"feed_hidden must be 'post_norm' or 'pre_norm', got {feed_hidden!r}")
    return Sizes.of(max_seq_len, weights.config.max_position_embeddings)


def needs_comm(weights: MtpWeights) -> bool:
    """True when the weights are sharded over ranks (``MtpWeights.shard``): every propose then
    runs collectives. ``GLM_MTP_NO_EP_PROPOSE=1`` keeps weights replicated at sharding time, so
    such a drafter needs no communicator."""
    return weights.shard_spec is not None


def state_device(weights: MtpWeights, device: torch.device | str) -> torch.device:
    """``alloc_state``'s device, which must be the weights' device."""
    device = torch.empty(0, device=device).device
    if device != weights.device:
        raise ValueError(f"device must be the weights' device {weights.device}, got {device} (move them with "
                         "MtpWeights.to)")
    return device


def check_live(state: DrafterState, call: str) -> None:
    """The lifecycle checks of a mutating call: a sound state with no propose pending."""
    check_sound(state, call)
    if state.pending:
        raise RuntimeError(f"{call}: a propose of {state.last_drafted} drafts is pending; call after_verify first")


def check_pending(state: DrafterState, call: str) -> None:
    """The lifecycle checks of a read of the pending propose (``draft_confidence``): a sound
    state with a propose pending; ``RuntimeError`` naming the call otherwise."""
    check_sound(state, call)
    if not state.pending:
        raise RuntimeError(f"{call}: no propose is pending (a propose's confidences are read before its after_verify)")


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
    logger.info("GLM MTP drafter prefill: %d rows (%d prompt tokens) in %.1f ms", rows, n,
                (time.perf_counter() - t0) * 1e3)
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
    grammar: Matcher | None = None
    first: FirstStep | None = None  # the grammar's answer for draft step 1, asked before any write


def propose_args(call: str, last_token: int | Tensor, target_hidden: Tensor, position: object, num_drafts: object,
                 state: DrafterState, weights: MtpWeights, capacity: int, device_checks: bool = False,
                 grammar: object = None, grammar_name: str = "grammar") -> ProposeArgs:
    """A propose's argument checks, in the contract's order, after its lifecycle checks:
    ``position``, the rows held, ``last_token``, ``target_hidden``, ``num_drafts``, the capacity,
    the ``grammar`` (``check_grammar``, named ``grammar_name``: ``grammars[b]`` in a batch), and,
    when the propose drafts, the grammar's answer for draft step 1 (``grammar.ask_first_step``,
    kept as ``first``): a matcher that fails it is refused here, before any write.

    ``device_checks``: leave the two checks that read the data (a token tensor's range, the
    hidden's finiteness) to the caller, which runs them on the device. When a later check
    refuses, they are read on the host first (on refusal only), so the first failing check in
    the contract's order decides in every backend. Logs the hidden's fingerprint when
    ``FINGERPRINT_ENV`` is 1 (a debugging aid; it syncs)."""
    if device_checks:
        try:
            args = _propose_args(call, last_token, target_hidden, position, num_drafts, state, weights, capacity, True)
        except (TypeError, ValueError, RuntimeError):
            _propose_args(call, last_token, target_hidden, position, num_drafts, state, weights, capacity, False)
            raise
    else:
        args = _propose_args(call, last_token, target_hidden, position, num_drafts, state, weights, capacity, False)
    try:
        args.grammar = check_grammar(grammar_name, grammar)  # type: ignore[assignment]  # check_grammar returns the checked grammar, typed wider than the field
        if args.grammar is not None and args.num_drafts:  # §10: a propose of 0 drafts never reads its matcher
            args.first = ask_first_step(grammar_name, args.grammar, weights.config.vocab_size)
    except ValueError:
        if device_checks:
            check_args_data(args, weights)  # the data checks left to the device come first in the contract's order
        raise
    return args


def _propose_args(call: str, last_token: int | Tensor, target_hidden: Tensor, position: object, num_drafts: object,
                  state: DrafterState, weights: MtpWeights, capacity: int, device_checks: bool) -> ProposeArgs:
    position = check_int("position", position)
    if state.seq_len < position:
        raise RuntimeError(f"{call}: the drafter holds {state.seq_len} rows, behind position {position}; catch "
                           "up first")
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
    hidden = (
        target_hidden.reshape(1, -1)
        if isinstance(target_hidden, Tensor) and target_hidden.dim() == 1
        else target_hidden
    )
    check_hiddens("target_hidden", hidden, 1, weights, state.device, finite=not device_checks)
    num_drafts = check_int("num_drafts", num_drafts)
    check_capacity(call, position + num_drafts, capacity)
    if os.environ.get(FINGERPRINT_ENV) == "1":
        tok = int(token[0]) if isinstance(token, Tensor) else token
        logger.info("GLM_MTP_DBG propose position=%d drafter_rows=%d tok=%d fp_target=%s",
                    position, state.seq_len, tok, hidden_fingerprint(hidden))
    return ProposeArgs(position, token, hidden, num_drafts)


def check_args_data(args: ProposeArgs, weights: MtpWeights) -> None:
    """The data checks ``propose_args`` left to the device, for one propose, on the host."""
    if isinstance(args.token, Tensor):
        token_ids("last_token", args.token, weights.config.vocab_size, args.token.device)
    check_hiddens("target_hidden", args.hidden, 1, weights, args.hidden.device)


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


