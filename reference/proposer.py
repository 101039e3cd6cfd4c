"""The drafter's contract (``DraftProposer``) and its eager implementation, ``ReferenceProposer``.

Row r pairs token ``t_{r+1}`` with the target's hidden ``h_r``, lives in slot r and is rotated at
RoPE position r. A propose writes one row per draft; ``after_verify`` keeps the first row of a
propose always (it pairs the last committed token with the target's own hidden) and trims the
rows of rejected drafts by lowering ``seq_len``. See DESIGN.md §3-§4.

Every call validates before it changes anything, in the order: the state's owner and its one
caller (``TypeError``/``ValueError``/``RuntimeError``, ``state.use_state``), lifecycle
(``RuntimeError``), arguments (``ValueError``), no-ops (return 0). A refused call leaves the state
byte-identical; a call that fails midway poisons it (``state.writing``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import math
import time
from dataclasses import dataclass
from typing import Callable, Literal, Protocol, Sequence, Union, runtime_checkable

import torch
from torch import Tensor

from .attention import Rope
from .block import draft_logits, mtp_rows
from .layers import draft_probs, greedy_token, sampled_token
from .numerics import acc_dtype
from .state import DrafterState, LayerCache, Owner, check_sound, num_blocks, use_state, writing
from .weights import MtpWeights

logger = logging.getLogger(__name__)

# Set to 1 to log a fingerprint (hash of the bytes) of the target hidden at every propose.
FINGERPRINT_ENV = "GLM_MTP_DEBUG_FINGERPRINT"

Tokens = Union[Sequence[int], Tensor]
FeedHidden = Literal["post_norm", "pre_norm"]
# write_rows(tokens (T,), hiddens (T, H), row_base, state): store context rows, set seq_len.
WriteRows = Callable[[Tensor, Tensor, int, DrafterState], None]


@runtime_checkable
class DraftProposer(Protocol):
    """What an engine calls on a drafter (the seed's ``DraftProposer`` trait, in snake_case)."""

    max_seq_len: int

    def prefill_hidden_rows(self, max_seq_len: int) -> int: ...
    def alloc_state(self, device: torch.device | str) -> DrafterState: ...
    def free_state(self, state: DrafterState) -> None: ...
    def needs_comm(self) -> bool: ...
    def prefill_uses_shared_buffers(self) -> bool: ...
    def drafter_rows(self, state: DrafterState) -> int: ...
    def last_pair_key(self, state: DrafterState) -> int | None: ...
    def prefill_drafter(self, prompt_tokens: Tokens, hiddens: Tensor, state: DrafterState) -> int: ...
    def catchup_drafter(self, tokens: Tokens, hiddens: Tensor, row_base: int, pos_base: int, state: DrafterState) -> int: ...
    def propose(self, last_token: int | Tensor, target_hidden: Tensor, position: int, num_drafts: int, state: DrafterState) -> list[int]: ...
    def after_verify(self, num_accepted: int, state: DrafterState) -> None: ...
    def export_state(self, state: DrafterState) -> dict[str, Tensor]: ...


@dataclass(eq=False)
class SampledDrafts:
    """What ``propose_sampled`` returns: the drafts and each draft's distribution. Two are equal
    when their drafts are and their ``q`` have the same shape, dtype and bytes (-0.0 != 0.0).

    Args:
        drafts: the k drafted token ids, ``drafts[i] = argmax(q[i] / noise[i])``.
        q: (k, V) in A, ``q[i] = softmax(up(logits_i) / temperature)`` (``layers.draft_probs``),
            on the state's device.
    """

    drafts: list[int]
    q: Tensor

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SampledDrafts):
            return NotImplemented
        a, b = self.q.detach().cpu().contiguous(), other.q.detach().cpu().contiguous()
        return (self.drafts == other.drafts and a.shape == b.shape and a.dtype == b.dtype
                and a.reshape(-1).view(torch.uint8).numpy().tobytes() == b.reshape(-1).view(torch.uint8).numpy().tobytes())


@runtime_checkable
class SamplingProposer(DraftProposer, Protocol):
    """A ``DraftProposer`` that can also draft by sampling (both backends of this package)."""

    def propose_sampled(self, last_token: int | Tensor, target_hidden: Tensor, position: int, num_drafts: int,
                        temperature: float, noise: Tensor, state: DrafterState) -> SampledDrafts: ...


