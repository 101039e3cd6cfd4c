"""Grammar-constrained drafts (DESIGN.md §10) and draft confidence (§12) in the optimized drafter,
against the reference byte for byte: drafts, ``q``, exported state, the confidences, the matcher
left as found, the refusals; both families, index sharing on and off, the Triton kernels (through
the interpreter) and their torch twins, alone and in a batch. Also the redo rule: a forbidden
draft redoes the propose from that step only, and a propose whose drafts are all allowed runs no
redo (so it reads the device once, as without a grammar: tests/optimized/test_syncs.py counts it)."""

from __future__ import annotations

import pytest
import torch

import glm_mtp.optimized.programs as programs_mod
from glm_mtp.conformance.grammars import Grammar
from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.bytes import keyed_bytes, same_bytes

from .conftest import Inputs

# Unbounded, both ends, a start past the root, and a liar (a matcher refusing what it allowed).
GRAMMARS = [Grammar(1), Grammar(2, depth=2), Grammar(3, depth=3, end="empty", start=1), Grammar(5, depth=6),
            Grammar(7), Grammar(11, depth=4, end="empty"), Grammar(13, depth=0), Grammar(17, liar=1)]


def _pair(weights, kernels, max_seq_len=64):
    return ReferenceProposer(weights, max_seq_len), OptimizedProposer(weights, max_seq_len, kernels=kernels)


def _ready(props, inputs, n=12):
    tokens, hiddens = inputs.tokens(n), inputs.hiddens(n)
    states = [p.alloc_state("cpu") for p in props]
    for p, s in zip(props, states):
        p.prefill_drafter(tokens, hiddens, s)
    return states


def _same_state(ref, rs, opt, os_):
    a, b = keyed_bytes(ref.export_state(rs)), keyed_bytes(opt.export_state(os_))
    assert a == b, [k for k in a if a[k] != b.get(k)]
    assert int(os_.seq_dev[0]) == os_.seq_len


def _same_confidence(ref, rs, opt, os_):
    for r, o in zip(ref.draft_confidence(rs), opt.draft_confidence(os_)):
        assert same_bytes(r, o), (r, o)


def _redos(monkeypatch):
    """Counts the redo programs the optimized drafter runs (``redo_from``), by their first step."""
    seen = []
    real = programs_mod.DevicePrograms.run_redo_from

    def spy(self, st, k, first):
        seen.append(first)
        return real(self, st, k, first)

    monkeypatch.setattr(programs_mod.DevicePrograms, "run_redo_from", spy)
    return seen


def _rounds(ref, opt, rs, os_, inputs, grammars, k, sampled=False, temperature=0.7):
    """Spec-decode rounds with a grammar each: the same drafts (and q), state bytes, confidences
    and matcher state in both; a refusal of the same type with both states as found."""
    V = ref.config.vocab_size
    pos = ref.drafter_rows(rs)
    for g in grammars:
        tok, hid = inputs.token(), inputs.hiddens(1)
        mr, mo = g.matcher(V), g.matcher(V)
        noise = torch.empty(k, V).exponential_(generator=inputs.gen).to(inputs.device) if sampled else None
        out = []
        for prop, st, m in ((ref, rs, mr), (opt, os_, mo)):
            try:
                if sampled:
                    out.append(("ok", prop.propose_sampled(tok, hid, pos, k, temperature, noise, st, grammar=m)))
                else:
                    out.append(("ok", prop.propose(tok, hid, pos, k, st, grammar=m)))
            except Exception as e:  # compared below
                out.append(("raised", e))
        (kr, vr), (ko, vo) = out
        assert kr == ko, (g, vr, vo)
        assert mr.as_found() and mo.as_found(), g
        _same_state(ref, rs, opt, os_)
        if kr == "raised":
            assert type(vr) is type(vo) is ValueError and "refused draft step" in str(vo), (vr, vo)
            assert str(vr) == str(vo)
            continue
        if sampled:
            assert vr.drafts == vo.drafts and same_bytes(vr.q, vo.q), g
            n = len(vr.drafts)
        else:
            assert vr == vo, (g, vr, vo)
            n = len(vr)
        assert n == g.drafts(k)
        _same_confidence(ref, rs, opt, os_)
        a = inputs.randint(0, n)
        ref.after_verify(a, rs)
        opt.after_verify(a, os_)
        _same_state(ref, rs, opt, os_)
        pos = ref.drafter_rows(rs)


