"""A checkpoint in GLM-5.3-Flash's release layout: ``config.json`` nests the text model under
``text_config`` with the released fields around the drafter (index sharing, pools of 4 rows,
compressed pool keys, mHC, KDA's ``linear_attn_config``, ``layer_types``, ``indexer_types``, the
router's dtype; tests/data/release_layout/glm5next_tiny, at the tiny preset's widths). It loads as
the preset, sharing included, and the MTP layer saved under it drafts the same bytes."""

import json
from pathlib import Path

import torch

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.bytes import keyed_bytes
from glm_mtp.reference.checkpoint import save_checkpoint

RELEASE = Path(__file__).parents[1] / "data" / "release_layout" / "glm5next_tiny"


def test_release_config_reads_as_the_preset():
    cfg = MtpConfig.from_hf_config(RELEASE)
    assert cfg == MtpConfig.preset("glm5next_tiny")
    assert cfg.index_share_for_mtp_iteration and cfg.index_kpool == 4
    text = json.loads((RELEASE / "config.json").read_text())["text_config"]
    for field in ("mhc", "hc_mult", "linear_attn_config", "layer_types", "indexer_types", "moe_router_dtype", "index_kpool_compress"):
        assert field in text  # the fixture carries the released fields the drafter reads past


def test_release_checkpoint_loads_and_drafts(tmp_path):
    w = MtpWeights.random(MtpConfig.preset("glm5next_tiny"), seed=3, dtype=torch.float32)
    directory = tmp_path / "release"
    save_checkpoint(directory, json.loads((RELEASE / "config.json").read_text()), w.state_dict())
    loaded = MtpWeights.from_pretrained(directory)
    assert loaded.config == w.config
    runs = []
    for weights in (w, loaded):
        prop = ReferenceProposer(weights, max_seq_len=32)
        st = prop.alloc_state("cpu")
        gen = torch.Generator().manual_seed(1)
        prop.prefill_drafter(torch.randint(1, 96, (10,), generator=gen), torch.randn(10, 64, generator=gen), st)
        runs.append((prop.propose(7, torch.randn(64, generator=gen), 9, 3, st), keyed_bytes(prop.export_state(st))))
    assert runs[0] == runs[1]
