"""The fine-tuning forward (experiments.training.mtp_train_forward) is the drafter's: with pinned
numerics and gradients off its logits are the reference drafter's teacher-forced logits, byte for
byte, at every depth; with torch's kernels (training) they differ by rounding only."""

import pytest
import torch

import glm_mtp.reference.proposer as proposer_module
from glm_mtp.experiments.training.mtp_train_forward import PINNED, VENDOR, drafter_forward
from glm_mtp.reference import ReferenceProposer
from glm_mtp.reference.bytes import bits, same_bytes
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.weights import MtpWeights

L, DEPTH = 22, 3


def _weights(preset, share):
    cfg = MtpConfig.preset(preset).replace(index_share_for_mtp_iteration=share)
    return MtpWeights.random(cfg, seed=5, dtype=torch.float32)


def _item(w, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, w.config.vocab_size, (L,), generator=g)
    return tokens, torch.randn(L, w.config.hidden_size, generator=g)


def reference_teacher_forced(w, tokens, hiddens, depth, feed_hidden, monkeypatch):
    """Per proposal p: a fresh reference drafter prefilled on t_0..t_p, then ``propose`` of
    ``depth`` drafts at position p; its logits per step and its drafts."""
    seen = []
    real = proposer_module.draft_logits
    monkeypatch.setattr(proposer_module, "draft_logits", lambda ww, x: seen.append(real(ww, x)) or seen[-1])
    logits = [[] for _ in range(depth)]
    drafts = []
    for p in range(L - 1):
        k = min(depth, L - 1 - p)
        prop = ReferenceProposer(w, 64, feed_hidden=feed_hidden)
        st = prop.alloc_state("cpu")
        prop.prefill_drafter(tokens[: p + 1].tolist(), hiddens[: p + 1], st)
        seen.clear()
        drafts.append(prop.propose(int(tokens[p + 1]), hiddens[p : p + 1], p, k, st))
        for d in range(k):
            logits[d].append(seen[d])
    return [torch.cat(x) for x in logits], drafts


CASES = [("tiny", False, "post_norm"), ("tiny", True, "post_norm"), ("glm5next_tiny", True, "post_norm"),
         ("glm5next_tiny", False, "pre_norm")]


@pytest.mark.parametrize("preset,share,feed", CASES)
def test_pinned_forward_is_the_reference_drafter_bytes(preset, share, feed, monkeypatch):
    w = _weights(preset, share)
    tokens, hiddens = _item(w, 11)
    want, drafts = reference_teacher_forced(w, tokens, hiddens, DEPTH, feed, monkeypatch)
    # depth d's token at proposal p: the reference's own draft d - 1 (what it fed itself)
    chain = lambda d, P: torch.tensor([drafts[p][d - 2] for p in range(P)])  # noqa: E731
    with torch.no_grad():
        got = drafter_forward(w, tokens, hiddens, DEPTH, ops=PINNED, feed_hidden=feed, chain=chain)
    for d in range(DEPTH):
        assert same_bytes(got[d].logits, want[d]), (d + 1, (bits(got[d].logits) != bits(want[d])).nonzero()[:3])


def test_a_changed_row_fails_the_comparison(monkeypatch):
    """The comparison can fail: feeding depth 2 the text's token instead of the drafts differs."""
    w = _weights("glm5next_tiny", True)
    tokens, hiddens = _item(w, 12)
    want, drafts = reference_teacher_forced(w, tokens, hiddens, 2, "post_norm", monkeypatch)
    with torch.no_grad():
        got = drafter_forward(w, tokens, hiddens, 2, ops=PINNED)
    assert same_bytes(got[0].logits, want[0])
    text = tokens[2 : 2 + len(drafts) - 1]
    assert any(drafts[p][0] != int(text[p]) for p in range(len(text)))
    assert not same_bytes(got[1].logits, want[1])


@pytest.mark.parametrize("preset,share", [("tiny", False), ("glm5next_tiny", True)])
def test_vendor_forward_differs_by_rounding_only_and_is_differentiable(preset, share):
    """Training's torch kernels sum in another order than the pinned drafter: float32 rounding,
    bounded here by 1e-4 of the logits' scale; the selections are the same (a flipped selection
    would move a logit by far more)."""
    w = _weights(preset, share)
    tokens, hiddens = _item(w, 13)
    with torch.no_grad():
        pinned = drafter_forward(w, tokens, hiddens, DEPTH, ops=PINNED)
    eh = w.eh_proj.detach().clone().requires_grad_(True)
    w.eh_proj = eh
    vendor = drafter_forward(w, tokens, hiddens, DEPTH, ops=VENDOR)
    for p, v in zip(pinned, vendor):
        scale = float(p.logits.abs().max())
        assert float((v.logits.detach() - p.logits).abs().max()) <= 1e-4 * scale
    sum(v.logits.square().mean() for v in vendor).backward()
    assert eh.grad is not None and float(eh.grad.abs().sum()) > 0
