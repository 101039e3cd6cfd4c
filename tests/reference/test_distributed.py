"""The sharded reference drafter over torch.distributed (gloo, one process per rank), against
the single-rank reference: expert-parallel MoE and row-parallel o_proj bit-exact; loading
reads only a rank's experts; a dead or stalled rank ends the run with a clear error. (The
sharded optimized drafter: tests/optimized/test_sharded.py.) The multi-process tests are
``slow``: they take most of this folder's time."""

import time

import pytest
import torch

from glm_mtp.conformance.sharded import check_sharded, check_sharded_runner, faulty_rank
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.distributed import NO_EP_ENV, launch
from glm_mtp.reference.bytes import same_bytes


@pytest.mark.slow
@pytest.mark.parametrize("world,scenarios", [(2, 12), (4, 6)])
def test_expert_parallel_passes_the_conformance_runner(world, scenarios):
    """The conformance runner's realistic scenarios, on every rank: sharded vs single-rank, bytes."""
    recs = check_sharded_runner(world, backend="reference", scenarios=scenarios, seed=world)
    for r in recs:
        assert r["ok"], r["first_difference"]
        assert r["scenarios_run"] == scenarios and r["steps_run"] > 5 * scenarios


@pytest.mark.slow
def test_expert_parallel_ranks_hold_the_same_bytes():
    recs = check_sharded(4, preset="tiny", dtype="bfloat16", scenarios=2, rounds=5, seed=4)
    for r in recs:
        assert r["needs_comm"] and r["experts_held"] == 2
        assert r["steps"] > 10 and r["byte_mismatch_steps"] == 0, r["first_mismatch"]
        assert r["draft_agree"] == r["draft_total"] > 0
        assert r["ranks_agree"]  # every rank's drafts and export_state bytes hash alike


@pytest.mark.slow
@pytest.mark.parametrize("world,dtype", [(2, "float32"), (4, "bfloat16")])
def test_row_parallel_o_proj_is_bit_exact(world, dtype):
    """Each rank sums an aligned subtree of o_proj's psum and the partials combine in tree
    order: the single-rank bytes, in every step."""
    recs = check_sharded(world, preset="tiny", dtype=dtype, scenarios=3, rounds=5, seed=7, row_parallel_o_proj=True)
    for r in recs:
        assert r["ranks_agree"]
        assert r["steps"] > 10 and r["byte_mismatch_steps"] == 0, r["first_mismatch"]
        assert r["draft_agree"] == r["draft_total"] > 0


def test_row_parallel_o_proj_needs_a_power_of_two_world():
    from glm_mtp.reference.distributed import ShardSpec

    with pytest.raises(ValueError, match="power-of-two world"):
        ShardSpec(0, 3, row_parallel_o_proj=True)
    assert ShardSpec(0, 3, row_parallel_o_proj=False).world == 3


@pytest.mark.slow
@pytest.mark.parametrize("fault,match", [("die", "rank 1 died"), ("stall", "a rank raised")])
def test_a_dead_or_stalled_rank_fails_fast(fault, match):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=match):
        launch(faulty_rank, 2, fault, timeout_s=90, collective_timeout_s=5)
    assert time.monotonic() - t0 < 90


def test_each_rank_reads_only_its_experts(tmp_path, monkeypatch):
    cfg = MtpConfig.preset("tiny")
    full = MtpWeights.random(cfg, seed=2, dtype=torch.bfloat16)
    full.save_pretrained(tmp_path, shard_size=9)
    import glm_mtp.reference.checkpoint as ck

    real, read = ck.read_tensors, {}

    def counting(directory, names, weight_map):
        out = real(directory, names, weight_map)
        read.update({n: t.numel() * t.element_size() for n, t in out.items()})
        return out

    monkeypatch.setattr(ck, "read_tensors", counting)
    sd = full.state_dict()
    expert_bytes = {n: t.numel() * t.element_size() for n, t in sd.items() if ".mlp.experts." in n}
    common = sum(t.numel() * t.element_size() for n, t in sd.items()) - sum(expert_bytes.values())
    for world in (2, 4):
        for rank in range(world):
            read.clear()
            w = MtpWeights.from_pretrained(tmp_path, ep_rank=rank, ep_world=world, row_parallel_o_proj=False)
            mine = range(rank * 8 // world, (rank + 1) * 8 // world)
            names = {n for n in read if ".mlp.experts." in n}
            assert names == {n for n in expert_bytes if int(n.split(".mlp.experts.")[1].split(".")[0]) in mine}
            assert sum(read.values()) == common + sum(expert_bytes[n] for n in names)
            assert same_bytes(w.layer.mlp.experts_up, full.layer.mlp.experts_up[mine.start : mine.stop])


def test_needs_comm_and_the_disabling_variable(monkeypatch):
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=0, dtype=torch.float32)
    assert not ReferenceProposer(w, 32).needs_comm()
    assert ReferenceProposer(w.shard(0, 2), 32).needs_comm()
    assert not ReferenceProposer(w.shard(0, 1), 32).needs_comm()
    monkeypatch.setenv(NO_EP_ENV, "1")
    replicated = w.shard(1, 2)
    assert replicated is w and not ReferenceProposer(replicated, 32).needs_comm()


def test_shard_rules():
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="n_routed_experts"):
        w.shard(0, 3, row_parallel_o_proj=False)
    with pytest.raises(ValueError, match="rank"):
        w.shard(2, 2)
    s = w.shard(1, 2)
    assert s.layer.attn.o_proj.shape == (64, 32) and same_bytes(s.layer.attn.o_proj, w.layer.attn.o_proj[:, 32:])
    with pytest.raises(ValueError, match="sharded"):
        s.state_dict()
