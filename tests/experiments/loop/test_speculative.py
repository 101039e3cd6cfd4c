import math
import random

import pytest
import torch

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.experiments.loop import verify
from glm_mtp.experiments.loop.speculative import POLICIES, SpecStats, SpeculativeDecoder, make_proposer, target_decode
from glm_mtp.experiments.loop.verify import stochastic_verify, target_probs
from glm_mtp.experiments.loop.sampler import SamplerSettings


class OracleProposer(ReferenceProposer):
    """The reference drafter's state machine with drafts taken from a known greedy continuation
    (each wrong with probability ``p_wrong``): exercises every accept count, a == k included."""

    def __init__(self, weights, max_seq_len, sequence, p_wrong, seed, **kw):
        super().__init__(weights, max_seq_len, **kw)
        self.sequence, self.p_wrong, self.rng = sequence, p_wrong, random.Random(seed)

    def propose(self, last_token, target_hidden, position, num_drafts, state):
        super().propose(last_token, target_hidden, position, num_drafts, state)
        out = []
        for i in range(num_drafts):
            tok = self.sequence[position + 2 + i]  # draft i+1 guesses t_{m+1+i}, m = position + 1
            out.append((tok + 1) % self.config.vocab_size if self.rng.random() < self.p_wrong else tok)
        return out


def oracle(tiny64, target64, prompt, n, p_wrong, seed=0, **kw):
    greedy = prompt + target_decode(target64, prompt, n + 8)
    return OracleProposer(tiny64.mtp, 128, greedy, p_wrong, seed, **kw), greedy


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_output_is_the_target_greedy_decode(tiny64, target64, random_prompt, policy, k):
    prompt = random_prompt(96, 9, k)
    prop, greedy = oracle(tiny64, target64, prompt, 30, p_wrong=0.3, seed=k)
    res = SpeculativeDecoder(target64, prop, k, policy).generate(prompt, 30)
    assert res.tokens == greedy[len(prompt) : len(prompt) + 30]
    if k > 1:  # the oracle's mix of right and wrong drafts reached every accept count
        assert 0 < res.stats.accepted[k - 1] < res.stats.steps


@pytest.mark.parametrize("feed", ["post_norm", "pre_norm"])
def test_greedy_with_the_real_drafter(tiny64, target64, random_prompt, feed):
    prompt = random_prompt(96, 12, 5)
    res = SpeculativeDecoder(target64, ReferenceProposer(tiny64.mtp, 128, feed_hidden=feed), 3).generate(prompt, 25)
    assert res.tokens == target_decode(target64, prompt, 25)


def test_metrics_perfect_and_accounting(tiny64, target64, random_prompt):
    prompt = random_prompt(96, 8, 6)
    prop, _ = oracle(tiny64, target64, prompt, 24, p_wrong=0.0)
    st = SpeculativeDecoder(target64, prop, 3).generate(prompt, 24).stats
    assert st.alpha == [1.0, 1.0, 1.0] and st.tau == 4.0 and st.committed == 4 * st.steps
    prop, _ = oracle(tiny64, target64, prompt, 40, p_wrong=0.4, seed=1)
    st = SpeculativeDecoder(target64, prop, 3).generate(prompt, 40).stats
    assert st.committed == st.steps + sum(st.accepted) and st.reached[0] == st.steps
    assert st.alpha[0] == st.accepted[0] / st.steps and st.alpha[1] == st.accepted[1] / st.accepted[0]
    assert 0 < st.draft_share < 1 and st.draft_s > 0 and st.verify_s > 0


def drafter_rows_from_target(tiny64, target64, committed, rows):
    """What a drafter holds after a prefill of the committed tokens with the target's hiddens."""
    st = target64.alloc_state()
    hid = target64.forward(torch.tensor(committed[: rows + 1]), st).hidden
    prop = ReferenceProposer(tiny64.mtp, 128)
    ds = prop.alloc_state("cpu")
    prop.prefill_drafter(committed[: rows + 1], hid, ds)
    return prop.export_state(ds)["kv_rows"]