def test_grammar_proposes_match_the_reference(weights, inputs, monkeypatch):
    ref, opt = _pair(weights, "torch")
    rs, os_ = _ready((ref, opt), inputs)
    redos = _redos(monkeypatch)
    _rounds(ref, opt, rs, os_, inputs, GRAMMARS, k=4)
    assert redos, "no grammar forbade an unmasked draft: the redo path was not exercised"


def test_grammar_proposes_with_triton_kernels(monkeypatch):
    """The interpreted Triton kernels (the head storing its logits, the masked argmax of a redo,
    the confidence kernel): a grammar whose first mask forbids the unmasked draft, and one that
    stops; bf16 in the default run (both dtypes and every grammar in the slow one)."""
    weights = MtpWeights.random(MtpConfig.preset("tiny"), seed=7, dtype=torch.bfloat16)
    inputs = Inputs(weights, seed=13)
    ref, opt = _pair(weights, "triton")
    rs, os_ = _ready((ref, opt), inputs)
    redos = _redos(monkeypatch)
    _rounds(ref, opt, rs, os_, inputs, [GRAMMARS[0], GRAMMARS[1]], k=3)
    assert redos


@pytest.mark.slow
def test_grammar_proposes_with_triton_kernels_slow(weights, inputs, monkeypatch):
    ref, opt = _pair(weights, "triton")
    rs, os_ = _ready((ref, opt), inputs)
    redos = _redos(monkeypatch)
    _rounds(ref, opt, rs, os_, inputs, GRAMMARS, k=4)
    assert redos


@pytest.mark.parametrize("preset,share", [("tiny", True), ("glm5next_tiny", False), ("glm5next_tiny", True)])
def test_grammar_proposes_both_families_and_sharing(preset, share, monkeypatch):
    w = MtpWeights.random(MtpConfig.preset(preset).replace(index_share_for_mtp_iteration=share), seed=3,
                          dtype=torch.bfloat16)
    inputs = Inputs(w, seed=11)
    ref, opt = _pair(w, "torch")
    rs, os_ = _ready((ref, opt), inputs, n=14)
    redos = _redos(monkeypatch)
    _rounds(ref, opt, rs, os_, inputs, GRAMMARS, k=5)
    assert redos


def test_pre_norm_feed_under_a_grammar(monkeypatch):
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=5, dtype=torch.bfloat16)
    inputs = Inputs(w, seed=2)
    ref, opt = ReferenceProposer(w, 64, "pre_norm"), OptimizedProposer(w, 64, "pre_norm", kernels="torch")
    rs, os_ = _ready((ref, opt), inputs)
    redos = _redos(monkeypatch)
    _rounds(ref, opt, rs, os_, inputs, GRAMMARS, k=4)
    assert redos


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_sampled_grammar_proposes_match_the_reference(weights, inputs, kernels):
    ref, opt = _pair(weights, kernels)
    rs, os_ = _ready((ref, opt), inputs)
    _rounds(ref, opt, rs, os_, inputs, GRAMMARS, k=3, sampled=True)


