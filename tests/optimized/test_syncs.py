"""Host synchronisations during a k-draft propose, counted with a TorchDispatchMode: every op that
hands a device value to the host (``_local_scalar_dense``, behind ``.item()``, ``int()``,
``bool()``; ``nonzero``-like ops whose output shape depends on the data; device-to-host copies).

The optimized propose makes none before its one read-back (``proposer.read_back``, observed by
wrapping it), and ``propose_device`` none at all; the reference makes several per call."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import glm_mtp.optimized.proposer as opt_proposer
from glm_mtp.optimized.graphs import GraphKey
from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import ReferenceProposer

# Ops whose result the host must wait for.
DATA_DEPENDENT = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
                  "aten.unique.default", "aten._unique2.default", "aten.equal.default", "aten.is_nonzero.default"}


class SyncCounter(TorchDispatchMode):
    """Counts ops that synchronise the host with the device, and where the read-back happened."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in DATA_DEPENDENT:
            self.syncs.append(name)
        elif name in ("aten._to_copy.default", "aten.copy_.default"):
            src = args[1] if name == "aten.copy_.default" else args[0]
            dst_device = args[0].device if name == "aten.copy_.default" else kwargs.get("device", src.device)
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and torch.device(dst_device).type == "cpu":
                self.syncs.append(name + " (device to host)")
        return func(*args, **kwargs)


@pytest.fixture
def read_backs(monkeypatch):
    """Wraps the optimized proposer's read-back: records the syncs counted before each call."""
    seen: list[int] = []
    counter: list[SyncCounter] = []
    real = opt_proposer.read_back

    def spy(t):
        seen.append(len(counter[0].syncs) if counter else -1)
        return real(t)

    monkeypatch.setattr(opt_proposer, "read_back", spy)
    return seen, counter


def _ready(props, inputs, device="cpu"):
    """A state with 11 rows for each drafter, from the same prompt."""
    tokens, hiddens = inputs.tokens(12), inputs.hiddens(12).to(device)
    states = [p.alloc_state(device) for p in props]
    for p, s in zip(props, states):
        p.prefill_drafter(tokens, hiddens, s)
    return states


@pytest.mark.parametrize("token_kind", ["int", "tensor"])
def test_propose_syncs_only_at_the_read_back(weights, inputs, read_backs, token_kind):
    seen, holder = read_backs
    k = 4
    opt, ref = OptimizedProposer(weights, 64), ReferenceProposer(weights, 64)
    so, sr = _ready([opt, ref], inputs)
    tok = inputs.token()
    token = torch.tensor(tok) if token_kind == "tensor" else tok
    hidden = inputs.hiddens(1)
    with SyncCounter() as c_ref:
        want = ref.propose(token, hidden, 11, k, sr)
    with SyncCounter() as c_opt:
        holder.append(c_opt)
        got = opt.propose(token, hidden, 11, k, so)
    assert got == want
    assert seen == [0], f"the optimized propose synced before its read-back: {c_opt.syncs}"
    assert len(c_opt.syncs) == 0
    # The reference reads each draft back (k times) and checks its inputs on the host.
    assert len(c_ref.syncs) >= k + 1, c_ref.syncs


def test_propose_device_never_syncs(weights, inputs, read_backs):
    seen, holder = read_backs
    opt, ref = OptimizedProposer(weights, 64), ReferenceProposer(weights, 64)
    so, sr = _ready([opt, ref], inputs)
    tok, hidden = inputs.token(), inputs.hiddens(1)
    with SyncCounter() as c:
        holder.append(c)
        drafts = opt.propose_device(torch.tensor([tok]), hidden, 11, 3, so)
    assert c.syncs == [] and seen == []
    assert drafts.tolist() == ref.propose(tok, hidden, 11, 3, sr)
    # The next call settles it: exactly one read (the check code).
    with SyncCounter() as c:
        holder[0] = c
        opt.after_verify(1, so)
    assert seen == [0]