@pytest.mark.parametrize("policy", POLICIES)
def test_policies_decide_which_hiddens_the_kept_rows_hold(tiny64, target64, random_prompt, policy):
    prompt = random_prompt(96, 10, 7)
    prop, _ = oracle(tiny64, target64, prompt, 30, p_wrong=0.3, seed=2)
    res = SpeculativeDecoder(target64, prop, 3, policy).generate(prompt, 30, free_state=False)
    snap = prop.export_state(res.drafter_state)
    rows = int(snap["seq_len"])
    assert rows == len(res.committed) - 2  # rows pair t_{r+1} with h_r up to the newest committed token
    want = drafter_rows_from_target(tiny64, target64, res.committed, rows)
    close = torch.allclose(snap["kv_rows"], want, rtol=0, atol=1e-9)
    # refeed / trim_all rebuild accepted rows from the target's hiddens; first_row_kept keeps the
    # drafter's own x in them, so its rows differ.
    assert close == (policy != "first_row_kept")


# ------------------------------------------------------------------------------------------------
# Stochastic verification: the output is distributed as the target's own samples.


class BigramTarget:
    """A target whose next-token distribution depends on the last token only: ``P[last]``."""

    def __init__(self, logp, emb):
        self.logp, self.emb = logp, emb

    def alloc_state(self):
        return {"length": 0}

    def prefill(self, tokens, state):
        return self.verify(tokens, state)

    def verify(self, tokens, state):
        tokens = torch.tensor(tokens)
        state["length"] += len(tokens)
        return type("Out", (), {"logits": self.logp[tokens], "hidden": self.emb[tokens]})

    def rollback(self, state, length):
        state["length"] = length


