"""MoE routing against brute-force enumeration, and the block against a float64 formula."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.reference.moe import moe_block, route


def brute_force_route(scores, bias, cfg):
    """Enumerate every admissible group set and expert set; keep the best, as the spec words it."""
    biased = scores + bias
    E, G = cfg.n_routed_experts, cfg.n_group
    per = E // G
    group_score = [sorted(biased[g * per : (g + 1) * per].tolist(), reverse=True)[:2] for g in range(G)]
    group_score = [sum(v) for v in group_score] if G > 1 else [0.0]
    best_groups = max(itertools.combinations(range(G), cfg.topk_group if G > 1 else 1),
                      key=lambda gs: sum(group_score[g] for g in gs))
    eligible = [e for g in best_groups for e in range(g * per, (g + 1) * per)] if G > 1 else list(range(E))
    experts = max(itertools.combinations(eligible, cfg.num_experts_per_tok),
                  key=lambda es: sum(biased[e].item() for e in es))
    w = scores[list(experts)]
    if cfg.norm_topk_prob:
        w = w / w.sum()
    return sorted(experts), w * cfg.routed_scaling_factor


@pytest.mark.parametrize("n_group,topk_group,k", [(4, 2, 2), (2, 1, 2), (1, 1, 3), (4, 3, 4)])
def test_route_matches_brute_force(n_group, topk_group, k):
    cfg = MtpConfig.preset("tiny").replace(n_group=n_group, topk_group=topk_group, num_experts_per_tok=k)
    w = MtpWeights.random(cfg, seed=11, dtype=torch.float64)
    m = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    experts, weights = route(w.layer.mlp, cfg, m)
    scores = torch.sigmoid(m @ w.layer.mlp.router.T)
    for t in range(m.shape[0]):
        want_e, want_w = brute_force_route(scores[t], w.layer.mlp.e_score_correction_bias.double(), cfg)
        assert experts[t].tolist() == want_e
        torch.testing.assert_close(weights[t], want_w, atol=1e-12, rtol=1e-12)


def test_group_limiting_changes_the_choice():
    """Construct scores where the best two experts overall sit in different groups but one group
    holds the best pair: with topk_group=1 both experts must come from that group."""
    cfg = MtpConfig.preset("tiny").replace(n_group=4, topk_group=1, num_experts_per_tok=2)
    w = MtpWeights.random(cfg, seed=0, dtype=torch.float64)
    moe = w.layer.mlp
    moe.e_score_correction_bias = torch.zeros(cfg.n_routed_experts, dtype=torch.float32)
    # Router rows chosen so that logits = m @ router.T are what we want for m = e_0.
    logits = torch.tensor([3.0, -5.0, 2.0, 1.9, -5.0, -5.0, 2.9, -5.0], dtype=torch.float64)
    moe.router = torch.zeros_like(moe.router)
    moe.router[:, 0] = logits
    m = torch.zeros(1, cfg.hidden_size, dtype=torch.float64)
    m[0, 0] = 1.0
    experts, _ = route(moe, cfg, m)
    # Groups of 2: g0 = {0, 1}: 3 + -5; g1 = {2, 3}: 2 + 1.9 (best pair); g3 = {6, 7}.
    assert experts[0].tolist() == [2, 3]
    ungrouped, _ = route(moe, cfg.replace(n_group=1, topk_group=1), m)
    assert ungrouped[0].tolist() == [0, 6]


def test_bias_selects_but_does_not_weight():
    cfg = MtpConfig.preset("tiny").replace(n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=False)
    w = MtpWeights.random(cfg, seed=3, dtype=torch.float64)
    moe = w.layer.mlp
    m = torch.randn(1, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    scores = torch.sigmoid(m @ moe.router.T)[0]
    worst = int(scores.argmin())
    moe.e_score_correction_bias = torch.zeros(cfg.n_routed_experts)
    moe.e_score_correction_bias[worst] = 10.0
    experts, weights = route(moe, cfg, m)
    assert worst in experts[0].tolist()
    j = experts[0].tolist().index(worst)
    assert weights[0, j].item() == pytest.approx(scores[worst].item() * cfg.routed_scaling_factor)


def test_route_ties_go_to_the_lower_expert():
    cfg = MtpConfig.preset("tiny").replace(n_group=1, topk_group=1, num_experts_per_tok=2)
    w = MtpWeights.random(cfg, seed=0, dtype=torch.float32)
    moe = w.layer.mlp
    moe.router = torch.zeros_like(moe.router)  # every score is sigmoid(0) = 0.5: an 8-way tie
    moe.e_score_correction_bias = torch.zeros(cfg.n_routed_experts)
    experts, weights = route(moe, cfg, torch.randn(3, cfg.hidden_size))
    assert experts.tolist() == [[0, 1]] * 3
    torch.testing.assert_close(weights, torch.full((3, 2), cfg.routed_scaling_factor / 2))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_moe_block_matches_float64_formula(dtype, tol):
    cfg = MtpConfig.preset("tiny")
    w64 = MtpWeights.random(cfg, seed=5, dtype=torch.float64)
    w = w64.to(dtype=dtype)
    m = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(6)).to(dtype)
    got = moe_block(w.layer.mlp, cfg, m).double()
    moe = w.to(dtype=torch.float64).layer.mlp  # the same (rounded) weights, in float64
    x = m.double()
    experts, weights = route(moe, cfg, x)

    def expert(x, g, u, d):
        return F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)

    want = expert(x, moe.shared.gate_proj, moe.shared.up_proj, moe.shared.down_proj)
    for t in range(x.shape[0]):
        for j, e in enumerate(experts[t].tolist()):
            want[t] += weights[t, j] * expert(x[t], moe.experts_gate[e], moe.experts_up[e], moe.experts_down[e])
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)


def test_a_rows_moe_output_does_not_depend_on_its_batch():
    """Pinned numerics: the same row gives the same bytes alone or among others (routing, the
    routed experts and the shared expert alike)."""
    from glm_mtp.reference.bytes import same_bytes

    cfg = MtpConfig.preset("tiny")
    w = MtpWeights.random(cfg, seed=7, dtype=torch.bfloat16)
    m = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    batch = moe_block(w.layer.mlp, cfg, m)
    for t in range(6):
        assert same_bytes(moe_block(w.layer.mlp, cfg, m[t : t + 1])[0], batch[t])


def test_experts_are_read_in_place():
    """The reference MoE reads each chosen expert's weights as views of the stacked tensors: no
    op copies, gathers or casts them (an ``index_select`` of 8 of GLM-5's experts would copy
    ~300 MB per row)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = MtpConfig.preset("tiny")
    moe = MtpWeights.random(cfg, seed=9, dtype=torch.bfloat16).layer.mlp
    stacked = {t.untyped_storage().data_ptr() for t in (moe.experts_gate, moe.experts_up, moe.experts_down)}
    touched = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.untyped_storage().data_ptr() in stacked:
                touched.append(str(func))
            return func(*args, **(kwargs or {}))

    m = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    with Spy():
        moe_block(moe, cfg, m)
    assert touched and set(touched) <= {"aten.select.int", "aten.unsqueeze.default", "aten.mul.Tensor",
                                        "aten.view.default", "aten.slice.Tensor", "aten.expand.default"}, set(touched)
