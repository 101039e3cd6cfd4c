"""The recall of a selection (tools/selection_recall.py): the share of the dense attention it
keeps, and the oracle that no selection of its size beats."""

import torch

from glm_mtp.reference import MtpConfig
from glm_mtp.reference.kpool import select_pool_rows, visible_rows
from glm_mtp.tools.selection_recall import oracle_pool_recall, recall_of

CFG = MtpConfig.preset("glm5next_tiny")  # index_kpool 4, index_topk 8


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


def test_dense_mass_of_an_fp8_drafter_is_that_of_its_dequantized_weights():
    # An fp8 drafter's recall is measured against the attention it computes: its weights dequantized.
    import dataclasses

    from glm_mtp.reference import MtpWeights
    from glm_mtp.reference.bytes import same_bytes
    from glm_mtp.reference.fp8 import dequantize
    from glm_mtp.tools.selection_recall import dense_attention_mass

    cfg = MtpConfig.preset("glm5next_tiny")
    attn8 = MtpWeights.random(cfg, seed=4, dtype=torch.bfloat16).quantize_fp8().layer.attn
    plain = dataclasses.replace(attn8, q_b_proj=dequantize(attn8.q_b_proj, torch.float64),
                                kv_b_proj=dequantize(attn8.kv_b_proj, torch.float64))
    g = torch.Generator().manual_seed(5)
    q_latent = torch.randn(3, cfg.q_lora_rank, generator=g)
    kv = torch.randn(10, cfg.kv_lora_rank, generator=g)
    slots = torch.tensor([7, 8, 9])
    a = dense_attention_mass(attn8, cfg, q_latent, kv, slots)
    b = dense_attention_mass(plain, cfg, q_latent, kv, slots)
    assert same_bytes(a, b)
