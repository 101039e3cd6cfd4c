"""The ranges of the numbers commands take (``glm_mtp.ranges``) are their consumers' ranges:
drawn values are accepted exactly when torch accepts them, as the runs use them (a seed with the
largest offset a run adds, a thread count), and refused naming the flag or setting otherwise."""

import argparse
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_mtp.ranges import SEED_MAX, THREADS_MAX, check_int_range, ranged_int

# The largest offset a run adds to its seed (train.py's ``seed + 7``; bench_batch's ``seed + batch``
# stays far below it for any batch a device holds).
SEED_OFFSET = 2**16
WIDE = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([-1, 0, 1, SEED_MAX, SEED_MAX + 1, 2**64 - 1, 2**64,
                                                              THREADS_MAX, THREADS_MAX + 1]))


def torch_takes_seed(seed: int) -> bool:
    try:
        torch.Generator().manual_seed(seed + SEED_OFFSET)
        return True
    except (RuntimeError, ValueError, OverflowError):
        return False


@settings(max_examples=200, deadline=None)
@given(WIDE)
def test_an_accepted_seed_is_one_torch_takes_with_every_offset(seed):
    try:
        check_int_range("seed", seed, 0, SEED_MAX)
    except ValueError as e:
        assert str(e).startswith("seed must be in [0, ")
        return
    assert torch_takes_seed(seed)


@settings(max_examples=100, deadline=None)
@given(WIDE)
def test_an_accepted_thread_count_is_one_torch_takes(n):
    before = torch.get_num_threads()
    try:
        check_int_range("threads", n, 1, THREADS_MAX)
    except ValueError as e:
        assert str(e).startswith("threads must be in [1, ")
        if n > THREADS_MAX:  # below 1 is the run's own rule (it needs a thread)
            with pytest.raises((RuntimeError, ValueError, OverflowError)):
                torch.set_num_threads(n)
        return
    try:
        torch.set_num_threads(n)
    finally:
        torch.set_num_threads(before)


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.integers(-2**70, 2**70), st.text(max_size=5), st.floats(allow_nan=True)))
def test_ranged_int_reads_what_check_int_range_accepts(value):
    parse = ranged_int(0, SEED_MAX)
    text = str(value)
    try:
        expected = check_int_range("x", int(text), 0, SEED_MAX)
    except ValueError:
        with pytest.raises(argparse.ArgumentTypeError, match="^must be "):
            parse(text)
        return
    assert parse(text) == expected


@pytest.mark.parametrize("value, message", [
    (True, "must be an integer"), (2.0, "must be an integer"), ("3", "must be an integer"),
    (None, "must be an integer"),
    (-1, "must be >= 0"), (2**64, "must be <= 9223372036854775807 (a 64-bit count)"),
])
def test_a_count_without_an_upper_bound_is_still_a_64_bit_one(value, message):
    with pytest.raises(ValueError, match=f"^n {re.escape(message)}"):
        check_int_range("n", value, 0)
