"""One round of the speculative loop (DESIGN.md §4), written once: ``play_round``. The loop
(``SpeculativeDecoder.generate``), its batch path (``generate_batch``, which drafts for every
sequence in one call and hands each its drafts) and teacher forcing (``teacher_forced``) all
call it.

With ``t_m`` the newest committed token (not yet fed to the target) and ``h_{m-1}`` the target's
hidden at the position before it, a round is

    draft    drafts = propose(t_m, h_{m-1}, m - 1, k)         rows [m-1, m-1+n) of the drafter (n <= k)
    width    s = the stop rule's prefix of the drafts          (``stop_rules.round_width``; s = n without one)
    verify   logits, h_m..h_{m+s} = target([t_m, d_1..d_s])   one verification forward
             a, b = verify(rule, logits, d_1..d_s)            (``verify.verify``, by name)
    rollback the target keeps positions < m + kept + 1; the drafter keeps rows per the policy
    timing   the drafter's seconds and the verification's, into the ``Round``

``kept`` is ``a`` in the loop. Teacher forcing keeps none (``keep_accepted=False``): the text, not
the drafts, moves on, so the target rewinds to ``m + 1`` and the drafter keeps its first row.

Rollback policies (``keep_rows``: what the drafter keeps of the rows its propose wrote):

- ``first_row_kept`` (the engine's drafter's, default): ``after_verify(kept)`` keeps rows
  [m-1, m-1+min(n, kept+1)); kept rows past the first hold the drafter's own ``x`` instead of the
  target's hidden; when all n were kept the drafter is one row behind and catches up
  ``(d_n, h_{m+n-1})`` (the batch path defers that row to one ``catchup_batch``).
- ``refeed``: ``after_verify(0)`` keeps only the first row, then a catch-up re-writes rows
  [m, m+kept) from the kept drafts and the target's own hiddens ``h_m..h_{m+kept-1}``.
- ``trim_all``: every row of the propose goes, the first too (``truncate_drafter``), and one
  catch-up rebuilds [m-1, m+kept) from the target's hiddens: ``refeed`` with the first row
  recomputed in a batch, so equal to it up to rounding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from glm_mtp.reference.contract import DraftProposer
from glm_mtp.reference.numerics import acc_dtype

from .grammar_verify import verify_masks
from .match_verify import target_samples
from .sampler import SamplerSettings, kept_tokens, truncates
from .stop_rules import NO_STOP, RoundRecord, StopRule, round_width
from .verify import VERIFY_RULES, verify

Policy = Literal["first_row_kept", "refeed", "trim_all"]
POLICIES = ("first_row_kept", "refeed", "trim_all")
Draft = Literal["argmax", "sampled"]
DRAFTS = ("argmax", "sampled")
GrammarDrafts = Literal["masked", "unmasked"]


class TargetModel(Protocol):
    """What the loop and teacher forcing need of a target. The package's toy target
    (``experiments.targets.target.Target``), transformers' model of a released checkpoint
    (``experiments.targets.hf_target.HfTarget``) and a recorded trace
    (``experiments.targets.replay.ReplayTarget``) are three.

    - ``prefill(tokens, state)``: the prompt, positions ``[0, n)`` of a fresh state;
    - ``verify(tokens, state)``: ``[t_m, d_1..d_k]`` at positions ``[m, m + k + 1)``;
    - ``rollback(state, length)``: keep positions ``< length``. The loop rolls back only into
      the last verify, and a target may refuse anything else (``HfTarget`` does: its linear
      layers restore recorded states only).

    Both forwards return ``.logits`` (T, V) and ``.hidden`` (T, H): the hidden rows after the
    final norm, what the head and the drafter read.
    """

    def alloc_state(self) -> object: ...
    def prefill(self, tokens: list[int], state: object) -> Any: ...
    def verify(self, tokens: list[int], state: object) -> Any: ...
    def rollback(self, state: object, length: int) -> None: ...


def check_draft(draft: str, temperature: float, proposer: DraftProposer | None = None) -> None:
    """``draft`` is ``argmax`` or ``sampled``; ``sampled`` needs ``temperature > 0`` and a drafter
    with ``propose_sampled``. ``ValueError`` otherwise."""
    if draft not in DRAFTS:
        raise ValueError(f"draft must be one of {DRAFTS}, got {draft!r}")
    if draft == "sampled":
        if not temperature > 0:
            raise ValueError("draft='sampled' draws from the drafter's softmax at the temperature: it needs "
                             f"temperature > 0, got {temperature!r}")
        if proposer is not None and not hasattr(proposer, "propose_sampled"):
            raise ValueError(f"draft='sampled' needs a drafter with propose_sampled; {type(proposer).__name__} "
                             "has none")


@dataclass(frozen=True)
class RoundRules:
    """What every round of one run follows. Checked on construction (``ValueError`` naming the
    argument); ``check_drafter`` checks what the rules ask of a drafter.

    Args:
        num_drafts: k >= 1 drafts per round.
        verify: the verification rule, one of ``verify.VERIFY_RULES`` (``greedy`` needs
            ``temperature == 0``; ``rejection`` and ``match`` ``temperature > 0``).
        policy: ``first_row_kept`` | ``refeed`` | ``trim_all`` (module docstring).
        temperature: the target's sampling temperature (0: greedy).
        gen: the generator of sampled verification and of sampled drafts' noise.
        draft: ``argmax`` or ``sampled`` (drafts drawn from the drafter's ``q`` at ``temperature``).
        stop: the stop rule (``loop/stop_rules.py``).
        record_rounds: read every round's confidences (for ``Round.record``) even without a stop rule.
        grammar_drafts: with a matcher, ``masked`` (the drafter drafts under it) or ``unmasked``.
        sampler: the seeded sampler's settings (``loop/sampler.py``; temperature equal to
            ``temperature``): ``match`` draws the target's samples with it (it needs one);
            ``rejection`` takes its top_p / top_k kept set as the target's support. None: no
            truncation (``match`` refused).
    """

    num_drafts: int
    verify: str
    gen: torch.Generator
    policy: Policy = "first_row_kept"
    temperature: float = 0.0
    draft: Draft = "argmax"
    stop: StopRule = NO_STOP
    record_rounds: bool = False
    grammar_drafts: GrammarDrafts = "masked"
    sampler: SamplerSettings | None = None

    def __post_init__(self) -> None:
        k = self.num_drafts
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_drafts must be an integer >= 1, got {k!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        check_draft(self.draft, self.temperature)
        if self.grammar_drafts not in ("masked", "unmasked"):
            raise ValueError(f"grammar_drafts must be masked or unmasked, got {self.grammar_drafts!r}")
        if self.verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {self.verify!r}")
        if self.verify == "greedy" and self.temperature != 0:
            raise ValueError(f"verify=greedy is the temperature-0 rule; got temperature={self.temperature!r}")
        if self.verify == "rejection" and not self.temperature > 0:
            raise ValueError(f"verify=rejection samples at the temperature: it needs temperature > 0, got "
                             f"{self.temperature!r}")
        if self.verify == "match" and not (self.temperature > 0 and self.sampler is not None):
            raise ValueError("verify=match compares drafts with the target's seeded samples: it needs temperature > 0 "
                             f"and the sampler's settings: temperature={self.temperature!r}, sampler={self.sampler}")
        if self.sampler is not None and self.sampler.temperature != self.temperature:
            raise ValueError(f"sampler.temperature must be the run's temperature {self.temperature!r}, got "
                             f"{self.sampler.temperature!r}")
        if self.truncates and self.verify == "greedy":
            raise ValueError("top_p / top_k truncate the sampled distribution: verify=greedy (temperature 0) has none")

    @property
    def truncates(self) -> bool:
        """Whether the sampler's top_p / top_k keep fewer tokens than the whole vocabulary (may)."""
        return truncates(self.sampler)

    def support(self, logits: Tensor) -> Tensor | None:
        """(T, V) bool, the tokens ``rejection`` may emit after each row of ``logits`` (T, V): the
        sampler's kept set (top_k then top_p, exactly the seeded sampler's); None without truncation."""
        return kept_tokens(logits, self.sampler) if self.truncates else None

    def check_drafter(self, proposer: DraftProposer) -> None:
        """What the rules need of ``proposer``: ``propose_sampled`` for sampled drafts,
        ``draft_confidence`` for a stop rule that trims or for recorded rounds."""
        check_draft(self.draft, self.temperature, proposer)
        if (self.stop.trims or self.record_rounds) and not hasattr(proposer, "draft_confidence"):
            raise ValueError(f"stop.rule={self.stop.rule} (or recording rounds) reads the drafts' confidences: "
                             f"{type(proposer).__name__} has no draft_confidence")


