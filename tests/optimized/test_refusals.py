"""Settings that pass a coarse check but whose computation is undefined in the dtype it runs in,
and arguments that reach a state's write section: both backends refuse exactly the same inputs,
before anything is written (DESIGN.md §4: a refused call leaves the state byte-identical and
usable), and a backend that cannot run here is refused at construction.

Examples: ``temperature`` 1e-45 rounds to a float32 subnormal and 1e-38 overflows the logits to
inf (``q`` NaN, drafts all 0), 1e39 overflows float32 (the optimized fill raised midway and
poisoned the state); a ``last_token`` tensor on a device the state cannot copy from (meta) was
copied inside the write section."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference import contract

from .conftest import state_bytes

BACKENDS = (ReferenceProposer, OptimizedProposer)


@pytest.fixture(scope="module")
def weights() -> MtpWeights:
    return MtpWeights.random(MtpConfig.preset("tiny"), seed=3, dtype=torch.bfloat16)


def prefilled(prop, weights, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    cfg = weights.config
    state = prop.alloc_state("cpu")
    tokens = torch.randint(cfg.vocab_size, (6,), generator=gen)
    hiddens = torch.randn(6, cfg.hidden_size, generator=gen).to(weights.dtype)
    prop.prefill_drafter(tokens, hiddens, state)
    noise = torch.empty(3, cfg.vocab_size).exponential_(generator=gen)
    return state, int(tokens[-1]), hiddens[-1], noise


def usable(prop, state, hidden, position=5):
    """A refused state still drafts (and is not poisoned)."""
    assert state.poisoned is None
    drafts = prop.propose(1, hidden, position, 2, state)
    prop.after_verify(0, state)
    return drafts


# ---- 1. a setting is valid when its computation is defined in the dtype it runs in -------------

BAD_TEMPERATURES = [1e-45, 1e-40, 1.0e-38, 2e-37, 1e39, 3.5e38, 10**400, math.inf, math.nan, -1.0, 0.0, -0.0, True,
                    "1.0", None]


@pytest.mark.parametrize("temperature", BAD_TEMPERATURES, ids=repr)
def test_both_backends_refuse_the_same_temperatures_before_writing(weights, temperature):
    messages = []
    for backend in BACKENDS:
        prop = backend(weights, 32)
        state, token, hidden, noise = prefilled(prop, weights)
        before = state_bytes(prop, state)
        with pytest.raises(ValueError, match="temperature") as e:
            prop.propose_sampled(token, hidden, 5, 3, temperature, noise, state)
        messages.append(str(e.value))
        assert state_bytes(prop, state) == before
        usable(prop, state, hidden)
    assert messages[0] == messages[1]


@pytest.mark.parametrize("temperature", [1e-30, 0.7, 1.0, 3e38, 3.4028234e38, 7])
def test_a_temperature_in_range_drafts_a_distribution_in_both_backends(weights, temperature):
    results = []
    for backend in BACKENDS:
        prop = backend(weights, 32)
        state, token, hidden, noise = prefilled(prop, weights)
        r = prop.propose_sampled(token, hidden, 5, 3, temperature, noise, state)
        assert bool(torch.isfinite(r.q).all()) and state.poisoned is None
        results.append(r)
    assert results[0] == results[1]  # SampledDrafts compares q by bytes


def test_the_temperature_floor_follows_the_head_logit_bound(weights):
    """The floor is the logit bound over float32's largest value: just above it drafts a finite
    ``q``, just below it is refused; the bound really bounds the logits."""
    bound = contract.logit_bound(weights)
    least = bound / torch.finfo(torch.float32).max
    assert contract.check_temperature(least * 1.01, bound, torch.float32) > 0
    with pytest.raises(ValueError, match="too small"):
        contract.check_temperature(least * 0.99, bound, torch.float32)
    # Rows of extreme but finite hiddens: the head's logits stay within the bound.
    prop = ReferenceProposer(weights, 32)
    from glm_mtp.reference.block import draft_logits
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(64, weights.config.hidden_size, generator=gen) * 1e3).to(weights.dtype)
    from glm_mtp.reference.numerics import rms_norm
    logits = draft_logits(weights, rms_norm(x, weights.shared_head_norm, weights.config.rms_norm_eps))
    assert float(logits.float().abs().max()) <= bound
    del prop


def test_float64_weights_take_float64_temperatures():
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=2, dtype=torch.float64)
    assert contract.check_temperature(1e39, contract.logit_bound(w), torch.float64) == 1e39
    with pytest.raises(ValueError, match="too small"):
        contract.check_temperature(1e-320, contract.logit_bound(w), torch.float64)  # a float64 subnormal


# ---- 2. the optimized drafter refuses before it writes -------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
def test_a_token_tensor_that_holds_no_data_is_refused_single(weights, backend):
    # a meta tensor: neither on the state's device nor readable (the hold-data rule names it first)
    prop = backend(weights, 32)
    state, token, hidden, _ = prefilled(prop, weights)
    before = state_bytes(prop, state)
    with pytest.raises(ValueError, match="last_token must hold data: a tensor on the meta device"):
        prop.propose(torch.tensor([token], device="meta"), hidden, 5, 2, state)
    assert state_bytes(prop, state) == before
    usable(prop, state, hidden)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
def test_a_token_tensor_that_holds_no_data_is_refused_batched(weights, backend):
    prop = backend(weights, 32)
    pairs = [prefilled(prop, weights, seed) for seed in (1, 2)]
    states = [p[0] for p in pairs]
    hiddens = torch.stack([p[2] for p in pairs])
    before = [state_bytes(prop, s) for s in states]
    with pytest.raises(ValueError, match="last_tokens must hold data"):
        prop.propose_batch(torch.tensor([1, 2], device="meta"), hiddens, [5, 5], 2, states)
    with pytest.raises(ValueError, match="tokens must hold data"):
        prop.catchup_batch(torch.tensor([1, 2], device="meta"), hiddens, [5, 5], states)
    assert [state_bytes(prop, s) for s in states] == before
    for s, p in zip(states, pairs):
        usable(prop, s, p[2])


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
def test_prompt_and_catchup_tokens_that_hold_no_data_are_refused(weights, backend):
    prop = backend(weights, 32)
    state = prop.alloc_state("cpu")
    h = torch.randn(3, weights.config.hidden_size).to(weights.dtype)
    with pytest.raises(ValueError, match="prompt_tokens must hold data"):
        prop.prefill_drafter(torch.tensor([1, 2, 3], device="meta"), h, state)
    with pytest.raises(ValueError, match="tokens must hold data"):
        prop.catchup_drafter(torch.tensor([1, 2, 3], device="meta"), h, 0, 0, state)
    assert prop.drafter_rows(state) == 0 and state.poisoned is None


def test_triton_kernels_that_cannot_run_are_refused_at_construction(tmp_path):
    """No GPU and no TRITON_INTERPRET: refused when the drafter is made, with the reason and the
    remedy (accepted, it would fail with "0 active drivers" at the first call)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device runs the kernels")
    code = ("import torch\n"
            "from glm_mtp.reference import MtpConfig, MtpWeights\n"
            "from glm_mtp.optimized import OptimizedProposer\n"
            "w = MtpWeights.random(MtpConfig.preset('tiny'))\n"
            "try:\n    OptimizedProposer(w, 32, kernels='triton')\nexcept ValueError as e:\n    print('refused:', e)\n"
            "print('auto', OptimizedProposer(w, 32).max_seq_len)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "refused: kernels='triton' cannot run here" in out.stdout
    assert "TRITON_INTERPRET=1" in out.stdout and "kernels='auto' or 'torch'" in out.stdout
    assert "auto 32" in out.stdout


# ---- found by the hostile-argument machine (conformance/machines/arguments.py) ---------------------------

def _nan_hidden(weights):
    h = torch.randn(weights.config.hidden_size).to(weights.dtype)
    h[7] = math.nan
    return h


@pytest.mark.parametrize("case", ["token_then_num_drafts", "nan_then_capacity", "nan_then_temperature",
                                  "token_then_noise_shape",
                                  "token_then_hidden_dtype"])
def test_the_first_failing_check_decides_in_both_backends(weights, case):
    """Two bad arguments: the check the contract orders first names the refusal in both
    backends (the optimized drafter reads its device-side data checks on the host on refusal)."""
    V, H = weights.config.vocab_size, weights.config.hidden_size
    good = torch.randn(H).to(weights.dtype)
    calls = {
        "token_then_num_drafts": (lambda p, s, n: p.propose(torch.tensor([V]), good, 5, "3", s),
                                  "last_token: token id"),
        "nan_then_capacity": (lambda p, s, n: p.propose(1, _nan_hidden(weights), 5, 70, s),
                              "target_hidden holds NaN or inf"),
        "nan_then_temperature": (lambda p, s, n: p.propose_sampled(1, _nan_hidden(weights), 5, 3, -1.0, n, s),
                                 "holds NaN"),
        "token_then_noise_shape": (lambda p, s, n: p.propose_sampled(torch.tensor([-1]), good, 5, 3, 1.0, n[:1], s),
                                   "token id -1"),
        "token_then_hidden_dtype": (lambda p, s, n: p.propose(torch.tensor([255]), good.double(), 5, 2, s),
                                    "token id 255"),
    }
    call, match = calls[case]
    messages = []
    for backend in BACKENDS:
        prop = backend(weights, 32)
        state, _, hidden, noise = prefilled(prop, weights)
        before = state_bytes(prop, state)
        with pytest.raises(ValueError, match=match) as e:
            call(prop, state, noise)
        messages.append(str(e.value))
        assert state_bytes(prop, state) == before
        usable(prop, state, hidden)
    assert messages[0] == messages[1]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
def test_arguments_torch_cannot_take_are_refused_naming_them(weights, backend):
    prop = backend(weights, 32)
    state, token, hidden, noise = prefilled(prop, weights)
    before = state_bytes(prop, state)
    H = weights.config.hidden_size
    with pytest.raises(ValueError, match="target_hidden must be a dense"):
        prop.propose(token, hidden.to_sparse(), 5, 2, state)
    with pytest.raises(ValueError, match="last_token must be a dense"):
        prop.propose(torch.tensor([token]).to_sparse(), hidden, 5, 2, state)
    with pytest.raises(ValueError, match="noise must be a dense"):
        prop.propose_sampled(token, hidden, 5, 3, 1.0, noise.to_sparse(), state)
    with pytest.raises(ValueError, match="tokens must be a list of token ids or a 1-D integer tensor, got int"):
        prop.catchup_drafter(5, torch.randn(1, H).to(weights.dtype), 5, 5, state)
    with pytest.raises(ValueError, match="tokens must be a list of token ids or a 1-D integer tensor, got NoneType"):
        prop.catchup_drafter(None, torch.randn(1, H).to(weights.dtype), 5, 5, state)
    assert state_bytes(prop, state) == before
    usable(prop, state, hidden)


# ---- drafter API corners: counts and batch buffers ----------------------------------------------


@pytest.mark.parametrize("cls", BACKENDS)
def test_prefill_hidden_rows_takes_a_count_only(weights, cls):
    """``prefill_hidden_rows(max_seq_len)``: an integer >= 0 (min with the drafter's length);
    anything else a ``ValueError`` naming ``max_seq_len``: named cases and 40 drawn ones."""
    prop = cls(weights, max_seq_len=32)
    rng = torch.Generator().manual_seed(45)
    for n in [0, 1, 31, 32, 33, 2**70, *torch.randint(0, 10**6, (20,), generator=rng).tolist()]:
        assert prop.prefill_hidden_rows(n) == min(n, 32)
    drawn = [-int(v) - 1 for v in torch.randint(0, 2**62, (10,), generator=rng)] + \
            [float(v) for v in torch.rand(10, generator=rng) * 64]
    for bad in [-1, 2.5, 2.0, True, None, "3", math.nan, torch.tensor(1.5), *drawn]:
        with pytest.raises(ValueError, match="^max_seq_len must be"):
            prop.prefill_hidden_rows(bad)


def test_a_max_batch_no_device_can_hold_is_refused_naming_it(weights):
    """``max_batch`` beyond what the device can allocate (out of memory, or past int64 sizes):
    ``alloc_state`` refuses naming ``max_batch``, and the drafter keeps no buffers."""
    rng = torch.Generator().manual_seed(7)
    drawn = [int(v) for v in torch.randint(10**13, 10**15, (3,), generator=rng)]
    for max_batch in [2**40, 2**63, 2**70, *drawn]:
        prop = OptimizedProposer(weights, max_seq_len=32, max_batch=max_batch)
        with pytest.raises(ValueError, match=f"^alloc_state: max_batch={max_batch}: .*smaller max_batch"):
            prop.alloc_state("cpu")
        assert not prop._batch


@pytest.mark.parametrize("cls", BACKENDS)
def test_a_second_drafters_batch_serves_states_the_first_allocated(weights, cls):
    """States allocated by one drafter, batched by another of the same weights and length: the
    same drafts as the first drafter's batch (single ``propose`` serves them alike)."""
    first, second = cls(weights, max_seq_len=32), cls(weights, max_seq_len=32)
    outs = []
    for prop in (first, second):
        states = [first.alloc_state("cpu") for _ in range(2)]
        gen = torch.Generator().manual_seed(11)
        for st in states:
            first.prefill_drafter(torch.randint(0, 96, (6,), generator=gen).tolist(),
                                  torch.randn(6, weights.config.hidden_size, generator=gen).to(weights.dtype), st)
        hiddens = torch.randn(2, weights.config.hidden_size, generator=gen).to(weights.dtype)
        outs.append(prop.propose_batch([3, 4], hiddens, [5, 5], 2, states))
    assert outs[0] == outs[1]
