"""The launch counter (glm_mtp.tools.counters): Triton launches through the CPU interpreter
(tests/conftest.py sets TRITON_INTERPRET=1), torch operators through a dispatch mode, and a
measured draft step against the floor."""

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from glm_mtp.optimized.kernels import embed_rows_triton, linear_triton
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.tools import counters
from glm_mtp.tools.counters import Footprint, LaunchCounter, measure_draft_step, tensors_bytes
from glm_mtp.tools.floor import floor_bytes_per_draft

pytestmark = pytest.mark.skipif(not counters.interpreting(),
                                reason="Triton launches are counted through the CPU interpreter")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_embed_rows_is_one_launch_of_the_rows_it_gathers(dtype):
    gen = torch.Generator().manual_seed(11)
    V, H = 40, 70  # H < BLOCK_H: a masked tail the counter must not count
    embed = torch.randn(V, H, generator=gen).to(dtype)
    tokens = torch.tensor([5, 17, 5, 33])  # row 5 twice: read once
    slots = torch.tensor([3, 4, 5, 6])
    with LaunchCounter() as c:
        out = embed_rows_triton(embed, tokens, slots)
    assert [(r.kind, r.name) for r in c.records] == [("triton", "_embed_rows_kernel")]
    es = embed.element_size()
    rows = 3 * H * es  # distinct rows 5, 17, 33
    assert c.records[0].bytes_loaded == rows + 4 * 8 + 4 * 8  # rows + token ids + slots (int64)
    assert c.records[0].bytes_stored == out.numel() * es
    assert c.launches == 1 and c.kernel_bytes == rows + 64 + 4 * H * es
    assert c.records[0].grid == (4, 1, 1)


@triton.jit
def _gated_copy_kernel(src_ptr, dst_ptr, flag_ptr, n, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    go = tl.load(flag_ptr).to(tl.int32)
    x = tl.load(src_ptr + (cols % 5), mask=inside)  # five distinct elements, re-read
    tl.store(dst_ptr + cols, x, mask=inside & ((cols * 0 + go) != 0))  # as rope_cache gates its stores


@pytest.mark.parametrize("flag", [True, False])
def test_masked_lanes_rereads_and_a_bool_flag(flag):
    src, dst = torch.randn(8), torch.zeros(37, dtype=torch.float32)
    with LaunchCounter() as c:
        _gated_copy_kernel[(3,)](src, dst, torch.tensor([flag]).view(torch.uint8), 37, BLOCK=16, enable_fp_fusion=False)
    (r,) = c.records
    assert r.grid == (3, 1, 1) and r.name == "_gated_copy_kernel"
    assert r.bytes_loaded == 5 * 4 + 1  # five floats, however often read, and the flag's byte
    assert r.bytes_stored == (37 * 4 if flag else 0)  # 48 lanes, 37 inside; none when the gate is off


def test_a_slot_zero_row_loads_nothing_more_and_masked_lanes_are_free():
    # Changing which rows are gathered changes the bytes: the counter reads the addresses.
    embed = torch.randn(10, 16)
    with LaunchCounter() as one:
        embed_rows_triton(embed, torch.tensor([2, 2, 2]), torch.tensor([1, 2, 3]))
    with LaunchCounter() as three:
        embed_rows_triton(embed, torch.tensor([2, 3, 4]), torch.tensor([1, 2, 3]))
    assert three.records[0].bytes_loaded - one.records[0].bytes_loaded == 2 * 16 * 4


def test_a_gemv_reads_its_weight_once():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 300, generator=gen), torch.randn(50, 300, generator=gen).to(torch.bfloat16)
    with LaunchCounter() as c:
        linear_triton(x, w)
    assert c.triton_launches == c.launches >= 1
    # At least the weight, the input and the output, and not the weight once per row.
    assert w.numel() * 2 + x.numel() * 4 <= c.kernel_bytes < 2 * w.numel() * 2


