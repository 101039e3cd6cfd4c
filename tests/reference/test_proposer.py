"""The engine drafter's invariants and every rule of DESIGN.md §4, one test each."""

import logging

import pytest
import torch

from glm_mtp.reference import ReferenceProposer
from glm_mtp.reference.state import BLOCK_ROWS


def prefilled(prop, inputs, n=10):
    """A state prefilled with an n-token prompt; returns (state, next position)."""
    state = prop.alloc_state("cpu")
    assert prop.prefill_drafter(inputs.tokens(n), inputs.hiddens(n), state) == n - 1
    return state, n - 1


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_first_row_is_never_trimmed(prop, inputs, k):
    for accepted in range(k + 1):
        state, pos = prefilled(prop, inputs)
        prop.propose(inputs.token(), inputs.hiddens(1), pos, k, state)
        assert prop.drafter_rows(state) == pos + k
        prop.after_verify(accepted, state)
        # keep = min(k, accepted + 1) >= 1: row `pos` survives every verdict.
        assert prop.drafter_rows(state) == pos + min(k, accepted + 1)
        assert prop.drafter_rows(state) >= pos + 1
        snap = prop.export_state(state)
        assert not bool(snap["pending"]) and int(snap["last_drafted"]) == 0


def test_kept_first_row_equals_a_one_draft_propose(prop, inputs, snap):
    tok, hid = inputs.token(), inputs.hiddens(1)
    prompt, hiddens = inputs.tokens(9), inputs.hiddens(9)
    a, b = prop.alloc_state("cpu"), prop.alloc_state("cpu")
    for s in (a, b):
        prop.prefill_drafter(prompt, hiddens, s)
    prop.propose(tok, hid, 8, 4, a)
    prop.after_verify(0, a)
    prop.propose(tok, hid, 8, 1, b)
    prop.after_verify(0, b)
    ea, eb = snap(prop, a), snap(prop, b)
    for key in ("kv_rows", "index_rows", "seq_len", "pending", "last_drafted", "block_table"):
        assert ea[key] == eb[key], key
    # x differs on purpose: it is the output of the last row propose wrote (row 11 vs row 8).


def test_one_draft_propose_trims_nothing(prop, inputs):
    state, pos = prefilled(prop, inputs)
    prop.propose(inputs.token(), inputs.hiddens(1), pos, 1, state)
    prop.after_verify(0, state)
    assert prop.drafter_rows(state) == pos + 1


def test_second_free_is_a_noop(prop, snap):
    state = prop.alloc_state("cpu")
    prop.free_state(state)
    before = snap(prop, state)
    prop.free_state(state)
    assert snap(prop, state) == before
    assert prop.drafter_rows(state) == 0 and prop.last_pair_key(state) is None


def test_freed_state_exports_empty(prop, inputs, weights):
    state, _ = prefilled(prop, inputs)
    prop.free_state(state)
    e = prop.export_state(state)
    cfg = weights.config
    assert e["kv_rows"].shape == (0, cfg.kv_row_width) and e["index_rows"].shape == (0, cfg.index_head_dim)
    assert e["block_table"].shape == (0,) and e["block_table"].dtype == torch.int32
    assert e["x"].shape == (cfg.hidden_size,) and not e["x"].any()
    assert int(e["seq_len"]) == 0 and int(e["last_drafted"]) == 0 and not bool(e["pending"])


def test_misaligned_catchup_writes_nothing(prop, inputs, snap):
    state, pos = prefilled(prop, inputs)
    before = snap(prop, state)
    for row_base in (pos - 1, pos + 1, 0):
        assert prop.catchup_drafter(inputs.tokens(2), inputs.hiddens(2), row_base, row_base, state) == 0
        assert snap(prop, state) == before


def test_aligned_catchup_appends(prop, inputs):
    state, pos = prefilled(prop, inputs)
    assert prop.catchup_drafter(inputs.tokens(3), inputs.hiddens(3), pos, pos, state) == 3
    assert prop.drafter_rows(state) == pos + 3 and prop.last_pair_key(state) == pos + 2


def test_propose_behind_is_refused(prop, inputs, snap):
    state, pos = prefilled(prop, inputs)
    before = snap(prop, state)
    with pytest.raises(RuntimeError, match="catch up"):
        prop.propose(inputs.token(), inputs.hiddens(1), pos + 1, 2, state)
    assert snap(prop, state) == before


