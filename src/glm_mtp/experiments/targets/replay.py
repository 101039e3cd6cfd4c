"""A trace replayed as the loop's target (DESIGN.md §11): ``prefill``, ``verify``, ``rollback``
answered from the record, with no target weight loaded.

A verify of ``[t_m, d_1 .. d_k]`` at position m answers position j with the target's greedy token
there, as long as the fed tokens follow the target's own path: ``t_m`` is the trace's token at m,
and ``d_1 .. d_j`` are the target's greedy chain after it (speculative trace: the trajectory,
``argmax[m .. m + j - 1]``; teacher-forced trace: ``greedy[m, 0 .. j - 1]``). Greedy verification
never reads past the first draft that leaves the path, so the rows after it are never read: their
logits are zeros and their hidden NaN, so a reader that did use them would not pass silently.

The logits of an answered row are one-hot (1 at the recorded token, 0 elsewhere, float32): the
loop takes their argmax. The hidden rows are the recorded bytes. A state may match several items
that share a prompt; ``verify`` narrows them by the fed token and answers from the first left.
A sampled trace (DESIGN.md §14) answers the same way along its seeded-sampled path: the chain is
``sample[m .. m + j - 1]``, the one-hot logits sit at the recorded samples and ``sample`` carries
them (-1 in the unread rows), which ``verify=match`` commits. Rejection sampling needs the target's
distribution, which a trace does not hold: the acceptance experiment refuses it before any work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .target import TargetOutput
from ..traces.format import Trace, TraceItem


def item_budget(item: TraceItem, num_drafts: int) -> int:
    """How many tokens the loop may generate from ``item`` at k = ``num_drafts`` and stay inside
    the record: a speculative item's last verify reads positions up to ``m + k`` with
    ``m <= P + N - 2``, so ``N <= L - P - k + 1``; a teacher-forced item scores its L - P positions."""
    if item.greedy is not None:
        return item.length - item.prompt_len
    return item.length - item.prompt_len - num_drafts + 1


@dataclass
class ReplayState:
    """One sequence: the items it may be (those whose prompt it was prefilled with, still on the
    fed path) and the positions it holds."""

    candidates: list[int] = field(default_factory=list)
    length: int = 0


class ReplayTarget:
    """The loop's target (``speculative.TargetModel``) answered from a trace.

    Args:
        trace: a checked trace (``traces.validate.open_trace``).
        device: where the hidden rows go (the drafter's device).
    """

    def __init__(self, trace: Trace, device: torch.device | str = "cpu") -> None:
        self.trace, self.device = trace, torch.device(device)
        self.vocab_size = trace.meta["vocab_size"]
        self.sampled = trace.meta["generation"]["temperature"] > 0  # the path follows `sample`
        self.by_prompt: dict[tuple[int, ...], list[int]] = {}
        for i, it in enumerate(trace.items):
            self.by_prompt.setdefault(tuple(it.tokens[: it.prompt_len].tolist()), []).append(i)
        self.forwards = 0  # prefills and verifies answered (what the live target would have run)

    def alloc_state(self) -> ReplayState:
        return ReplayState()

    def prefill(self, tokens: list[int], state: ReplayState) -> TargetOutput:
        """The prompt at positions ``[0, n)``: an item recorded from exactly this prompt."""
        if state.length:
            raise ValueError(f"prefill needs an empty state; this one holds {state.length} positions")
        key = tuple(int(t) for t in tokens)
        found = self.by_prompt.get(key)
        if not found:
            raise ValueError(f"tokens: the trace holds no item whose prompt is these {len(tokens)} tokens (replay "
                             "the trace's own prompts)")
        state.candidates, state.length = list(found), len(tokens)
        self.forwards += 1
        it = self.trace.items[found[0]]
        P = len(tokens)
        return self._output(it.hidden[:P], self._next(it)[:P])

    def verify(self, tokens: list[int], state: ReplayState) -> TargetOutput:
        """``[t_m, d_1 .. d_k]`` at positions ``[m, m + k + 1)``: rows on the target's path
        answered from the record, the rest unread (zeros, NaN)."""
        m, T = state.length, len(tokens)
        keep = [i for i in state.candidates
                if m < self.trace.items[i].length and int(self.trace.items[i].tokens[m]) == tokens[0]]
        if not keep:
            i = state.candidates[0]
            it = self.trace.items[i]
            held = int(it.tokens[m]) if m < it.length else "nothing (past its end)"
            raise ValueError(f"tokens: the loop fed {tokens[0]} at position {m}; item {i} of the trace holds {held} "
                             "there (a replay follows the target's greedy path)")
        state.candidates = keep
        it = self.trace.items[keep[0]]
        chain = self._chain(it, m, T)  # the target's greedy tokens at m, m+1, .. along its path
        on_path = 1
        while on_path < T and on_path < len(chain) and tokens[on_path] == chain[on_path - 1]:
            on_path += 1
        if on_path == len(chain) < T and (not chain or tokens[on_path] == chain[on_path - 1]):
            raise ValueError(f"position {m + on_path}: the replay ran past the end of item {keep[0]}'s record "
                             f"(length {it.length}); generate at most its budget")
        answered = chain[:on_path]
        logits = torch.zeros(T, self.vocab_size, dtype=torch.float32)  # (T, V)
        logits[torch.arange(on_path), torch.tensor(answered, dtype=torch.long)] = 1.0
        hidden = torch.full((T, it.hidden.shape[1]), float("nan"), dtype=it.hidden.dtype)  # (T, H)
        known = on_path if it.greedy is None else 1  # a teacher-forced trace holds the text's hidden only
        hidden[:known] = it.hidden[m : m + known]
        state.length += T
        self.forwards += 1
        sample = None
        if self.sampled:
            sample = torch.full((T,), -1, dtype=torch.int64)
            sample[:on_path] = torch.tensor(answered, dtype=torch.int64)
        return TargetOutput(logits=logits, hidden=hidden.to(self.device), sample=sample)

    def rollback(self, state: ReplayState, length: int) -> None:
        """Keep positions ``< length``."""
        if not 0 <= length <= state.length:
            raise ValueError(f"length must be in [0, {state.length}], got {length}")
        state.length = length

    def _chain(self, it: TraceItem, m: int, T: int) -> list[int]:
        """The target's greedy tokens after positions m, m + 1, .. along its own path from m (as
        many of the T as the record holds)."""
        if it.greedy is None:
            return self._next(it)[m : m + T].tolist()
        return [t for t in it.greedy[m, :T].tolist() if t >= 0]

    def _next(self, it: TraceItem) -> Tensor:
        """The item's next token after each position along its path: ``sample`` or ``argmax``."""
        if self.sampled:
            assert it.sample is not None  # a sampled trace's every item holds sample (format.py checks it)
            return it.sample
        return it.argmax

    def _output(self, hidden: Tensor, nxt: Tensor) -> TargetOutput:
        logits = torch.zeros(hidden.shape[0], self.vocab_size, dtype=torch.float32)  # (T, V)
        logits[torch.arange(hidden.shape[0]), nxt.long()] = 1.0
        return TargetOutput(logits=logits, hidden=hidden.to(self.device),
                            sample=nxt.long() if self.sampled else None)
