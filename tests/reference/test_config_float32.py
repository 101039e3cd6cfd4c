"""Every float setting of ``MtpConfig`` is checked as the float32 value the drafter computes with
(DESIGN.md §5, "Constants"): finite, normal and > 0 there, else a ``ValueError`` naming the field,
whether the config comes from a preset, ``replace`` or a ``config.json``."""

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer

FIELDS = ("rope_theta", "routed_scaling_factor", "rms_norm_eps", "swiglu_limit")
TINY, MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
# float64 values at float32's edges: the least normal and the greatest finite float32, their float64
# neighbours, and the halfway points that round (to even) onto the edge or past it.
EDGES = [TINY, np.nextafter(TINY, 0), np.nextafter(TINY, 1), TINY / 2, TINY * (1 - 2**-25),
         float(np.float32(TINY) - np.float32(2**-149)),
         MAX, np.nextafter(MAX, math.inf), MAX + 2.0**103, np.nextafter(MAX + 2.0**103, 0), 2.0**128, 1e-300, 1e300,
         1e-45, 1e-46,
         5e-324, 0.0, -0.0, -1.0, math.inf, math.nan, 10**400, 1.0, 2.5]


def float32_ok(value: float) -> bool:
    """The rule's oracle, by numpy: the float32 value is finite, normal and > 0."""
    try:
        if not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
            return False
    except OverflowError:
        return False
    with np.errstate(over="ignore"):
        f = np.float32(value)
    return bool(np.isfinite(f)) and float(f) >= TINY


values = st.one_of(st.sampled_from(EDGES), st.floats(allow_nan=True, allow_infinity=True),
                   st.floats(min_value=TINY / 4, max_value=TINY * 4), st.floats(min_value=MAX / 2, max_value=MAX * 2))


@settings(max_examples=400, deadline=None, database=None)
@given(field=st.sampled_from(FIELDS), value=values)
def test_a_float_setting_loads_exactly_when_its_float32_value_is_finite_normal_and_positive(field, value):
    base = MtpConfig.preset("glm5next_tiny")
    if float32_ok(value):
        assert getattr(base.replace(**{field: value}), field) == value
    else:
        with pytest.raises(ValueError, match=rf"MtpConfig\.{field} must be a finite number > 0"):
            base.replace(**{field: value})


def next_config_json(tmp_path, **fields):
    d = MtpConfig.preset("glm5next_tiny").to_hf_dict()
    d["text_config"].update(fields)
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path


@pytest.mark.parametrize("field, value, why", [
    ("swiglu_limit", 1e-300, "rounds to 0.0"),           # every expert would add exactly 0
    ("swiglu_limit", 1e300, "rounds to inf"),            # the clamp would clamp nothing
    ("rms_norm_eps", 1e-300, "rounds to 0.0"),           # a zero hidden would write NaN rows
    ("routed_scaling_factor", 1e300, "rounds to inf"),   # drafted [0, 0, 0]
])
def test_named_config_json_values_are_refused_in_float32(tmp_path, field, value, why):
    with pytest.raises(ValueError) as e:
        MtpConfig.from_hf_config(next_config_json(tmp_path, **{field: value}))
    message = str(e.value)
    assert "config.json: text_config" in message and f"MtpConfig.{field} must be a finite number > 0" in message
    assert "as float32" in message and why in message


def test_the_least_accepted_eps_keeps_a_zero_hidden_finite():
    # 2^-126, the least eps the rule accepts: a zero row's RMSNorm is 0 * (1 / sqrt(eps)), finite.
    cfg = MtpConfig.preset("glm5next_tiny").replace(rms_norm_eps=TINY)
    w = MtpWeights.random(cfg, seed=1, dtype=torch.bfloat16)
    prop = ReferenceProposer(w, 32)
    state = prop.alloc_state("cpu")
    zeros = torch.zeros(5, cfg.hidden_size, dtype=torch.bfloat16)
    prop.prefill_drafter([1, 2, 3, 4, 5], zeros, state)
    prop.propose(7, zeros[0], 4, 3, state)
    for name, t in prop.export_state(state).items():
        if t.is_floating_point():
            assert bool(torch.isfinite(t).all()), name