def hidden_fingerprint(hidden: Tensor) -> str:
    """16 hex digits of a hash of the tensor's bytes."""
    data = hidden.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def check_int(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum``; ``ValueError`` naming the argument otherwise."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.dtype.is_floating_point and value.dtype != torch.bool:
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


def check_temperature(temperature: object) -> float:
    """A sampling temperature: a finite real number > 0; ``ValueError`` naming it otherwise."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    return float(temperature)


def check_noise_shape(noise: object, num_drafts: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The noise of a sampled propose: a ``(num_drafts, vocab_size)`` tensor of the acc dtype
    ``dtype`` on ``device`` (its values, positive and finite, are checked by the backend)."""
    if not isinstance(noise, Tensor):
        raise ValueError(f"noise must be a tensor, got {type(noise).__name__}")
    if tuple(noise.shape) != (num_drafts, vocab_size):
        raise ValueError(f"noise must have shape ({num_drafts}, {vocab_size}) (num_drafts, vocab_size), got {tuple(noise.shape)}")
    if noise.dtype != dtype:
        raise ValueError(f"noise must have the accumulation dtype {dtype}, got {noise.dtype}")
    if noise.device != device:
        raise ValueError(f"noise must be on the state's device {device}, got {noise.device}")
    return noise


NOISE_MESSAGE = "noise must hold positive finite values (Exponential(1) draws)"


def one_token(last_token: int | Tensor) -> int | Tensor:
    """``last_token`` as an int, or as a (1,) tensor when a tensor of one id was given (0-d or
    (1,)); any other tensor shape is a ``ValueError`` naming the argument. The range is checked
    by the caller (on the host, or on the device by the optimized backend)."""
    if isinstance(last_token, Tensor):
        if last_token.dim() > 1 or last_token.numel() != 1:
            raise ValueError(f"last_token must be an int or a tensor of one token id (0-d or (1,)), got shape {tuple(last_token.shape)}")
        return last_token.reshape(1)
    return last_token


class ReferenceProposer:
    """The eager GLM-5 MTP drafter.

    Args:
        weights: the MTP layer with the target's embedding and head; states live on its device.
        max_seq_len: the longest sequence a state serves; capped at the model's
            ``max_position_embeddings`` (its DSA context). A state holds
            ``16 * (max_seq_len // 16 + 2)`` rows, so drafts may run a little past it.
        feed_hidden: what draft i > 1 consumes: ``post_norm`` (the drafter's ``x``, the
            default and the right choice for GLM-5) or ``pre_norm`` (the layer output; an ablation).
    """

    def __init__(self, weights: MtpWeights, max_seq_len: int, feed_hidden: FeedHidden = "post_norm") -> None:
        check_int("max_seq_len", max_seq_len, 1)
        if feed_hidden not in ("post_norm", "pre_norm"):
            raise ValueError(f"feed_hidden must be 'post_norm' or 'pre_norm', got {feed_hidden!r}")
        self.weights = weights
        self.config = weights.config
        self.max_seq_len = min(max_seq_len, self.config.max_position_embeddings)
        self.blocks = num_blocks(self.max_seq_len)
        self.capacity = 16 * self.blocks
        self.feed_hidden: FeedHidden = feed_hidden
        self._rope: dict[torch.device, Rope] = {}

    # ---- the contract's simple queries ------------------------------------------------------
    def prefill_hidden_rows(self, max_seq_len: int) -> int:
        return min(max_seq_len, self.max_seq_len)

    def needs_comm(self) -> bool:
        """True when the weights are sharded over ranks (``MtpWeights.shard``): every propose
        then runs collectives. ``GLM_MTP_NO_EP_PROPOSE=1`` keeps weights replicated at sharding
        time, so such a drafter needs no communicator."""
        return self.weights.shard_spec is not None

    def prefill_uses_shared_buffers(self) -> bool:
        return True

    def drafter_rows(self, state: DrafterState) -> int:
        with self.use(state, "drafter_rows"):
            return state.seq_len

    def last_pair_key(self, state: DrafterState) -> int | None:
        with self.use(state, "last_pair_key"):
            return state.seq_len - 1 if state.seq_len > 0 else None

    # ---- lifetime -----------------------------------------------------------------------
    def rope(self, device: torch.device) -> Rope:
        if device not in self._rope:
            self._rope[device] = Rope.build(self.config, self.capacity, device, self.weights.dtype)
        return self._rope[device]

    def alloc_state(self, device: torch.device | str) -> DrafterState:
        device = torch.empty(0, device=device).device
        if device != self.weights.device:
            raise ValueError(f"device must be the weights' device {self.weights.device}, got {device} (move them with MtpWeights.to)")
        self.rope(device)
        return DrafterState(
            cache=LayerCache.allocate(self.config, self.blocks, self.weights.dtype, device),
            x=torch.zeros(self.config.hidden_size, dtype=self.weights.dtype, device=device),
            device=device,
            owner=Owner(self.weights, self.capacity),
        )

    def use(self, state: DrafterState, call: str):  # type: ignore[no-untyped-def]
        """``state.use_state`` for this drafter: its own states only, one caller at a time."""
        return use_state(state, call, type(self).__name__, DrafterState, self.weights, self.capacity)

    def free_state(self, state: DrafterState) -> None:
        """Release the state's rows; a second call is a no-op. A poisoned state is freed too."""
        with self.use(state, "free_state"):
            if state.released:
                return
            state.released = True
            state.cache = None  # type: ignore[assignment]
            state.x = None  # type: ignore[assignment]
            state.seq_len = 0
            state.pending = False
            state.last_drafted = 0

    def export_state(self, state: DrafterState) -> dict[str, Tensor]:
        """Every byte the conformance suite compares; rows past ``seq_len`` are never exported.
        Works on a freed or a poisoned state (the bytes as they are)."""
        with self.use(state, "export_state"):
            return self.snapshot(state)

    def snapshot(self, state: DrafterState) -> dict[str, Tensor]:
        """``export_state`` without the owner checks (the optimized drafter shares it)."""
        cfg, dt, dev = self.config, self.weights.dtype, state.device
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
            }
        n = state.seq_len
        return {
            "kv_rows": state.cache.kv_rows()[:n].clone(),
            "index_rows": state.cache.index_rows()[:n].clone(),
            "x": state.x.clone(),
            **scalars,
            "block_table": state.cache.block_table.clone(),
        }

    # ---- validation ---------------------------------------------------------------------
    def _check_live(self, state: DrafterState, call: str) -> None:
        check_sound(state, call)
        if state.pending:
            raise RuntimeError(f"{call}: a propose of {state.last_drafted} drafts is pending; call after_verify first")

    def _tokens(self, name: str, tokens: Tokens, device: torch.device) -> Tensor:
        """``tokens`` as an int64 tensor (n,) on ``device``, every id in [0, vocab_size)."""
        if isinstance(tokens, Tensor):
            check_token_dtype(name, tokens)
            if tokens.dim() != 1:
                raise ValueError(f"{name} must be 1-D, got shape {tuple(tokens.shape)}")
            ids = tokens.to(device=device, dtype=torch.int64)
        else:
            values = [check_token_id(name, v, self.config.vocab_size) for v in tokens]
            return torch.tensor(values, dtype=torch.int64, device=device)
        if ids.numel() and not bool(((ids >= 0) & (ids < self.config.vocab_size)).all()):
            bad = ids[(ids < 0) | (ids >= self.config.vocab_size)][0].item()
            raise ValueError(f"{name}: token id {bad} is outside [0, vocab_size={self.config.vocab_size})")
        return ids

    def _hiddens(self, name: str, hiddens: object, rows: int, state: DrafterState, finite: bool = True) -> Tensor:
        """``hiddens`` checked to be ``(rows, H)`` of the weights' dtype on the state's device, and
        finite unless ``finite`` is false (the optimized propose checks that on the device)."""
        H = self.config.hidden_size
        if not isinstance(hiddens, Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(hiddens).__name__}")
        if tuple(hiddens.shape) != (rows, H):
            raise ValueError(f"{name} must have shape ({rows}, {H}), got {tuple(hiddens.shape)}")
        if hiddens.dtype != self.weights.dtype:
            raise ValueError(f"{name} must have the weights' dtype {self.weights.dtype}, got {hiddens.dtype}")
        if hiddens.device != state.device:
            raise ValueError(f"{name} must be on the state's device {state.device}, got {hiddens.device}")
        if finite and rows and not bool(torch.isfinite(hiddens).all()):
            raise ValueError(f"{name} holds NaN or inf")
        return hiddens

    def _check_capacity(self, name: str, end: int) -> None:
        if end > self.capacity:
            raise ValueError(f"{name}: rows up to {end} would run past the state's capacity of {self.capacity} rows")

    # ---- context rows ------------------------------------------------------------------
    def _write_rows(self, tokens: Tensor, hiddens: Tensor, row_base: int, state: DrafterState) -> None:
        end = row_base + tokens.shape[0]
        slots = torch.arange(row_base, end, device=state.device)
        mtp_rows(self.weights, tokens, hiddens, slots, state.cache, self.rope(state.device), rows_read=end)
        state.seq_len = row_base + tokens.shape[0]

    def prefill_drafter(self, prompt_tokens: Tokens, hiddens: Tensor, state: DrafterState) -> int:
        """Write rows ``[0, n-1)`` from prompt ``t_0..t_{n-1}`` and hiddens ``h_0..h_{n-1}``."""
        with self.use(state, "prefill_drafter"):
            self._check_live(state, "prefill_drafter")
            return self.write_prefill(prompt_tokens, hiddens, state, self._write_rows)

    def write_prefill(self, prompt_tokens: Tokens, hiddens: Tensor, state: DrafterState, write_rows: WriteRows) -> int:
        """``prefill_drafter`` after its lifecycle checks: the argument checks, the no-op rule,
        the rows written through ``write_rows`` and the log. The optimized drafter shares it and
        writes its own way."""
        tokens = self._tokens("prompt_tokens", prompt_tokens, state.device)
        n = tokens.shape[0]
        if n > self.max_seq_len:
            raise ValueError(f"prompt_tokens: a prompt of {n} tokens is longer than max_seq_len={self.max_seq_len}")
        self._hiddens("hiddens", hiddens, n, state)
        if state.seq_len > 0 or n < 2:
            return 0
        t0 = time.perf_counter()
        with writing(state, "prefill_drafter"):
            write_rows(tokens[1:], hiddens[:-1], 0, state)
        rows = n - 1
        logger.info("GLM MTP drafter prefill: %d rows (%d prompt tokens) in %.1f ms", rows, n, (time.perf_counter() - t0) * 1e3)
        return rows

    def catchup_drafter(self, tokens: Tokens, hiddens: Tensor, row_base: int, pos_base: int, state: DrafterState) -> int:
        """Write rows ``row_base + i`` pairing ``tokens[i] = t_{row_base+i+1}`` with
        ``hiddens[i] = h_{row_base+i}``. ``pos_base`` is ignored: a row's position is its slot."""
        with self.use(state, "catchup_drafter"):
            self._check_live(state, "catchup_drafter")
            return self.write_catchup(tokens, hiddens, row_base, pos_base, state, self._write_rows)

    def write_catchup(
        self, tokens: Tokens, hiddens: Tensor, row_base: int, pos_base: int, state: DrafterState, write_rows: WriteRows
    ) -> int:
        """``catchup_drafter`` after its lifecycle checks (shared like ``write_prefill``)."""
        ids = self._tokens("tokens", tokens, state.device)
        row_base = check_int("row_base", row_base)
        check_int("pos_base", pos_base)
        self._hiddens("hiddens", hiddens, ids.shape[0], state)
        self._check_capacity("catchup_drafter", row_base + ids.shape[0])
        if row_base != state.seq_len or ids.shape[0] == 0:
            return 0
        with writing(state, "catchup_drafter"):
            write_rows(ids, hiddens, row_base, state)
        return ids.shape[0]

    # ---- drafting ----------------------------------------------------------------------
    def propose(self, last_token: int | Tensor, target_hidden: Tensor, position: int, num_drafts: int, state: DrafterState) -> list[int]:
        """Draft ``num_drafts`` tokens after ``last_token``; draft 1 writes row ``position`` from
        ``(last_token, target_hidden)``, draft i > 1 row ``position + i - 1`` from the previous
        draft and the drafter's own hidden. Rewinds first if the drafter is ahead of ``position``."""
        with self.use(state, "propose"):
            return self._propose(last_token, target_hidden, position, num_drafts, state)[0]

    def propose_sampled(self, last_token: int | Tensor, target_hidden: Tensor, position: int, num_drafts: int,
                        temperature: float, noise: Tensor, state: DrafterState) -> SampledDrafts:
        """``propose`` with sampled drafts: draft i is ``argmax(q_i / noise[i])`` (ties to the
        lower id) with ``q_i = softmax(up(logits_i) / temperature)`` in A (``layers.draft_probs``,
        the temperature rounded to A once), instead of ``argmax(logits_i)``. ``noise``
        (num_drafts, V) in A on the state's device, positive and finite: i.i.d. Exponential(1)
        makes each draft a draw from its ``q_i``; the caller owns the randomness, so every
        backend and device drafts the same tokens. Rows, ``x`` and counters are written as by
        ``propose`` (for the drafts drawn). Returns the drafts and the (k, V) ``q``."""
        with self.use(state, "propose_sampled"):
            drafts, q = self._propose(last_token, target_hidden, position, num_drafts, state, (temperature, noise), "propose_sampled")
            return SampledDrafts(drafts, q)

    def sampling_inputs(self, temperature: object, noise: object, num_drafts: int, state: DrafterState) -> tuple[float, Tensor]:
        """The checks of ``propose_sampled``'s own arguments that read no data (shared with the
        optimized drafter): ``(temperature, noise)``."""
        return (check_temperature(temperature),
                check_noise_shape(noise, num_drafts, self.config.vocab_size, acc_dtype(self.weights.dtype), state.device))

    def _propose(self, last_token: int | Tensor, target_hidden: Tensor, position: int, num_drafts: int, state: DrafterState,
                 sample: tuple[object, object] | None = None, call: str = "propose") -> tuple[list[int], Tensor | None]:
        self._check_live(state, call)
        position = check_int("position", position)
        if state.seq_len < position:
            raise RuntimeError(f"{call}: the drafter holds {state.seq_len} rows, behind position {position}; catch up first")
        one = one_token(last_token)
        token = self._tokens("last_token", one if isinstance(one, Tensor) else [one], state.device)
        hidden = target_hidden.reshape(1, -1) if isinstance(target_hidden, Tensor) and target_hidden.dim() == 1 else target_hidden
        self._hiddens("target_hidden", hidden, 1, state)
        num_drafts = check_int("num_drafts", num_drafts)
        self._check_capacity(call, position + num_drafts)
        temp = noise = None
        if sample is not None:
            temperature, noise = self.sampling_inputs(*sample, num_drafts, state)
            if num_drafts and not bool(((noise > 0) & (noise < math.inf)).all()):  # NaN fails both
                raise ValueError(NOISE_MESSAGE)
            temp = torch.tensor([temperature], dtype=noise.dtype, device=state.device)

        if os.environ.get(FINGERPRINT_ENV) == "1":
            logger.info(
                "GLM_MTP_DBG propose position=%d drafter_rows=%d tok=%d fp_target=%s",
                position, state.seq_len, int(token[0]), hidden_fingerprint(hidden),
            )
        drafts: list[int] = []
        qs: list[Tensor] = []
        rope = self.rope(state.device)
        with writing(state, call):
            state.seq_len = min(state.seq_len, position)  # rewind: rows past position become unreachable
            for i in range(num_drafts):
                slot = torch.tensor([position + i], device=state.device)
                out = mtp_rows(self.weights, token, hidden, slot, state.cache, rope, rows_read=position + i + 1)
                logits = draft_logits(self.weights, out.x)  # (1, V) in S
                if temp is None:
                    token = greedy_token(logits)  # (1,)
                else:
                    qs.append(draft_probs(logits, temp))  # (1, V) in A
                    token = sampled_token(qs[-1], noise[i : i + 1])  # (1,)
                drafts.append(int(token[0]))
                state.x = out.x[0].clone()
                hidden = out.x if self.feed_hidden == "post_norm" else out.pre_norm
                state.seq_len = position + i + 1
        state.pending = True
        state.last_drafted = num_drafts
        if temp is None:
            return drafts, None
        V = self.config.vocab_size
        return drafts, torch.cat(qs) if qs else torch.zeros(0, V, dtype=temp.dtype, device=state.device)

    def after_verify(self, num_accepted: int, state: DrafterState) -> None:
        """Keep the first ``num_accepted + 1`` rows of the pending propose (never fewer than
        one: the first row is always kept) and trim the rest."""
        with self.use(state, "after_verify"):
            self.apply_verify(num_accepted, state)

    def apply_verify(self, num_accepted: int, state: DrafterState) -> None:
        """``after_verify`` without the owner checks: its lifecycle and argument checks and the
        counters (the optimized drafter shares it)."""
        check_sound(state, "after_verify")
        if not state.pending:
            raise RuntimeError("after_verify: no propose is pending (a second after_verify would trim the kept first row)")
        num_accepted = check_int("num_accepted", num_accepted)
        if num_accepted > state.last_drafted:
            raise ValueError(f"num_accepted must be in [0, {state.last_drafted}] (the drafts proposed), got {num_accepted}")
        keep = min(state.last_drafted, num_accepted + 1)
        state.seq_len -= state.last_drafted - keep
        state.pending = False
        state.last_drafted = 0
