"""Byte comparison: the signs of zeros, NaN payloads, and where a difference is."""

import torch

from glm_mtp.conformance.compare import first_mismatch, snapshots_equal


def test_negative_zero_differs_from_zero():
    a = torch.tensor([1.0, 0.0, 2.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0, -0.0, 2.0], dtype=torch.bfloat16)
    assert torch.equal(a, b)  # why the suite never compares floats with torch.equal
    m = first_mismatch(a, b)
    assert m is not None and m.index == (1,) and "0x0000" in m.candidate and "0x8000" in m.baseline


def test_same_nan_is_equal_and_the_first_differing_element_is_named():
    a = torch.randn(4, 5)
    a[1, 2] = float("nan")
    b = a.clone()
    assert first_mismatch(a, b) is None
    b[3, 1] += 1
    b[2, 4] += 1
    m = first_mismatch(a, b)
    assert m.index == (2, 4) and m.count == 2


def test_dtype_shape_and_keys():
    a = torch.zeros(3, dtype=torch.int64)
    assert first_mismatch(a, a.to(torch.int32)).index is None
    assert first_mismatch(a, torch.zeros(4, dtype=torch.int64)).detail == "dtype or shape differ"
    assert first_mismatch(torch.tensor(True), torch.tensor(False)).index == ()
    assert not snapshots_equal({"x": a}, {"x": a, "y": a})
