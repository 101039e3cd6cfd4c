"""The dense ablation's selection (kpool.kpool_all_rows, kpool.visible_rows) on a random
glm5next_tiny drafter."""

import torch

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.bytes import same_bytes
from glm_mtp.reference.kpool import kpool_all_rows, visible_rows

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
