"""The glm5_next forward pieces (DESIGN.md §7): the KPool selection (whole pools, ties to the
lower pool id, the tail, ascending slots), the pooled key of a pool computed once when its last
row is written, the clamped SwiGLU, and NoPE MLA rows."""

import pytest
import torch

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference import kpool as kpool_mod
from glm_mtp.reference.kpool import select_pool_rows
from glm_mtp.reference.layers import clamped_swiglu_hidden
from glm_mtp.reference.numerics import linear

CFG = MtpConfig.preset("glm5next_tiny")  # kpool 4, index_topk 8: two pools selected


def listed(rows, count, t):
    return rows[t, : count[t]].tolist()


def test_a_row_before_its_first_complete_pool_attends_to_its_tail_only():
    rows, count = select_pool_rows(torch.zeros(3, 0), torch.tensor([0, 1, 2]), CFG)
    assert [listed(rows, count, t) for t in range(3)] == [[0], [0, 1], [0, 1, 2]]


def test_a_row_completing_its_pool_has_no_tail_and_selects_it():
    rows, count = select_pool_rows(torch.tensor([[0.5]]), torch.tensor([3]), CFG)
    assert listed(rows, count, 0) == [0, 1, 2, 3]


def test_best_pools_in_ascending_slot_order_then_the_tail():
    # row 21: pools 0..4 complete (last rows 3..19), tail rows 20, 21; pool 4 and 1 score best.
    scores = torch.tensor([[0.1, 0.9, 0.2, 0.3, 1.5]])
    rows, count = select_pool_rows(scores, torch.tensor([21]), CFG)
    assert listed(rows, count, 0) == [4, 5, 6, 7, 16, 17, 18, 19, 20, 21]


def test_ties_go_to_the_lower_pool_id():
    scores = torch.tensor([[0.7, 0.7, 0.7, 0.7]])
    rows, count = select_pool_rows(scores, torch.tensor([17]), CFG)
    assert listed(rows, count, 0) == [0, 1, 2, 3, 4, 5, 6, 7, 16, 17]


def test_pools_past_a_row_are_not_candidates():
    # one call, rows 5 and 15: row 5 sees pool 0 only (pool 1 ends at 7), whatever pool 3 scores.
    scores = torch.tensor([[0.0, 0.0, 0.0, 9.0], [0.0, 0.0, 0.0, 9.0]])
    rows, count = select_pool_rows(scores, torch.tensor([5, 15]), CFG)
    assert listed(rows, count, 0) == [0, 1, 2, 3, 4, 5]
    assert listed(rows, count, 1) == [0, 1, 2, 3, 12, 13, 14, 15]


def test_clamped_swiglu_clamps_gate_above_and_up_on_both_sides():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 8, generator=g) * 4
    gate, up = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    L = 1.5
    got = clamped_swiglu_hidden(x, gate, up, L).double()
    a, b = linear(x, gate).double().clamp(max=L), linear(x, up).double().clamp(-L, L)
    want = torch.nn.functional.silu(a) * b
    assert (linear(x, gate) > L).any() and (linear(x, up) < -L).any() and (linear(x, up) > L).any()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    x[0, 0] = float("nan")
    assert clamped_swiglu_hidden(x, gate, up, L)[0].isnan().all()


@pytest.fixture(scope="module")
def prop():
    return ReferenceProposer(MtpWeights.random(CFG, seed=4, dtype=torch.bfloat16), max_seq_len=64)


def inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(CFG.vocab_size, (n,), generator=g), torch.randn(n, CFG.hidden_size, generator=g).to(
        torch.bfloat16
    )


def test_each_pool_key_is_computed_once_when_its_last_row_is_written(prop, monkeypatch):
    computed = []
    real = kpool_mod.pooled_keys

    def counting(ix, keys, gates):
        computed.append(keys.shape[0])
        return real(ix, keys, gates)

    monkeypatch.setattr(kpool_mod, "pooled_keys", counting)
    state = prop.alloc_state("cpu")
    tokens, hiddens = inputs(11)
    prop.prefill_drafter(tokens, hiddens, state)  # rows 0..9: pools 0, 1
    assert computed == [2]
    prop.propose(5, hiddens[-1], 10, 3, state)  # rows 10, 11 (completes pool 2), 12
    assert computed == [2, 1]
    prop.after_verify(0, state)  # back to 11 rows: pool 2 loses row 11
    snap = prop.export_state(state)
    assert snap["pool_complete"].tolist() == [True, True, False] and snap["pool_keys"].shape == (2, CFG.index_head_dim)
    prop.propose(7, hiddens[-2], 11, 1, state)  # row 11 again: pool 2's key is recomputed
    assert computed == [2, 1, 1]


def test_nope_rows_hold_the_latent_only_and_the_index_key_unrotated(prop):
    state = prop.alloc_state("cpu")
    tokens, hiddens = inputs(9, seed=1)
    prop.prefill_drafter(tokens, hiddens, state)
    snap = prop.export_state(state)
    assert snap["kv_rows"].shape == (8, CFG.kv_lora_rank) and snap["index_rows"].shape == (8, CFG.index_head_dim)
    assert snap["pool_gates"].shape == (8, CFG.index_head_dim) and snap["pool_complete"].tolist() == [True, True]
    assert not (snap["pool_keys"] == 0).all()


def test_the_glm5_export_keys_are_unchanged():
    p = ReferenceProposer(MtpWeights.random(MtpConfig.preset("tiny"), seed=0), max_seq_len=32)
    assert list(p.export_state(p.alloc_state("cpu"))) == ["kv_rows", "index_rows", "x", "seq_len", "last_drafted",
                                                          "pending", "block_table"]


def test_a_freed_state_exports_no_pools(prop):
    state = prop.alloc_state("cpu")
    tokens, hiddens = inputs(9, seed=2)
    prop.prefill_drafter(tokens, hiddens, state)
    prop.free_state(state)
    snap = prop.export_state(state)
    assert snap["pool_keys"].shape == (0, CFG.index_head_dim) and snap["pool_complete"].shape == (0,)
    assert snap["pool_gates"].shape == (0, CFG.index_head_dim)


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda p, s, h: p.propose(CFG.vocab_size, h[0], 9, 2, s), ValueError),  # token id out of range
        (lambda p, s, h: p.propose(1, h[0, :-1], 9, 2, s), ValueError),  # hidden of the wrong shape
        (lambda p, s, h: p.propose(1, h[0], 10, 2, s), RuntimeError),  # behind: position > seq_len
        (lambda p, s, h: p.catchup_drafter([1, 2], h[:1], 9, 9, s), ValueError),  # len(tokens) != len(hiddens)
        (lambda p, s, h: p.after_verify(0, s), RuntimeError),  # nothing pending
        (lambda p, s, h: p.propose(1, h[0], 9, 200, s), ValueError),  # rows past capacity
    ],
)
def test_a_refused_call_leaves_every_byte_including_the_pools(prop, call, error):
    from glm_mtp.reference.bytes import same_bytes

    state = prop.alloc_state("cpu")
    tokens, hiddens = inputs(10, seed=3)
    prop.prefill_drafter(tokens, hiddens, state)  # 9 rows: pools 0, 1 complete, pool 2 partial
    before = prop.export_state(state)
    with pytest.raises(error):
        call(prop, state, hiddens)
    after = prop.export_state(state)
    assert before.keys() == after.keys() and all(same_bytes(before[k], after[k]) for k in before)
