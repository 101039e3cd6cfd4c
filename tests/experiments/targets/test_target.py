import pytest
import torch

from glm_mtp.reference import MtpWeights
from glm_mtp.reference.attention import Rope
from glm_mtp.reference.block import mtp_rows
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.moe import moe_block
from glm_mtp.reference.state import BLOCK_ROWS, LayerCache, num_blocks
from glm_mtp.reference.bytes import same_bytes
from glm_mtp.reference.weights import MlpWeights, MoeWeights
from glm_mtp.experiments.targets.target import Target, TargetWeights, grouped_moe
from glm_mtp.experiments.training.train_run import build_models, mtp_forward, sequence_losses, trainable




def test_layers_follow_first_k_dense_replace(tiny64):
    cfg = tiny64.target.config
    kinds = [isinstance(l.mlp, MlpWeights) for l in tiny64.target.layers]
    assert kinds == [i < cfg.first_k_dense_replace for i in range(cfg.num_hidden_layers)]
    assert isinstance(tiny64.target.layers[-1].mlp, MoeWeights)


def test_incremental_forward_matches_one_pass_and_head_reads_hidden(tiny64, target64, random_prompt):
    toks = torch.tensor(random_prompt(96, 30, 1))
    whole = target64.forward(toks, target64.alloc_state())
    st = target64.alloc_state()
    parts = [target64.forward(toks[a:b], st) for a, b in ((0, 11), (11, 12), (12, 30))]
    assert st.length == 30
    torch.testing.assert_close(torch.cat([p.logits for p in parts]), whole.logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(whole.logits, torch.nn.functional.linear(whole.hidden, tiny64.target.lm_head), rtol=0,
                               atol=0)
    # The hidden is final-normed: RMS of hidden / norm weight is 1.
    rms = (whole.hidden / tiny64.target.norm).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=0, atol=1e-4)


def test_rewind_then_new_tokens_equals_fresh_run(target64, random_prompt):
    a, b = torch.tensor(random_prompt(96, 20, 2)), torch.tensor(random_prompt(96, 5, 3))
    st = target64.alloc_state()
    target64.forward(a, st)
    target64.rewind(st, 12)
    got = target64.forward(b, st)
    ref_st = target64.alloc_state()
    target64.forward(a[:12], ref_st)
    want = target64.forward(b, ref_st)
    assert same_bytes(got.logits, want.logits)
    with pytest.raises(ValueError, match="length"):
        target64.rewind(st, 99)


def test_grouped_moe_is_the_reference_moe(tiny64):
    moe = tiny64.target.layers[-1].mlp
    m = torch.randn(37, tiny64.target.config.hidden_size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(grouped_moe(moe, tiny64.target.config, m), moe_block(moe, tiny64.target.config, m),
                               rtol=1e-12, atol=1e-12)


def test_training_mtp_forward_is_mtp_rows_in_float64(tiny64):
    """Training computes with torch's kernels (numerics.VENDOR), the drafter in the pinned order:
    the same math, so in float64 they agree to rounding."""
    w, cfg = tiny64.mtp, tiny64.mtp.config
    g = torch.Generator().manual_seed(9)
    T = 21
    toks = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    hid = torch.randn(T, cfg.hidden_size, dtype=torch.float64, generator=g)
    x, logits = mtp_forward(w, toks, hid, zero_first=True, moe=moe_block)
    cache = LayerCache.allocate(cfg, num_blocks(T), torch.float64, "cpu")
    ref = mtp_rows(w, toks, hid, torch.arange(T), cache, Rope.build(cfg, BLOCK_ROWS * num_blocks(T), "cpu"))
    torch.testing.assert_close(x, ref.x, rtol=1e-12, atol=1e-12)


def test_joint_losses_backprop_into_every_parameter(random_prompt):
    cfg = MtpConfig.preset("tiny").replace(n_group=1, topk_group=1)
    target, mtp, params = build_models(cfg, seed=0)
    assert mtp.embed_tokens is target.embed_tokens and mtp.lm_head is target.lm_head
    window = torch.tensor(random_prompt(cfg.vocab_size, 33, 4))
    ls = sequence_losses(target, mtp, window, depth=3, moe=grouped_moe)
    assert len(ls.mtp) == 3
    (ls.target + sum(ls.mtp)).backward()
    no_grad = [i for i, p in enumerate(params) if p.grad is None or not p.grad.abs().sum() > 0]
    # The lightning indexer selects rows (no gradient reaches it: training contexts fit index_topk).
    indexer = {id(t) for l in [*target.layers, mtp.layer] for t in vars(l.attn.indexer).values()}
    assert all(id(params[i]) in indexer for i in no_grad)
    assert len(no_grad) < len(params)


def test_checkpoint_roundtrip(tmp_path, tiny64):
    tw, mw = tiny64.target, tiny64.mtp
    mw.save_pretrained(tmp_path, extra={n: t.clone() for n, t in tw.state_dict().items()})
    t2 = TargetWeights.from_pretrained(tmp_path)
    m2 = MtpWeights.from_pretrained(tmp_path)
    sd, sd2 = tw.state_dict(), t2.state_dict()
    assert sd.keys() == sd2.keys() and all(same_bytes(sd[k], sd2[k]) for k in sd)
    assert same_bytes(m2.eh_proj, mw.eh_proj) and same_bytes(m2.embed_tokens, tw.embed_tokens)


def test_trainable_makes_shared_tensors_one_leaf():
    cfg = MtpConfig.preset("tiny")
    tw = TargetWeights.random(cfg, 0)
    params = trainable(tw)
    assert all(p.is_leaf and p.requires_grad for p in params)
    assert not tw.layers[-1].mlp.e_score_correction_bias.requires_grad


def test_self_distillation_aims_the_mtp_loss_at_the_target(random_prompt):
    cfg = MtpConfig.preset("tiny").replace(n_group=1, topk_group=1)
    target, mtp, _ = build_models(cfg, seed=1)
    window = torch.tensor(random_prompt(cfg.vocab_size, 25, 8))
    text = sequence_losses(target, mtp, window, depth=2, moe=grouped_moe, distill=0.0)
    soft = sequence_losses(target, mtp, window, depth=2, moe=grouped_moe, distill=1.0)
    tg = Target(target, max_seq_len=24, moe=grouped_moe)
    teacher = torch.softmax(tg.forward(window[:-1], tg.alloc_state()).logits[1:24], -1)  # predicts t_2..t_24
    _, logits = mtp_forward(mtp, window[1:24], tg.forward(window[:-1], tg.alloc_state()).hidden[:23], True, grouped_moe)
    torch.testing.assert_close(soft.mtp[0], torch.nn.functional.cross_entropy(logits, teacher))
    assert not torch.allclose(soft.mtp[0], text.mtp[0]) and torch.equal(soft.target, text.target)
