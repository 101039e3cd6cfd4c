"""xgrammar's ``GrammarMatcher`` passes as a drafter's grammar as it is (DESIGN.md §10). The
drafter imports nothing of xgrammar; this test does, and is skipped where it is not installed."""

import pytest
import torch

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer

xgr = pytest.importorskip("xgrammar")

# 95 strings of repeated letters and a stop token: the tiny preset's vocabulary (V = 96).
VOCAB = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(95)] + ["</s>"]


def matcher(regex):
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[95])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(regex))


def test_an_xgrammar_matcher_constrains_the_drafts_and_is_left_as_found():
    cfg = MtpConfig.preset("tiny")
    prop = ReferenceProposer(MtpWeights.random(cfg, seed=0, dtype=torch.float32), 64)
    state = prop.alloc_state("cpu")
    m = matcher("[a-c]+")
    drafts = prop.propose(3, torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(0)), 0, 4, state,
                          grammar=m)
    assert len(drafts) == 4 and all(set(VOCAB[t]) <= set("abc") for t in drafts)
    prob, margin = prop.draft_confidence(state)
    assert prob.shape == margin.shape == (4,)
    assert not m.is_terminated() and not m.accept_token(95)  # still at the start: "" does not match [a-c]+
    prop.after_verify(0, state)
    m.accept_token(0)
    m.accept_token(95)  # "a" then the stop token: terminated
    assert m.is_terminated()
    assert prop.propose(3, torch.randn(cfg.hidden_size), 1, 3, state, grammar=m) == []
    assert m.is_terminated()
