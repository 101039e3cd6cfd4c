"""Batched drafting (optimized/batch.py): ``propose_batch`` / ``catchup_batch`` of the optimized
drafter against each state drafted ALONE by the reference, byte for byte (drafts and every
``export_state`` byte), over rounds with random subsets, orders, lengths, accept counts, joins and
leaves; refusals name the state and leave every state byte-identical; broken variants are caught."""

import dataclasses
import random

import pytest
import torch

from glm_mtp.optimized import OptimizedProposer
from glm_mtp.optimized.batch import bucket
from glm_mtp.optimized.kernels import paged
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer

from .conftest import state_bytes


class Batched:
    """N sequences drafted two ways: batched on the optimized drafter, alone on the reference."""

    def __init__(self, weights, kernels="auto", max_seq_len=48, seed=0, max_batch=16):
        self.w, self.cfg, self.device = weights, weights.config, weights.device
        self.opt = OptimizedProposer(weights, max_seq_len, kernels=kernels, max_batch=max_batch)
        self.ref = ReferenceProposer(weights, max_seq_len)
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.seqs: list[dict] = []

    def hiddens(self, n):
        return torch.randn(n, self.cfg.hidden_size, generator=self.gen).to(self.w.dtype).to(self.device)

    def tokens(self, n):
        return torch.randint(0, self.cfg.vocab_size, (n,), generator=self.gen).to(self.device)

    def join(self, prompt_len):
        s = {"opt": self.opt.alloc_state(self.device), "ref": self.ref.alloc_state(self.device)}
        toks, hs = self.tokens(prompt_len), self.hiddens(prompt_len)
        assert self.opt.prefill_drafter(toks, hs, s["opt"]) == self.ref.prefill_drafter(toks, hs, s["ref"])
        s["pos"] = max(prompt_len - 1, 0)
        self.seqs.append(s)
        return s

    def leave(self, s):
        self.opt.free_state(s["opt"])
        self.ref.free_state(s["ref"])
        self.seqs.remove(s)

    def same(self, s):
        assert self.opt.drafter_rows(s["opt"]) == self.ref.drafter_rows(s["ref"])
        assert state_bytes(self.opt, s["opt"]) == state_bytes(self.ref, s["ref"])

    def round(self, group, k):
        """One spec-decode round for ``group``: a batched propose, per-state verifies with random
        accept counts, a batched catch-up of the fully accepted ones."""
        last, hid = self.tokens(len(group)), self.hiddens(len(group))
        pos = [s["pos"] for s in group]
        drafts = self.opt.propose_batch(last, hid, pos, k, [s["opt"] for s in group])
        alone = [self.ref.propose(last[b : b + 1], hid[b], pos[b], k, s["ref"]) for b, s in enumerate(group)]
        assert drafts == alone
        owed = []
        for s in group:
            self.same(s)
            a = self.rng.randint(0, k)
            self.opt.after_verify(a, s["opt"])
            self.ref.after_verify(a, s["ref"])
            s["pos"] += a + 1 if k else 0
            if k and a == k:
                owed.append(s)
        if owed:
            toks, hs = self.tokens(len(owed)), self.hiddens(len(owed))
            bases = [self.opt.drafter_rows(s["opt"]) for s in owed]
            got = self.opt.catchup_batch(toks, hs, bases, [s["opt"] for s in owed])
            want = [
                self.ref.catchup_drafter(toks[b : b + 1], hs[b : b + 1], bases[b], bases[b], s["ref"])
                for b, s in enumerate(owed)
            ]
            assert got == want == [1] * len(owed)
        for s in group:
            self.same(s)