def test_torch_ops_count_launches_and_bytes_views_count_zero():
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    with LaunchCounter(triton=False) as c:
        s = a + b
    assert c.launches == 1 and c.records[0].name == "aten.add.Tensor"
    assert c.kernel_bytes == 3 * 8 * 16 * 4  # two inputs read, one output written
    with LaunchCounter(triton=False) as v:
        a.view(16, 8).t()[2:5].unsqueeze(0).expand(3, -1, -1)
        a.reshape(-1)
        a[1]
        torch.empty(5, 5)
    assert v.launches == 0 and v.kernel_bytes == 0 and sum(v.excluded.values()) >= 6
    with LaunchCounter(triton=False) as same:
        a + a  # one input twice: read once
    assert same.kernel_bytes == 2 * 8 * 16 * 4
    with LaunchCounter(triton=False) as strided:
        s[:, :4].clone()  # reads a quarter of each row, not the span
    assert strided.launches == 1 and strided.kernel_bytes == 2 * 8 * 4 * 4
    with LaunchCounter(triton=False) as inplace:
        s.copy_(a)  # the destination is written, not read
        s.add_(b)  # read and written
    assert [r.bytes for r in inplace.records] == [2 * 512, 3 * 512]


def test_a_gather_reads_only_its_rows_and_syncs_are_not_launches():
    table = torch.randn(100, 32)
    ids = torch.tensor([3, 7])
    with LaunchCounter(triton=False) as c:
        rows = torch.index_select(table, 0, ids)
        rows.sum().item()
    assert c.records[0].bytes == 2 * 32 * 4 + 2 * 8 + 2 * 32 * 4
    assert c.launches == 2 and c.syncs == 1  # index_select, sum; the .item() is a host read
    rows, column = torch.ones(2, 32), torch.zeros(100, 1, dtype=torch.int64)
    with LaunchCounter(triton=False) as s:
        table.index_copy_(0, ids, rows)  # reads the ids and the rows, writes the rows
        table.scatter_(1, column, 0.5)  # one element per row
    assert [r.bytes for r in s.records] == [2 * 8 + 2 * 2 * 32 * 4, 100 * 8 + 100 * 4]


def test_footprint_merges_overlaps():
    fp = Footprint()
    fp.add_elements(torch.tensor([0, 4, 8, 4]).numpy(), 4)
    fp.add_elements(torch.tensor([6]).numpy(), 4)  # overlaps [4, 12)
    fp.add_elements(torch.tensor([100]).numpy(), 2)
    assert fp.nbytes == 12 + 2
    assert tensors_bytes([torch.zeros(4, 4)[:, 1], torch.zeros(3)]) == 4 * 4 + 3 * 4


def test_patches_are_restored_even_after_an_error():
    from triton.runtime import interpreter as interp

    before = (interp.GridExecutor.__call__, interp.InterpreterBuilder.create_masked_load,
              interp.InterpreterBuilder.create_masked_store, torch._C._len_torch_dispatch_stack())
    with pytest.raises(RuntimeError, match="boom"):
        with LaunchCounter():
            raise RuntimeError("boom")
    after = (interp.GridExecutor.__call__, interp.InterpreterBuilder.create_masked_load,
             interp.InterpreterBuilder.create_masked_store, torch._C._len_torch_dispatch_stack())
    assert before == after
    with LaunchCounter() as c:
        pass
    embed_rows_triton(torch.randn(4, 8), torch.tensor([1]), torch.tensor([1]))  # outside: not counted
    assert c.launches == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_measure_draft_step_tiny(dtype):
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=0, dtype=dtype)
    r = measure_draft_step(w, "triton", context=8, max_seq_len=32)
    assert r["launches_per_draft"] > 0 and r["triton_launches_per_draft"] > 0
    assert r["kernel_bytes_per_draft"] > 0
    assert r["floor_bytes_per_draft"] == floor_bytes_per_draft(w.config, w.dtype, 10)
    assert r["launches_propose_2"] == r["launches_propose_1"] + r["launches_per_draft"]
    assert r["preset"] == "tiny" and r["visible_rows"] == 10
    json.dumps(r)


# One case of each family in the default run; the other dtypes and sharing with the slow sweep
# (fp8 stays in the default run through test_cli_weights_fp8_counts_a_block_scaled_step).
@pytest.mark.parametrize("preset,dtype,fp8,share", [
    ("tiny", torch.bfloat16, False, False),
    pytest.param("tiny", torch.bfloat16, False, True, marks=pytest.mark.slow),
    ("glm5next_tiny", torch.bfloat16, False, True),
    pytest.param("glm5next_tiny", torch.float32, False, True, marks=pytest.mark.slow),
    pytest.param("glm5next_tiny", torch.bfloat16, True, True, marks=pytest.mark.slow)],
    ids=["tiny-bf16", "tiny-bf16-shared", "glm5next_tiny-bf16", "glm5next_tiny-fp32", "glm5next_tiny-fp8"])
