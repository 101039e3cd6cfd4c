"""The byte model (glm_mtp.tools.floor): what one draft step must read, by hand at tiny and in
proportion at GLM-5."""

import torch

from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.tools.floor import floor_bytes_per_draft


def test_floor_bytes_glm5():
    cfg = MtpConfig.preset("glm5")
    b = floor_bytes_per_draft(cfg, torch.bfloat16, visible_rows=1000)
    experts = 8 * 3 * 2048 * 6144 * 2  # the chosen experts dominate with the head
    head = 154880 * 6144 * 2
    assert experts + head < b < experts + head + 1.2e9
    # Attending more rows reads more, and only the top-k KV rows count.
    assert floor_bytes_per_draft(cfg, torch.bfloat16, 5000) - b == 4000 * 128 * 2 + (2048 - 1000) * 576 * 2


def test_floor_bytes_of_tiny_by_hand():
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=0, dtype=torch.bfloat16)
    H, V = 64, 96
    weights = (
        3 * H + 2 * H * H  # enorm, hnorm, shared_head.norm; eh_proj (64, 128)
        + 2 * H  # input / post-attention norms
        + 32 * H + 32 + 4 * (16 + 8) * 32  # q_a (32, 64), q_a norm, q_b (96, 32)
        + (16 + 8) * H + 16 + 4 * (16 + 16) * 16  # kv_a (24, 64), kv_a norm, kv_b (128, 16)
        + H * 4 * 16  # o_proj (64, 64)
        + 2 * 16 * 32 + 16 * H + 2 * 16 + 2 * H  # indexer wq_b (32, 32), wk (16, 64), k_norm w+b, weights_proj (2, 64)
        + 8 * H  # router
        + 2 * 3 * 32 * H  # the two chosen experts
        + 3 * 32 * H  # the shared expert
        + H + V * H  # one embedding row, the head
    )
    rows = 10 * 16 + 6 * 24  # index keys of 10 rows, kv rows of min(6, 10)
    assert floor_bytes_per_draft(w.config, w.dtype, 10) == 2 * (weights + rows) + 8 * 4  # + the float32 router bias
    assert floor_bytes_per_draft(w.config, w.dtype, 3) == 2 * (weights + 3 * 16 + 3 * 24) + 32
    w32 = MtpWeights.random(MtpConfig.preset("tiny"), seed=0, dtype=torch.float32)
    assert floor_bytes_per_draft(w32.config, w32.dtype, 10) == 4 * (weights + rows) + 32


def test_floor_counts_pooled_keys_and_selected_pools_in_glm5next():
    from glm_mtp.tools.floor import attended_row_bytes

    cfg = MtpConfig.preset("glm5next_tiny")  # kp 4, index_topk 8: two pools listed
    D, row = cfg.index_head_dim, cfg.kv_row_width  # 16, 16 (NoPE: the latent only)
    # 10 rows visible (slot 9): pools 0 and 1 complete, both listed, tail rows 8 and 9.
    assert attended_row_bytes(cfg, 10, 2) == 2 * (2 * D + (2 * 4 + 2) * row)
    # 23 rows: 5 complete pools scored, 2 listed (8 rows) and a tail of 3.
    assert attended_row_bytes(cfg, 23, 2) == 2 * (5 * D + (8 + 3) * row)
    # A row that completes its pool has no tail: its pool is one of the scored ones.
    assert attended_row_bytes(cfg, 24, 2) == 2 * (6 * D + 8 * row)
    # Before its first pool completes a row reads no pooled key, only its own rows.
    assert attended_row_bytes(cfg, 3, 2) == 2 * (3 * row)
    # At GLM-5.3-Flash's released sizes (kpool 4) the scored keys are 1/4 of GLM-5's per-row keys;
    # the listed rows stay 512 pools of 4 (2,048) past 2,048 rows.
    big = MtpConfig.preset("glm5next")
    assert big.index_kpool == 4 and big.kpool_pools_selected == 512
    assert attended_row_bytes(big, 4096 * 16, 2) - attended_row_bytes(big, 4096, 2) == 2 * (4096 * 15 // 4) * 128


def test_a_shared_steps_floor_leaves_out_the_query_side():
    """A shared draft step (DESIGN.md §9) reads no index query weights (the indexer's wq_b and
    weights_proj), no index or pooled keys, and the MLA rows of step 1's list only."""
    import math

    from glm_mtp.reference.weights import mtp_tensor_shapes
    from glm_mtp.tools.floor import QUERY_SIDE_WEIGHTS, draft_step_bytes, shared_row_bytes

    for preset in ("tiny", "glm5next_tiny"):
        cfg = MtpConfig.preset(preset)
        plain, shared = draft_step_bytes(cfg, 20), draft_step_bytes(cfg, 20, selected_at=19)
        shapes = mtp_tensor_shapes(cfg)
        assert plain.layer - shared.layer == 2 * sum(math.prod(shapes[n]) for n in QUERY_SIDE_WEIGHTS) > 0
        assert shared.head == plain.head and shared.cache == shared_row_bytes(cfg, 19)
        assert draft_step_bytes(cfg, 40, selected_at=19) == shared  # step 1's list, not the step's own rows
    tiny, nxt = MtpConfig.preset("tiny"), MtpConfig.preset("glm5next_tiny")
    assert shared_row_bytes(tiny, 19) == 2 * 6 * 24  # index_topk 6 rows of 24 values, no keys
    # 19 rows visible to step 1: 4 complete pools, 2 listed (8 rows), a tail of 3.
    assert shared_row_bytes(nxt, 19) == 2 * (8 + 3) * 16
    assert shared_row_bytes(nxt, 0) == 0
