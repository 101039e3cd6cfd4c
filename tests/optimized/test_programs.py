"""``programs.input_check``: the one device-side check of a propose's data, shared by one
state's draft programs and the batch's. A row passes when its token is in ``[0, V)`` and its
hidden finite; the code's bits say which part failed."""

from __future__ import annotations

import pytest
import torch

from glm_mtp.optimized.programs import CHECK_OK, HIDDEN_FINITE, TOKEN_IN_RANGE, input_check
from glm_mtp.reference.bytes import same_bytes

V, H = 50, 16


def _rows(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(V, (n,), generator=gen), torch.randn(n, H, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("bad_token, bad_value", [(None, None), (V, None), (-1, None), (None, float("nan")),
                                                  (None, float("inf")), (V + 7, float("-inf"))])
def test_each_row_code_names_what_failed(bad_token, bad_value):
    tokens, hiddens = _rows(1, 5)
    if bad_token is not None:
        tokens[2] = bad_token
    if bad_value is not None:
        hiddens[2, 9] = bad_value
    code, finite, tok_ok = input_check(tokens, hiddens, V, per_row=True)
    want = [CHECK_OK] * 5
    want[2] = (0 if bad_value is not None else HIDDEN_FINITE) | (0 if bad_token is not None else TOKEN_IN_RANGE)
    assert code.tolist() == want  # only row 2 fails, and only in what was broken
    assert finite.tolist() == [w & HIDDEN_FINITE != 0 for w in want]
    assert tok_ok.tolist() == [w & TOKEN_IN_RANGE != 0 for w in want]


@pytest.mark.parametrize("seed", range(3))
def test_one_state_check_is_the_batch_check_of_one_row(seed):
    tokens, hiddens = _rows(seed, 1)
    if seed == 1:
        hiddens[0, seed] = float("nan")
    if seed == 2:
        tokens[0] = V
    whole, rows = input_check(tokens, hiddens, V, per_row=False), input_check(tokens, hiddens, V, per_row=True)
    for a, b in zip(whole, rows):
        assert same_bytes(a, b)