def test_the_fused_step_meets_its_targets_at_any_capacity(preset, dtype, fp8, share):
    """At most 24 launches and 1.15x the floor per draft step (with fp8 weights: the fp8 floor,
    1 byte a value plus the scales), and the same launches and bytes at two capacities (a step
    reads what it attends to, never the capacity). glm5_next's counted step (slot 19) completes
    pool 4 (its pooled key is computed) and sees 5 pools, 2 listed. GLM-5's index_scores still
    stores -inf at every row past the slot: 4 bytes a row of capacity.

    With index sharing (DESIGN.md §9; glm5next_tiny shares as the release does) the counted step
    is a shared one: none of the indexer's query side is launched (no scores, no selection, two
    launches fewer than step 1), against a floor without the query side's weights and keys, and
    nothing read grows with the capacity; draft step 1, counted apart, meets the same targets."""
    w = MtpWeights.random(MtpConfig.preset(preset), seed=0, dtype=dtype).with_index_share(share)
    if fp8:
        w = w.quantize_fp8()
        block_scaled = floor_bytes_per_draft(w.config, dtype, 20, block_scaled=True)
        assert block_scaled < floor_bytes_per_draft(w.config, dtype, 20)
    small, large = (measure_draft_step(w, "triton", context=18, max_seq_len=m) for m in (64, 256))
    assert small["launches_per_draft"] <= 24 and small["kernel_floor_ratio"] <= 1.15, small
    for key in ("launches_per_draft", "triton_launches_per_draft", "floor_bytes_per_draft"):
        assert small[key] == large[key], key
    grown = 0 if w.config.is_next or share else 4 * (256 - 64)
    assert large["kernel_bytes_per_draft"] - small["kernel_bytes_per_draft"] == grown
    step = set(small["by_name_step"])
    query_side = {"triton:_index_scores_kernel", "triton:_pool_scores_kernel", "triton:_select_rows_kernel"}
    if w.config.is_next:  # the family's pieces ran, GLM-5's indexer did not
        names = small["by_name_2"]
        assert {"triton:_pool_keys_kernel", "triton:_pool_scores_kernel", "triton:_select_rows_kernel"} <= set(names)
        assert "triton:_index_scores_kernel" not in names
        assert "triton:_pool_keys_kernel" in step  # a shared step still writes the pool it completes
    assert small["shared_step"] == share
    if not share:
        assert step >= query_side - {"triton:_pool_scores_kernel"} and "launches_step_1" not in small
        return
    assert not step & query_side, step
    assert small["floor_bytes_per_draft"] == floor_bytes_per_draft(w.config, dtype, 20, fp8, selected_at=19)
    assert small["floor_bytes_per_draft"] < floor_bytes_per_draft(w.config, dtype, 20, fp8)
    for r in (small, large):
        assert r["step_1_unchanged"], r  # a 1-draft propose counts the same with sharing and without
        assert r["launches_step_1"] <= 24 and r["kernel_floor_ratio_step_1"] <= 1.15, r
        assert r["launches_per_draft"] == r["launches_step_1"] - 2
    assert small["floor_bytes_step_1"] == floor_bytes_per_draft(w.config, dtype, 20, fp8)


def test_measure_draft_step_reference_counts_torch_ops():
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=0, dtype=torch.float32)
    r = measure_draft_step(w, backend="reference", context=4, max_seq_len=32)
    assert r["launches_per_draft"] > 50 and r["triton_launches_per_draft"] == 0 and r["kernel_bytes_per_draft"] > 0


def test_measure_refuses_triton_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=0, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        measure_draft_step(w, "triton")


@pytest.mark.slow
def test_cli_json_sets_the_interpreter_itself():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "glm_mtp.tools.counters", "--preset", "tiny", "--dtype", "float32",
                          "--json",
                          "--context", "4", "--max-seq-len", "32"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["triton_launches_per_draft"] > 0 and r["launches_per_draft"] > 0


