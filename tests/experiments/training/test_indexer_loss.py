"""Training the KPool indexer (glm5_next): the training forward selects as the drafter does, and
the indexer's KL trains the indexer alone (experiments/training/indexer_loss.py)."""

import math

import torch

from glm_mtp.experiments.training.indexer_loss import pool_kl
from glm_mtp.experiments.targets.target import Target, TargetWeights, grouped_moe
from glm_mtp.experiments.training.train_run import build_models, mtp_forward, sequence_losses
from glm_mtp.reference.attention import Rope
from glm_mtp.reference.block import mtp_rows
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.moe import moe_block
from glm_mtp.reference.state import BLOCK_ROWS, LayerCache, num_blocks
from glm_mtp.reference.weights import MtpWeights

NEXT = MtpConfig.preset("glm5next_tiny")  # index_kpool 4, index_topk 8: 30 rows leave pools out


def _tokens(n, seed):
    return torch.randint(0, NEXT.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_training_forward_selects_as_the_pinned_drafter_in_float64():
    """torch's kernels (training, the target) and the pinned drafter: the same KPool selection and
    math, so in float64 they agree to rounding at a length where selection drops pools."""
    w = MtpWeights.random(NEXT, seed=2, dtype=torch.float64)
    T = 30
    toks, hid = _tokens(T, 1), torch.randn(T, NEXT.hidden_size, dtype=torch.float64,
                                           generator=torch.Generator().manual_seed(3))
    x, _ = mtp_forward(w, toks, hid, zero_first=True, moe=moe_block)
    cache = LayerCache.allocate(NEXT, num_blocks(T), torch.float64, "cpu")
    ref = mtp_rows(w, toks, hid, torch.arange(T), cache, Rope.build(NEXT, BLOCK_ROWS * num_blocks(T), "cpu"))
    torch.testing.assert_close(x, ref.x, rtol=1e-10, atol=1e-10)


def test_target_rewind_forgets_cut_pools():
    """A rewind into a complete pool, then new tokens: a fresh run's logits (torch's kernels, so
    to rounding: their pooled keys are computed over other batches of pools)."""
    tg = Target(TargetWeights.random(NEXT, seed=4, dtype=torch.float64), max_seq_len=64)
    a, b = _tokens(22, 5), _tokens(6, 6)
    st = tg.alloc_state()
    tg.forward(a, st)
    tg.rewind(st, 13)  # cuts pool 3 (rows 12..15)
    assert not bool(st.caches[0].kpool.complete[3])
    got = tg.forward(b, st)
    ref = tg.alloc_state()
    tg.forward(a[:13], ref)
    torch.testing.assert_close(got.logits, tg.forward(b, ref).logits, rtol=0, atol=1e-12)
    assert bool(st.caches[0].kpool.complete[3])  # row 15 completed it again, with the new rows


def test_pool_kl_is_zero_at_the_target_and_positive_elsewhere():
    kp, T = 4, 3
    slots = torch.tensor([11, 13, 15])  # 3, 3 and 4 candidate pools
    mass = torch.rand(T, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mass = mass.masked_fill(torch.arange(16)[None] > slots[:, None], 0.0)
    mass = mass / mass.sum(-1, keepdim=True)
    perfect = mass.reshape(T, 4, kp).sum(-1).log()  # softmax over candidates = the renormalised mass
    kl, n = pool_kl(perfect, mass, slots, kp)
    assert n == 3 and abs(float(kl)) < 1e-12
    kl_flat, _ = pool_kl(torch.zeros(T, 4, dtype=torch.float64), mass, slots, kp)
    assert float(kl_flat) > 1e-3
    # Rows with fewer than two candidates are not scored.
    _, n_one = pool_kl(perfect, mass, torch.tensor([4, 6, 2]), kp)  # 1, 1 and 0 candidates
    assert n_one == 0


def test_indexer_kl_trains_the_indexer_and_nothing_else():
    target, mtp, params = build_models(NEXT, seed=0)
    window = _tokens(41, 7)
    ls = sequence_losses(target, mtp, window, depth=2, moe=grouped_moe)
    assert ls.indexer is not None and float(ls.indexer.detach()) > 0 and 0 < ls.recall < 1
    indexer = {
        id(t) for l in [*target.layers, mtp.layer] for t in vars(l.attn.indexer).values() if isinstance(t, torch.Tensor)
    }
    (ls.target + sum(ls.mtp)).backward(retain_graph=True)
    lm_grads = [p for p in params if p.grad is not None and p.grad.abs().sum() > 0]
    assert lm_grads and not any(id(p) in indexer for p in lm_grads)  # selection is discrete
    for p in params:
        p.grad = None
    ls.indexer.backward()
    kl_grads = [p for p in params if p.grad is not None and p.grad.abs().sum() > 0]
    assert {id(p) for p in kl_grads} == indexer  # every indexer tensor, nothing else (inputs detached)


def test_glm5_family_keeps_no_indexer_loss():
    cfg = MtpConfig.preset("tiny").replace(n_group=1, topk_group=1)
    target, mtp, _ = build_models(cfg, seed=0)
    ls = sequence_losses(target, mtp, _tokens(20, 8) % cfg.vocab_size, depth=1, moe=grouped_moe)
    assert ls.indexer is None and math.isnan(ls.recall)
