"""Recording a trace from a target, in two passes (DESIGN.md §11).

Speculative traces: pass 1 runs the target's greedy (or, with sampler settings at temperature > 0,
seeded-sampled: DESIGN.md §14) continuation of every prompt (``continue_fn``:
the package's target one token per forward, transformers' model batched); pass 2 runs one
teacher-forced forward per item over prompt + continuation (``target.prefill``), which gives the
``hidden`` and ``argmax`` of every position. Where pass 2's argmax parts from pass 1's next token
(a near-tie the two passes rounded apart), the item ends at that position and the positions cut
are counted, so every item satisfies ``tokens[p + 1] == argmax[p]`` after its prompt. A sampled
recording also computes pass 2's seeded ``sample`` at every position and cuts where it parts from
pass 1's token instead (``tokens[p + 1] == sample[p]``).

Teacher-forced traces (natural text, the package's target): one forward over each window gives
``hidden`` and ``argmax``; then at every scored position p the target's greedy chain of K + 1
tokens after the text up to p (``greedy[p]``), one token per forward, the state rolled back to the
text after each chain. A chain whose first token parts from the window's forward ends the item
there, counted the same way.

Both count the target forwards they ran, which a replay grid compares with the live grid's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..loop.sampler import SamplerSettings, seeded_sample
from .format import NOT_RECORDED, TraceItem
from .prompt_id import prompt_identity, prompt_sha256

ContinueFn = Callable[[list[list[int]], int], tuple[list[list[int]], int]]


@dataclass
class RecordStats:
    """What a recording ran and cut: ``forwards`` per pass, items cut at a near-tie, positions
    they lost, and items left with no generated position (dropped whole)."""

    generation_forwards: int = 0
    teacher_forced_forwards: int = 0
    truncated_items: int = 0
    positions_dropped: int = 0
    items_dropped: int = 0

    def forwards(self) -> dict[str, int]:
        return {"generation": self.generation_forwards, "teacher_forced": self.teacher_forced_forwards,
                "total": self.generation_forwards + self.teacher_forced_forwards}

    def truncation(self) -> dict[str, int]:
        return {"items": self.truncated_items, "positions_dropped": self.positions_dropped,
                "items_dropped": self.items_dropped}


def first_disagreement(prompt_len: int, tokens: list[int], argmax: list[int]) -> int | None:
    """The first generated position p (``prompt_len - 1 <= p < len(tokens) - 1``) where
    ``argmax[p] != tokens[p + 1]``; None when the two passes agree everywhere."""
    for p in range(prompt_len - 1, len(tokens) - 1):
        if argmax[p] != tokens[p + 1]:
            return p
    return None


def sampled(settings: SamplerSettings | None) -> bool:
    """Whether ``settings`` sample (temperature > 0); None and temperature 0 are greedy."""
    return settings is not None and settings.temperature > 0


def next_tokens(logits: torch.Tensor, settings: SamplerSettings | None, prompt: list[int], first: int) -> list[int]:
    """The target's next token after each row of ``logits`` (T, V), row t at item position
    ``first + t``: the argmax (greedy) or the seeded sample keyed by ``prompt``'s sha256."""
    if not sampled(settings):
        return torch.argmax(logits, dim=-1).tolist()
    assert settings is not None  # sampled() is False for None
    positions = torch.arange(first, first + logits.shape[0], device=logits.device)
    return seeded_sample(logits, settings, prompt_sha256(prompt), positions).tolist()


def sequential_continue(target: Any, settings: SamplerSettings | None = None) -> ContinueFn:
    """Pass 1 on a target with the loop's interface: each prompt's greedy (or seeded-sampled)
    continuation, one token per forward (a prefill, then one-token verifies). Returns
    ``(continuations, forwards)``."""

    def run(prompts: list[list[int]], n: int) -> tuple[list[list[int]], int]:
        out, forwards = [], 0
        for p in prompts:
            state = target.alloc_state()
            res = target.prefill(list(p), state)
            toks = next_tokens(res.logits[-1:], settings, p, len(p) - 1)
            forwards += 1
            while len(toks) < n:
                res = target.verify(toks[-1:], state)
                # toks[-1] sits at position P + len(toks) - 1: its row's key
                toks += next_tokens(res.logits[-1:], settings, p, len(p) + len(toks) - 1)
                forwards += 1
            out.append(toks)
        return out, forwards

    return run


