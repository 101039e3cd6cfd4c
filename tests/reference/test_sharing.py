"""Index sharing across the draft steps of one propose (DESIGN.md §9), in the reference drafter,
both families: step 1 selects ``S`` for row p; step i >= 2 (row q) attends exactly ``S``, runs
none of the indexer's query side, and still writes every cache entry of row q. ``S`` lives for one
propose of one state. With the flag off every step selects for its own row, as a chain of
one-draft proposes does."""

import pytest
import torch

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference import attention as attention_module
from glm_mtp.reference import proposer as proposer_module
from glm_mtp.reference.bytes import keyed_bytes, same_bytes
from glm_mtp.reference.kpool import kpool_all_rows
from glm_mtp.reference.numerics import acc_dtype

# tiny: DSA, index_topk 6; glm5next_tiny: KPool, index_kpool 4, index_topk 8 (two pools).
FAMILIES = ["tiny", "glm5next_tiny"]
# The cache's bytes: what a row writes (export_state less x and the propose's counters).
CACHE_KEYS = ("kv_rows", "index_rows", "pool_keys", "pool_complete", "pool_gates", "seq_len")


def weights(preset: str, share: bool, seed: int = 3) -> MtpWeights:
    return MtpWeights.random(MtpConfig.preset(preset), seed=seed, dtype=torch.float32).with_index_share(share)