def test_bucket():
    assert [bucket(n, 16) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert bucket(7, 6) == 6 and bucket(0, 16) == 1


def test_batch_equals_each_state_alone(weights):
    """Random rounds over a changing batch (joins, leaves, subsets in random order, k = 0..4)."""
    bt = Batched(weights, seed=1)
    for n in (1, 9, 17, 4, 30):
        bt.join(n)
    for r in range(10):
        if r in (3, 6):
            bt.join(bt.rng.randint(1, 25))
        if r == 5:
            bt.leave(bt.seqs[1])
        live = [s for s in bt.seqs if s["pos"] + 4 < bt.opt.capacity]
        group = bt.rng.sample(live, bt.rng.randint(1, len(live)))
        bt.round(group, bt.rng.choice([0, 1, 2, 3, 4]))
    assert len(bt.seqs) >= 5


def test_batch_with_interpreted_kernels(weights):
    """The same with every fused piece a Triton kernel (the interpreter): the per-row address
    tables of the cache kernels and the scatters; short, the interpreter is slow."""
    bt = Batched(weights, kernels="triton", max_seq_len=32, seed=2)
    for n in (3, 12, 1):
        bt.join(n)
    bt.round(bt.seqs[::-1], 2)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def next_weights(request):
    """glm5_next (kpool 4, 2 pools listed): a batch's rows complete pools in some states and not
    others, and random accept counts rewind states into complete pools."""
    return MtpWeights.random(MtpConfig.preset("glm5next_tiny"), seed=8, dtype=request.param)


def test_glm5_next_batch_equals_each_state_alone(next_weights):
    """The family through the fused step's batched programs: random rounds over a changing batch
    of states at different lengths, each state's drafts and bytes the reference's alone."""
    bt = Batched(next_weights, seed=4)
    assert bt.opt.step is not None
    for n in (1, 6, 13, 22):
        bt.join(n)
    for r in range(8):
        if r == 3:
            bt.join(bt.rng.randint(1, 25))
        live = [s for s in bt.seqs if s["pos"] + 4 < bt.opt.capacity]
        group = bt.rng.sample(live, bt.rng.randint(1, len(live)))
        bt.round(group, bt.rng.choice([1, 2, 3, 4]))


def test_glm5_next_batch_with_interpreted_kernels():
    """The same with every piece a Triton kernel (the KPool ones through the per-row address
    table, pools_forget included): a round that rewinds, then one that completes pools. bf16 only
    (the kernels' dtypes are proven apart in kernels/test_kpool.py; the interpreter is slow)."""
    w = MtpWeights.random(MtpConfig.preset("glm5next_tiny"), seed=8, dtype=torch.bfloat16)
    bt = Batched(w, kernels="triton", max_seq_len=32, seed=5)
    for n in (4, 11, 2):
        bt.join(n)
    bt.round(bt.seqs[::-1], 3)
    bt.round(bt.seqs, 2)


def test_glm5_next_refusal_changes_no_state(next_weights):
    """A NaN hidden in one row refuses the batch, naming it; every state (pools included) unchanged."""
    bt = Batched(next_weights, seed=6, max_batch=4)
    for n in (7, 3, 12):
        bt.join(n)
    before = _snapshot(bt)
    hid = bt.hiddens(3)
    hid[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"states\[1\]"):
        bt.opt.propose_batch(bt.tokens(3), hid, [s["pos"] for s in bt.seqs], 3, [s["opt"] for s in bt.seqs])
    assert _snapshot(bt) == before


def _snapshot(bt):
    return [state_bytes(bt.opt, s["opt"]) for s in bt.seqs]


@pytest.mark.parametrize("bad",
                         ["nan_hidden", "token_tensor", "token_int", "pending", "behind", "capacity", "duplicate",
                          "freed", "other_drafter", "lengths", "too_many"])
def test_refusal_names_the_state_and_changes_nothing(weights, bad):
    bt = Batched(weights, seed=3, max_batch=4)
    for n in (5, 2, 11, 7):
        bt.join(n)
    bt.round(bt.seqs[:2], 2)  # rows and x that a partial write would disturb
    states = [s["opt"] for s in bt.seqs]
    last, hid, pos = bt.tokens(4), bt.hiddens(4), [s["pos"] for s in bt.seqs]
    expect, where = ValueError, "states\\[2\\]"
    if bad == "nan_hidden":
        hid[2, 3] = float("nan")
    elif bad == "token_tensor":
        last[2] = bt.cfg.vocab_size
    elif bad == "token_int":
        last = last.tolist()
        last[2] = -1
    elif bad == "pending":
        bt.opt.propose(1, bt.hiddens(1), pos[2], 1, states[2])
        expect = RuntimeError
    elif bad == "behind":
        pos[2] += 1
        expect = RuntimeError
    elif bad == "capacity":
        pos[2] = bt.opt.capacity - 1
        bt.opt.catchup_drafter(bt.tokens(pos[2] - bt.opt.drafter_rows(states[2])),
                               bt.hiddens(pos[2] - bt.opt.drafter_rows(states[2])),
                               bt.opt.drafter_rows(states[2]), 0, states[2])
    elif bad == "duplicate":
        states[3] = states[1]
        where = "states\\[3\\] is states\\[1\\]"
    elif bad == "freed":
        other = bt.opt.alloc_state("cpu")
        bt.opt.free_state(other)
        states[2] = other
        expect = RuntimeError
    elif bad == "other_drafter":
        states[2] = OptimizedProposer(weights, 80).alloc_state("cpu")  # another capacity
    elif bad == "lengths":
        pos = pos[:3]
        where = "positions has 3 entries for 4 states"
    elif bad == "too_many":
        states = states + [bt.opt.alloc_state("cpu")]
        where = "max_batch=4"
    before = _snapshot(bt)
    with pytest.raises(expect, match=where):
        bt.opt.propose_batch(last, hid, pos, 3, states)
    assert _snapshot(bt) == before
    if bad in ("nan_hidden", "token_tensor"):  # the device-checked refusals leave the buffers usable
        bt.round(bt.seqs, 2)


def test_catchup_batch_no_op_rows_and_refusals(weights):
    bt = Batched(weights, seed=4)
    for n in (6, 3, 9):
        bt.join(n)
    states = [s["opt"] for s in bt.seqs]
    rows = [bt.opt.drafter_rows(st) for st in states]
    toks, hs = bt.tokens(3), bt.hiddens(3)
    before = _snapshot(bt)
    bad = hs.clone()
    bad[1, 0] = float("inf")
    with pytest.raises(ValueError, match="catchup_batch: states\\[1\\]: hiddens holds NaN or inf"):
        bt.opt.catchup_batch(toks, bad, rows, states)
    assert _snapshot(bt) == before
    got = bt.opt.catchup_batch(toks, hs, [rows[0], rows[1] + 2, rows[2]], states)  # state 1 misaligned: a no-op
    assert got == [1, 0, 1]
    for b in (0, 2):
        bt.ref.catchup_drafter(toks[b : b + 1], hs[b : b + 1], rows[b], rows[b], bt.seqs[b]["ref"])
    for s in bt.seqs:
        bt.same(s)


def test_mutant_every_row_on_the_first_state_cache_is_caught(weights, monkeypatch):
    """A batch whose rows all read and write the first state's cache (the address table's stride
    dropped; the twins follow the table's runs, so they take the same wrong caches): the
    comparison against each state alone must fail."""
    bt = Batched(weights, max_seq_len=32, seed=5)
    for n in (4, 10):
        bt.join(n)
    monkeypatch.setattr(paged.RowCaches, "stride", property(lambda self: 0))
    monkeypatch.setattr(paged.RowCaches, "runs", lambda self, rows: [(self.caches[0], slice(0, rows))])
    with pytest.raises(AssertionError):
        bt.round(bt.seqs, 2)


def test_mutant_one_x_for_every_state_is_caught(weights, monkeypatch):
    """A batch that writes row 0's ``x`` into every state (the scatter's rows mixed up)."""
    bt = Batched(weights, seed=6)
    for n in (4, 10):
        bt.join(n)
    real = paged.scatter_rows_torch

    def first_row_everywhere(values, targets, ok):
        real(values[:1].expand(values.shape[0], -1), targets, ok)

    programs = bt.opt.programs
    monkeypatch.setattr(programs, "step", dataclasses.replace(programs.step, scatter_rows=first_row_everywhere))
    with pytest.raises(AssertionError):
        bt.round(bt.seqs, 2)


def test_one_batched_call_at_a_time(weights):
    bt = Batched(weights, seed=7)
    bt.join(5)
    bb = bt.opt._batch[torch.device("cpu")]
    with bb.claim("test"):
        with pytest.raises(RuntimeError, match="one at a time"):
            bt.opt.propose_batch([1], bt.hiddens(1), [bt.seqs[0]["pos"]], 1, [bt.seqs[0]["opt"]])
    assert bt.opt.propose_batch([1], bt.hiddens(1), [bt.seqs[0]["pos"]], 1, [bt.seqs[0]["opt"]])


def test_padded_buckets_and_their_graph_keys(weights, monkeypatch):
    """As on CUDA with graphs: a batch of B runs its bucket's rows (the spare ones on the scratch
    state) under the key (bucket, num_drafts); the real rows' bytes stay those of each state alone.
    On CPU the programs run eagerly, so the padding is what this checks."""
    import glm_mtp.optimized.programs as programs
    from glm_mtp.optimized.graphs import GraphKey

    keys = []

    def record(owner, key, program, capture):
        keys.append((key, capture))
        program()

    monkeypatch.setattr(programs, "run_program", record)
    monkeypatch.setattr(programs.DevicePrograms, "batch_captures", lambda self, bb: True)
    bt = Batched(weights, seed=8, max_batch=8)
    for n in (3, 8, 5, 12, 1):
        bt.join(n)
    bt.round(bt.seqs[:3], 2)  # 3 rows -> bucket 4
    bt.round(bt.seqs, 1)  # 5 -> 8
    bt.round(bt.seqs[1:2], 0)  # num_drafts 0 only rewinds: never captured, its own row count
    proposes = [k for k in keys if k[0].program != "catchup"]
    assert proposes == [(GraphKey.draft(2, rows=4), True), (GraphKey.draft(1, rows=8), True),
                        (GraphKey.draft(0, rows=1), False)]
    # catch-ups, bucketed
    assert all(key.rows in (1, 2, 4, 8) and capture for key, capture in keys if key.program == "catchup")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_batch_on_cuda_with_graphs(dtype):
    """On a GPU: the Triton kernels and a CUDA graph per (bucket, num_drafts), replayed for other
    states than the ones it was captured with; each state equal to the reference alone."""
    from glm_mtp.reference import MtpConfig, MtpWeights

    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=9, dtype=dtype, device="cuda")
    bt = Batched(w, seed=9)
    for n in (3, 17, 8, 1, 25, 12):
        bt.join(n)
    for r in range(8):
        live = [s for s in bt.seqs if s["pos"] + 4 < bt.opt.capacity]
        bt.round(bt.rng.sample(live, bt.rng.randint(1, len(live))), bt.rng.choice([1, 2, 3]))
        if r == 4:
            bt.leave(bt.seqs[0])
            bt.join(9)
    bb = bt.opt._batch[torch.device("cuda", torch.cuda.current_device())]
    assert bb.graphs and all(key.rows in (1, 2, 4, 8, 16) for key in bb.graphs)


def test_a_layer_the_fused_step_does_not_take_drafts_each_state_in_turn(tiny_cfg):
    """float64 (no fused kernels): the batch runs each state's own program after checking every
    state's data on the host; the same bytes, and a bad row still refuses before any state moves."""
    from glm_mtp.reference import MtpWeights

    w = MtpWeights.random(tiny_cfg, seed=10, dtype=torch.float64)
    bt = Batched(w, seed=10)
    assert bt.opt.step is None
    for n in (4, 13, 2):
        bt.join(n)
    for k in (2, 3, 1):
        bt.round(bt.seqs[::-1], k)
    before = _snapshot(bt)
    hid = bt.hiddens(3)
    hid[2, 0] = float("nan")
    with pytest.raises(ValueError, match="states\\[2\\]: target_hidden holds NaN"):
        bt.opt.propose_batch([1, 2, 3], hid, [s["pos"] for s in bt.seqs], 2, [s["opt"] for s in bt.seqs])
    assert _snapshot(bt) == before