def test_confidence_without_a_grammar_matches_the_reference(weights, inputs):
    """``propose``, ``propose_sampled`` and ``propose_device``, k = 0 included; the tensors stay
    on the device (no read) and a second call returns the same ones."""
    ref, opt = _pair(weights, "torch")
    rs, os_ = _ready((ref, opt), inputs)
    V = ref.config.vocab_size
    for k in (3, 0, 1):
        tok, hid = inputs.token(), inputs.hiddens(1)
        pos = ref.drafter_rows(rs)
        assert ref.propose(tok, hid, pos, k, rs) == opt.propose(tok, hid, pos, k, os_)
        _same_confidence(ref, rs, opt, os_)
        assert opt.draft_confidence(os_)[0] is opt.draft_confidence(os_)[0]
        prob, margin = opt.draft_confidence(os_)
        assert prob.shape == margin.shape == (k,) and prob.dtype == torch.float32
        ref.after_verify(0, rs)
        opt.after_verify(0, os_)
        noise = torch.empty(k, V).exponential_(generator=inputs.gen)
        pos = ref.drafter_rows(rs)
        a = ref.propose_sampled(tok, hid, pos, k, 0.8, noise, rs)
        b = opt.propose_sampled(tok, hid, pos, k, 0.8, noise, os_)
        assert a.drafts == b.drafts
        _same_confidence(ref, rs, opt, os_)
        ref.after_verify(0, rs)
        opt.after_verify(0, os_)
    pos = ref.drafter_rows(rs)
    tok, hid = inputs.token(), inputs.hiddens(1)
    ref.propose(tok, hid, pos, 2, rs)
    opt.propose_device(tok, hid, pos, 2, os_)
    _same_confidence(ref, rs, opt, os_)


def test_confidence_needs_a_pending_propose(weights, inputs):
    ref, opt = _pair(weights, "torch")
    rs, os_ = _ready((ref, opt), inputs)
    for prop, st in ((ref, rs), (opt, os_)):
        with pytest.raises(RuntimeError, match="no propose is pending"):
            prop.draft_confidence(st)
        prop.propose(3, inputs.hiddens(1), prop.drafter_rows(st), 2, st)
        prop.draft_confidence(st)
        prop.after_verify(1, st)
        with pytest.raises(RuntimeError, match="no propose is pending"):
            prop.draft_confidence(st)
        prop.free_state(st)
        with pytest.raises(RuntimeError):
            prop.draft_confidence(st)


def test_allowed_drafts_run_no_redo_and_forbidden_ones_redo_from_their_step(weights, inputs, monkeypatch):
    """A grammar allowing every unmasked draft runs the one unmasked program; one forbidding draft
    2 only (every other token allowed) runs one redo, from step 2 (0-based 1)."""
    ref, opt = _pair(weights, "torch")
    rs, os_ = _ready((ref, opt), inputs)
    tok, hid = inputs.token(), inputs.hiddens(1)
    plain = opt.propose(tok, hid, 11, 4, os_)
    opt.after_verify(0, os_)
    redos = _redos(monkeypatch)

    class Forbid:
        """Every token allowed, but ``banned[i]`` at draft i (depth i)."""

        def __init__(self, banned):
            self.banned, self.depth = banned, 0

        def is_terminated(self):
            return False

        def fill_next_token_bitmask(self, bitmask, index=0):
            bitmask[index] = -1
            t = self.banned.get(self.depth)
            if t is not None:
                bitmask[index, t // 32] &= ~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF

        def accept_token(self, token):
            self.depth += 1
            return True

        def rollback(self, n):
            self.depth -= n

    assert opt.propose(tok, hid, 11, 4, os_, grammar=Forbid({})) == plain
    assert redos == []
    opt.after_verify(0, os_)
    want = ref.propose(tok, hid, 11, 4, rs, grammar=Forbid({1: plain[1]}))
    assert opt.propose(tok, hid, 11, 4, os_, grammar=Forbid({1: plain[1]})) == want
    assert redos == [1] and want[0] == plain[0] and want[1] != plain[1]
    _same_state(ref, rs, opt, os_)
    _same_confidence(ref, rs, opt, os_)


def test_batch_with_grammars_matches_the_reference(weights, inputs, monkeypatch):
    """``propose_batch`` with one matcher or None per state: each state's drafts, bytes and
    confidence are those of the reference (itself the loop of single proposes); a forbidden
    draft redoes its state alone, a liar puts every state back."""
    _check_batch(weights, inputs, monkeypatch)


def test_batch_with_grammars_on_the_per_primitive_path(monkeypatch):
    """float64 weights take the per-primitive block (no fused step): the states one by one."""
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=9, dtype=torch.float64)
    _check_batch(w, Inputs(w, seed=4), monkeypatch)