def test_propose_ahead_is_rewound(prop, inputs, snap):
    """A drafter ahead of `position` first drops rows >= position; the result equals a drafter
    that never had them."""
    prompt, hiddens = inputs.tokens(12), inputs.hiddens(12)
    tok, hid = inputs.token(), inputs.hiddens(1)
    ahead, exact = prop.alloc_state("cpu"), prop.alloc_state("cpu")
    for s in (ahead, exact):  # the same 7 rows, written in the same batch
        prop.prefill_drafter(prompt[:8], hiddens[:8], s)
    assert prop.catchup_drafter(prompt[8:12], hiddens[7:11], 7, 7, ahead) == 4  # 4 rows ahead
    d_ahead = prop.propose(tok, hid, 7, 3, ahead)
    d_exact = prop.propose(tok, hid, 7, 3, exact)
    assert d_ahead == d_exact
    assert snap(prop, ahead) == snap(prop, exact)


def test_num_drafts_zero_only_rewinds(prop, inputs):
    state, pos = prefilled(prop, inputs)
    assert prop.propose(inputs.token(), inputs.hiddens(1), pos - 3, 0, state) == []
    e = prop.export_state(state)
    assert int(e["seq_len"]) == pos - 3 and bool(e["pending"]) and int(e["last_drafted"]) == 0
    prop.after_verify(0, state)
    assert prop.drafter_rows(state) == pos - 3


def test_rope_position_is_the_slot(prop, inputs, snap):
    """pos_base is ignored: a catch-up written with another pos_base holds the same bytes."""
    prompt, hiddens = inputs.tokens(6), inputs.hiddens(6)
    toks, hids = inputs.tokens(4), inputs.hiddens(4)
    a, b = prop.alloc_state("cpu"), prop.alloc_state("cpu")
    for s, pos_base in ((a, 5), (b, 1000)):
        prop.prefill_drafter(prompt, hiddens, s)
        assert prop.catchup_drafter(toks, hids, 5, pos_base, s) == 4
    assert snap(prop, a) == snap(prop, b)


def test_prefill_on_a_state_with_rows_writes_nothing(prop, inputs, snap):
    state, _ = prefilled(prop, inputs)
    before = snap(prop, state)
    assert prop.prefill_drafter(inputs.tokens(5), inputs.hiddens(5), state) == 0
    assert snap(prop, state) == before


def test_prefill_logs_only_when_it_writes(prop, inputs, caplog):
    state = prop.alloc_state("cpu")
    with caplog.at_level(logging.INFO, logger="glm_mtp"):
        prop.prefill_drafter(inputs.tokens(5), inputs.hiddens(5), state)
        prop.prefill_drafter(inputs.tokens(5), inputs.hiddens(5), state)
    records = [r for r in caplog.records if "prefill" in r.getMessage()]
    assert len(records) == 1
    assert "4 rows (5 prompt tokens)" in records[0].getMessage() and " ms" in records[0].getMessage()


def test_fingerprint_log(prop, inputs, caplog, monkeypatch):
    state, pos = prefilled(prop, inputs)
    hid = inputs.hiddens(1)
    monkeypatch.setenv("GLM_MTP_DEBUG_FINGERPRINT", "1")
    with caplog.at_level(logging.INFO, logger="glm_mtp"):
        prop.propose(7, hid, pos, 1, state)
    (rec,) = [r for r in caplog.records if "GLM_MTP_DBG" in r.getMessage()]
    from glm_mtp.reference.bytes import hidden_fingerprint

    assert f"position={pos}" in rec.getMessage() and f"fp_target={hidden_fingerprint(hid)}" in rec.getMessage()
    assert hidden_fingerprint(hid) != hidden_fingerprint(hid + 1)


def test_pair_key(prop, inputs):
    state = prop.alloc_state("cpu")
    assert prop.last_pair_key(state) is None
    prop.prefill_drafter(inputs.tokens(4), inputs.hiddens(4), state)
    assert prop.last_pair_key(state) == 2 == prop.drafter_rows(state) - 1


