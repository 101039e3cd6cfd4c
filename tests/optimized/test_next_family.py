"""The optimized drafter on the glm5_next family (GLM-5.3-Flash, DESIGN.md §7) against the
reference, byte for byte: the lockstep scenarios at ``glm5next_tiny`` (kpool 4, so rows cross pool
boundaries within a few steps) in bf16 and fp32, and walks through the family's device-gated state
writes (pool gates and keys, a propose's rewind into a complete pool, a refused propose whose row
would complete a pool, a batch of states at different lengths), each with a mutant it catches."""

import pytest
import torch

from glm_mtp.conformance import run
from glm_mtp.optimized import unfused_block as opt_block
from glm_mtp.optimized import kernels, proposer
from glm_mtp.reference.bytes import same_bytes
from glm_mtp.reference import MtpConfig, MtpWeights

from .conftest import DrafterPair, Inputs

PRESET = "glm5next_tiny"
CFG = MtpConfig.preset(PRESET)  # kpool 4, index_topk 8


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def next_weights(request) -> MtpWeights:
    return MtpWeights.random(CFG, seed=11, dtype=request.param)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_lockstep_scenarios(dtype):
    r = run("optimized", "reference", scenarios=2, seed=7, preset=PRESET, dtype=dtype)
    assert r.ok, r.first_difference


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=["bf16", "fp32", "fp64"])
def test_lockstep_scenarios_long(dtype):
    r = run("optimized", "reference", scenarios=20, seed=8, preset=PRESET, dtype=dtype,
            generators=("realistic", "adversarial", "batched"))
    assert r.ok, r.first_difference


