"""DSA attention against a float64 re-derivation with expanded keys and values, the indexer
against its formula, and the row selection against a brute-force ranking."""

import pytest
import torch
import torch.nn.functional as F

from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.reference.attention import Rope, dsa_attention
from glm_mtp.reference.indexer import index_keys, index_queries, index_scores, select_rows, selection_mask
from glm_mtp.reference.layers import apply_rope
from glm_mtp.reference.numerics import rms_norm
from glm_mtp.reference.state import LayerCache


def expanded_attention(attn, cfg, a, topk):
    """Textbook MLA over rows 0..T-1 in float64: expand K and V per head through kv_b_proj,
    attend causally to the indexer's top-k, computed head by head, row by row."""
    T, nh, nope, R, v = a.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    cos, sin = Rope.build(cfg, T, "cpu", torch.float64).at(torch.arange(T))
    q_lat = rms_norm(a @ attn.q_a_proj.T, attn.q_a_layernorm, 1e-6)
    q = (q_lat @ attn.q_b_proj.T).view(T, nh, nope + R)
    kv = a @ attn.kv_a_proj_with_mqa.T
    c = rms_norm(kv[:, : cfg.kv_lora_rank], attn.kv_a_layernorm, 1e-6)
    k_pe = apply_rope(kv[:, cfg.kv_lora_rank :], cos, sin, cfg.rope_interleave)
    kvb = (c @ attn.kv_b_proj.T).view(T, nh, nope + v)
    ix = attn.indexer
    iq = (q_lat @ ix.wq_b.T).view(T, cfg.index_n_heads, cfg.index_head_dim)
    ik = F.layer_norm(a @ ix.wk.T, (cfg.index_head_dim,), ix.k_norm_weight, ix.k_norm_bias, 1e-6)
    iq = torch.cat((apply_rope(iq[..., :R], cos[:, None], sin[:, None], True), iq[..., R:]), -1)
    ik = torch.cat((apply_rope(ik[..., :R], cos, sin, True), ik[..., R:]), -1)
    iw = (a @ ix.weights_proj.T) / (cfg.index_n_heads * cfg.index_head_dim) ** 0.5
    out = torch.zeros(T, nh, v, dtype=torch.float64)
    for t in range(T):
        score = {
            s: sum(iw[t, h] * torch.relu(iq[t, h] @ ik[s]) for h in range(cfg.index_n_heads)).item()
            for s in range(t + 1)
        }
        chosen = sorted(score, key=lambda s: (-score[s], s))[:topk]
        for h in range(nh):
            qh = torch.cat((q[t, h, :nope], apply_rope(q[t, h, nope:], cos[t], sin[t], True)))
            logits = torch.stack([qh @ torch.cat((kvb[s, h, :nope], k_pe[s])) for s in chosen]) / (nope + R) ** 0.5
            p = torch.softmax(logits, 0)
            out[t, h] = sum(p[i] * kvb[s, h, nope:] for i, s in enumerate(chosen))
    return out.reshape(T, nh * v) @ attn.o_proj.T


@pytest.mark.parametrize("topk", [3, 64])
def test_dsa_attention_matches_expanded_float64(topk):
    cfg = MtpConfig.preset("tiny").replace(index_topk=topk)
    w = MtpWeights.random(cfg, seed=21, dtype=torch.float64)
    T = 12
    a = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    cache = LayerCache.allocate(cfg, 2, torch.float64, "cpu")  # capacity 32 > T: masked tail
    got = dsa_attention(w.layer.attn, cfg, a, torch.arange(T), cache, Rope.build(cfg, 32, "cpu", torch.float64))
    want = expanded_attention(w.layer.attn, cfg, a, topk)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_rows_written_one_at_a_time_equal_a_batch_float64():
    cfg = MtpConfig.preset("tiny")
    w = MtpWeights.random(cfg, seed=23, dtype=torch.float64)
    a = torch.randn(10, cfg.hidden_size, generator=torch.Generator().manual_seed(24), dtype=torch.float64)
    rope = Rope.build(cfg, 32, "cpu", torch.float64)
    c1, c2 = (LayerCache.allocate(cfg, 2, torch.float64, "cpu") for _ in range(2))
    batch = dsa_attention(w.layer.attn, cfg, a, torch.arange(10), c1, rope)
    single = torch.cat([dsa_attention(w.layer.attn, cfg, a[t : t + 1], torch.tensor([t]), c2, rope) for t in range(10)])
    torch.testing.assert_close(single, batch, atol=1e-12, rtol=1e-12)


def test_index_scores_formula():
    cfg = MtpConfig.preset("tiny")
    w = MtpWeights.random(cfg, seed=25, dtype=torch.float64)
    ix = w.layer.attn.indexer
    g = torch.Generator().manual_seed(26)
    a = torch.randn(4, cfg.hidden_size, generator=g, dtype=torch.float64)
    q_lat = torch.randn(4, cfg.q_lora_rank, generator=g, dtype=torch.float64)
    keys = torch.randn(20, cfg.index_head_dim, generator=g, dtype=torch.float64)
    cos, sin = Rope.build(cfg, 20, "cpu", torch.float64).at(torch.tensor([3, 7, 8, 19]))
    got = index_scores(*index_queries(ix, cfg, a, q_lat, cos, sin), keys)
    R = cfg.qk_rope_head_dim
    q = (q_lat @ ix.wq_b.T).view(4, cfg.index_n_heads, -1)
    q = torch.cat((apply_rope(q[..., :R], cos[:, None], sin[:, None], True), q[..., R:]), -1)
    w_th = (a @ ix.weights_proj.T) * cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5
    for t in range(4):
        for s in range(20):
            want = sum(w_th[t, h] * max(0.0, (q[t, h] @ keys[s]).item()) for h in range(cfg.index_n_heads))
            assert got[t, s].item() == pytest.approx(float(want), abs=1e-12)
    k = index_keys(ix, cfg, a, cos, sin)
    assert k.shape == (4, cfg.index_head_dim)


def test_select_rows_brute_force():
    g = torch.Generator().manual_seed(27)
    scores = torch.randint(-3, 4, (30, 40), generator=g).double()  # small integers: many ties
    slots = torch.randint(0, 40, (30,), generator=g)
    for topk in (1, 5, 40):
        rows, count = select_rows(scores, slots, topk)
        mask = selection_mask(rows, count, 40)
        for t in range(30):
            visible = list(range(int(slots[t]) + 1))
            want = sorted(visible, key=lambda s: (-scores[t, s].item(), s))[:topk]
            assert rows[t, : int(count[t])].tolist() == sorted(want)  # the list, in ascending slot order
            assert mask[t].nonzero().flatten().tolist() == sorted(want)