@dataclass
class Round:
    """What one round did.

    Args:
        drafts: the n drafts proposed (n <= k; fewer where a grammar stopped the propose).
        width: s, the drafts verified (the stop rule's prefix).
        accepted: a <= s, the drafts the verification accepted.
        bonus: the token the verification added after them; None where a grammar allowed nothing.
        kept: drafts the target and the drafter kept (``accepted``; 0 in teacher forcing).
        hidden: (s+1, H) the verification forward's hidden rows h_m..h_{m+s}.
        prob / margin: the drafts' confidences, when the round read them (else empty).
        forbidden: verified drafts the grammar forbade (0 without one, or with masked drafts).
        draft_s / verify_s: seconds in the drafter (the propose, when the round made it, the
            width and the rollback policy) and in the verification (masks, forward, rule, the
            target's rollback).
        owed: ``(d_n, h_{m+n-1}, row m+n-1)``, the row a fully kept ``first_row_kept`` round
            owes, when its catch-up was deferred (``play_round(defer_catchup=True)``); else None.
    """

    drafts: list[int]
    width: int
    accepted: int
    bonus: int | None
    kept: int
    hidden: Tensor
    prob: list[float] = field(default_factory=list)
    margin: list[float] = field(default_factory=list)
    forbidden: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    owed: tuple[int, Tensor, int] | None = None

    @property
    def committed(self) -> list[int]:
        """The tokens the loop commits: the accepted drafts and the bonus (if any)."""
        return [*self.drafts[: self.accepted], *([] if self.bonus is None else [self.bonus])]

    @property
    def next_hidden(self) -> Tensor:
        """(1, H) the target's hidden the next round's propose reads: h_{m+kept}."""
        return self.hidden[self.kept : self.kept + 1]

    @property
    def record(self) -> RoundRecord:
        """The round's confidences, width and accepted count (``SpecStats.rounds``)."""
        return RoundRecord(self.prob, self.margin, self.width, self.accepted)


