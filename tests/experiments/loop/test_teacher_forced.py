"""Teacher-forced acceptance equals a stateless recomputation: at every position a fresh target and
a fresh drafter see exactly the text before it, and one speculative step is scored."""

import random

import pytest
import torch

from glm_mtp.reference import ReferenceProposer
from glm_mtp.experiments.loop import verify
from glm_mtp.experiments.loop.speculative import POLICIES, target_decode, teacher_forced
from glm_mtp.experiments.loop.verify import greedy_verify


class RecordingProposer(ReferenceProposer):
    """The reference drafter, remembering every propose's drafts by position."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log = []

    def propose(self, last_token, target_hidden, position, num_drafts, state):
        out = super().propose(last_token, target_hidden, position, num_drafts, state)
        if num_drafts:
            self.log.append((position, out))
        return out


def fresh_step(tiny64, target64, text, m, k):
    """Drafts and accepted count at position m from scratch: prefill both models on text[:m]."""
    st = target64.alloc_state()
    out = target64.forward(torch.tensor(text[:m]), st)
    prop = ReferenceProposer(tiny64.mtp, 128)
    ds = prop.alloc_state("cpu")
    prop.prefill_drafter(text[:m], out.hidden, ds)
    drafts = prop.propose(text[m], out.hidden[-1:], m - 1, k, ds)
    ver = target64.forward(torch.tensor([text[m], *drafts]), st)
    return drafts, greedy_verify(ver.logits, drafts)[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_teacher_forced_drafts_match_a_fresh_prefill(tiny64, target64, random_prompt, policy):
    text, n, k = random_prompt(96, 20, 3), 6, 3
    prop = RecordingProposer(tiny64.mtp, 128)
    st = teacher_forced(target64, prop, text, n, k, policy)
    assert st.steps == len(text) - n and [p for p, _ in prop.log] == list(range(n - 1, len(text) - 1))
    accepted = [0] * k
    for (pos, drafts) in prop.log:
        want, a = fresh_step(tiny64, target64, text, pos + 1, k)
        assert drafts == want, pos
        for i in range(a):
            accepted[i] += 1
    assert st.accepted == accepted


class GreedyOracle(ReferenceProposer):
    """Drafts the target's own greedy continuation of the text so far, draft ``i`` corrupted with
    probability ``p_wrong``: the accepted count is known (the first corrupted draft)."""

    def __init__(self, weights, max_seq_len, target, text, p_wrong, seed):
        super().__init__(weights, max_seq_len)
        self.target, self.text, self.p_wrong, self.rng, self.expected = target, text, p_wrong, random.Random(seed), []

    def propose(self, last_token, target_hidden, position, num_drafts, state):
        super().propose(last_token, target_hidden, position, num_drafts, state)
        if not num_drafts:
            return []
        greedy = target_decode(self.target, self.text[: position + 2], num_drafts)
        wrong = [self.rng.random() < self.p_wrong for _ in range(num_drafts)]
        self.expected.append(wrong.index(True) if any(wrong) else num_drafts)
        return [(g + 1) % self.config.vocab_size if w else g for g, w in zip(greedy, wrong)]


def test_teacher_forced_counts_each_position_once(tiny64, target64, random_prompt):
    text, n, k = random_prompt(96, 40, 4), 8, 3
    prop = GreedyOracle(tiny64.mtp, 128, target64, text, 0.3, seed=5)
    st = teacher_forced(target64, prop, text, n, k)
    assert st.steps == 32 and len(prop.expected) == 32
    assert st.accepted == [sum(e > i for e in prop.expected) for i in range(k)]
    assert st.reached == [sum(e >= i for e in prop.expected) for i in range(k)]
    assert 0 < st.accepted[k - 1] < st.accepted[0] < st.steps  # every accept count occurs


def test_a_target_left_on_the_drafts_is_caught(tiny64, target64, random_prompt, monkeypatch):
    # Mutant: the target keeps the accepted drafts (rewinds as the loop does) instead of the text.
    text, n, k = random_prompt(96, 40, 4), 8, 3
    good = GreedyOracle(tiny64.mtp, 128, target64, text, 0.3, seed=5)
    ok = teacher_forced(target64, good, text, n, k)
    real_verify = verify.greedy_verify
    last = {}

    def remember(logits, drafts):
        last["a"] = real_verify(logits, drafts)[0]
        return real_verify(logits, drafts)

    real_rollback = target64.rollback
    monkeypatch.setattr(verify, "greedy_verify", remember)
    monkeypatch.setattr(target64, "rollback", lambda state, length: real_rollback(state, length + last["a"]))
    bad = GreedyOracle(tiny64.mtp, 128, target64, text, 0.3, seed=5)
    mutant = teacher_forced(target64, bad, text, n, k)
    assert mutant.accepted != ok.accepted


def test_bad_prompt_len_is_refused(tiny64, target64):
    prop = ReferenceProposer(tiny64.mtp, 128)
    for n in (0, 5):
        with pytest.raises(ValueError, match="prompt_len"):
            teacher_forced(target64, prop, [1, 2, 3, 4, 5], n, 2)
