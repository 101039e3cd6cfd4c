"""Nothing in the drafter's path reduces floating data in a library's order (DESIGN.md §5): every
floating-point aten op that prefill, catch-up and propose dispatch, in both backends, is one of
the allowed operations. A forward with torch's kernels (``numerics.VENDOR``) is caught."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.attention import Rope
from glm_mtp.reference.block import decoder_layer
from glm_mtp.reference.numerics import VENDOR
from glm_mtp.reference.state import LayerCache

# Exact one IEEE operation at a time (sqrt only in float64: see numerics.sqrt), exact by value
# (max, argmax, sort, top-k), or moving bytes.
ALLOWED = {
    "add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "neg.default", "sqrt.default", "abs.default",
    "relu.default", "clamp.default", "amax.default", "argmax.default", "sort.stable", "topk.default",
    "where.self", "masked_fill.Scalar", "eq.Tensor", "ne.Tensor", "ne.Scalar", "lt.Tensor", "ge.Tensor",
    "_to_copy.default", "copy_.default", "clone.default", "detach.default", "lift_fresh.default",
    "cat.default", "stack.default", "embedding.default", "gather.default", "index.Tensor",
    "index_put_.default", "index_select.default", "select.int", "slice.Tensor", "view.default",
    "view.dtype", "permute.default", "unsqueeze.default", "expand.default", "empty.memory_format",
    "zeros_like.default", "ones_like.default", "full_like.default", "full.default", "zeros.default", "fill_.Scalar",
    "minimum.default", "maximum.default", "alias.default",  # the clamped SwiGLU (glm5_next); a view
    "scalar_tensor.default",  # the -inf / +0.0 of a grammar's masked argmax and softmax (a constant)
    "gt.Scalar", "lt.Scalar",  # a sampled propose's check of its noise (comparisons)
}
# Library reductions and transcendental kernels (DESIGN.md §5 keeps them out), named for a clear message.
FORBIDDEN = {"mm.default", "addmm.default", "bmm.default", "matmul.default", "dot.default", "mv.default",
             "sum.dim_IntList", "sum.default", "mean.dim", "_softmax.default", "exp.default",
             "native_layer_norm.default", "linear.default", "sigmoid.default", "silu.default", "rsqrt.default"}


class FloatOps(TorchDispatchMode):
    """Counts the aten ops that touch floating data (an input or an output)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree_leaves((args, kwargs, out))):
            self.ops[str(func).removeprefix("aten.")] += 1
        return out



def drafter_ops(backend, dtype, preset="tiny"):
    cfg = MtpConfig.preset(preset)
    w = MtpWeights.random(cfg, seed=0, dtype=dtype)
    prop = backend(w, 64)
    state = prop.alloc_state("cpu")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (12,), generator=g)
    hiddens = torch.randn(12, cfg.hidden_size, generator=g).to(dtype)
    with FloatOps() as mode:
        prop.prefill_drafter(tokens, hiddens, state)
        prop.propose(5, hiddens[-1], 11, 3, state)
        prop.after_verify(3, state)
        prop.catchup_drafter([4], hiddens[:1], 14, 14, state)
        prop.propose(7, hiddens[-2], 15, 2, state)
    return mode.ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", [ReferenceProposer, OptimizedProposer], ids=["reference", "optimized"])
def test_the_drafter_path_uses_only_allowed_operations(backend, dtype):
    ops = drafter_ops(backend, dtype)
    assert ops["add.Tensor"] > 100 and ops["mul.Tensor"] > 50  # the sums really run here
    assert not set(ops) & FORBIDDEN, sorted(set(ops) & FORBIDDEN)
    assert set(ops) <= ALLOWED, f"not an allowed operation: {sorted(set(ops) - ALLOWED)}"


def constrained_ops(dtype, preset):
    """The reference's path under a grammar (DESIGN.md §10), greedy and sampled, with each
    draft's confidence read (§12)."""
    from glm_mtp.conformance.grammars import Grammar

    cfg = MtpConfig.preset(preset)
    prop = ReferenceProposer(MtpWeights.random(cfg, seed=0, dtype=dtype), 64)
    state = prop.alloc_state("cpu")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (12,), generator=g)
    hiddens = torch.randn(12, cfg.hidden_size, generator=g).to(dtype)
    noise = torch.empty(3, cfg.vocab_size).exponential_(generator=g)
    with FloatOps() as mode:
        prop.prefill_drafter(tokens, hiddens, state)
        prop.propose(5, hiddens[-1], 11, 3, state, grammar=Grammar(1).matcher(cfg.vocab_size))
        prop.draft_confidence(state)
        prop.after_verify(1, state)
        prop.propose_sampled(7, hiddens[-2], 12, 3, 0.7, noise, state, grammar=Grammar(5).matcher(cfg.vocab_size))
        prop.draft_confidence(state)
    return mode.ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("preset", ["tiny", "glm5next_tiny"])
def test_the_grammar_and_confidence_path_uses_only_allowed_operations(dtype, preset):
    ops = constrained_ops(dtype, preset)
    assert ops["where.self"] > 0 and ops["gather.default"] > 0  # the masked path and the confidences ran
    assert not set(ops) & FORBIDDEN, sorted(set(ops) & FORBIDDEN)
    assert set(ops) <= ALLOWED, f"not an allowed operation: {sorted(set(ops) - ALLOWED)}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_glm5next_path_uses_only_allowed_operations(dtype):
    """The KPool indexer, NoPE MLA and clamped SwiGLU (glm5_next): the same rule."""
    ops = drafter_ops(ReferenceProposer, dtype, "glm5next_tiny")
    assert ops["add.Tensor"] > 100 and ops["mul.Tensor"] > 50
    assert not set(ops) & FORBIDDEN, sorted(set(ops) & FORBIDDEN)
    assert set(ops) <= ALLOWED, f"not an allowed operation: {sorted(set(ops) - ALLOWED)}"


def test_float32_square_roots_go_through_float64():
    seen = []

    class Sqrts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) == "aten.sqrt.default":
                seen.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    cfg = MtpConfig.preset("tiny")
    prop = ReferenceProposer(MtpWeights.random(cfg, seed=0, dtype=torch.float32), 32)
    state = prop.alloc_state("cpu")
    with Sqrts():
        prop.propose(3, torch.randn(cfg.hidden_size), 0, 1, state)
    assert seen and set(seen) == {torch.float64}


def test_the_check_catches_a_forward_with_torch_kernels():
    """The same layer with ``ops=VENDOR`` (what training runs) dispatches GEMMs, softmax and
    norms in the library's order: the check above would fail on it."""
    cfg = MtpConfig.preset("tiny")
    w = MtpWeights.random(cfg, seed=0, dtype=torch.float32)
    cache = LayerCache.allocate(cfg, 2, torch.float32, "cpu")
    h = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with FloatOps() as mode:
        decoder_layer(w.layer, cfg, h, torch.arange(5), cache, Rope.build(cfg, 32, "cpu"), ops=VENDOR)
    assert set(mode.ops) & FORBIDDEN >= {"_softmax.default", "native_layer_norm.default"}
    assert set(mode.ops) - ALLOWED
