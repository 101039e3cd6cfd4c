"""Every misuse of DESIGN.md §4: the right error, naming the argument or rule, and the state left
byte-identical. Checks run lifecycle first (RuntimeError), then arguments (ValueError), then
no-ops (return 0)."""

import pytest
import torch


def make_state(prop, inputs, kind):
    """'live': 9 rows, nothing pending; 'pending': a 3-draft propose outstanding; 'freed'."""
    state = prop.alloc_state("cpu")
    prop.prefill_drafter(inputs.tokens(10), inputs.hiddens(10), state)
    if kind == "pending":
        prop.propose(inputs.token(), inputs.hiddens(1), 9, 3, state)
    if kind == "freed":
        prop.free_state(state)
    return state


def H(prop):
    return prop.config.hidden_size


def V(prop):
    return prop.config.vocab_size


# (state kind, call, exception, message fragment)
CASES = {
    # lifecycle
    "propose_after_free": ("freed", lambda p, s, i: p.propose(1, i.hiddens(1), 0, 1, s), RuntimeError, "freed"),
    "prefill_after_free": ("freed", lambda p, s, i: p.prefill_drafter(i.tokens(3), i.hiddens(3), s), RuntimeError,
                           "freed"),
    "catchup_after_free": ("freed", lambda p, s, i: p.catchup_drafter(i.tokens(1), i.hiddens(1), 0, 0, s), RuntimeError,
                           "freed"),
    "verify_after_free": ("freed", lambda p, s, i: p.after_verify(0, s), RuntimeError, "freed"),
    "propose_while_pending": ("pending", lambda p, s, i: p.propose(1, i.hiddens(1), 12, 1, s), RuntimeError, "pending"),
    "prefill_while_pending": ("pending", lambda p, s, i: p.prefill_drafter(i.tokens(3), i.hiddens(3), s), RuntimeError,
                              "pending"),
    "catchup_while_pending": ("pending", lambda p, s, i: p.catchup_drafter(i.tokens(1), i.hiddens(1), 12, 12, s),
                              RuntimeError, "pending"),
    "verify_none_pending": ("live", lambda p, s, i: p.after_verify(0, s), RuntimeError, "no propose is pending"),
    "propose_behind": ("live", lambda p, s, i: p.propose(1, i.hiddens(1), 10, 1, s), RuntimeError, "catch up"),
    # lifecycle wins over bad arguments
    "freed_and_bad_token": ("freed", lambda p, s, i: p.propose(-1, i.hiddens(1), 0, 1, s), RuntimeError, "freed"),
    "pending_and_bad_hidden": ("pending", lambda p, s, i: p.propose(1, torch.full((H(p),), float("nan")), 12, 1, s),
                               RuntimeError, "pending"),
    # arguments
    "token_negative": ("live", lambda p, s, i: p.propose(-1, i.hiddens(1), 9, 1, s), ValueError,
                       "last_token: token id -1"),
    "token_too_large": ("live", lambda p, s, i: p.propose(V(p), i.hiddens(1), 9, 1, s), ValueError, "vocab_size"),
    "token_tensor_two_ids": ("live", lambda p, s, i: p.propose(torch.tensor([1, 2]), i.hiddens(1), 9, 1, s), ValueError,
                             "last_token must be an int or a tensor of one token id"),
    "token_tensor_2d": ("live", lambda p, s, i: p.propose(torch.tensor([[1]]), i.hiddens(1), 9, 1, s), ValueError,
                        "got shape \\(1, 1\\)"),
    "token_float": ("live", lambda p, s, i: p.propose(1.0, i.hiddens(1), 9, 1, s), ValueError, "integer"),
    "prefill_token_out_of_range": ("live", lambda p, s, i: p.prefill_drafter(torch.tensor([1, V(p)]), i.hiddens(2), s),
                                   ValueError, "prompt_tokens"),
    "catchup_token_out_of_range": ("live",
                                   lambda p, s, i: p.catchup_drafter(torch.tensor([V(p) + 5]), i.hiddens(1), 9, 9, s),
                                   ValueError, "tokens"),
    "catchup_float_tokens": ("live", lambda p, s, i: p.catchup_drafter(torch.tensor([1.0]), i.hiddens(1), 9, 9, s),
                             ValueError, "integer"),
    "hidden_wrong_width": ("live", lambda p, s, i: p.propose(1, torch.randn(H(p) + 1).to(i.dtype), 9, 1, s), ValueError,
                           "target_hidden must have shape"),
    "hidden_two_rows": ("live", lambda p, s, i: p.propose(1, i.hiddens(2), 9, 1, s), ValueError,
                        "target_hidden must have shape"),
    "hidden_wrong_dtype": ("live", lambda p, s, i: p.propose(1, i.hiddens(1).double(), 9, 1, s), ValueError, "dtype"),
    "hidden_wrong_device": ("live", lambda p, s, i: p.propose(1, i.hiddens(1).to("meta"), 9, 1, s), ValueError,
                            "device"),
    "hidden_nan": ("live", lambda p, s, i: p.propose(1, i.hiddens(1).index_fill(1, torch.tensor([3]), float("nan")), 9,
                                                     1, s), ValueError, "NaN"),
    "hidden_inf": ("live",
                   lambda p, s, i: p.catchup_drafter(
                       i.tokens(2), i.hiddens(2).index_fill(0, torch.tensor([1]), float("inf")), 9, 9, s),
                   ValueError, "NaN or inf"),
    "hidden_not_tensor": ("live", lambda p, s, i: p.propose(1, [0.5] * H(p), 9, 1, s), ValueError, "tensor"),
    "len_mismatch_prefill": ("live", lambda p, s, i: p.prefill_drafter(i.tokens(4), i.hiddens(3), s), ValueError,
                             "shape"),
    "len_mismatch_catchup": ("live", lambda p, s, i: p.catchup_drafter(i.tokens(2), i.hiddens(3), 9, 9, s), ValueError,
                             "shape"),
    "num_drafts_negative": ("live", lambda p, s, i: p.propose(1, i.hiddens(1), 9, -1, s), ValueError, "num_drafts"),
    "num_accepted_too_many": ("pending", lambda p, s, i: p.after_verify(4, s), ValueError,
                              r"num_accepted must be in \[0, 3\]"),
    "num_accepted_negative": ("pending", lambda p, s, i: p.after_verify(-1, s), ValueError, "num_accepted"),
    "propose_past_capacity": ("live", lambda p, s, i: p.propose(1, i.hiddens(1), 9, p.capacity, s), ValueError,
                              "capacity"),
    "catchup_past_capacity": ("live",
                              lambda p, s, i: p.catchup_drafter(i.tokens(p.capacity), i.hiddens(p.capacity), 9, 9, s),
                              ValueError, "capacity"),
    "prompt_too_long": ("live",
                        lambda p, s, i: p.prefill_drafter(i.tokens(p.max_seq_len + 1), i.hiddens(p.max_seq_len + 1), s),
                        ValueError, "max_seq_len"),
    "row_base_negative": ("live", lambda p, s, i: p.catchup_drafter(i.tokens(1), i.hiddens(1), -1, 0, s), ValueError,
                          "row_base"),
    "position_negative": ("live", lambda p, s, i: p.propose(1, i.hiddens(1), -2, 1, s), ValueError, "position"),
    # a misaligned catch-up with bad arguments still raises
    "misaligned_catchup_bad_token": ("live",
                                     lambda p, s, i: p.catchup_drafter(torch.tensor([-3]), i.hiddens(1), 2, 2, s),
                                     ValueError, "token id -3"),
    "misaligned_catchup_past_capacity": ("live",
                                         lambda p, s, i: p.catchup_drafter(i.tokens(2), i.hiddens(2), p.capacity - 1,
                                                                           0, s),
                                         ValueError, "capacity"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_misuse_raises_and_leaves_state(prop, inputs, snap, name):
    kind, call, exc, match = CASES[name]
    state = make_state(prop, inputs, kind)
    before = snap(prop, state)
    rows, key = prop.drafter_rows(state), prop.last_pair_key(state)
    with pytest.raises(exc, match=match):
        call(prop, state, inputs)
    assert snap(prop, state) == before
    assert prop.drafter_rows(state) == rows and prop.last_pair_key(state) == key


def test_state_stays_usable_after_a_refused_call(prop, inputs):
    state = make_state(prop, inputs, "live")
    with pytest.raises(ValueError):
        prop.propose(1, inputs.hiddens(1).index_fill(1, torch.tensor([0]), float("nan")), 9, 2, state)
    assert len(prop.propose(1, inputs.hiddens(1), 9, 2, state)) == 2
    with pytest.raises(RuntimeError):
        prop.propose(1, inputs.hiddens(1), 11, 2, state)
    prop.after_verify(1, state)
    with pytest.raises(RuntimeError):
        prop.after_verify(1, state)  # the engine's drafter would trim again and cut the kept first row
    assert prop.drafter_rows(state) == 11


def test_bad_constructor_arguments(weights):
    from glm_mtp.reference import ReferenceProposer

    with pytest.raises(ValueError, match="max_seq_len"):
        ReferenceProposer(weights, max_seq_len=0)
    with pytest.raises(ValueError, match="feed_hidden"):
        ReferenceProposer(weights, max_seq_len=8, feed_hidden="mid_norm")
    with pytest.raises(ValueError, match="device"):
        ReferenceProposer(weights, max_seq_len=8).alloc_state("meta")
