"""Mutants of grammar-constrained drafts (DESIGN.md §10): the mistakes engines make when they mask
drafts, each a reference drafter that breaks one rule of the walk over the matcher. The scenarios
draw grammars when both backends take them (``lockstep.Harness.grammars``); without a grammar
these are the reference.

Each swaps, for its own proposes only (single, sampled and batched: ``StepSwappingMutant``), how
a propose walks its matcher (``proposer.walking``, a ``GrammarWalk`` of its own) or how a step
compares the allowed tokens (``layers.restricted``, ``proposer.draft_margin``), or, for its
proposes' checks, whether step 1's question is asked before any write
(``contract.ask_first_step``). Registered in ``mutants.GROUPS``.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from types import ModuleType
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from glm_mtp.reference import contract as _contract
from glm_mtp.reference import layers as _layers
from glm_mtp.reference import proposer as _proposer
from glm_mtp.reference.grammar import FirstStep, GrammarWalk, allowed_tokens
from glm_mtp.reference.numerics import up

from .base import Mutant, swapped


class StepSwappingMutant(Mutant):
    """A mutant whose bug is a swapped function of the draft steps (``ReferenceProposer._draft``
    reads it from its module), active during its own proposes only."""

    def swaps(self) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        raise NotImplementedError

    def _draft(self, args, state, call, sample=None):
        with ExitStack() as stack:
            for module, name, fn in self.swaps():
                stack.enter_context(swapped(module, name, fn))
            return super()._draft(args, state, call, sample)


def walking_with(walk_type: type[GrammarWalk]) -> Callable[..., Any]:
    """``grammar.walking`` with another kind of walk."""

    @contextmanager
    def walking(matcher: object | None, vocab_size: int, device: torch.device,
                first: FirstStep | None = None) -> Iterator[GrammarWalk | None]:
        if matcher is None:
            yield None
            return
        walk = walk_type(matcher, vocab_size, device, first)
        try:
            yield walk
        finally:
            walk.rollback()

    return walking


class WalkMutant(StepSwappingMutant):
    """A mutant whose proposes walk their matcher with ``walk``."""

    walk: type[GrammarWalk]

    def swaps(self) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_proposer, "walking", walking_with(self.walk))]


class _OneMaskWalk(GrammarWalk):
    """The seed's signature: one bitmask, filled before the propose, for every draft position."""

    filled = False
    mask: Tensor | None = None

    def allowed(self) -> Tensor | None:
        if not self.filled:
            self.mask, self.filled = super().allowed(), True
        return self.mask  # MUTATION: A_1 at every step

    def accept(self, token: int, step: int) -> None:
        pass  # MUTATION: the matcher is never walked


class OneMaskEveryStep(WalkMutant):
    name = "grammar_one_mask"
    rule = "§10: draft i is masked with A_i, the matcher's mask after d_1 .. d_{i-1}, not one mask for every draft"
    walk = _OneMaskWalk


class _LateMaskWalk(GrammarWalk):
    """Each step's mask is read, then handed to the next step: step 1 drafts unmasked."""

    previous: Tensor | None = None

    def allowed(self) -> Tensor | None:
        current = super().allowed()
        if current is None:
            return None
        shown = self.previous if self.previous is not None else torch.ones_like(current)
        self.previous = current
        return shown  # MUTATION: A_{i-1} at step i (every token at step 1)


class MaskOneStepLate(WalkMutant):
    name = "grammar_mask_one_step_late"
    rule = "§10: step i is masked with its own A_i, not the mask of step i - 1"
    walk = _LateMaskWalk


class _NoRollbackWalk(GrammarWalk):
    def rollback(self) -> None:
        pass  # MUTATION: the drafts stay accepted


class NoRollback(WalkMutant):
    name = "grammar_no_rollback"
    rule = "§10: a propose rolls its matcher back to how it found it"
    walk = _NoRollbackWalk


class _DraftsOnWalk(GrammarWalk):
    def allowed(self) -> Tensor | None:
        # MUTATION: is_terminated is never asked; a terminated matcher's mask drafts on
        self.bitmask.zero_()
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)  # type: ignore[attr-defined]  # duck-typed matcher (held as object)
        allowed = allowed_tokens(self.bitmask[0], self.vocab_size)
        return allowed.to(self.device) if bool(allowed.any()) else None


class TerminatedDraftsOn(WalkMutant):
    name = "grammar_terminated_drafts_on"
    rule = "§10: a propose stops before a step whose matcher is terminated"
    walk = _DraftsOnWalk


def _sentinel_restricted(x: Tensor, allowed: Tensor | None) -> Tensor:
    # MUTATION: a forbidden entry is compared, as the dtype's lowest finite value
    return x if allowed is None else torch.where(allowed, x, torch.finfo(x.dtype).min)


def _sentinel_argmax(x: Tensor, allowed: Tensor | None) -> Tensor:
    return torch.argmax(_sentinel_restricted(x, allowed), dim=-1)


def _sentinel_margin(logits: Tensor, token: Tensor, allowed: Tensor | None = None) -> Tensor:
    s = up(_sentinel_restricted(logits, allowed))  # (T, V): forbidden logits at the sentinel, compared
    own = s.gather(-1, token[:, None])[:, 0]
    others = torch.arange(s.shape[-1], device=s.device) != token[:, None]
    return own - torch.where(others, s, -torch.inf).amax(dim=-1)


class FiniteSentinel(StepSwappingMutant):
    name = "grammar_finite_sentinel"
    rule = "§10: a forbidden token is never compared (margin +inf when one token is allowed), not a finite sentinel"

    def swaps(self) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_layers, "restricted_argmax", _sentinel_argmax), (_proposer, "draft_margin", _sentinel_margin)]


def _not_asked(name: str, matcher: object, vocab_size: int) -> None:
    return None  # MUTATION: step 1's question is left to the walk, after the rewind has written


class AsksMatcherAfterWriting(Mutant):
    """The walk asks the matcher for step 1 itself, inside the propose's writes (as the walks
    did before the rule): a matcher of another vocabulary fails there, poisoning the state with
    the matcher's own error, instead of the refusal before any write."""

    name = "grammar_asked_after_writing"
    rule = ("§4, §10: a propose asks its matcher for step 1 among its checks, before any write: one that cannot "
            "answer (another vocabulary's bitmask width) is a ValueError naming grammar, the state as found")
    generators = ("adversarial",)  # the generator that draws broken grammar arguments

    def _propose(self, *args, **kwargs):
        with swapped(_contract, "ask_first_step", _not_asked):
            return super()._propose(*args, **kwargs)

    def propose_batch(self, *args, **kwargs):
        with swapped(_contract, "ask_first_step", _not_asked):
            return super().propose_batch(*args, **kwargs)


MUTANTS: tuple[type[Mutant], ...] = (OneMaskEveryStep, MaskOneStepLate, NoRollback, FiniteSentinel, TerminatedDraftsOn,
                                     AsksMatcherAfterWriting)