def test_propose_sampled_syncs_only_at_the_read_back(weights, inputs, read_backs):
    """A sampled propose: the noise's check, each q and each draw on the device; the one sync
    is the read-back of the check code and the drafts (q stays on the device)."""
    seen, counter = read_backs
    opt, ref = OptimizedProposer(weights, 64), ReferenceProposer(weights, 64)
    so, sr = _ready([opt, ref], inputs)
    tok, hidden = inputs.token(), inputs.hiddens(1)
    A = torch.float32  # the acc dtype of fp32 and bf16 weights
    e = (
        torch.empty(3, weights.config.vocab_size, dtype=torch.float64)
        .exponential_(generator=torch.Generator().manual_seed(4))
        .to(A)
    )
    want = ref.propose_sampled(tok, hidden, 11, 3, 0.9, e, sr)
    with SyncCounter() as c:
        counter.append(c)
        got = opt.propose_sampled(tok, hidden, 11, 3, 0.9, e, so)
    assert got == want
    assert seen == [0] and c.syncs == [], c.syncs


@pytest.mark.parametrize("ban", [None, 0, 1], ids=["allowing", "forbid_1", "forbid_2"])
def test_grammar_propose_reads_back_once_when_its_drafts_are_allowed(weights, inputs, read_backs, ban):
    """A grammar that allows every unmasked draft: the same one read-back as without one and no
    other sync; one that forbids the unmasked draft 1 or 2: one more read-back (the redo from
    that step), still no other sync. The drafts are the reference's."""
    from glm_mtp.tools.counters import BanMatcher

    seen, holder = read_backs
    k = 3
    opt, ref = OptimizedProposer(weights, 64), ReferenceProposer(weights, 64)
    so, sr = _ready([opt, ref], inputs)
    tok, hidden = inputs.token(), inputs.hiddens(1)
    plain = opt.propose(tok, hidden, 11, k, so)
    opt.after_verify(0, so)
    seen.clear()
    banned = {} if ban is None else {ban: plain[ban]}
    want = ref.propose(tok, hidden, 11, k, sr, grammar=BanMatcher(banned))
    with SyncCounter() as c:
        holder.append(c)
        got = opt.propose(tok, hidden, 11, k, so, grammar=BanMatcher(banned))
    assert got == want and (got == plain) == (ban is None)
    assert c.syncs == [], c.syncs
    assert seen == ([0] if ban is None else [0, 0]), seen
    with SyncCounter() as c:  # the confidence stays on the device
        holder[0] = c
        prob, margin = opt.draft_confidence(so)
    assert c.syncs == [] and len(seen) == (1 if ban is None else 2)


def test_the_counter_sees_syncs(weights, inputs):
    """The counter is not blind: an explicit item() and the reference's checks are counted."""
    with SyncCounter() as c:
        torch.randn(3).sum().item()
        bool(torch.isfinite(inputs.hiddens(2)).all())
    assert len(c.syncs) == 2


@pytest.mark.gpu
def test_cuda_graph_propose_has_no_sync(weights, inputs, monkeypatch):
    """On CUDA, with torch's sync debug mode set to error: propose_device (after its first call
    captured the graph) runs without a synchronising call, and so does propose up to its one
    read-back (the spy below turns the mode off just there)."""
    w = weights.to("cuda")
    opt = OptimizedProposer(w, 64)
    (st,) = _ready([opt], inputs, "cuda")
    opt.propose_device(inputs.token(), inputs.hiddens(1).cuda(), 11, 3, st)  # captures
    opt.after_verify(0, st)
    token, hidden = inputs.token(), inputs.hiddens(1).cuda()  # the upload syncs: before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drafts = opt.propose_device(token, hidden, 12, 3, st)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert drafts.shape == (3,) and drafts.is_cuda
    assert list(st.graphs) == [GraphKey.draft(3)]
    expected = drafts.tolist()
    opt.after_verify(0, st)

    real = opt_proposer.read_back
    reads: list[int] = []

    def read_back_unchecked(t):
        torch.cuda.set_sync_debug_mode(0)
        reads.append(t.numel())
        return real(t)

    monkeypatch.setattr(opt_proposer, "read_back", read_back_unchecked)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = opt.propose(token, hidden, 12, 3, st)  # replays the captured graph
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert got == expected and reads == [4]