@pytest.mark.parametrize("preset,share", [("tiny", True), ("glm5next_tiny", True)])
def test_batch_with_grammars_and_sharing(preset, share, monkeypatch):
    """A redone state of a sharing batch attends its own step-1 selection, handed over from the
    batch's kept lines."""
    w = MtpWeights.random(MtpConfig.preset(preset).replace(index_share_for_mtp_iteration=share), seed=8,
                          dtype=torch.bfloat16)
    _check_batch(w, Inputs(w, seed=6), monkeypatch)


def _check_batch(weights, inputs, monkeypatch):
    redos = _redos(monkeypatch)
    ref, opt = _pair(weights, "torch")
    V, B, k = ref.config.vocab_size, 3, 4
    rstates, ostates = [], []
    for b in range(B):
        rs, os_ = _ready((ref, opt), inputs, n=10 + 2 * b)
        rstates.append(rs)
        ostates.append(os_)
    for grammars in ([GRAMMARS[0], None, GRAMMARS[2]], [GRAMMARS[3], GRAMMARS[4], GRAMMARS[5]], None,
                     [None, GRAMMARS[7], GRAMMARS[1]]):
        toks = inputs.tokens(B).tolist()
        hid = inputs.hiddens(B)
        pos = [ref.drafter_rows(s) for s in rstates]
        out = []
        ms = []
        for prop, states in ((ref, rstates), (opt, ostates)):
            m = None if grammars is None else [g.matcher(V) if g is not None else None for g in grammars]
            ms.append(m)
            try:
                out.append(("ok", prop.propose_batch(toks, hid, pos, k, states, grammars=m)))
            except Exception as e:  # compared below
                out.append(("raised", e))
        (kr, vr), (ko, vo) = out
        assert kr == ko and (kr == "raised" or vr == vo), (vr, vo)
        if kr == "raised":
            assert type(vr) is type(vo) and str(vr) == str(vo)
        for m in ms:
            assert m is None or all(x is None or x.as_found() for x in m)
        for rs, os_ in zip(rstates, ostates):
            _same_state(ref, rs, opt, os_)
            if kr == "ok":
                _same_confidence(ref, rs, opt, os_)
                ref.after_verify(0, rs)
                opt.after_verify(0, os_)
    assert redos, "no state was redone"


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_grammar_proposes_on_cuda(weights, cuda_graphs, monkeypatch):
    """On CUDA: the grammar's programs (the unmasked k steps, a redo from step i, a sampled step
    under its mask) are captured under their own keys and replayed; the drafts, q, state bytes
    and confidences are the reference's on the same device, batches included."""
    w = weights.to("cuda")
    inputs = Inputs(w, seed=21)
    ref = ReferenceProposer(w, 64)
    opt = OptimizedProposer(w, 64, cuda_graphs=cuda_graphs)
    tokens, hiddens = inputs.tokens(12), inputs.hiddens(12)
    rs, os_ = ref.alloc_state("cuda"), opt.alloc_state("cuda")
    ref.prefill_drafter(tokens, hiddens, rs)
    opt.prefill_drafter(tokens, hiddens, os_)
    redos = _redos(monkeypatch)
    for _ in range(2):  # the second round replays what the first captured
        _rounds(ref, opt, rs, os_, inputs, GRAMMARS, k=4)
        _rounds(ref, opt, rs, os_, inputs, GRAMMARS[:4], k=3, sampled=True)
    assert redos
    if cuda_graphs:
        keys = set(os_.graphs)
        assert any(key.masked and key.program == "draft" for key in keys)
        assert any(key.masked and key.program == "sampled" for key in keys)