def test_a_batched_step_reads_each_weight_once_for_all_rows(dtype=torch.bfloat16):
    """One batched draft step over 1 and 3 states (different lengths): the same launches per step,
    and the bytes grow only by what is per row (each state's attended rows, its routed experts,
    its activations), far below three separate steps; each weight is read once."""
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=3, dtype=dtype)
    one = counters.measure_batch_step(w, 1, context=8, max_seq_len=32)
    three = counters.measure_batch_step(w, 3, context=8, max_seq_len=32)
    single = measure_draft_step(w, context=8, max_seq_len=32)
    assert one["launches_per_step"] == three["launches_per_step"] == single["launches_per_draft"]
    assert one["syncs_per_step"] == single["syncs_per_draft"]  # the read-back's one more element (per row)
    # the scatters: a few hundred bytes
    assert 0.95 < one["kernel_bytes_per_step"] / single["kernel_bytes_per_draft"] < 1.1
    lm_head = w.lm_head.numel() * w.lm_head.element_size()
    assert three["kernel_bytes_per_step"] < one["kernel_bytes_per_step"] + 2 * (one["kernel_bytes_per_step"] - lm_head)
    assert three["kernel_bytes_per_step"] < 1.6 * one["kernel_bytes_per_step"]


def test_dispatched_operators_and_the_reference_syncs():
    """Without the byte model (a benchmark's use) the counter still sees every operator and
    every host read: the reference reads each draft back."""
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=0, dtype=torch.float32)
    prop = ReferenceProposer(w, 64)
    state = prop.alloc_state("cpu")
    prop.prefill_drafter(torch.randint(96, (9,)), torch.randn(9, 64), state)
    with LaunchCounter(triton=False, measure_bytes=False) as c:
        prop.propose(3, torch.randn(64), 8, 3, state)
    assert c.syncs >= 3 and c.dispatched > 100  # one read-back per draft at least
    assert c.launches > 0 and c.kernel_bytes == 0


def test_cli_weights_fp8_counts_a_block_scaled_step(capsys):
    """``--weights fp8`` quantizes the random weights (DESIGN.md §8) before counting: the floor is
    the fp8 one (1 byte a value plus the scales), below the plain floor, and the record says so."""
    counters.main(["--preset", "glm5next_tiny", "--weights", "fp8", "--context", "8", "--max-seq-len", "32", "--json"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = MtpConfig.preset("glm5next_tiny")
    assert r["weights"] == "fp8" and r["visible_rows"] == 10
    # The preset shares (DESIGN.md §9): the counted step is a shared one, step 1 is apart.
    assert r["index_share"] and r["shared_step"]
    assert r["floor_bytes_per_draft"] == floor_bytes_per_draft(cfg, torch.bfloat16, 10, block_scaled=True,
                                                               selected_at=9)
    assert r["floor_bytes_step_1"] == floor_bytes_per_draft(cfg, torch.bfloat16, 10, block_scaled=True)
    assert r["floor_bytes_step_1"] < floor_bytes_per_draft(cfg, torch.bfloat16, 10) and r["step_1_unchanged"]
    assert r["launches_per_draft"] <= 24 and r["kernel_floor_ratio"] <= 1.15
    assert r["launches_step_1"] <= 24 and r["kernel_floor_ratio_step_1"] <= 1.15


@pytest.mark.parametrize("preset", ["tiny", pytest.param("glm5next_tiny", marks=pytest.mark.slow)])
def test_grammar_counts_one_read_back_when_drafts_are_allowed(preset):
    """``measure_grammar_propose`` (the Triton kernels, interpreted): an allowing grammar reads
    back once and launches what no grammar launches plus its fixed host-side keep (``x`` and the
    rows a refusal would put back); one forbidding draft 1 or 2 reads back twice and adds one
    redo program (fewer steps when the forbidden draft is later); ``draft_confidence`` is one
    Triton launch with no read-back, and the head's logits store adds V values per step."""
    w = MtpWeights.random(MtpConfig.preset(preset), seed=0, dtype=torch.bfloat16)
    r = counters.measure_grammar_propose(w, "triton", num_drafts=3, context=8, max_seq_len=32)
    none, allowing, f1, f2 = r["none"], r["allowing"], r["forbid_1"], r["forbid_2"]
    assert none["read_backs"] == allowing["read_backs"] == 1
    assert f1["read_backs"] == f2["read_backs"] == 2
    assert none["counter_syncs"] == allowing["counter_syncs"]
    assert allowing["drafts"] == none["drafts"] == r["unmasked_drafts"]
    assert f1["drafts"][0] != none["drafts"][0] and f2["drafts"][:2] != none["drafts"][:2]
    assert f2["drafts"][0] == none["drafts"][0]
    assert 0 < allowing["launches"] - none["launches"] <= 8
    assert none["launches"] < f2["launches"] < f1["launches"]
    for c in (r["confidence"], r["confidence_masked"]):
        assert c["launches"] == c["triton_launches"] == 1 and c["read_backs"] == 0
