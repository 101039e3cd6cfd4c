"""Speculative decoding with an MTP drafter: the loop of DESIGN.md §4, its rollback policies and
its acceptance metrics.

With ``t_m`` the newest committed token (not yet fed to the target) and ``h_{m-1}`` the target's
hidden at the position before it, one step is

    drafts = propose(t_m, h_{m-1}, m - 1, k)             rows [m-1, m-1+k) of the drafter
    logits, h_m..h_{m+k} = target([t_m, d_1..d_k])        one verification forward
    a, b   = verify(logits, drafts)                       a drafts accepted, bonus token b
    commit d_1..d_a, b;  target keeps positions < m+a+1;  drafter per the policy;  m += a + 1

Rollback policies (what the drafter keeps of the rows its propose wrote):

- ``first_row_kept`` (the engine's drafter's, default): ``after_verify(a)`` keeps rows [m-1, m-1+min(k, a+1));
  kept rows past the first hold the drafter's own ``x`` instead of the target's hidden; when all
  k were accepted the drafter is one row behind and catches up ``(d_k, h_{m+k-1})``.
- ``refeed``: ``after_verify(0)`` keeps only the first row, then a catch-up re-writes rows
  [m, m+a) from the accepted drafts and the target's own hiddens ``h_m..h_{m+a-1}``.
- ``trim_all``: every row of the propose goes, the first too (a zero-draft propose rewinds to
  m-1), and one catch-up rebuilds [m-1, m+a) from the target's hiddens: ``refeed`` with the first
  row recomputed in a batch, so equal to it up to rounding.

Verification:

- greedy (``temperature == 0``): accept while the draft equals the target's argmax; the bonus is
  the target's argmax after the last accepted draft. The output is the target's greedy decode.
- stochastic (``temperature > 0``), speculative sampling by rejection (Leviathan et al. 2023;
  Chen et al. 2023): with target probabilities ``p = softmax(logits / T)`` and draft distribution
  ``q``, draft ``d`` is accepted with probability ``min(1, p(d) / q(d))``; on rejection the token is
  drawn from ``normalise(max(0, p - q))``; after k acceptances the bonus is drawn from ``p``. The
  emitted tokens are distributed exactly as sampling from the target alone, for either way of
  drafting (``draft``):

  - ``argmax`` (default, as production engines do): the drafter drafts its argmax, so
    ``q`` is one-hot at the draft: accept with probability ``p(d)``, and on rejection draw from
    ``p`` with ``d`` removed;
  - ``sampled``: the drafter draws each draft from its own ``q = softmax(logits / T)`` (the
    pinned softmax, ``propose_sampled``) with Exponential(1) noise the loop draws from its
    generator and passes in, and returns ``q``; acceptance is ``min(1, p(d) / q(d))`` in full.
    Greedy verification (T = 0) has no ``q``: ``sampled`` needs T > 0.

Grammars (DESIGN.md §10): ``generate(..., matcher=M)`` constrains the output with a grammar's
matcher. Each verify is masked per position, position j with the matcher after ``d_1..d_j``
(``grammar_verify``), so the output is the target's constrained decode; the matcher advances
on committed tokens only; the drafter drafts under the matcher (``grammar_drafts='masked'``,
fewer than k drafts where the grammar stops them) or freely (``'unmasked'``, the ablation: a
forbidden draft and those after it waste their verify slots and count as ``forbidden``).

Stop rules (``stop``, ``loop/stop_rules.py``): after the propose the loop reads the drafts'
confidences and verifies only ``[t_m, d_1..d_s]``, ``s`` the longest prefix on which the rule
holds; ``after_verify(a)`` gets ``a <= s`` and the policies run as above (a catch-up only when
every one of the k drafts was accepted). The choice of s reads the drafter only, so both
verifications stay lossless.

Metrics: ``alpha_i`` = P(draft i accepted | drafts 1..i-1 accepted), per position;
``tau`` = tokens committed per verification forward (accepted drafts + the bonus), the mean
accepted length; and the time spent in the drafter and in the target's verification forwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Sequence

import torch
from torch import Tensor

from glm_mtp.reference.attention import KPoolRowsFn
from glm_mtp.reference.numerics import acc_dtype
from glm_mtp.reference.contract import DraftProposer
from glm_mtp.reference.weights import MtpWeights
from glm_mtp.registry import backend_class

from .grammar_verify import (commit_tokens, masked_argmax, masked_greedy_verify, masked_target_probs,
                             matcher_row, output_finished, verify_masks)
from .stop_rules import NO_STOP, RoundRecord, StopRule, round_width

Policy = Literal["first_row_kept", "refeed", "trim_all"]
POLICIES = ("first_row_kept", "refeed", "trim_all")
Draft = Literal["argmax", "sampled"]
DRAFTS = ("argmax", "sampled")
GrammarDrafts = Literal["masked", "unmasked"]


class TargetModel(Protocol):
    """What the loop and teacher forcing need of a target. The package's toy target
    (``experiments.targets.target.Target``) and transformers' model of a released checkpoint
    (``experiments.targets.hf_target.HfTarget``) are two.

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