def record_speculative(target: Any, prompts: list[list[int]], continuation: int, continue_fn: ContinueFn,
                       batch: int = 8, progress: Callable[[Iterable[Any]], Iterable[Any]] = iter,
                       source: str = "unknown", settings: SamplerSettings | None = None
                       ) -> tuple[list[TraceItem], RecordStats]:
    """Record ``prompts`` with ``continuation`` greedy tokens each.

    Args:
        target: the loop's target interface (pass 2 is its ``prefill`` of the whole item).
        prompts: token ids, each at least one token.
        continuation: tokens generated per prompt (max_new_tokens + max_drafts - 1 serves every k <= max_drafts).
        continue_fn: pass 1, ``(prompts, n) -> (continuations, forwards)``.
        batch: prompts handed to ``continue_fn`` at once.
        progress: wraps the iteration over batches (a progress bar).
        source: the prompts' source, each item's prompt identity with its index in ``prompts``.
        settings: the seeded sampler's (temperature > 0: a sampled trace, which ``continue_fn``
            must have sampled with the same settings); None or temperature 0: greedy.
    Returns the items (those left with no generated position are dropped, counted) and the stats.
    """
    stats, items = RecordStats(), []
    for i in progress(range(0, len(prompts), batch)):
        chunk = prompts[i : i + batch]
        conts, forwards = continue_fn(chunk, continuation)
        stats.generation_forwards += forwards
        for j, (p, c) in enumerate(zip(chunk, conts)):
            tokens = list(p) + list(c)
            out = target.prefill(tokens, target.alloc_state())
            stats.teacher_forced_forwards += 1
            argmax = torch.argmax(out.logits, dim=-1).tolist()
            sample = next_tokens(out.logits, settings, p, 0) if sampled(settings) else None
            cut = first_disagreement(len(p), tokens, argmax if sample is None else sample)
            length = len(tokens) if cut is None else cut + 1
            if cut is not None:
                stats.truncated_items += 1
                stats.positions_dropped += len(tokens) - length
            if length <= len(p):  # the first generated token already parted: nothing to replay
                stats.items_dropped += 1
                continue
            items.append(TraceItem(torch.tensor(tokens[:length], dtype=torch.int32),
                                   torch.tensor(argmax[:length], dtype=torch.int32),
                                   out.hidden[:length].detach().cpu().contiguous(), len(p),
                                   dropped=len(tokens) - length, prompt=prompt_identity(source, i + j, p),
                                   sample=None if sample is None else torch.tensor(sample[:length], dtype=torch.int32)))
    return items, stats


def record_teacher_forced(target: Any, windows: list[list[int]], prompt_len: int, max_drafts: int,
                          progress: Callable[[Iterable[Any]], Iterable[Any]] = iter, source: str = "unknown"
                          ) -> tuple[list[TraceItem], RecordStats]:
    """Record natural-text ``windows`` (each longer than ``prompt_len``) with the greedy chain of
    ``max_drafts + 1`` tokens at every scored position (``target`` must roll back anywhere: the
    package's ``Target``); each item names its prompt (``source``, its window's index)."""
    stats, items = RecordStats(), []
    K1 = max_drafts + 1
    for index, w in enumerate(progress(windows)):
        out = target.prefill(list(w), target.alloc_state())
        stats.teacher_forced_forwards += 1
        argmax = torch.argmax(out.logits, dim=-1).tolist()
        greedy = torch.full((len(w), K1), NOT_RECORDED, dtype=torch.int32)
        greedy[:, 0] = torch.tensor(argmax, dtype=torch.int32)
        state = target.alloc_state()
        target.prefill(list(w[:prompt_len]), state)
        stats.generation_forwards += 1
        length = len(w)
        for p in range(prompt_len, len(w)):
            chain = []
            fed = w[p]
            for _ in range(K1):
                res = target.verify([fed], state)
                stats.generation_forwards += 1
                fed = int(torch.argmax(res.logits[-1]))
                chain.append(fed)
            target.rollback(state, p + 1)
            if chain[0] != argmax[p]:  # a near-tie the window's forward and the one-token chain rounded apart
                length = p
                break
            greedy[p] = torch.tensor(chain, dtype=torch.int32)
        if length < len(w):
            stats.truncated_items += 1
            stats.positions_dropped += len(w) - length
        if length <= prompt_len:
            stats.items_dropped += 1
            continue
        items.append(TraceItem(torch.tensor(w[:length], dtype=torch.int32),
                               torch.tensor(argmax[:length], dtype=torch.int32),
                               out.hidden[:length].detach().cpu().contiguous(), prompt_len,
                               greedy[:length].contiguous(), dropped=len(w) - length,
                               prompt=prompt_identity(source, index, w[:prompt_len])))
    return items, stats


def measure_target_costs(target: Any, max_drafts: int, context: list[int], repeats: int = 15,
                         clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """The target's forward costs on this machine, for the speedup model of a replay: a decode
    step (1 token after ``context``) and a verify of k + 1 tokens for k = 1..max_drafts, medians of
    ``repeats`` alternating rounds (as ``speedup.measure_costs`` times them). Milliseconds."""
    if len(context) < 2:
        raise ValueError("context must hold at least 2 tokens")
    P = len(context)
    state = target.alloc_state()
    target.prefill(list(context[:-1]), state)
    fed = [context[-1]] + [context[i % P] for i in range(max_drafts)]

    def verify(n: int) -> float:
        t0 = clock()
        out = target.verify(fed[:n], state)
        if out.logits.is_cuda:
            torch.cuda.synchronize(out.logits.device)
        dt = clock() - t0
        target.rollback(state, P - 1)
        return dt

    verify(1), verify(max_drafts + 1)  # warm-up
    step, ver = [], [[] for _ in range(max_drafts)]
    for _ in range(repeats):
        step.append(verify(1))
        for k in range(1, max_drafts + 1):
            ver[k - 1].append(verify(k + 1))
    return {"target_step_ms": statistics.median(step) * 1e3, "verify_ms": [statistics.median(t) * 1e3 for t in ver],
            "repeats": repeats, "context": P, "source": "measured at recording"}