def test_prefill_cap(weights, inputs):
    prop = ReferenceProposer(weights, max_seq_len=20)
    assert prop.prefill_hidden_rows(100) == 20 and prop.prefill_hidden_rows(7) == 7
    state = prop.alloc_state("cpu")
    with pytest.raises(ValueError, match="max_seq_len"):
        prop.prefill_drafter(inputs.tokens(21), inputs.hiddens(21), state)
    assert prop.prefill_drafter(inputs.tokens(20), inputs.hiddens(20), state) == 19


def test_max_seq_len_is_capped_at_the_dsa_context(weights):
    prop = ReferenceProposer(weights, max_seq_len=10**6)
    assert prop.max_seq_len == weights.config.max_position_embeddings


@pytest.mark.parametrize("max_seq_len", [1, 15, 16, 17, 64, 100])
def test_block_table_size_and_clearing(weights, max_seq_len):
    prop = ReferenceProposer(weights, max_seq_len=max_seq_len)
    state = prop.alloc_state("cpu")
    table = prop.export_state(state)["block_table"]
    blocks = max_seq_len // BLOCK_ROWS + 2
    assert table.dtype == torch.int32 and table.tolist() == list(range(blocks))
    assert prop.capacity == BLOCK_ROWS * blocks > max_seq_len
    prop.free_state(state)
    assert prop.export_state(state)["block_table"].numel() == 0


def test_drafts_run_past_max_seq_len_up_to_capacity(weights, inputs):
    prop = ReferenceProposer(weights, max_seq_len=16)  # capacity 48
    state = prop.alloc_state("cpu")
    prop.prefill_drafter(inputs.tokens(16), inputs.hiddens(16), state)
    prop.catchup_drafter(inputs.tokens(30), inputs.hiddens(30), 15, 15, state)
    assert len(prop.propose(inputs.token(), inputs.hiddens(1), 45, 3, state)) == 3
    assert prop.drafter_rows(state) == 48


def test_two_fresh_states_are_byte_identical(prop, inputs, snap):
    prompt, hiddens = inputs.tokens(11), inputs.hiddens(11)
    calls = [(inputs.token(), inputs.hiddens(1), k, a) for k, a in ((3, 1), (2, 2), (4, 0))]
    snaps, drafts = [], []
    for _ in range(2):
        s = prop.alloc_state("cpu")
        prop.prefill_drafter(prompt, hiddens, s)
        out = []
        for tok, hid, k, acc in calls:
            out.append(prop.propose(tok, hid, prop.drafter_rows(s), k, s))
            prop.after_verify(acc, s)
        drafts.append(out)
        snaps.append(snap(prop, s))
    assert drafts[0] == drafts[1] and snaps[0] == snaps[1]


def test_catchup_pairs_like_prefill(weights, inputs):
    """Rows written by prefill(20) and by prefill(10) + catch-up(10) pair the same tokens with
    the same hiddens: same drafts, rows equal up to rounding (batches of another size)."""
    prop = ReferenceProposer(weights, max_seq_len=64)
    prompt, hiddens = inputs.tokens(21), inputs.hiddens(21)
    whole, split = prop.alloc_state("cpu"), prop.alloc_state("cpu")
    assert prop.prefill_drafter(prompt, hiddens, whole) == 20
    assert prop.prefill_drafter(prompt[:11], hiddens[:11], split) == 10
    # Rows 10..19 pair t_11..t_20 with h_10..h_19.
    assert prop.catchup_drafter(prompt[11:21], hiddens[10:20], 10, 10, split) == 10
    tok, hid = inputs.token(), inputs.hiddens(1)
    assert prop.propose(tok, hid, 20, 3, whole) == prop.propose(tok, hid, 20, 3, split)
    a, b = prop.export_state(whole), prop.export_state(split)
    tol = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(a["kv_rows"].float(), b["kv_rows"].float(), **tol)
    torch.testing.assert_close(a["index_rows"].float(), b["index_rows"].float(), **tol)
    # A mispaired catch-up (token r with hidden r+1) is far from it, so the check above can fail.
    bad = prop.alloc_state("cpu")
    prop.prefill_drafter(prompt[:11], hiddens[:11], bad)
    prop.catchup_drafter(prompt[11:21], hiddens[11:21], 10, 10, bad)
    diff = (prop.export_state(bad)["kv_rows"][10:20].float() - a["kv_rows"][10:20].float()).abs().max()
    assert diff > 0.1