def exponential_noise(num_drafts: int, vocab_size: int, gen: torch.Generator, dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> Tensor:
    """(num_drafts, vocab_size) i.i.d. Exponential(1) draws from ``gen`` in ``dtype`` (float64
    first, then rounded; a rounded 0 becomes the smallest normal), on ``device``: the noise of a
    sampled propose."""
    e = torch.empty(num_drafts, vocab_size, dtype=torch.float64).exponential_(generator=gen).to(dtype)
    return torch.clamp(e, min=torch.finfo(dtype).tiny).to(device)


def draft_tokens(proposer: DraftProposer, draft: str, last_token: int, hidden: Tensor, position: int, k: int,
                 state: object,
                 temperature: float, gen: torch.Generator, grammar: Any = None) -> tuple[list[int], Tensor | None]:
    """One propose: argmax drafts (``q`` None) or sampled drafts with their ``q`` (noise from ``gen``).
    ``grammar``: a matcher the drafts obey (DESIGN.md §10; fewer than k drafts when it stops them),
    or None (drafted freely; the propose is called without the argument)."""
    under = {} if grammar is None else {"grammar": grammar}
    if draft == "argmax":
        return proposer.propose(last_token, hidden, position, k, state, **under), None
    noise = exponential_noise(k, proposer.config.vocab_size, gen, acc_dtype(hidden.dtype), hidden.device)
    out = proposer.propose_sampled(last_token, hidden, position, k, temperature, noise, state,
                                   **under)
    return out.drafts, out.q


def truncate_drafter(proposer: DraftProposer, state: object, rows: int, last_token: int, hidden: Tensor) -> None:
    """The drafter keeps its rows ``< rows``, none pending: a zero-draft propose at ``rows`` (it
    only rewinds, DESIGN.md §4) closed by ``after_verify(0)``. ``last_token`` / ``hidden``: any
    valid pair (a zero-draft propose reads neither); no propose may be pending."""
    proposer.propose(last_token, hidden, rows, 0, state)
    proposer.after_verify(0, state)


def keep_rows(proposer: DraftProposer, state: object, policy: str, token: int, h_prev: Tensor, drafts: list[int],
              hidden: Tensor, m: int, kept: int, defer_catchup: bool = False) -> tuple[int, Tensor, int] | None:
    """The rollback policy (module docstring): what the drafter keeps of the rows its propose at
    ``m - 1`` wrote, ``kept`` of the ``drafts`` kept by the target.

    Args:
        token / h_prev: t_m and h_{m-1}, the propose's first pair.
        drafts: the n drafts proposed.
        hidden: (s+1, H) the verification's hidden rows h_m..h_{m+s}.
        defer_catchup: return ``first_row_kept``'s owed row ``(d_n, h_{m+n-1}, m+n-1)`` instead of
            writing it (the batch path writes every sequence's in one ``catchup_batch``).
    Returns the owed row when deferred, else None.
    """
    n = len(drafts)
    if policy == "first_row_kept":
        proposer.after_verify(kept, state)
        if n and kept == n:  # the drafter is one row behind: (d_n, h_{m+n-1}) at row m+n-1
            owed = (drafts[-1], hidden[n - 1 : n], m + n - 1)
            if defer_catchup:
                return owed
            proposer.catchup_drafter(drafts[-1:], owed[1], owed[2], owed[2], state)
    elif policy == "refeed":
        proposer.after_verify(0, state)
        if kept:
            proposer.catchup_drafter(drafts[:kept], hidden[:kept], m, m, state)
    else:  # trim_all
        proposer.after_verify(0, state)
        truncate_drafter(proposer, state, m - 1, token, h_prev)
        proposer.catchup_drafter([token, *drafts[:kept]], torch.cat((h_prev, hidden[:kept])), m - 1, m - 1, state)
    return None


def play_round(rules: RoundRules, target: TargetModel, proposer: DraftProposer, tstate: object, dstate: object,
               token: int, h_prev: Tensor, m: int, *, drafts: list[int] | None = None, matcher: Any = None,
               keep_accepted: bool = True, defer_catchup: bool = False, prompt_sha256: str | None = None) -> Round:
    """One round at ``m`` (module docstring): draft, width, verify, rollback, timing.

    Args:
        rules: the run's rules.
        target / tstate, proposer / dstate: the target and the drafter with their states.
        token / h_prev: t_m (the newest committed token) and h_{m-1} (1, H).
        drafts: argmax drafts already proposed for this round (the batch path's ``propose_batch``);
            None: the round proposes (``rules.draft``).
        matcher: a grammar's matcher at the output's current position (DESIGN.md §10), or None.
            The verification is masked per position with it; the drafter drafts under it when
            ``rules.grammar_drafts`` is ``masked``. The round does not advance it.
        keep_accepted: False for teacher forcing: the target and the drafter keep none of the
            accepted drafts (the text moves on).
        defer_catchup: ``first_row_kept``'s owed row is returned in ``Round.owed``, not written.
        prompt_sha256: the prompt's sha256 (``traces/prompt_id.py``), the key of ``match``'s seeded
            samples (row t of the verify at item position m + t); a target that answers its own
            samples (a sampled trace's replay) is not asked.
    """
    if defer_catchup and rules.policy != "first_row_kept":
        raise ValueError(f"a deferred catch-up is first_row_kept's one owed row; policy={rules.policy}")
    clock, k = time.perf_counter, rules.num_drafts
    t0 = clock()
    q = None
    if drafts is None:
        grammar = matcher if rules.grammar_drafts == "masked" else None
        drafts, q = draft_tokens(proposer, rules.draft, token, h_prev, m - 1, k, dstate, rules.temperature, rules.gen,
                                 grammar)
    n = len(drafts)  # k, or fewer where a grammar stopped the propose
    width, prob, margin = round_width(rules.stop, proposer, dstate, n, rules.record_rounds)
    verified = drafts[:width]  # a stop rule verifies the confident prefix only
    t1 = clock()  # the verify's masks count as the verify's time
    allowed, legal = (None, width) if matcher is None else verify_masks(matcher, verified, proposer.config.vocab_size)
    out = target.verify([token, *verified], tstate)  # positions m..m+width
    samples = None
    if rules.verify == "match":
        if matcher is not None:
            raise ValueError("verify=match runs without a grammar (its samples are the unconstrained target's)")
        if prompt_sha256 is None and getattr(out, "sample", None) is None:
            raise ValueError("verify=match keys the target's seeded samples by the prompt: prompt_sha256 is None")
        samples = target_samples(out, rules.sampler, prompt_sha256, m, width + 1)
    elif rules.verify == "rejection" and rules.truncates:
        if matcher is not None:
            raise ValueError("top_p / top_k with a grammar: the two supports are not combined; run one of them")
        allowed = rules.support(out.logits[: width + 1])  # (width+1, V): p over the sampler's kept set
    a, bonus = verify(rules.verify, out.logits, verified, rules.temperature, rules.gen,
                      None if q is None else q[:width], allowed, samples)
    kept = a if keep_accepted else 0
    target.rollback(tstate, m + kept + 1)
    t2 = clock()
    owed = keep_rows(proposer, dstate, rules.policy, token, h_prev, drafts, out.hidden, m, kept, defer_catchup)
    t3 = clock()
    return Round(drafts, width, a, bonus, kept, out.hidden, prob, margin, width - legal,
                 (t1 - t0) + (t3 - t2), t2 - t1, owed)
