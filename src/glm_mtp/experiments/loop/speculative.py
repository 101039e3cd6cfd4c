"""Speculative decoding with an MTP drafter: the loop of DESIGN.md §4 and its acceptance metrics.

With ``t_m`` the newest committed token (not yet fed to the target) and ``h_{m-1}`` the target's
hidden at the position before it, one step is

    drafts = propose(t_m, h_{m-1}, m - 1, k)             rows [m-1, m-1+k) of the drafter
    logits, h_m..h_{m+k} = target([t_m, d_1..d_k])        one verification forward
    a, b   = verify(logits, drafts)                       a drafts accepted, bonus token b
    commit d_1..d_a, b;  target keeps positions < m+a+1;  drafter per the policy;  m += a + 1

Each step is one round (``loop/round.py``, ``play_round``: draft, width, verify, rollback,
timing), written once for ``SpeculativeDecoder.generate``, ``generate_batch`` and
``teacher_forced``. The rollback policies (``first_row_kept``, the default; ``refeed``;
``trim_all``) are the round's ``keep_rows``; the verification rules (``greedy`` at
``temperature == 0``, ``rejection`` sampling or ``match``, seeded exact match, above it) are
``loop/verify.py``'s. The emitted
tokens are distributed exactly as sampling from the target alone, for either way of drafting
(``draft``):

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
holds; ``after_verify(a)`` gets ``a <= s`` and the policies run as without one (a catch-up only when
every one of the k drafts was accepted). The choice of s reads the drafter only, so both
verifications stay lossless.

Metrics: ``alpha_i`` = P(draft i accepted | drafts 1..i-1 accepted), per position;
``tau`` = tokens committed per verification forward (accepted drafts + the bonus), the mean
accepted length; and the time spent in the drafter and in the target's verification forwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from glm_mtp.reference.attention import KPoolRowsFn
from glm_mtp.reference.contract import DraftProposer
from glm_mtp.reference.weights import MtpWeights
from glm_mtp.registry import backend_class

from .grammar_verify import commit_tokens, masked_argmax, masked_target_probs, matcher_row, output_finished
from .round import (DRAFTS, POLICIES, Draft, GrammarDrafts, Policy, Round, RoundRules, TargetModel, play_round)
from ..traces.prompt_id import prompt_sha256
from .sampler import SamplerSettings, kept_tokens, seeded_sample, truncates
from .stop_rules import NO_STOP, RoundRecord, StopRule
from .verify import default_verify_rule, target_probs

__all__ = ["DRAFTS", "POLICIES", "SpecResult", "SpecStats", "SpeculativeDecoder", "TargetModel", "make_proposer",
           "pick", "speculative_results", "target_decode", "teacher_forced"]


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


def next_token(out: Any, temperature: float, gen: torch.Generator, sampler: SamplerSettings | None = None,
               seeded: bool = False, key: tuple[str | None, int] = (None, 0),
               allowed: Tensor | None = None) -> int | None:
    """The target's own token after the last row of a forward's ``out``.

    Args:
        temperature / gen / allowed: as ``pick``'s (``rejection`` and greedy).
        sampler: the seeded sampler's settings: ``seeded`` draws the seeded sample with them;
            otherwise their top_p / top_k kept set is the support ``pick`` draws from.
        seeded: the seeded sample (``verify=match``): the target's own (``out.sample``, a sampled
            trace's replay) where it answers one, else ``seeded_sample`` keyed by ``key``.
        key: (the prompt's sha256, the last row's item position).
    """
    if seeded:
        given = getattr(out, "sample", None)
        if given is not None:
            return int(given[-1])
        sha, position = key
        if sha is None or sampler is None:
            raise ValueError("a seeded sample needs the sampler's settings and the prompt's sha256")
        row = out.logits[-1:]  # (1, V)
        return int(seeded_sample(row, sampler, sha, torch.tensor([position], device=row.device))[0])
    if temperature > 0 and truncates(sampler):
        if allowed is not None:
            raise ValueError("top_p / top_k with a grammar: the two supports are not combined; run one of them")
        allowed = kept_tokens(out.logits[-1:], sampler)[0]
    return pick(out.logits[-1], temperature, gen, allowed)


def decode_rule(temperature: float, verify: str | None, top_p: float | None, top_k: int | None,
                seed: int) -> tuple[str, SamplerSettings | None]:
    """The verification rule and the sampler's settings of a run: ``greedy`` and no sampler at
    ``temperature == 0`` (top_p / top_k refused there), else ``verify`` (``rejection`` when None)
    with the seeded sampler at ``(temperature, top_p, top_k, seed)``."""
    if temperature == 0:
        if top_p is not None or top_k is not None:
            raise ValueError(f"top_p / top_k truncate the sampled distribution: they need temperature > 0 (got top_p="
                             f"{top_p!r}, top_k={top_k!r} at temperature 0)")
        return "greedy", None
    rule = default_verify_rule(temperature) if verify is None else verify
    if rule not in ("rejection", "match"):
        raise ValueError(f"verify must be rejection or match at temperature > 0, got {verify!r}")
    return rule, SamplerSettings(float(temperature), top_p, top_k, int(seed))


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

    def add_round(self, r: Round) -> None:
        """Count one ``round.Round``: its verification (``record``), its seconds, and its
        confidences, width and accepted count when the stats keep ``rounds``."""
        self.record(r.accepted, r.width, r.bonus is not None, r.forbidden)
        self.draft_s += r.draft_s
        self.verify_s += r.verify_s
        if self.rounds is not None:
            self.rounds.append(r.record)

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
        policy: ``first_row_kept`` | ``refeed`` | ``trim_all`` (``loop/round.py``).
        temperature: 0 for greedy verification, > 0 for rejection sampling at that temperature.
        seed: the sampling generator's seed (rejection sampling and the sampled drafts' noise).
        draft: ``argmax`` (default) or ``sampled`` (drafts drawn from the drafter's ``q`` at
            ``temperature``; needs ``temperature > 0`` and a drafter with ``propose_sampled``).
        grammar_drafts: with a matcher given to ``generate``, ``masked`` (default: the drafter
            drafts under it) or ``unmasked`` (drafts drawn freely); the verify is masked either way.
        stop: the stop rule (``loop/stop_rules.py``; default: verify every draft).
        record_rounds: keep every round's confidences, width and accepted count in the stats'
            ``rounds`` (reads the confidences even without a stop rule).
        verify: at ``temperature > 0``, ``rejection`` (default) or ``match`` (seeded exact match,
            DESIGN.md §14: the output is the target's seeded sampling of each prompt, the first
            token after the prompt included, whatever the drafter); ignored at temperature 0
            (greedy, where the seeded sampler is the argmax).
        top_p / top_k: the seeded sampler's truncation (None: off; ``temperature > 0`` only):
            ``match``'s samples are drawn with it, ``rejection`` samples from the truncated target.
    """

    def __init__(self, target: TargetModel, proposer: DraftProposer, num_drafts: int, policy: Policy = "first_row_kept",
                 temperature: float = 0.0, seed: int = 0, draft: Draft = "argmax",
                 grammar_drafts: GrammarDrafts = "masked", stop: StopRule = NO_STOP,
                 record_rounds: bool = False, verify: str | None = None, top_p: float | None = None,
                 top_k: int | None = None) -> None:
        self.target, self.proposer = target, proposer
        self.gen = torch.Generator().manual_seed(seed)
        rule, sampler = decode_rule(float(temperature), verify, top_p, top_k, seed)
        self.rules = RoundRules(num_drafts, rule, self.gen, policy, float(temperature),
                                draft, stop, record_rounds, grammar_drafts, sampler)
        self.rules.check_drafter(proposer)

    @property
    def seeded(self) -> bool:
        """Whether the target's tokens are its seeded samples (``verify=match``)."""
        return self.rules.verify == "match"

    def _new_stats(self) -> SpecStats:
        return SpecStats(self.rules.num_drafts, rounds=[] if self.rules.record_rounds else None)

    def _first_token(self, out: Any, matcher: Any, sha: str | None, n: int) -> int | None:
        """The prefill's token after the prompt of ``n`` tokens (sha256 ``sha``), under the
        matcher's mask when there is one (None: the grammar allows nothing); the seeded sample at
        position n - 1 under ``match``."""
        allowed = None if matcher is None else matcher_row(matcher, self.proposer.config.vocab_size)
        r = self.rules
        return next_token(out, r.temperature, self.gen, r.sampler, self.seeded, (sha, n - 1), allowed)

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
        if matcher is not None and (self.seeded or self.rules.truncates):
            raise ValueError("a grammar runs with verify=rejection without top_p / top_k (or greedy): the seeded "
                             "sampler's samples and kept set are the unconstrained target's")
        tg, prop = self.target, self.proposer
        sha = prompt_sha256(list(prompt)) if self.seeded else None
        stats = self._new_stats()
        clock = time.perf_counter

        t0 = clock()
        tstate = tg.alloc_state()
        out = tg.prefill(list(prompt), tstate)  # h_0..h_{n-1}
        first = self._first_token(out, matcher, sha, len(prompt))
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
            r = play_round(self.rules, tg, prop, tstate, dstate, tokens[m], h_prev, m, matcher=matcher,
                           prompt_sha256=sha)
            stats.add_round(r)
            if matcher is not None:
                commit_tokens(matcher, r.committed)
                finished = output_finished(matcher, r.bonus)
            tokens += r.committed
            h_prev, m = r.next_hidden, m + r.accepted + 1  # h_{m+a}; t_{m+a+1} is the bonus
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

        Greedy verification (``temperature == 0``) and ``verify=match``: each sequence's tokens
        and counters (every ``SpecStats`` field but the seconds) equal ``generate`` on its prompt
        alone, bit for bit (the drafter's batch invariance; match's samples are keyed by prompt and
        position, not drawn from a generator). Under ``rejection`` the loop's one generator is
        drawn from sequence by sequence within each round: the emitted tokens are still
        distributed as the target's, but they are not the draws ``generate`` makes prompt
        after prompt (with one prompt they are). Time in a batched drafter call is split
        evenly over the sequences in it.

        Only ``policy='first_row_kept'`` and ``draft='argmax'`` are batched; others raise
        ``ValueError`` (use ``generate``).
        """
        seqs = [_Seq(p, n, self._new_stats(), prompt_sha256(p) if self.seeded else None)
                for p, n in self._batch_inputs(prompts, max_new_tokens)]
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
        if self.rules.policy != "first_row_kept":
            raise ValueError(f"generate_batch runs policy='first_row_kept' only, got policy={self.rules.policy!r} "
                             "(refeed and trim_all are single-sequence: use generate)")
        if self.rules.draft != "argmax":
            raise ValueError(f"generate_batch runs draft='argmax' only, got draft={self.rules.draft!r} "
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
        first = self._first_token(out, None, s.sha, len(s.prompt))
        assert first is not None  # no grammar in the batch path
        s.tokens.append(first)
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
                                                  [s.m - 1 for s in part], self.rules.num_drafts,
                                                  [s.dstate for s in part])
            share = (clock() - t0) / len(part)
            for s in part:
                s.stats.draft_s += share
        return drafts

    def _verify_one(self, s: _Seq, d: list[int]) -> tuple[_Seq, int, Tensor, int] | None:
        """The rest of ``s``'s round (``round.play_round`` on the drafts ``d`` the batch proposed)
        and its commit. Returns the row a fully accepted sequence owes, ``(seq, d_k, h_{m+k-1},
        row m+k-1)``, for the round's catch-up (None otherwise)."""
        r = play_round(self.rules, self.target, self.proposer, s.tstate, s.dstate, s.tokens[s.m], s.h_prev, s.m,
                       drafts=d, defer_catchup=True, prompt_sha256=s.sha)
        s.stats.add_round(r)
        s.tokens += r.committed
        s.h_prev, s.m = r.next_hidden, s.m + r.accepted + 1  # h_{m+a}
        return None if r.owed is None else (s, *r.owed)

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
    sha: str | None = None  # the prompt's sha256 under verify=match (its samples' key), else None
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
                  gen: torch.Generator | None = None, matcher: Any = None, vocab_size: int | None = None,
                  seeded: SamplerSettings | None = None) -> list[int]:
    """The target alone, one token per forward: the reference speculative decoding must match.

    ``seeded``: the target's own seeded sampling with these settings (``loop/sampler.py``; what
    ``verify=match`` must equal token for token): each token the seeded sample of its row, keyed
    by the prompt's sha256 and the row's position (``temperature`` and ``gen`` unread).

    ``matcher`` (with ``vocab_size``, the bitmask's width): the target's constrained decode, each
    token picked over the matcher's mask and accepted into it (the matcher is left after the last
    one); it stops early where the grammar allows nothing more or the matcher terminates."""
    gen = gen or torch.Generator().manual_seed(0)
    if matcher is not None and vocab_size is None:
        raise ValueError("target_decode with a matcher needs vocab_size (the width of its bitmask)")
    if seeded is not None and matcher is not None:
        raise ValueError("target_decode: a seeded decode runs without a grammar")
    sha = prompt_sha256(list(prompt)) if seeded is not None else None
    state = target.alloc_state()
    out = target.prefill(list(prompt), state)
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        if tokens:
            out = target.verify(tokens[-1:], state)
        allowed = None if matcher is None else matcher_row(matcher, vocab_size)
        if seeded is not None:  # the row of the newest token, at position len(prompt) + len(tokens) - 1
            token = next_token(out, seeded.temperature, gen, seeded, True, (sha, len(prompt) + len(tokens) - 1))
        else:
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
                   record_rounds: bool = False, verify: str | None = None, top_p: float | None = None,
                   top_k: int | None = None, seed: int = 0) -> SpecStats:
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
        verify / top_p / top_k / seed: as ``SpeculativeDecoder``'s (``match``'s samples keyed by
            ``seed``, ``text[:prompt_len]``'s sha256 and the position; ``gen`` draws none of them).
    Returns the counters (``steps`` = positions scored).
    """
    if not 1 <= prompt_len < len(text):
        raise ValueError(f"prompt_len must be in [1, len(text)) = [1, {len(text)}), got {prompt_len}")
    gen = gen or torch.Generator().manual_seed(0)
    rule, sampler = decode_rule(float(temperature), verify, top_p, top_k, seed)
    rules = RoundRules(num_drafts, rule, gen, policy, float(temperature), draft, stop, record_rounds,
                       sampler=sampler)
    sha = prompt_sha256(list(text[:prompt_len])) if rule == "match" else None
    rules.check_drafter(proposer)
    stats, clock = SpecStats(num_drafts, rounds=[] if record_rounds else None), time.perf_counter
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
        # the target rewinds to m + 1 (row m holds t_m) and the drafter keeps its row m-1, (t_m, h_{m-1})
        r = play_round(rules, target, proposer, tstate, dstate, text[m], h_prev, m, keep_accepted=False,
                       prompt_sha256=sha)
        stats.add_round(r)
        h_prev = r.next_hidden  # h_m, the text's own
    proposer.free_state(dstate)
    return stats


def speculative_results(decoder: SpeculativeDecoder, prompts: list[list[int]], max_new_tokens: list[int],
                        batch_size: int, device: torch.device | str = "cpu",
                        grammars: Any = None) -> Iterator[tuple[list[int], SpecResult]]:
    """``(prompt, result)`` of the speculative loop per prompt, in order, made lazily: one
    ``generate`` per prompt when ``batch_size`` is 1, else one ``generate_batch`` per
    ``batch_size`` prompts (the last batch may be shorter); ``max_new_tokens`` per prompt;
    drafter states on ``device``. ``grammars``: each prompt's output constrained by its grammar,
    if it has one (batch_size 1; ``experiments.acceptance_job.run_grammars.RunGrammars``:
    ``matcher(i)``, None for none)."""
    for i in range(0, len(prompts), batch_size):
        chunk, wants = prompts[i : i + batch_size], max_new_tokens[i : i + batch_size]
        if batch_size == 1:
            matcher = None if grammars is None else grammars.matcher(i)
            yield chunk[0], decoder.generate(chunk[0], wants[0], device, matcher=matcher)
        else:
            yield from zip(chunk, decoder.generate_batch(chunk, wants, device))