def chi_square_p(seqs, probs):
    """p-value of the bigram counts of ``seqs`` against transition probabilities ``probs``."""
    V = probs.shape[0]
    counts = torch.zeros(V, V, dtype=torch.float64)
    for s in seqs:
        for a, b in zip(s, s[1:]):
            counts[a, b] += 1
    n = counts.sum(1, keepdim=True)
    expected = n * probs
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = int((n[:, 0] > 0).sum()) * (V - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def bigram():
    V = 8
    cfg = MtpConfig.preset("tiny").replace(vocab_size=V)
    g = torch.Generator().manual_seed(11)
    logp = torch.log_softmax(1.5 * torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    emb = torch.randn(V, cfg.hidden_size, generator=g, dtype=torch.float64)
    return BigramTarget(logp, emb), MtpWeights.random(cfg, seed=12, dtype=torch.float64)


def sample_sequences(bigram, temperature, n_seqs=50, length=40, k=3, draft="argmax"):
    target, mw = bigram
    prop = ReferenceProposer(mw, 64)
    dec = SpeculativeDecoder(target, prop, k, temperature=temperature, seed=123, draft=draft)
    seqs, stats = [], SpecStats(k)
    for i in range(n_seqs):
        prompt = [i % 8]
        res = dec.generate(prompt, length)
        seqs.append(prompt + res.tokens)
        stats.merge(res.stats)
    return seqs, stats


@pytest.mark.parametrize("draft", ["argmax", pytest.param("sampled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("temperature", [1.0, pytest.param(0.6, marks=pytest.mark.slow)])
def test_rejection_sampling_reproduces_the_target_distribution(bigram, temperature, draft):
    seqs, stats = sample_sequences(bigram, temperature, draft=draft)
    assert 0.05 < stats.alpha[0] < 0.95  # drafts are accepted and rejected
    p = chi_square_p(seqs, target_probs(bigram[0].logp, temperature))
    assert p > 1e-3, p


def test_chi_square_catches_a_lossy_verifier(bigram, monkeypatch):
    def accept_all(logits, drafts, temperature, gen, q=None, allowed=None):
        return len(drafts), int(torch.multinomial(target_probs(logits[-1], temperature), 1, generator=gen))

    monkeypatch.setattr(verify, "stochastic_verify", accept_all)
    seqs, _ = sample_sequences(bigram, 1.0, n_seqs=20)
    assert chi_square_p(seqs, target_probs(bigram[0].logp, 1.0)) < 1e-6


@pytest.mark.slow
def test_chi_square_catches_a_lossy_sampled_verifier(bigram, monkeypatch):
    """Sampled drafts with a classic mistake, a rejection resampled from p instead of from
    norm(max(0, p - q)): the output is no longer the target's distribution, and the test sees it.
    (Verifying sampled drafts as if one-hot is not such a mistake: accept with p(d), else draw
    from p without d, gives p for any draft distribution; it only accepts less.)"""
    real = verify.stochastic_verify

    def resample_from_p(logits, drafts, temperature, gen, q=None, allowed=None):
        a, bonus = real(logits, drafts, temperature, gen, q, allowed)
        if a < len(drafts):  # rejected: redraw from p itself
            bonus = int(torch.multinomial(target_probs(logits[a], temperature), 1, generator=gen))
        return a, bonus

    monkeypatch.setattr(verify, "stochastic_verify", resample_from_p)
    seqs, _ = sample_sequences(bigram, 1.0, draft="sampled")
    assert chi_square_p(seqs, target_probs(bigram[0].logp, 1.0)) < 1e-4


def test_single_step_with_q_accepts_sum_min_p_q_and_emits_p():
    """One draft drawn from q (the exponential race), verified against q: accepted with
    probability sum_x min(p(x), q(x)); the emitted token (accepted draft or residual draw) ~ p."""
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0, 1.0], [0.0] * 5], dtype=torch.float64)
    p = target_probs(logits, 1.0)
    q = torch.softmax(torch.tensor([[0.0, 1.5, 0.5, -0.5, 1.0]], dtype=torch.float64), -1)
    gen = torch.Generator().manual_seed(1)
    n = 12000
    accepted, emitted = 0, torch.zeros(5, dtype=torch.float64)
    for _ in range(n):
        e = torch.empty(1, 5, dtype=torch.float64).exponential_(generator=gen)
        d = int(torch.argmax(q / e, dim=-1)[0])
        a, b = stochastic_verify(logits, [d], 1.0, gen, q)
        accepted += a
        emitted[d if a else b] += 1
    beta = float(torch.minimum(p[0], q[0]).sum())
    assert abs(accepted / n - beta) < 4 * math.sqrt(beta * (1 - beta) / n)
    stat = float(((emitted - n * p[0]) ** 2 / (n * p[0])).sum())
    assert stat < 18.5, stat  # chi-square, 4 degrees of freedom: P(> 18.5) < 1e-3


def test_sampled_drafts_need_a_temperature_and_a_sampling_drafter(tiny64, target64):
    prop = ReferenceProposer(tiny64.mtp, 128)
    with pytest.raises(ValueError, match="temperature > 0"):
        SpeculativeDecoder(target64, prop, 2, draft="sampled")
    with pytest.raises(ValueError, match="draft"):
        SpeculativeDecoder(target64, prop, 2, temperature=1.0, draft="topk")

    class ArgmaxOnly:
        config = tiny64.mtp.config

    with pytest.raises(ValueError, match="propose_sampled"):
        SpeculativeDecoder(target64, ArgmaxOnly(), 2, temperature=1.0, draft="sampled")


def test_sampled_noise_comes_from_the_loop_generator(tiny64, target64, random_prompt):
    """The same seed gives the same sampled run; another seed another one."""
    prompt = random_prompt(96, 10, 4)
    runs = [
        SpeculativeDecoder(
            target64, ReferenceProposer(tiny64.mtp, 128), 3, temperature=1.0, seed=s, draft="sampled"
        ).generate(prompt, 16)
        for s in (1, 1, 2)
    ]
    assert runs[0].tokens == runs[1].tokens and runs[0].stats.accepted == runs[1].stats.accepted
    assert runs[0].tokens != runs[2].tokens


def test_single_step_acceptance_probability_is_p_of_the_draft():
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    p = target_probs(logits, 1.0)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    out = [stochastic_verify(logits, [1], 1.0, gen) for _ in range(n)]
    accepted = sum(a for a, _ in out) / n
    assert abs(accepted - float(p[0, 1])) < 4 * math.sqrt(p[0, 1] * (1 - p[0, 1]) / n)
    # A rejected draft is never the replacement.
    assert all(b != 1 for a, b in out if a == 0)


# ------------------------------------------------------------------------------------------------


def test_bad_arguments_are_refused(tiny64, target64):
    prop = ReferenceProposer(tiny64.mtp, 128)
    for kw, msg in (({"num_drafts": 0}, "num_drafts"), ({"num_drafts": 2, "policy": "keep"}, "policy"),
                    ({"num_drafts": 2, "temperature": -1.0}, "temperature")):
        with pytest.raises(ValueError, match=msg):
            SpeculativeDecoder(target64, prop, **kw)
    with pytest.raises(ValueError, match="prompt"):
        SpeculativeDecoder(target64, prop, 2).generate([], 4)
    with pytest.raises(ValueError, match="backend"):
        make_proposer("fastest", tiny64.mtp, 64)


def test_backends_resolve_by_name(tiny64):
    prop = make_proposer("reference", tiny64.mtp, 64, feed_hidden="pre_norm")
    assert isinstance(prop, ReferenceProposer) and prop.feed_hidden == "pre_norm"


@pytest.mark.parametrize("draft", ["argmax", "sampled"])
@pytest.mark.parametrize("policy", ["first_row_kept", "refeed"])
def test_backends_draft_alike_through_the_loop(tiny64, target64, random_prompt, policy, draft):
    # The optimized drafter is equal to the reference bit for bit, so the loop sees the same drafts.
    prompt = random_prompt(96, 10, 9)
    runs = [
        SpeculativeDecoder(
            target64, make_proposer(b, tiny64.mtp, 128), 3, policy, temperature=1.0, seed=4, draft=draft
        ).generate(prompt, 20)
        for b in ("reference", "optimized")
    ]
    assert runs[0].tokens == runs[1].tokens and runs[0].stats.accepted == runs[1].stats.accepted


# ------------------------------------------------------------------------------------------------
# verify=match (DESIGN.md §14): the output is the target's own seeded sampling, whatever the drafter

MATCH = SamplerSettings(1.0, 0.9, None, 7)  # temperature, top_p, top_k, seed


def match_decoder(target64, proposer, k, policy="first_row_kept", draft="argmax"):
    return SpeculativeDecoder(target64, proposer, k, policy, MATCH.temperature, MATCH.seed, draft, verify="match",
                              top_p=MATCH.top_p)


@pytest.mark.parametrize("policy", POLICIES)
def test_match_output_is_the_targets_seeded_sampling(tiny64, target64, random_prompt, policy):
    """Drafts from the seeded decode itself, each wrong with probability 0.3: every accept count
    is reached, and the output is that decode token for token (greedy's oracle, at T = 1)."""
    prompt = random_prompt(96, 9, 3)
    seeded = target_decode(target64, prompt, 24, seeded=MATCH)
    assert seeded != target_decode(target64, prompt, 24)  # at T = 1 the samples leave the argmax
    prop = OracleProposer(tiny64.mtp, 128, prompt + seeded + [0] * 8, 0.3, 1)
    res = match_decoder(target64, prop, 3, policy).generate(prompt, 24)
    assert res.tokens == seeded
    assert 0 < res.stats.accepted[2] < res.stats.steps  # some rounds accepted all, some not


def test_match_is_drafter_invariant_for_argmax_and_sampled_drafts(tiny64, target64, random_prompt):
    """Two different drafters (the oracle, the real one with argmax and with sampled drafts) give
    the same tokens; their acceptance differs. A verifier that commits the draft at the first
    mismatch instead of the sample would part (``test_match_catches_a_lossy_rule``)."""
    prompt = random_prompt(96, 8, 11)
    seeded = target_decode(target64, prompt, 16, seeded=MATCH)
    oracle_prop = OracleProposer(tiny64.mtp, 128, prompt + seeded + [0] * 8, 0.2, 2)
    outs = [match_decoder(target64, oracle_prop, 2).generate(prompt, 16),
            match_decoder(target64, ReferenceProposer(tiny64.mtp, 128), 2).generate(prompt, 16),
            match_decoder(target64, ReferenceProposer(tiny64.mtp, 128), 2, draft="sampled").generate(prompt, 16)]
    assert all(r.tokens == seeded for r in outs)
    assert outs[0].stats.accepted != outs[1].stats.accepted


def test_match_catches_a_lossy_rule(tiny64, target64, random_prompt, monkeypatch):
    """The broken rule: at the first mismatch commit the draft, not the target's sample."""
    from glm_mtp.experiments.loop import match_verify

    def lossy(samples, drafts):
        a = 0
        while a < len(drafts) and drafts[a] == samples[a]:
            a += 1
        return a, drafts[a] if a < len(drafts) else samples[a]

    prompt = random_prompt(96, 8, 11)
    seeded = target_decode(target64, prompt, 16, seeded=MATCH)
    monkeypatch.setattr(verify, "match_verify", lossy)
    res = match_decoder(target64, ReferenceProposer(tiny64.mtp, 128), 2).generate(prompt, 16)
    assert res.tokens != seeded
    assert match_verify.match_verify([5, 6], [4]) == (0, 5)  # the real rule, untouched


def test_match_batch_equals_each_prompt_alone(tiny64, target64, random_prompt):
    """Match's samples are keyed by prompt and position, not drawn from a generator: a batch's
    sequences equal their single runs, tokens and counts."""
    prompts = [random_prompt(96, 9, 21), random_prompt(96, 6, 22)]
    prop = ReferenceProposer(tiny64.mtp, 128)
    batch = match_decoder(target64, prop, 2).generate_batch(prompts, 10)
    for p, b in zip(prompts, batch):
        alone = match_decoder(target64, prop, 2).generate(p, 10)
        assert b.tokens == alone.tokens == target_decode(target64, p, 10, seeded=MATCH)
        assert (b.stats.reached, b.stats.accepted, b.stats.steps) == (alone.stats.reached, alone.stats.accepted,
                                                                      alone.stats.steps)


def test_rejection_samples_from_the_truncated_target(tiny64, target64, random_prompt):
    """top_k / top_p restrict rejection's p to the sampler's kept set: top_k = 1 keeps the
    argmax alone, so the output is the greedy decode (ignoring top_k would sample at T = 1)."""
    prompt = random_prompt(96, 9, 5)
    res = SpeculativeDecoder(target64, ReferenceProposer(tiny64.mtp, 128), 2, temperature=1.0, seed=3,
                             top_k=1).generate(prompt, 16)
    assert res.tokens == target_decode(target64, prompt, 16)
    free = SpeculativeDecoder(target64, ReferenceProposer(tiny64.mtp, 128), 2, temperature=1.0, seed=3)
    assert free.generate(prompt, 16).tokens != res.tokens


def test_match_and_truncation_refusals(tiny64, target64):
    prop = ReferenceProposer(tiny64.mtp, 128)
    with pytest.raises(ValueError, match="top_p / top_k"):
        SpeculativeDecoder(target64, prop, 2, top_p=0.9)  # temperature 0
    with pytest.raises(ValueError, match="verify must be"):
        SpeculativeDecoder(target64, prop, 2, temperature=1.0, verify="exact")
    with pytest.raises(ValueError, match="grammar"):
        match_decoder(target64, prop, 2).generate([1, 2, 3], 4, matcher=object())


def test_match_with_top_k_1_is_greedy_live_and_teacher_forced(tiny64, target64, random_prompt):
    """The seeded sampler's top_k = 1 is the argmax exactly, so match at T = 1 then counts and
    commits what greedy verification does, in the loop and in teacher forcing."""
    from glm_mtp.experiments.loop.speculative import teacher_forced

    prompt = random_prompt(96, 9, 8)

    def prop():  # greedy's drafts, some wrong; a fresh one per run draws the same wrong ones
        return oracle(tiny64, target64, prompt, 12, p_wrong=0.3)[0]

    greedy = SpeculativeDecoder(target64, prop(), 2).generate(prompt, 12)
    match = SpeculativeDecoder(target64, prop(), 2, temperature=1.0, verify="match", top_k=1).generate(prompt, 12)
    assert match.tokens == greedy.tokens and match.stats.accepted == greedy.stats.accepted
    text = prompt + greedy.tokens
    tf_greedy = teacher_forced(target64, prop(), text, 9, 2)
    tf_match = teacher_forced(target64, prop(), text, 9, 2, temperature=1.0, verify="match", top_k=1)
    assert (tf_match.reached, tf_match.accepted) == (tf_greedy.reached, tf_greedy.accepted)
    assert 0 < sum(tf_greedy.accepted) < sum(tf_greedy.reached)  # some drafts accepted, some not
