"""The block-scale rule (DESIGN.md §8): every ``*_scale_inv`` value is a normal float32 > 0.
``quantize_fp8`` writes only such scales (and finite codes), whatever the block's magnitude, and
the loader refuses any other scale naming the file and the tensor (``fp8.check_scales``)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.reference import fp8
from glm_mtp.reference.weights import weights_equal

TINY = float(np.finfo(np.float32).tiny)
# Block magnitudes across float32's whole range: zero, subnormal amaxes (whose amax / 448 was 0 or
# a subnormal), the normal edge, ordinary weights, and up to float32's largest value.
MAGNITUDES = [0.0, 1e-45, 2.0**-140, 1e-40, TINY / 448, TINY, 448 * TINY, 1e-30, 1e-3, 1.0, 448.0, 1e30, 3e38]
SPECIAL_SCALES = [0.0, -0.0, -1.0, -TINY, 1e-45, 1e-40, float(np.nextafter(np.float32(TINY), np.float32(0))), TINY, 1.0,
                  3.4e38, math.inf, -math.inf, math.nan]


@settings(max_examples=150, deadline=None, database=None)
@given(shape=st.sampled_from([(130, 10), (128, 128), (3, 257), (2, 129, 7)]),
       mags=st.lists(st.sampled_from(MAGNITUDES), min_size=1, max_size=6), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_quantize_writes_only_normal_positive_scales_and_finite_codes(shape, mags, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(shape, generator=gen) * 2 - 1
    # one magnitude per 128-row band, so blocks of very different size sit side by side
    rows = torch.arange(shape[-2]) // 128
    scale = torch.tensor(mags)[rows % len(mags)].reshape(-1, 1)
    w = (w * scale).to(dtype)
    if not bool(torch.isfinite(w).all()):  # a bf16 cast of 3e38 * 1.x overflows: not a weight
        return
    q = fp8.quantize_fp8(w, "drawn")
    fp8.check_scales("drawn scale", q.scale_inv)  # the loader's rule holds for what quantize writes
    assert fp8.non_finite_fp8(q.w8) == 0
    back = fp8.dequantize(q, torch.float64)
    # a block's values come back within e4m3's relative step of its amax (or below 2^-126 * 2^-9, the
    # least code at the least scale)
    amax = w.abs().to(torch.float64).amax()
    assert float((back - w.to(torch.float64)).abs().amax()) <= max(float(amax) * 2**-4, TINY)


@settings(max_examples=150, deadline=None, database=None)
@given(values=st.lists(st.one_of(st.sampled_from(SPECIAL_SCALES), st.floats(width=32)), min_size=4, max_size=4))
def test_a_scale_is_accepted_exactly_when_every_value_is_a_normal_positive_float32(values):
    s = torch.tensor(values, dtype=torch.float32).reshape(2, 2)
    good = all(np.isfinite(np.float32(v)) and float(np.float32(v)) >= TINY for v in values)
    if good:
        fp8.check_scales("file: scale 'x_scale_inv'", s)
    else:
        with pytest.raises(ValueError,
                           match=r"^file: scale 'x_scale_inv' holds \d+ value\(s\) that are not a normal float32 > 0"):
            fp8.check_scales("file: scale 'x_scale_inv'", s)


def test_a_subnormal_block_quantizes_saves_and_loads_back(tmp_path):
    cfg = MtpConfig.preset("tiny")
    w = MtpWeights.random(cfg, seed=2)
    w.layer.attn.q_a_proj.mul_(2.0**-130)  # its one block: subnormal values, amax / 448 a subnormal or 0 in float32
    q = w.quantize_fp8()
    s = q.layer.attn.q_a_proj.scale_inv
    assert float(s.min()) == TINY and fp8.non_finite_fp8(q.layer.attn.q_a_proj.w8) == 0
    q.save_pretrained(tmp_path)
    assert weights_equal(MtpWeights.from_pretrained(tmp_path), q)


def test_quantize_names_the_tensor_that_holds_inf():
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=2)
    w.layer.attn.q_b_proj[3, 5] = math.inf
    with pytest.raises(ValueError, match=r"quantize_fp8: tensor '.*self_attn\.q_b_proj\.weight' holds 1 NaN/inf value"):
        w.quantize_fp8()