def make_proposer(backend: str, weights: MtpWeights, max_seq_len: int, feed_hidden: str = "post_norm",
                  kpool: KPoolRowsFn | None = None) -> DraftProposer:
    """A drafter of the named backend (a key of ``glm_mtp.registry.BACKENDS``), imported only when
    asked for. ``kpool``: another KPool selection (glm5_next; ``experiments.loop.recall``), which only
    the reference drafter takes (the optimized one fuses its own)."""
    if kpool is None:
        return backend_class(backend)(weights, max_seq_len=max_seq_len, feed_hidden=feed_hidden)
    if backend != "reference":
        raise ValueError("attention=dense and the recall probe swap the reference drafter's KPool selection; "
                         f"backend={backend} fuses its own (use backend=reference)")
    return backend_class(backend)(weights, max_seq_len=max_seq_len, feed_hidden=feed_hidden, kpool=kpool)


# ------------------------------------------------------------------------------------------------
# Verification


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


def pick(logits: Tensor, temperature: float, gen: torch.Generator, allowed: Tensor | None = None) -> int | None:
    """The target's own next token: argmax, or a sample at ``temperature``; over the ``allowed``
    (V,) bool tokens only when given (None when it allows nothing)."""
    if allowed is not None:
        if temperature == 0:
            return masked_argmax(logits, allowed)
        if not bool(allowed.any()):
            return None
        return int(torch.multinomial(masked_target_probs(logits[None], temperature, allowed[None])[0], 1,
                                     generator=gen))
    if temperature == 0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(target_probs(logits, temperature), 1, generator=gen))


# ------------------------------------------------------------------------------------------------