def prefilled(prop: ReferenceProposer, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    state = prop.alloc_state("cpu")
    prop.prefill_drafter(torch.randint(1, prop.config.vocab_size, (n,), generator=gen),
                         torch.randn(n, prop.config.hidden_size, generator=gen), state)
    return state, gen


def cache_bytes(prop, state):
    return {k: v for k, v in keyed_bytes(prop.export_state(state)).items() if k in CACHE_KEYS}


@pytest.fixture
def attended(monkeypatch):
    """Every list the MLA attends, per call: ``[(rows, count)]`` (one call per drafted row)."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = attention_module.sparse_mla

    def spy(attn, cfg, q_nope, q_pe, kv_rows, rows, count):  # type: ignore[no-untyped-def]
        seen.append((rows.clone(), count.clone()))
        return real(attn, cfg, q_nope, q_pe, kv_rows, rows, count)

    monkeypatch.setattr(attention_module, "sparse_mla", spy)
    return seen


def listed(rows: torch.Tensor, count: torch.Tensor) -> list[int]:
    return rows[0, : int(count[0])].tolist()


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("context", [3, 21], ids=["below_topk", "above_topk"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_shared_steps_attend_step_ones_selection(preset, context, sampled, attended):
    """Two proposes with drafts accepted between: in each, steps 2..k attend exactly step 1's
    list (rows <= p: not q, not p+1..q-1, no new tail or pool), a fresh one per propose. With the
    flag off later steps read rows past p (their own row; in KPool their tail)."""
    k = 4
    for share in (True, False):
        prop = ReferenceProposer(weights(preset, share), max_seq_len=64)
        state, gen = prefilled(prop, context, seed=11)
        A = acc_dtype(prop.weights.dtype)
        for _ in range(2):
            attended.clear()
            p = prop.drafter_rows(state)
            token = int(torch.randint(1, prop.config.vocab_size, (1,), generator=gen))
            hidden = torch.randn(prop.config.hidden_size, generator=gen)
            if sampled:
                noise = torch.empty(k, prop.config.vocab_size, dtype=A).exponential_(generator=gen)
                prop.propose_sampled(token, hidden, p, k, 1.5, noise, state)
            else:
                prop.propose(token, hidden, p, k, state)
            lists = [listed(r, c) for r, c in attended]
            assert len(lists) == k
            if share:
                assert max(lists[0]) <= p
                for i in range(1, k):
                    assert same_bytes(attended[i][0], attended[0][0]) and same_bytes(attended[i][1], attended[0][1])
            else:
                assert any(max(lists[i]) > p for i in range(1, k))
            prop.after_verify(2, state)  # rows p, p+1, p+2 stay: the next propose selects over them


@pytest.mark.parametrize("preset", FAMILIES)
def test_rows_outside_the_selection_are_never_read(preset, attended):
    """Above index_topk: overwrite the latent of every context row outside step 1's ``S``; a shared
    propose drafts the same bytes, while the flag-off drafter (whose later rows select other rows,
    checked) does not."""
    k, n = 3, 26
    out = {}
    for share in (True, False):
        prop = ReferenceProposer(weights(preset, share, seed=5), max_seq_len=64)
        runs = []
        S: list[int] = []  # step 1's selection, listed by the unperturbed run (the first)
        for perturb in (False, True):
            state, gen = prefilled(prop, n, seed=2)
            p = n - 1
            token = int(torch.randint(1, prop.config.vocab_size, (1,), generator=gen))
            hidden = torch.randn(prop.config.hidden_size, generator=gen)
            if perturb:
                outside = sorted(set(range(p)) - set(S))
                assert outside, "the context must be larger than the selection"
                L = prop.config.kv_lora_rank
                latent = state.cache.kv_pool.flatten(0, 1)  # block_table: identity
                latent[torch.tensor(outside), :L] = torch.randn(len(outside), L, generator=gen) * 10
            attended.clear()
            drafts = prop.propose(token, hidden, p, k, state)
            if not perturb:
                S = listed(*attended[0])
                lists = [set(listed(r, c)) for r, c in attended]
            runs.append((drafts, prop.export_state(state)["x"]))
        out[share] = (runs, lists)
    (same, changed), _ = out[True]
    assert same[0] == changed[0] and same_bytes(same[1], changed[1])
    (off_plain, off_perturbed), off_lists = out[False]
    assert any(lst - set(S) - set(range(n - 1, n - 1 + k)) for lst in off_lists[1:])  # flag off reads rows outside S
    assert not same_bytes(off_plain[1], off_perturbed[1])


@pytest.mark.parametrize("preset", FAMILIES)
def test_shared_rows_write_their_cache_entries_as_without_sharing(preset, monkeypatch):
    """Each row of a shared propose (a KPool pool completing inside it) stores exactly what a
    catch-up of the same (token, hidden) pairs stores: latent, index key, gate, pooled key."""
    prop = ReferenceProposer(weights(preset, True), max_seq_len=64)
    n, k = 14, 5  # rows 13..17: pool 3 (rows 12..15) completes at step 3 in glm5next_tiny
    shared, gen = prefilled(prop, n, seed=7)
    caught_up, _ = prefilled(prop, n, seed=7)
    inputs: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = proposer_module.mtp_rows

    def spy(w, tokens, hiddens, *args, **kwargs):  # type: ignore[no-untyped-def]
        inputs.append((tokens.clone(), hiddens.clone()))
        return real(w, tokens, hiddens, *args, **kwargs)

    monkeypatch.setattr(proposer_module, "mtp_rows", spy)
    prop.propose(int(torch.randint(1, prop.config.vocab_size, (1,), generator=gen)),
                 torch.randn(prop.config.hidden_size, generator=gen),
                 n - 1, k, shared)
    monkeypatch.setattr(proposer_module, "mtp_rows", real)
    assert len(inputs) == k
    tokens = torch.cat([t for t, _ in inputs])
    hiddens = torch.cat([h.reshape(1, -1) for _, h in inputs])
    assert prop.catchup_drafter(tokens, hiddens, n - 1, n - 1, caught_up) == k
    assert cache_bytes(prop, shared) == cache_bytes(prop, caught_up)
    if prop.config.is_next:
        assert bool(prop.export_state(shared)["pool_complete"][3])


@pytest.mark.parametrize("preset", FAMILIES)
def test_flag_off_is_a_chain_of_one_draft_proposes(preset):
    """With the flag off a k-draft propose is k one-draft proposes (each step selects for its own
    row): the same drafts, x and cache. With it on, one draft is the same on and off."""
    w = weights(preset, False)
    many, chain = ReferenceProposer(w, max_seq_len=64), ReferenceProposer(w, max_seq_len=64)
    a, gen = prefilled(many, 12, seed=4)
    b, _ = prefilled(chain, 12, seed=4)
    token, hidden = 5, torch.randn(w.config.hidden_size, generator=gen)
    drafts = many.propose(token, hidden, 11, 4, a)
    got = []
    for i in range(4):
        got += chain.propose(token, hidden, 11 + i, 1, b)
        chain.after_verify(0, b)
        token, hidden = got[-1], chain.export_state(b)["x"]
    assert drafts == got
    assert same_bytes(many.export_state(a)["x"], chain.export_state(b)["x"])
    assert cache_bytes(many, a) == cache_bytes(chain, b)

    on, off = ReferenceProposer(w.with_index_share(True), 64), ReferenceProposer(w, 64)
    sa, g1 = prefilled(on, 20, seed=9)
    sb, g2 = prefilled(off, 20, seed=9)
    for position in (19, 20, 21):
        token = int(torch.randint(1, w.config.vocab_size, (1,), generator=g1))
        hidden = torch.randn(w.config.hidden_size, generator=g1)
        assert on.propose(token, hidden, position, 1, sa) == off.propose(token, hidden, position, 1, sb)
        assert keyed_bytes(on.export_state(sa)) == keyed_bytes(off.export_state(sb))
        on.after_verify(1, sa)
        off.after_verify(1, sb)


@pytest.mark.parametrize("preset", FAMILIES)
def test_batch_is_each_state_alone(preset):
    """``propose_batch`` under sharing: every state keeps its own selection, from its own p."""
    prop = ReferenceProposer(weights(preset, True), max_seq_len=64)
    lengths = (3, 13, 22)
    batch = [prefilled(prop, n, seed=n)[0] for n in lengths]
    alone = [prefilled(prop, n, seed=n)[0] for n in lengths]
    gen = torch.Generator().manual_seed(8)
    for k, accepted in ((3, 1), (4, 4), (2, 0)):
        pos = [prop.drafter_rows(st) for st in batch]
        last = torch.randint(1, prop.config.vocab_size, (3,), generator=gen)
        hid = torch.randn(3, prop.config.hidden_size, generator=gen)
        got = prop.propose_batch(last, hid, pos, k, batch)
        want = [prop.propose(int(last[b]), hid[b], pos[b], k, alone[b]) for b in range(3)]
        assert got == want
        for b in range(3):
            assert keyed_bytes(prop.export_state(batch[b])) == keyed_bytes(prop.export_state(alone[b]))
            prop.after_verify(min(accepted, k), batch[b])
            prop.after_verify(min(accepted, k), alone[b])
            if accepted == k:  # the drafter is one row behind: catch up as the loop does
                x = prop.export_state(alone[b])["x"].reshape(1, -1)
                tok = torch.tensor([got[b][-1]])
                prop.catchup_drafter(tok, x, pos[b] + k, 0, batch[b])
                prop.catchup_drafter(tok, x, pos[b] + k, 0, alone[b])


def test_dense_ablation_attends_every_visible_row_whatever_the_flag(attended):
    """``attention=dense`` (``kpool_all_rows``) selects nothing, so nothing is shared: on and off
    draft the same bytes, and step i attends rows [0, q]."""
    runs = []
    for share in (True, False):
        prop = ReferenceProposer(weights("glm5next_tiny", share), max_seq_len=64, kpool=kpool_all_rows)
        state, gen = prefilled(prop, 17, seed=6)
        attended.clear()
        drafts = prop.propose(3, torch.randn(prop.config.hidden_size, generator=gen), 16, 3, state)
        assert [listed(r, c) for r, c in attended] == [list(range(16 + i + 1)) for i in range(3)]
        runs.append((drafts, keyed_bytes(prop.export_state(state))))
    assert runs[0] == runs[1]


def test_index_share_override_is_a_config_choice():
    w = MtpWeights.random(MtpConfig.preset("glm5next_tiny"), seed=0, dtype=torch.float32)
    assert w.config.index_share_for_mtp_iteration
    assert w.with_index_share(None) is w
    off = w.with_index_share(False)
    assert not off.config.index_share_for_mtp_iteration and off.eh_proj is w.eh_proj
    with pytest.raises(ValueError, match="index_share"):
        w.with_index_share("yes")  # type: ignore[arg-type]
