"""The target's verification under a grammar (DESIGN.md §10, experiments.loop.grammar_verify) and
the loop around it: masks per position after d_1..d_j, the masked argmax, the matcher left as
found by the masks and advanced on committed tokens only, and the output equal to the target's
own constrained decode (greedy) or obeying the grammar (rejection sampling), with forbidden drafts
and wasted verify slots counted."""

import pytest
import torch

from glm_mtp.experiments.loop.grammar_verify import (allowed_tokens, masked_argmax, masked_greedy_verify,
                                                     matcher_row, verify_masks)
from glm_mtp.experiments.loop.speculative import POLICIES, SpeculativeDecoder, target_decode
from glm_mtp.reference import ReferenceProposer

from ..token_automaton import TokenAutomaton, pack_bitmask

V = 96  # the tiny preset's vocabulary


def test_allowed_tokens_reads_bit_j_mod_32_of_word_j_div_32():
    g = torch.Generator().manual_seed(1)
    for vocab in (1, 31, 32, 33, 96, 100):
        words = (vocab + 31) // 32
        bitmask = torch.randint(-(1 << 31), 1 << 31, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
        want = torch.tensor([[bool((int(bitmask[r, j // 32]) >> (j % 32)) & 1) for j in range(vocab)]
                             for r in range(3)])
        assert torch.equal(allowed_tokens(bitmask, vocab), want)
        assert torch.equal(allowed_tokens(pack_bitmask(want[0]), vocab)[0], want[0])  # the test's packing agrees


def test_masked_argmax_is_the_lowest_allowed_maximum_and_never_compares_forbidden_logits():
    logits = torch.tensor([9.0, 1.0, 5.0, 5.0, float("nan"), 5.0])
    allowed = torch.tensor([False, True, True, True, False, True])
    assert masked_argmax(logits, allowed) == 2  # 9 and NaN are forbidden: never compared
    assert masked_argmax(logits, torch.tensor([False, True, False, False, False, False])) == 1
    assert masked_argmax(logits, torch.zeros(6, dtype=torch.bool)) is None


def test_verify_masks_are_the_matcher_after_each_prefix_and_leave_it_as_found():
    m = TokenAutomaton(V, seed=2, density=0.4)
    assert m.walk([int(torch.nonzero(m.allowed[0])[0])])  # a matcher mid-output
    found = list(m.history)
    legal_drafts = []
    probe = TokenAutomaton(V, seed=2, density=0.4)
    probe.history = list(found)
    for _ in range(3):  # three drafts the grammar allows, then one it forbids
        t = int(torch.nonzero(probe.allowed[probe.state])[-1])
        legal_drafts.append(t)
        assert probe.accept_token(t)
    forbidden = int(torch.nonzero(~probe.allowed[probe.state])[0])
    allowed, legal = verify_masks(m, [*legal_drafts, forbidden, 0], V)
    assert legal == 3 and allowed.shape == (4, V) and m.history == found
    for j in range(4):
        ref = TokenAutomaton(V, seed=2, density=0.4)
        ref.history = list(found)
        assert ref.walk(legal_drafts[:j])
        assert torch.equal(allowed[j], ref.allowed[ref.state]), j
    allowed, legal = verify_masks(m, legal_drafts, V)  # every draft allowed: k + 1 rows
    assert legal == 3 and allowed.shape == (4, V) and m.history == found


def test_a_matcher_that_refuses_a_token_its_mask_allowed_is_named_and_rolled_back():
    m = TokenAutomaton(V, seed=3, density=0.5)
    a = int(torch.nonzero(m.allowed[0])[0])
    m.liar = next(int(t) for t in torch.nonzero(m.allowed[int(m.next[0, a])]) if int(t) != a)
    with pytest.raises(ValueError, match=f"refused draft 2 \\(token {m.liar}\\)"):
        verify_masks(m, [a, m.liar], V)
    assert m.history == [0]


def test_masked_greedy_verify_is_the_constrained_argmax_walk():
    g = torch.Generator().manual_seed(4)
    for trial in range(50):
        m = TokenAutomaton(V, seed=trial, density=0.2)
        logits = torch.randn(4, V, generator=g, dtype=torch.float64)
        # drafts: the constrained argmax for a random number of steps, then a random token
        drafts, probe = [], TokenAutomaton(V, seed=trial, density=0.2)
        right = int(torch.randint(0, 4, (), generator=g))
        for j in range(3):
            best = masked_argmax(logits[j], probe.allowed[probe.state])
            d = best if j < right else int(torch.randint(0, V, (), generator=g))
            drafts.append(d)
            probe.accept_token(d)
        allowed, _ = verify_masks(m, drafts, V)
        a, bonus = masked_greedy_verify(logits, drafts, allowed)
        want, ref = 0, TokenAutomaton(V, seed=trial, density=0.2)
        while want < 3 and drafts[want] == masked_argmax(logits[want], ref.allowed[ref.state]):
            ref.accept_token(drafts[want])
            want += 1
        assert a == want >= min(right, 3), trial
        assert bonus == masked_argmax(logits[a], ref.allowed[ref.state])


class NoisyOracle(ReferenceProposer):
    """The reference drafter whose drafts are replaced by the continuation ``text`` holds (the
    target's constrained decode after the prompt), each wrong with probability ``p_wrong``: a
    drafter that is often right, so verifies accept runs of drafts. Its rows are its own."""

    def __init__(self, weights, max_seq_len, text, p_wrong, seed):
        super().__init__(weights, max_seq_len)
        self.text, self.p_wrong, self.g = text, p_wrong, torch.Generator().manual_seed(seed)

    def propose(self, last_token, target_hidden, position, num_drafts, state):
        drafts = super().propose(last_token, target_hidden, position, num_drafts, state)
        want = self.text[position + 2 : position + 2 + len(drafts)]  # d_i = text[m + i], m = position + 1
        want += [0] * (len(drafts) - len(want))
        return [int(torch.randint(0, V, (), generator=self.g)) if float(torch.rand((), generator=self.g)) < self.p_wrong
                else w for w in want]


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_loop_under_a_grammar_is_the_targets_constrained_decode(tiny64, target64, random_prompt, policy):
    """Unmasked drafts: forbidden ones counted and rejected, the output the constrained decode,
    the matcher left after the committed tokens."""
    prompt = random_prompt(V, 9, 1)
    plain = target_decode(target64, prompt, 40, matcher=TokenAutomaton(V, seed=5, density=0.3), vocab_size=V)
    m = TokenAutomaton(V, seed=5, density=0.3)
    drafter = NoisyOracle(tiny64.mtp, 128, prompt + plain, 0.3, seed=1)
    res = SpeculativeDecoder(target64, drafter, 3, policy, grammar_drafts="unmasked").generate(prompt, 24, matcher=m)
    assert res.tokens == plain[:24]
    out = TokenAutomaton(V, seed=5, density=0.3)
    assert out.walk(res.committed[len(prompt):]) and m.history == out.history  # advanced on committed tokens only
    st = res.stats
    assert st.forbidden > 0 and sum(st.accepted) > 0 and st.steps < 24  # runs accepted, some drafts forbidden
    assert st.wasted == 3 * st.steps - sum(st.accepted)  # every verified draft not accepted


@pytest.mark.parametrize("policy", POLICIES)
def test_masked_drafts_are_never_forbidden_and_emit_the_same_tokens(tiny64, target64, random_prompt, policy):
    """A sparse grammar (about 3 tokens of 96 a state): masked drafts are often the target's
    choice; the output is the unmasked run's, token for token."""
    prompt = random_prompt(V, 9, 4)
    runs = {}
    for drafts in ("masked", "unmasked"):
        m = TokenAutomaton(V, seed=7, density=0.03)
        runs[drafts] = SpeculativeDecoder(target64, ReferenceProposer(tiny64.mtp, 128), 3, policy,
                                          grammar_drafts=drafts).generate(prompt, 30, matcher=m)
        out = TokenAutomaton(V, seed=7, density=0.03)
        assert out.walk(runs[drafts].committed[len(prompt):]) and m.history == out.history
    masked, unmasked = runs["masked"], runs["unmasked"]
    assert masked.tokens == unmasked.tokens == target_decode(target64, prompt, 30,
                                                             matcher=TokenAutomaton(V, seed=7, density=0.03),
                                                             vocab_size=V)
    assert masked.stats.forbidden == 0 and unmasked.stats.forbidden > 0
    assert sum(masked.stats.accepted) > 0


def test_masked_sampled_drafts_at_temperature_draw_allowed_tokens_only(tiny64, target64, random_prompt):
    prompt = random_prompt(V, 9, 5)
    m = TokenAutomaton(V, seed=8, density=0.1)
    res = SpeculativeDecoder(target64, ReferenceProposer(tiny64.mtp, 128), 3, temperature=1.0, draft="sampled",
                             grammar_drafts="masked").generate(prompt, 30, matcher=m)
    assert TokenAutomaton(V, seed=8, density=0.1).walk(res.committed[len(prompt):])
    assert res.stats.forbidden == 0 and res.stats.steps > 0


@pytest.mark.parametrize("drafts", ["masked", "unmasked"])
def test_a_grammar_that_ends_ends_the_output_as_the_constrained_decode_does(tiny64, target64, random_prompt, drafts):
    """A stop token (the matcher terminates) or an empty mask ends the output; masked proposes
    return fewer than k drafts where the grammar stops them."""
    prompt = random_prompt(V, 9, 2)
    ends = set()
    for seed in range(6):
        kw = dict(seed=seed, density=0.3, terminal=seed % 2 == 0, empty_state=seed % 2 == 1, num_states=3)
        m = TokenAutomaton(V, **kw)
        res = SpeculativeDecoder(target64, ReferenceProposer(tiny64.mtp, 128), 3,
                                 grammar_drafts=drafts).generate(prompt, 40, matcher=m)
        assert res.tokens == target_decode(target64, prompt, 40, matcher=TokenAutomaton(V, **kw), vocab_size=V)
        ended = m.is_terminated() or not bool(matcher_row(m, V).any())
        assert ended == (len(res.tokens) < 40), seed
        assert res.stats.committed + 1 == len(res.committed) - len(prompt)  # + the prefill's token
        if ended:
            ends.add("stop token" if m.is_terminated() else "empty mask")
    assert ends == {"stop token", "empty mask"}  # both ways of ending were met


def test_rejection_sampling_under_a_grammar_draws_only_allowed_tokens(tiny64, target64, random_prompt):
    prompt = random_prompt(V, 9, 3)
    for seed in range(3):
        m = TokenAutomaton(V, seed=seed, density=0.2)
        res = SpeculativeDecoder(target64, ReferenceProposer(tiny64.mtp, 128), 3, temperature=1.0, seed=seed,
                                 grammar_drafts="unmasked").generate(prompt, 30, matcher=m)
        assert TokenAutomaton(V, seed=seed, density=0.2).walk(res.committed[len(prompt):])
        assert res.stats.forbidden > 0
