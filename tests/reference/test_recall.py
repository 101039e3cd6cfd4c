"""The dense ablation's selection (kpool.kpool_all_rows) and the recall of a selection
(reference/recall.py) on a random glm5next_tiny drafter."""

import torch

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.bytes import same_bytes
from glm_mtp.reference.kpool import kpool_all_rows, select_pool_rows, visible_rows
from glm_mtp.reference.recall import oracle_pool_recall, recall_of

CFG = MtpConfig.preset("glm5next_tiny")  # index_kpool 4, index_topk 8


def _prefill(kpool=None, n=30):
    w = MtpWeights.random(CFG, seed=0, dtype=torch.float32)
    p = ReferenceProposer(w, max_seq_len=64) if kpool is None else ReferenceProposer(w, max_seq_len=64, kpool=kpool)
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()
    st = p.alloc_state("cpu")
    p.prefill_drafter(toks, torch.randn(n, CFG.hidden_size, generator=g), st)
    prefilled = p.export_state(st)
    p.propose(toks[-1], torch.randn(1, CFG.hidden_size, generator=g), n - 1, 1, st)
    return prefilled, p.export_state(st)["x"]


def test_dense_ablation_changes_what_attention_reads_and_nothing_it_stores():
    sparse, x_sparse = _prefill()
    dense, x_dense = _prefill(kpool_all_rows)
    # A row's cache entries, index key and pool are made before its attention (and the prompt's
    # rows from the caller's hiddens): the same bytes either way ...
    for key in ("kv_rows", "index_rows", "pool_keys", "pool_complete", "pool_gates", "seq_len"):
        assert same_bytes(sparse[key], dense[key]), key
    # ... while the output the drafts read differs (30 rows at index_topk 8: pools were dropped).
    assert not same_bytes(x_sparse, x_dense)


def test_visible_rows_lists_every_visible_row():
    rows, count = visible_rows(torch.tensor([0, 3, 5]))
    assert count.tolist() == [1, 4, 6] and rows.shape == (3, 6)
    assert rows[1, :4].tolist() == [0, 1, 2, 3] and rows[1, 4:].tolist() == [0, 0]  # padding: slot 0


def test_recall_is_one_for_every_row_and_the_listed_mass_otherwise():
    slots = torch.arange(12, 20)
    g = torch.Generator().manual_seed(2)
    mass = torch.rand(8, 20, generator=g, dtype=torch.float64).masked_fill(torch.arange(20)[None] > slots[:, None], 0.0)
    mass = mass / mass.sum(-1, keepdim=True)
    assert recall_of(mass, *visible_rows(slots), slots).tolist() == [1.0] * 8
    rows, count = select_pool_rows(torch.rand(8, 5, generator=g), slots, CFG)  # 2 pools + the tail
    r = recall_of(mass, rows, count, slots)
    listed = torch.stack([mass[t, rows[t, : count[t]]].sum() for t in range(8)])
    torch.testing.assert_close(r, listed, rtol=0, atol=1e-12)
    assert bool((r < 1).all()) and bool((r > 0).all())


def test_the_oracle_keeps_the_most_mass_any_selection_can():
    slots = torch.arange(20, 28)
    g = torch.Generator().manual_seed(3)
    mass = torch.rand(8, 28, generator=g, dtype=torch.float64).masked_fill(torch.arange(28)[None] > slots[:, None], 0.0)
    mass = mass / mass.sum(-1, keepdim=True)
    best = oracle_pool_recall(mass, slots, CFG)
    for seed in range(20):  # random pool scores: never above the oracle
        rows, count = select_pool_rows(torch.rand(8, 7, generator=torch.Generator().manual_seed(seed)), slots, CFG)
        assert bool((recall_of(mass, rows, count, slots) <= best + 1e-12).all())
    uniform = torch.ones(8, 28, dtype=torch.float64).masked_fill(torch.arange(28)[None] > slots[:, None], 0.0)
    uniform = uniform / uniform.sum(-1, keepdim=True)
    # Flat attention: every selection keeps its share of the rows, the oracle too.
    torch.testing.assert_close(oracle_pool_recall(uniform, slots, CFG),
                               (2 * 4 + (slots + 1) % 4).double() / (slots + 1), rtol=0, atol=1e-12)
