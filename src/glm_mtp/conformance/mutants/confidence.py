"""Mutants of draft confidence (DESIGN.md §12): each a reference drafter whose ``draft_confidence``
breaks one rule, with the drafts and rows of the reference. Registered in ``mutants.GROUPS``."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import torch
from torch import Tensor

from glm_mtp.reference import proposer as _proposer
from glm_mtp.reference.layers import draft_margin, draft_prob
from glm_mtp.reference.numerics import masked_softmax, up

from .base import Mutant
from .grammar import StepSwappingMutant


def _margin_unmasked(logits: Tensor, token: Tensor, allowed: Tensor | None = None) -> Tensor:
    return draft_margin(logits, token)  # MUTATION: the second best of every logit, forbidden ones too


class MarginUnmasked(StepSwappingMutant):
    name = "confidence_margin_unmasked"
    rule = "§12: a draft's margin is over the allowed tokens of its step, not the unmasked logits"

    def swaps(self) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_proposer, "draft_margin", _margin_unmasked)]


class ProbAtTemperatureOne(StepSwappingMutant):
    name = "confidence_prob_at_temperature_one"
    rule = "§12: a sampled draft's prob is q at the temperature drawn from, not the softmax at temperature 1"

    def swaps(self) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        self._steps: list[tuple[Tensor, Tensor, Tensor | None]] = []

        def margin_seen(logits: Tensor, token: Tensor, allowed: Tensor | None = None) -> Tensor:
            self._steps.append((logits, token, allowed))  # each step's logits, draft and mask
            return draft_margin(logits, token, allowed)

        return [(_proposer, "draft_margin", margin_seen)]

    def _draft(self, args, state, call, sample=None):
        out = super()._draft(args, state, call, sample)
        if sample is not None and self._steps:
            # MUTATION: the probability of each draft under the softmax of its logits at temperature 1
            prob = torch.cat([draft_prob(masked_softmax(up(lg), allowed), tok) for lg, tok, allowed in self._steps])
            state.confidence = (prob, state.confidence[1])
        return out


MUTANTS: tuple[type[Mutant], ...] = (MarginUnmasked, ProbAtTemperatureOne)
