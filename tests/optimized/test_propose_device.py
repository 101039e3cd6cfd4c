"""``propose_device`` (drafts stay on the device, no sync), its deferred input check, and
``reset_state``: against the reference, byte for byte."""

import pytest
import torch

from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import ReferenceProposer
from glm_mtp.reference.bytes import same_bytes


def _pair(weights, inputs, rows=9):
    ref, opt = ReferenceProposer(weights, 64), OptimizedProposer(weights, 64)
    rs, os_ = ref.alloc_state("cpu"), opt.alloc_state("cpu")
    tokens, hiddens = inputs.tokens(rows + 1), inputs.hiddens(rows + 1)
    ref.prefill_drafter(tokens, hiddens, rs)
    opt.prefill_drafter(tokens, hiddens, os_)
    return ref, opt, rs, os_


def test_propose_device_matches_propose(weights, inputs, lockstep):
    ref, opt, rs, os_ = _pair(weights, inputs)
    for k, a in ((3, 1), (4, 4), (1, 0), (0, 0), (5, 2)):
        pos = ref.drafter_rows(rs)
        tok, hidden = inputs.token(), inputs.hiddens(1)
        want = ref.propose(tok, hidden, pos, k, rs)
        got = opt.propose_device(torch.tensor([tok]), hidden, pos, k, os_)
        assert got.dtype == torch.int64 and got.shape == (k,) and got.device == os_.device
        assert got.tolist() == want
        mine = opt.export_state(os_)
        assert all(same_bytes(t, mine[name]) for name, t in ref.export_state(rs).items())
        ref.after_verify(a, rs)
        opt.after_verify(a, os_)
        if a == k:
            h = inputs.hiddens(1)
            last = want[-1] if k else tok
            assert ref.catchup_drafter([last], h, pos + k, 0, rs) == opt.catchup_drafter([last], h, pos + k, 0, os_)


@pytest.mark.parametrize("bad", ["nan_hidden", "inf_hidden", "token_tensor_out_of_range"])
def test_propose_device_with_bad_data(weights, inputs, bad):
    """A non-finite hidden (or an out-of-range token tensor) reaches propose_device unchecked on
    the host: the drafts come back as -1, nothing on the device changes, queries show the state
    as before, the next mutating call raises ValueError (once), and the drafter then goes on
    exactly like a reference that refused the call."""
    ref, opt, rs, os_ = _pair(weights, inputs)
    before = {k: v.clone() for k, v in opt.export_state(os_).items()}
    x_before, pools_before = os_.x.clone(), os_.cache.kv_pool.clone()
    hidden, token = inputs.hiddens(1), torch.tensor([inputs.token()])
    if bad == "nan_hidden":
        hidden[0, 7] = float("nan")
    elif bad == "inf_hidden":
        hidden[0, 0] = float("inf")
    else:
        token = torch.tensor([weights.config.vocab_size + 2])
    drafts = opt.propose_device(token, hidden, 9, 3, os_)
    assert drafts.tolist() == [-1, -1, -1]
    # The device never changed: pools (every row, not only the exported ones), x, row count.
    assert same_bytes(os_.x, x_before) and same_bytes(os_.cache.kv_pool, pools_before)
    assert opt.drafter_rows(os_) == 9 and opt.last_pair_key(os_) == 8
    after = opt.export_state(os_)
    assert all(same_bytes(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="NaN or inf" if "hidden" in bad else "token id"):
        opt.after_verify(0, os_)
    with pytest.raises(RuntimeError, match="no propose is pending"):  # reported once; nothing pending
        opt.after_verify(0, os_)
    # And on: the same propose with good data, equal to the reference.
    good = inputs.hiddens(1)
    assert opt.propose(3, good, 9, 3, os_) == ref.propose(3, good, 9, 3, rs)
    mine = opt.export_state(os_)
    assert all(same_bytes(t, mine[k]) for k, t in ref.export_state(rs).items())


def test_deferred_error_raised_by_next_propose(weights, inputs):
    ref, opt, rs, os_ = _pair(weights, inputs)
    opt.propose_device(1, torch.full((weights.config.hidden_size,), float("nan")).to(weights.dtype), 9, 2, os_)
    with pytest.raises(ValueError, match="discarded"):
        opt.propose(1, inputs.hiddens(1), 9, 2, os_)
    assert opt.propose(1, inputs.hiddens(1), 9, 2, os_) is not None  # now it runs


def test_reset_state_is_a_fresh_state(weights, inputs, lockstep):
    """A reset state behaves like a newly allocated one (captured graphs kept)."""
    ls = lockstep(weights, max_seq_len=64)
    ls.call("prefill_drafter", inputs.tokens(8), inputs.hiddens(8))
    ls.call("propose", inputs.token(), inputs.hiddens(1), 7, 3)
    ls.opt.reset_state(ls.os)
    ls.ref.free_state(ls.rs)
    ls.rs = ls.ref.alloc_state("cpu")
    ls.check()
    ls.call("propose", inputs.token(), inputs.hiddens(1), 0, 4)
    ls.call("after_verify", 2)
    ls.call("catchup_drafter", inputs.tokens(1), inputs.hiddens(1), 3, 3)
    ls.call("prefill_drafter", inputs.tokens(5), inputs.hiddens(5))  # a state with rows: no-op
    ls.opt.free_state(ls.os)
    with pytest.raises(RuntimeError):
        ls.opt.reset_state(ls.os)


def test_foreign_state_is_refused(weights):
    ref, opt = ReferenceProposer(weights, 64), OptimizedProposer(weights, 64)
    with pytest.raises(TypeError, match="OptimizedProposer.alloc_state"):
        opt.drafter_rows(ref.alloc_state("cpu"))