@dataclass
class SpecStats:
    """Counters of one or more generations (``merge`` adds them up).

    Args:
        num_drafts: k.
        reached: per draft position, how often it was verified with every draft before it accepted.
        accepted: per draft position, how often it was accepted.
        steps: verification forwards; committed: tokens they committed (accepted + bonus).
        wasted: verify slots wasted, the drafts verified but not accepted.
        forbidden: drafts a grammar forbade (DESIGN.md §10): per propose, the first draft the
            matcher does not allow and every draft after it (0 when the drafts are masked).
        draft_s / verify_s / prefill_s: seconds in the drafter, in verification forwards and in
            the prompt's target forward.
        widths: per verify width s = 0..k, the rounds that verified s drafts (a stop rule's
            histogram; every round verifies k without one).
        rounds: each round's confidences, width and accepted count, when the loop records them
            (None otherwise).
    """

    num_drafts: int
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    steps: int = 0
    committed: int = 0
    wasted: int = 0
    forbidden: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    widths: list[int] = field(default_factory=list)
    rounds: list[RoundRecord] | None = None

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.num_drafts
        self.accepted = self.accepted or [0] * self.num_drafts
        self.widths = self.widths or [0] * (self.num_drafts + 1)

    def record(self, a: int, width: int | None = None, bonus: bool = True, forbidden: int = 0) -> None:
        """One verification of ``width`` drafts (None: all k; fewer where a stop rule trimmed the
        round or a grammar stopped the propose) that accepted ``a`` of them, committing a bonus
        token unless ``bonus`` is false (the grammar allowed nothing there), ``forbidden`` of the
        verified drafts forbidden by the grammar. A draft past the width is not reached."""
        s = self.num_drafts if width is None else width
        if not 0 <= a <= s <= self.num_drafts:
            raise ValueError(f"a round must accept a <= width <= k = {self.num_drafts} drafts; got a={a}, width={s}")
        for i in range(min(a + 1, s)):
            self.reached[i] += 1
        for i in range(a):
            self.accepted[i] += 1
        self.widths[s] += 1
        self.steps += 1
        self.committed += a + int(bonus)
        self.wasted += s - a
        self.forbidden += forbidden

    def merge(self, other: SpecStats) -> None:
        self.reached = [x + y for x, y in zip(self.reached, other.reached)]
        self.accepted = [x + y for x, y in zip(self.accepted, other.accepted)]
        self.widths = [x + y for x, y in zip(self.widths, other.widths)]
        if self.rounds is not None and other.rounds is not None:
            self.rounds = self.rounds + other.rounds
        for name in ("steps", "committed", "wasted", "forbidden", "draft_s", "verify_s", "prefill_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def alpha(self) -> list[float]:
        """Per position: accepted / reached (NaN where never reached)."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted, self.reached)]

    @property
    def alpha_cumulative(self) -> list[float]:
        """Per position: share of steps whose first i drafts were all accepted."""
        return [a / self.steps if self.steps else float("nan") for a in self.accepted]

    @property
    def tau(self) -> float:
        """Tokens committed per verification forward (the mean accepted length, bonus included)."""
        return self.committed / self.steps if self.steps else float("nan")

    @property
    def mean_width(self) -> float:
        """Drafts verified per round (k without a stop rule)."""
        return sum(s * n for s, n in enumerate(self.widths)) / self.steps if self.steps else float("nan")

    @property
    def draft_share(self) -> float:
        """Share of the loop's time spent in the drafter (the rest verifies)."""
        total = self.draft_s + self.verify_s
        return self.draft_s / total if total else float("nan")


@dataclass
class SpecResult:
    """``tokens``: the generated tokens (prompt excluded, cut to ``max_new_tokens``)."""

    tokens: list[int]
    stats: SpecStats
    committed: list[int] = field(default_factory=list)  # prompt + every committed token (uncut)
    drafter_state: object | None = None  # the drafter's state, when generate(free_state=False)


class SpeculativeDecoder:
    """Drives a target and a ``DraftProposer`` through the loop of DESIGN.md §4.

    Args:
        target: the target model (``Target``); its hiddens must be the drafter's dtype and device.
        proposer: any ``DraftProposer`` backend.
        num_drafts: k >= 1 drafts per step.
        policy: ``first_row_kept`` | ``refeed`` | ``trim_all`` (module docstring).
        temperature: 0 for greedy verification, > 0 for rejection sampling at that temperature.
        seed: the sampling generator's seed (rejection sampling and the sampled drafts' noise).
        draft: ``argmax`` (default) or ``sampled`` (drafts drawn from the drafter's ``q`` at
            ``temperature``; needs ``temperature > 0`` and a drafter with ``propose_sampled``).
        grammar_drafts: with a matcher given to ``generate``, ``masked`` (default: the drafter
            drafts under it) or ``unmasked`` (drafts drawn freely); the verify is masked either way.
        stop: the stop rule (``loop/stop_rules.py``; default: verify every draft).
        record_rounds: keep every round's confidences, width and accepted count in the stats'
            ``rounds`` (reads the confidences even without a stop rule).
    """

    def __init__(self, target: TargetModel, proposer: DraftProposer, num_drafts: int, policy: Policy = "first_row_kept",
                 temperature: float = 0.0, seed: int = 0, draft: Draft = "argmax",
                 grammar_drafts: GrammarDrafts = "masked", stop: StopRule = NO_STOP,
                 record_rounds: bool = False) -> None:
        if isinstance(num_drafts, bool) or not isinstance(num_drafts, int) or num_drafts < 1:
            raise ValueError(f"num_drafts must be an integer >= 1, got {num_drafts!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        check_draft(draft, temperature, proposer)
        if grammar_drafts not in ("masked", "unmasked"):
            raise ValueError(f"grammar_drafts must be masked or unmasked, got {grammar_drafts!r}")
        self.target, self.proposer = target, proposer
        self.k, self.policy, self.temperature, self.draft = num_drafts, policy, float(temperature), draft
        self.grammar_drafts = grammar_drafts
        self.gen = torch.Generator().manual_seed(seed)
        self.stop, self.record_rounds = stop, record_rounds
        if (stop.trims or record_rounds) and not hasattr(proposer, "draft_confidence"):
            raise ValueError(f"stop.rule={stop.rule} (or recording rounds) reads the drafts' confidences: "
                             f"{type(proposer).__name__} has no draft_confidence")

    def _new_stats(self) -> SpecStats:
        return SpecStats(self.k, rounds=[] if self.record_rounds else None)

    def _record(self, stats: SpecStats, a: int, width: int, prob: list[float], margin: list[float],
                bonus: bool = True, forbidden: int = 0) -> None:
        stats.record(a, width, bonus, forbidden)
        if stats.rounds is not None:
            stats.rounds.append(RoundRecord(prob, margin, width, a))

    def _verify(self, logits: Tensor, drafts: list[int], q: Tensor | None = None,
                allowed: Tensor | None = None) -> tuple[int, int | None]:
        """(drafts accepted, bonus): greedy or by rejection; under a grammar's ``allowed`` masks
        when given (the bonus None where the grammar allows nothing)."""
        if self.temperature == 0:
            return greedy_verify(logits, drafts) if allowed is None else masked_greedy_verify(logits, drafts, allowed)
        if allowed is None:
            return stochastic_verify(logits, drafts, self.temperature, self.gen, q)
        return stochastic_verify(logits, drafts, self.temperature, self.gen, q, allowed)

    def _drafter_grammar(self, matcher: Any) -> Any:
        """The matcher the drafter drafts under: the run's with masked drafts, else None."""
        return matcher if self.grammar_drafts == "masked" else None

    def _first_token(self, logits: Tensor, matcher: Any) -> int | None:
        """The prefill's token after the prompt, under the matcher's mask when there is one (None:
        the grammar allows nothing)."""
        allowed = None if matcher is None else matcher_row(matcher, self.proposer.config.vocab_size)
        return pick(logits, self.temperature, self.gen, allowed)

    def generate(self, prompt: list[int], max_new_tokens: int, device: torch.device | str = "cpu",
                 free_state: bool = True, matcher: Any = None) -> SpecResult:
        """Generate at least ``max_new_tokens`` tokens after ``prompt`` (>= 1 token); returns the
        first ``max_new_tokens`` and the step statistics (and the drafter's state, not freed, when
        ``free_state`` is false).

        ``matcher``: a grammar's matcher at the start of the output (DESIGN.md §10), or None. The
        target's verify is masked per position with it (``grammar_verify``), the drafter drafts
        under it when ``grammar_drafts='masked'``, and it advances on the committed tokens only
        (it is left after the last one). The output is the target's constrained decode; it ends
        early, with fewer tokens, where the grammar allows nothing more."""
        if len(prompt) < 1:
            raise ValueError("prompt must hold at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        tg, prop, k = self.target, self.proposer, self.k
        stats = self._new_stats()
        clock = time.perf_counter

        t0 = clock()
        tstate = tg.alloc_state()
        out = tg.prefill(list(prompt), tstate)  # h_0..h_{n-1}
        first = self._first_token(out.logits[-1], matcher)
        tokens, finished = list(prompt) + ([] if first is None else [first]), first is None
        if matcher is not None and first is not None:
            commit_tokens(matcher, [first])
            finished = output_finished(matcher, first)
        stats.prefill_s += clock() - t0
        t0 = clock()
        dstate = prop.alloc_state(device)
        prop.prefill_drafter(prompt, out.hidden, dstate)  # rows [0, n-1)
        stats.draft_s += clock() - t0
        m, h_prev = len(prompt), out.hidden[-1:]  # t_m newest, h_{m-1}

        while not finished and len(tokens) - len(prompt) < max_new_tokens:
            t0 = clock()
            drafts, q = draft_tokens(prop, self.draft, tokens[m], h_prev, m - 1, k, dstate, self.temperature, self.gen,
                                     self._drafter_grammar(matcher))
            n = len(drafts)  # k, or fewer where a grammar stopped the propose
            width, prob, margin = round_width(self.stop, prop, dstate, n, self.record_rounds)
            verified = drafts[:width]  # a stop rule verifies the confident prefix only
            t1 = clock()  # the verify's masks count as the verify's time
            allowed, legal = (None, width) if matcher is None else verify_masks(matcher, verified,
                                                                                prop.config.vocab_size)
            out = tg.verify([tokens[m], *verified], tstate)  # positions m..m+width
            a, bonus = self._verify(out.logits, verified, None if q is None else q[:width], allowed)
            tg.rollback(tstate, m + a + 1)
            t2 = clock()
            if self.policy == "first_row_kept":
                prop.after_verify(a, dstate)
                if n and a == n:  # the drafter is one row behind: (d_n, h_{m+n-1}) at row m+n-1
                    prop.catchup_drafter(drafts[-1:], out.hidden[n - 1 : n], m + n - 1, m + n - 1, dstate)
            elif self.policy == "refeed":
                prop.after_verify(0, dstate)
                if a:
                    prop.catchup_drafter(drafts[:a], out.hidden[:a], m, m, dstate)
            else:  # trim_all
                prop.after_verify(0, dstate)
                prop.propose(tokens[m], h_prev, m - 1, 0, dstate)  # only rewinds, to m-1
                prop.after_verify(0, dstate)
                prop.catchup_drafter([tokens[m], *drafts[:a]], torch.cat((h_prev, out.hidden[:a])), m - 1, m - 1,
                                     dstate)
            t3 = clock()
            stats.draft_s += (t1 - t0) + (t3 - t2)
            stats.verify_s += t2 - t1
            self._record(stats, a, width, prob, margin, bonus is not None, width - legal)
            committed = [*drafts[:a], *([] if bonus is None else [bonus])]
            if matcher is not None:
                commit_tokens(matcher, committed)
                finished = output_finished(matcher, bonus)
            tokens += committed
            h_prev = out.hidden[a : a + 1]  # h_{m+a}
            m += a + 1
        if free_state:
            prop.free_state(dstate)
        return SpecResult(tokens[len(prompt) : len(prompt) + max_new_tokens], stats, tokens,
                          None if free_state else dstate)

    def generate_batch(self, prompts: Sequence[list[int]], max_new_tokens: int | Sequence[int],
                       device: torch.device | str = "cpu") -> list[SpecResult]:
        """``generate`` for many prompts at once: one ``SpecResult`` per prompt, in order.

        The target runs per sequence (its API is per state); the drafter runs once per round for
        every live sequence: ONE ``propose_batch`` drafts for all of them and ONE
        ``catchup_batch`` writes the row each fully accepted sequence owes (``after_verify`` stays
        per state). A sequence leaves the batch as soon as it has its ``max_new_tokens``
        (an int for all, or one per prompt): its drafter state is freed before the next round.
        Prompts may differ in length. A drafter with a ``max_batch`` (the optimized one's) gets
        the live sequences in calls of at most that many states (still one call per round when
        they fit).

        Greedy verification (``temperature == 0``): each sequence's tokens and counters (every
        ``SpecStats`` field but the seconds) equal ``generate`` on its prompt alone, bit for bit
        (the drafter's batch invariance). At ``temperature > 0`` the loop's one generator is
        drawn from sequence by sequence within each round: the emitted tokens are still
        distributed as the target's, but they are not the draws ``generate`` makes prompt
        after prompt (with one prompt they are). Time in a batched drafter call is split
        evenly over the sequences in it.

        Only ``policy='first_row_kept'`` and ``draft='argmax'`` are batched; others raise
        ``ValueError`` (use ``generate``).
        """
        seqs = [_Seq(p, n, self._new_stats()) for p, n in self._batch_inputs(prompts, max_new_tokens)]
        cap = getattr(self.proposer, "max_batch", None) or len(seqs)  # the most states one batched call takes
        try:
            for s in seqs:  # prompt by prompt (the order generate draws from the generator in)
                self._prefill_one(s, device)
            self._leave(seqs)
            while live := [s for s in seqs if not s.done]:
                drafts = self._propose_round(live, cap)
                owed = [o for s, d in zip(live, drafts) if (o := self._verify_one(s, d)) is not None]
                self._catch_up_round(owed, cap)
                for s in live:
                    s.done = s.generated >= s.want
                self._leave(live)
        finally:  # an error midway frees every state still held
            for s in seqs:
                if s.dstate is not None:
                    self.proposer.free_state(s.dstate)
                    s.dstate = None
        return [SpecResult(s.tokens[len(s.prompt) : len(s.prompt) + s.want], s.stats, s.tokens) for s in seqs]

    # The steps of generate_batch, in the order a round runs them.

    def _batch_inputs(self, prompts: Sequence[list[int]],
                      max_new_tokens: int | Sequence[int]) -> list[tuple[list[int], int]]:
        """(prompt, tokens wanted) per prompt, checked: a batched policy and draft, at least one
        prompt of at least one token, a count >= 1 for each."""
        if self.policy != "first_row_kept":
            raise ValueError(f"generate_batch runs policy='first_row_kept' only, got policy={self.policy!r} "
                             "(refeed and trim_all are single-sequence: use generate)")
        if self.draft != "argmax":
            raise ValueError(f"generate_batch runs draft='argmax' only, got draft={self.draft!r} "
                             "(sampled drafts are single-sequence: use generate)")
        prompts = [list(p) for p in prompts]
        B = len(prompts)
        if B < 1:
            raise ValueError("generate_batch needs at least one prompt")
        wants = [max_new_tokens] * B if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(wants) != B:
            raise ValueError(f"max_new_tokens has {len(wants)} entries for {B} prompts")
        for b, (p, n) in enumerate(zip(prompts, wants)):
            if len(p) < 1:
                raise ValueError(f"prompts[{b}] must hold at least one token")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"max_new_tokens must be >= 1, got {n!r} for prompts[{b}]")
        return list(zip(prompts, wants))

    def _prefill_one(self, s: _Seq, device: torch.device | str) -> None:
        """The target's prefill of the prompt (h_0..h_{n-1}, the first token) and the drafter's
        rows [0, n-1)."""
        clock = time.perf_counter
        t0 = clock()
        s.tstate = self.target.alloc_state()
        out = self.target.prefill(s.tokens, s.tstate)
        s.tokens.append(pick(out.logits[-1], self.temperature, self.gen))
        s.stats.prefill_s += clock() - t0
        t0 = clock()
        s.dstate = self.proposer.alloc_state(device)
        self.proposer.prefill_drafter(s.prompt, out.hidden, s.dstate)
        s.stats.draft_s += clock() - t0
        s.m, s.h_prev = len(s.prompt), out.hidden[-1:]  # t_m newest, h_{m-1}
        s.done = s.generated >= s.want

    def _propose_round(self, live: list[_Seq], cap: int) -> list[list[int]]:
        """One ``propose_batch`` per ``cap`` live sequences: k drafts each, in order."""
        clock, drafts = time.perf_counter, []
        for i in range(0, len(live), cap):
            part = live[i : i + cap]
            t0 = clock()
            drafts += self.proposer.propose_batch([s.tokens[s.m] for s in part], torch.cat([s.h_prev for s in part]),
                                                  [s.m - 1 for s in part], self.k, [s.dstate for s in part])
            share = (clock() - t0) / len(part)
            for s in part:
                s.stats.draft_s += share
        return drafts

    def _verify_one(self, s: _Seq, d: list[int]) -> tuple[_Seq, int, Tensor, int] | None:
        """The target verifies ``[t_m, d_1..d_s]`` (s: the stop rule's width, k without one),
        rolls back past the accepted drafts and the drafter keeps its rows; commits. Returns the
        row a fully accepted sequence owes, ``(seq, d_k, h_{m+k-1}, row m+k-1)``, for the round's
        catch-up (None otherwise)."""
        clock, k = time.perf_counter, self.k
        width, prob, margin = round_width(self.stop, self.proposer, s.dstate, len(d), self.record_rounds)
        t1 = clock()
        out = self.target.verify([s.tokens[s.m], *d[:width]], s.tstate)  # positions m..m+width
        a, bonus = self._verify(out.logits, d[:width])
        self.target.rollback(s.tstate, s.m + a + 1)
        t2 = clock()
        self.proposer.after_verify(a, s.dstate)
        s.stats.verify_s += t2 - t1
        s.stats.draft_s += clock() - t2
        owed = (s, d[-1], out.hidden[k - 1 : k], s.m + k - 1) if a == k else None
        self._record(s.stats, a, width, prob, margin)
        s.tokens += [*d[:a], bonus]
        s.h_prev = out.hidden[a : a + 1]  # h_{m+a}
        s.m += a + 1
        return owed

    def _catch_up_round(self, owed: list[tuple[_Seq, int, Tensor, int]], cap: int) -> None:
        """One ``catchup_batch`` per ``cap`` owed rows; each must write exactly its one row."""
        clock = time.perf_counter
        for i in range(0, len(owed), cap):
            part = owed[i : i + cap]
            t0 = clock()
            written = self.proposer.catchup_batch([o[1] for o in part], torch.cat([o[2] for o in part]),
                                                  [o[3] for o in part],
                                                  [o[0].dstate for o in part])
            share = (clock() - t0) / len(part)
            for (s, _, _, row), w in zip(part, written):
                s.stats.draft_s += share
                if w != 1:
                    raise RuntimeError(f"catchup_batch wrote {w} rows for a fully accepted sequence at row {row}; "
                                       "the drafter is not where the loop left it")

    def _leave(self, seqs: list[_Seq]) -> None:
        """Finished sequences leave the batch: their drafter state is freed, their target state dropped."""
        for s in seqs:
            if s.done and s.dstate is not None:
                self.proposer.free_state(s.dstate)
                s.dstate, s.tstate = None, None


@dataclass(eq=False)
class _Seq:
    """One sequence of ``generate_batch``: ``tokens`` = prompt + committed, ``m`` the index of the
    newest committed token t_m (not yet fed to the target), ``h_prev`` = h_{m-1}."""

    prompt: list[int]
    want: int
    stats: SpecStats
    tokens: list[int] = field(init=False)
    m: int = 0
    h_prev: Tensor | None = None
    tstate: object | None = None
    dstate: object | None = None
    done: bool = False

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


def target_decode(target: TargetModel, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
                  gen: torch.Generator | None = None, matcher: Any = None, vocab_size: int | None = None) -> list[int]:
    """The target alone, one token per forward: the reference speculative decoding must match.

    ``matcher`` (with ``vocab_size``, the bitmask's width): the target's constrained decode, each
    token picked over the matcher's mask and accepted into it (the matcher is left after the last
    one); it stops early where the grammar allows nothing more or the matcher terminates."""
    gen = gen or torch.Generator().manual_seed(0)
    if matcher is not None and vocab_size is None:
        raise ValueError("target_decode with a matcher needs vocab_size (the width of its bitmask)")
    state = target.alloc_state()
    out = target.prefill(list(prompt), state)
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        if tokens:
            out = target.verify(tokens[-1:], state)
        allowed = None if matcher is None else matcher_row(matcher, vocab_size)
        token = pick(out.logits[-1], temperature, gen, allowed)
        if token is None:
            break
        tokens.append(token)
        if matcher is not None:
            commit_tokens(matcher, [token])
            if matcher.is_terminated():
                break
    return tokens


def teacher_forced(target: TargetModel, proposer: DraftProposer, text: list[int], prompt_len: int, num_drafts: int,
                   policy: Policy = "first_row_kept", temperature: float = 0.0, gen: torch.Generator | None = None,
                   device: torch.device | str = "cpu", draft: Draft = "argmax", stop: StopRule = NO_STOP,
                   record_rounds: bool = False) -> SpecStats:
    """Acceptance on natural text: at every position ``m`` in ``[prompt_len, len(text))`` the
    drafter proposes k drafts after the text ``t_0..t_m`` (its first row reads the target's
    hidden ``h_{m-1}``, later rows its own post-norm ``x``, as in the loop), and one verification
    forward of ``[t_m, d_1..d_k]`` after that text scores them exactly as a speculative step would
    (greedy, or rejection sampling at ``temperature``). Then the text, not the drafts, moves on:
    the target rewinds to ``m + 1`` (row m holds ``t_m``, written by that forward) and the drafter
    keeps only its first row ``(t_m, h_{m-1})``. The greedy loop scores contexts of its own making
    (a small target's greedy output loops, and loops are easy to draft); this scores the contexts
    the corpus offers.

    Rollback policies differ only in how rows of accepted drafts are kept; teacher forcing keeps
    none of them, so ``first_row_kept`` and ``refeed`` make the same calls, and ``trim_all``
    rewrites row m-1 in a catch-up (equal up to rounding).

    Args:
        text: token ids, at least ``prompt_len + 1``; ``len(text) - prompt_len`` positions are scored.
        prompt_len: tokens of context before the first scored position (>= 1).
        gen: the generator of rejection sampling (``temperature > 0``) and of sampled drafts'
            noise; device: the drafter state's.
        draft: ``argmax`` or ``sampled`` (as ``SpeculativeDecoder``'s).
        stop / record_rounds: the stop rule (each position verifies its rule's prefix of the
            drafts) and whether to record each round (as ``SpeculativeDecoder``'s).
    Returns the counters (``steps`` = positions scored).
    """
    if not 1 <= prompt_len < len(text):
        raise ValueError(f"prompt_len must be in [1, len(text)) = [1, {len(text)}), got {prompt_len}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    check_draft(draft, temperature, proposer)
    gen = gen or torch.Generator().manual_seed(0)
    stats, clock, k = SpecStats(num_drafts, rounds=[] if record_rounds else None), time.perf_counter, num_drafts
    t0 = clock()
    tstate = target.alloc_state()
    out = target.prefill(list(text[:prompt_len]), tstate)  # h_0..h_{n-1}
    stats.prefill_s += clock() - t0
    t0 = clock()
    dstate = proposer.alloc_state(device)
    proposer.prefill_drafter(text[:prompt_len], out.hidden, dstate)  # rows [0, n-1)
    stats.draft_s += clock() - t0
    h_prev = out.hidden[-1:]  # h_{m-1}
    for m in range(prompt_len, len(text)):
        t0 = clock()
        drafts, q = draft_tokens(proposer, draft, text[m], h_prev, m - 1, k, dstate, temperature, gen)
        width, prob, margin = round_width(stop, proposer, dstate, len(drafts), record_rounds)
        drafts, q = drafts[:width], None if q is None else q[:width]
        t1 = clock()
        out = target.verify([text[m], *drafts], tstate)  # positions m..m+width
        if temperature == 0:
            a, _ = greedy_verify(out.logits, drafts)
        else:
            a, _ = stochastic_verify(out.logits, drafts, temperature, gen, q)
        target.rollback(tstate, m + 1)
        t2 = clock()
        proposer.after_verify(0, dstate)  # keeps row m-1: (t_m, h_{m-1})
        if policy == "trim_all":
            proposer.propose(text[m], h_prev, m - 1, 0, dstate)  # only rewinds, to m-1
            proposer.after_verify(0, dstate)
            proposer.catchup_drafter([text[m]], h_prev, m - 1, m - 1, dstate)
        stats.draft_s += (t1 - t0) + (clock() - t2)
        stats.verify_s += t2 - t1
        stats.record(a, width)
        if stats.rounds is not None:
            stats.rounds.append(RoundRecord(prob, margin, width, a))
        h_prev = out.hidden[:1]  # h_m, the text's own
    proposer.free_state(dstate)
    return stats
