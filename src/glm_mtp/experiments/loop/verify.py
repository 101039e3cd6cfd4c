"""Verification: how the target's one forward over ``[t_m, d_1..d_s]`` decides how many drafts a
round accepts and which token it adds (the bonus). One function, ``verify``, chooses the rule by
name; the round (``loop/round.py``) calls it and nothing else.

Rules (``VERIFY_RULES``):

- ``greedy`` (``temperature == 0``): accept while the draft equals the target's argmax; the bonus
  is the target's argmax after the last accepted draft. The output is the target's greedy decode.
- ``rejection`` (``temperature > 0``), speculative sampling by rejection (Leviathan et al. 2023;
  Chen et al. 2023): with ``p = softmax(logits / T)`` and the draft distribution ``q``, draft
  ``d`` is accepted with probability ``min(1, p(d) / q(d))``; on rejection the token is drawn from
  ``normalise(max(0, p - q))``; after every draft is accepted the bonus is drawn from ``p``. For
  argmax drafts ``q`` is one-hot at the draft (accept with ``p(d)``, else draw from ``p`` without
  ``d``). The emitted tokens are distributed as sampling from the target alone. With top_p /
  top_k (``loop/sampler.py``) ``p`` is the target's distribution over the sampler's kept set
  (the round passes that set as ``allowed``), so the output is distributed as the truncated
  target's sampling.
- ``match`` (``temperature > 0``), seeded exact match (DESIGN.md §14, ``loop/match_verify.py``):
  accept the longest prefix of drafts equal to the target's own seeded samples ``y_m..y_{m+s}``
  (``samples``), commit ``y`` at the first mismatch (the bonus after s). The output is the
  target's seeded sampling of the prompt whatever the drafter drafted.

Under a grammar (DESIGN.md §10) greedy and rejection take the per-position masks of ``grammar_verify.verify_masks``:
greedy takes the best allowed token, rejection draws from ``p`` over the allowed tokens, and a
position that allows nothing ends the output (the bonus is None); ``match`` runs without one.

A new rule is one more name in ``VERIFY_RULES`` and one more branch in ``verify``, with the same
arguments and the same ``(accepted, bonus)`` answer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .grammar_verify import masked_greedy_verify, masked_target_probs
from .match_verify import match_verify

VERIFY_RULES = ("greedy", "rejection", "match")


def default_verify_rule(temperature: float) -> str:
    """The rule a run verifies by when it names none: ``greedy`` at ``temperature == 0``, else
    ``rejection``."""
    return "greedy" if temperature == 0 else "rejection"


def verify(rule: str, logits: Tensor, drafts: list[int], temperature: float, gen: torch.Generator,
           q: Tensor | None = None, allowed: Tensor | None = None,
           samples: list[int] | None = None) -> tuple[int, int | None]:
    """``(drafts accepted, bonus token)`` of one round by the rule named ``rule``.

    Args:
        rule: one of ``VERIFY_RULES`` (module docstring).
        logits: (s+1, V), the target's at positions m..m+s.
        drafts: the s verified drafts.
        temperature / gen: the sampling temperature and generator (``rejection``; ``greedy``
            reads neither).
        q: (s, V) the drafter's distributions of sampled drafts; None for argmax drafts.
        allowed: (legal+1, V) bool, a grammar's masks; None without a grammar. The bonus is None
            where the grammar allows nothing. (``rejection``: the sampler's kept set too.)
        samples: (s+1) the target's seeded samples y_m..y_{m+s} (``match``; the others read none).
    """
    if rule == "match":
        if samples is None or allowed is not None:
            raise ValueError("verify=match needs the target's seeded samples and runs without a grammar's masks")
        return match_verify(samples, drafts)
    if rule == "greedy":
        return greedy_verify(logits, drafts) if allowed is None else masked_greedy_verify(logits, drafts, allowed)
    if rule == "rejection":
        return stochastic_verify(logits, drafts, temperature, gen, q, allowed)
    raise ValueError(f"verify rule must be one of {VERIFY_RULES}, got {rule!r}")


def greedy_verify(logits: Tensor, drafts: list[int]) -> tuple[int, int]:
    """``logits`` (k+1, V) at positions m..m+k. Returns (drafts accepted, bonus token)."""
    best = torch.argmax(logits, dim=-1).tolist()  # ties to the lower id, as the drafter's
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return a, best[a]


def target_probs(logits: Tensor, temperature: float) -> Tensor:
    """``softmax(logits / temperature)`` in float64, so acceptance tests do not round."""
    return torch.softmax(logits.double() / temperature, dim=-1)


def stochastic_verify(logits: Tensor, drafts: list[int], temperature: float, gen: torch.Generator,
                      q: Tensor | None = None, allowed: Tensor | None = None) -> tuple[int, int | None]:
    """Rejection sampling (see the module docstring): against one-hot drafts when ``q`` is None
    (argmax drafts), else against the drafter's distributions ``q`` (k, V) (sampled drafts):
    accept draft i with probability ``min(1, p(d) / q(d))``, else draw from ``norm(max(0, p - q))``.
    ``allowed`` (legal+1, V) bool: a grammar's masks (``grammar_verify.verify_masks``); then ``p``
    is the target's distribution over each position's allowed tokens (a forbidden draft has
    ``p(d) = 0`` and is always rejected), and a position that allows nothing ends the output
    there (the token returned is None)."""
    if allowed is None:
        p, live = target_probs(logits, temperature), None  # (k+1, V)
    else:
        live = allowed.any(dim=-1)  # (legal+1,); a row that allows nothing is never drawn from
        p = masked_target_probs(logits[: allowed.shape[0]], temperature, allowed | ~live[:, None])
    if q is not None:
        q = q.detach().to(device="cpu", dtype=torch.float64)
    for i, d in enumerate(drafts):
        if live is not None and not bool(live[i]):
            return i, None
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if q is None:
            if u < float(p[i, d]):
                continue
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            if u * float(q[i, d]) < float(p[i, d]):  # u < p(d) / q(d); q(d) > 0 for a drawn draft
                continue
            residual = torch.clamp(p[i] - q[i], min=0.0)
            if not float(residual.sum()) > 0:  # p <= q everywhere only when they are equal up to rounding
                residual = p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    if live is not None and not bool(live[len(drafts)]):
        return len(drafts), None
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))