def walk(pair: DrafterPair, inp: Inputs) -> None:
    """Prefill 9 rows (two pools complete), drafts that complete pool 2 (rows 8..11), a verify
    that cuts it, drafts that complete it again, a propose that rewinds into it, a refused propose
    whose row would complete it, more drafts."""
    H = CFG.hidden_size
    pair.call("prefill_drafter", inp.tokens(10), inp.hiddens(10))  # rows 0..8
    pair.call("propose", inp.token(), inp.hiddens(1), 9, 4)  # rows 9..12: pool 2 completes
    pair.call("after_verify", 1)  # rows 0..10 held: pool 2 is cut
    pair.call("propose", inp.token(), inp.hiddens(1), 11, 3)  # rows 11..13: pool 2 completes again
    pair.call("after_verify", 2)  # all kept: 14 rows
    pair.call("propose", inp.token(), inp.hiddens(1), 10, 1)  # a rewind into complete pool 2, row 10
    pair.call("after_verify", 0)  # 11 rows
    bad = inp.bad_hiddens(1, 0, H // 2, float("nan"))
    pair.call("propose", inp.token(), bad, 11, 2)  # refused: row 11 would complete pool 2
    pair.call("propose", inp.token(), inp.hiddens(1), 11, 5)  # rows 11..15: pools 2 and 3 complete
    pair.call("after_verify", 4)


def test_walk_across_pool_boundaries(next_weights):
    pair = DrafterPair(next_weights, max_seq_len=32)
    walk(pair, Inputs(next_weights, seed=3))
    assert pair.refused == 1
    assert pair.os.cache.kpool.complete[:5].tolist() == [True, True, True, True, False]


def test_the_fused_step_runs_the_family(next_weights):
    assert DrafterPair(next_weights, max_seq_len=32).opt.step is not None


def test_mutant_ungated_pool_writes_are_caught(next_weights, monkeypatch):
    """The fused step's pooled-key write ignoring the device check: the refused propose marks
    pool 2 complete."""
    real = kernels.pool_keys_write_torch

    def ungated(cfg, ix, slots, caches, ok):
        return real(cfg, ix, slots, caches, torch.ones_like(ok))

    monkeypatch.setattr(kernels, "pool_keys_write_torch", ungated)
    with pytest.raises(AssertionError, match="refused call changed the optimized state|pool"):
        walk(DrafterPair(next_weights, max_seq_len=32), Inputs(next_weights, seed=3))


def test_mutant_per_primitive_ungated_pool_writes_are_caught(next_weights, monkeypatch):
    """The per-primitive block (a layer the fused step does not take; here forced) with pool
    writes that ignore the device check: caught the same way."""
    real = opt_block.gated_pool_writes

    def ungated(ix, cfg, gates, slots, cache, ok, kernel_set=None):
        return real(ix, cfg, gates, slots, cache, torch.ones_like(ok), kernel_set)

    monkeypatch.setattr(opt_block, "gated_pool_writes", ungated)
    monkeypatch.setattr(proposer, "fusable", lambda w: False)
    pair = DrafterPair(next_weights, max_seq_len=32)
    assert pair.opt.step is None
    with pytest.raises(AssertionError, match="refused call changed the optimized state|pool"):
        walk(pair, Inputs(next_weights, seed=3))


def test_mutant_propose_without_the_rewind_of_a_cut_pool_is_caught(next_weights, monkeypatch):
    import glm_mtp.optimized.programs as programs

    monkeypatch.setattr(programs, "gated_forget", lambda cache, n, ok: None)
    with pytest.raises(AssertionError, match="pool_complete"):
        walk(DrafterPair(next_weights, max_seq_len=32), Inputs(next_weights, seed=3))


def batch_walk(next_weights) -> None:
    """propose_batch / catchup_batch on three states (3, 7 and 12 rows): the batch's rows complete
    pools in some states and not others, then a batch whose positions rewind two states into
    complete pools; every state's bytes are the reference's after each call."""
    inp = Inputs(next_weights, seed=5)
    pairs = [DrafterPair(next_weights, max_seq_len=32) for _ in range(3)]
    ref, opt = pairs[0].ref, pairs[0].opt
    rs = [ref.alloc_state("cpu") for _ in range(3)]
    os_ = [opt.alloc_state("cpu") for _ in range(3)]
    lens = [3, 7, 12]
    for n, r, o in zip(lens, rs, os_):
        toks, hids = inp.tokens(n + 1), inp.hiddens(n + 1)
        ref.prefill_drafter(toks, hids, r)
        opt.prefill_drafter(toks, hids, o)
    toks, hids = inp.tokens(3), inp.hiddens(3)
    assert ref.catchup_batch(toks, hids, lens, rs) == opt.catchup_batch(toks, hids, lens, os_)
    for pos in ([n + 1 for n in lens], [5, 4, 9]):  # then: rows 5.., 4.. and 9.. rewound (pools 1, 1 and 2 cut)
        toks, hids = inp.tokens(3), inp.hiddens(3)
        assert ref.propose_batch(toks, hids, pos, 3, rs) == opt.propose_batch(toks, hids, pos, 3, os_)
        for r, o in zip(rs, os_):
            a, b = ref.export_state(r), opt.export_state(o)
            assert a.keys() == b.keys()
            for k in a:
                assert same_bytes(a[k], b[k]), k
        for r, o in zip(rs, os_):
            ref.after_verify(0, r)
            opt.after_verify(0, o)


def test_batch_of_states_at_different_lengths(next_weights):
    batch_walk(next_weights)


def test_mutant_batch_without_the_rewind_of_cut_pools_is_caught(next_weights, monkeypatch):
    """A batched propose that forgets no pool: the rewound states keep stale complete flags."""
    monkeypatch.setattr(kernels, "pools_forget_torch", lambda cfg, n, caches, ok: None)
    with pytest.raises(AssertionError, match="pool_complete"):
        batch_walk(next_weights)

@pytest.mark.slow  # ~60 s in the interpreter on this machine (idle)
def test_lockstep_with_interpreted_triton_kernels(monkeypatch):
    """The block's Triton kernels (the GEMVs, the embedding, the pooled-key write, the pool
    scores and selection, the clamped experts' gate/up) through the interpreter inside the
    orchestration: two scenarios over short sequences (one batched); each family kernel ran."""
    ran = set()

    def counted(name, fn):
        def call(*args, **kwargs):
            ran.add(name)
            return fn(*args, **kwargs)
        return call

    names = {"cache_rows_write_triton", "pool_keys_write_triton", "pool_scores_triton", "select_pool_rows_triton",
             "pools_forget_triton", "experts_gate_up_triton", "sparse_mla_triton"}
    for name in names:
        monkeypatch.setattr(kernels, name, counted(name, getattr(kernels, name)))
    # Two scenarios: the generators take turns, so the second is a batched one (pools_forget runs
    # in a batched propose only).
    r = run("glm_mtp.optimized:with_triton_kernels", "reference", scenarios=2, seed=9, preset=PRESET, max_seq_len=24,
            dtype=torch.bfloat16, generators=("realistic", "batched"))
    assert r.ok, r.first_difference
    assert ran == names
