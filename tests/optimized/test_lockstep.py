"""The optimized drafter against the reference, call by call: random spec-decode loops with
misuse mixed in, bf16 and fp32, tiny preset. After every call both give the same result (or the
same exception type) and export byte-identical states; a refused call changes nothing."""

import pytest
import torch

from glm_mtp.optimized.graphs import GraphKey

# A misuse: (name, needs a pending propose?, call(prop-free spec) -> (method, args)).
# ``p`` is the next position, ``s`` the rows held, ``k`` the pending draft count, ``i`` inputs.
MISUSE = [
    ("propose_while_pending", True, lambda i, p, s, k: ("propose", (i.token(), i.hiddens(1), s, 1))),
    ("prefill_while_pending", True, lambda i, p, s, k: ("prefill_drafter", (i.tokens(3), i.hiddens(3)))),
    ("verify_too_many", True, lambda i, p, s, k: ("after_verify", (k + 1,))),
    ("verify_negative", True, lambda i, p, s, k: ("after_verify", (-1,))),
    ("verify_none_pending", False, lambda i, p, s, k: ("after_verify", (0,))),
    ("propose_behind", False, lambda i, p, s, k: ("propose", (i.token(), i.hiddens(1), s + 1, 2))),
    ("hidden_nan", False, lambda i, p, s, k: ("propose", (i.token(), i.bad_hiddens(1, 0, 5, float("nan")), p, 3))),
    ("hidden_inf_1d", False,
     lambda i, p, s, k: ("propose", (i.token(), i.bad_hiddens(1, 0, 0, float("-inf"))[0], p, 2))),
    ("token_out_of_range", False, lambda i, p, s, k: ("propose", (i.cfg.vocab_size, i.hiddens(1), p, 2))),
    ("token_tensor_out_of_range", False, lambda i, p, s, k: ("propose", (torch.tensor([-3]), i.hiddens(1), p, 2))),
    ("token_tensor_bad_and_nan", False,
     lambda i, p, s, k: ("propose", (torch.tensor(i.cfg.vocab_size + 1), i.bad_hiddens(1, 0, 1, float("nan"))[0], p,
                                     1))),
    ("token_float", False, lambda i, p, s, k: ("propose", (2.0, i.hiddens(1), p, 2))),
    ("token_tensor_float", False, lambda i, p, s, k: ("propose", (torch.tensor([2.0]), i.hiddens(1), p, 2))),
    ("token_tensor_two", False, lambda i, p, s, k: ("propose", (torch.tensor([1, 2]), i.hiddens(1), p, 2))),
    ("hidden_dtype", False, lambda i, p, s, k: ("propose", (i.token(), i.hiddens(1).double(), p, 2))),
    ("hidden_shape", False, lambda i, p, s, k: ("propose", (i.token(), i.hiddens(2), p, 2))),
    ("hidden_list", False, lambda i, p, s, k: ("propose", (i.token(), [0.5] * i.cfg.hidden_size, p, 2))),
    ("drafts_negative", False, lambda i, p, s, k: ("propose", (i.token(), i.hiddens(1), p, -1))),
    ("past_capacity", False, lambda i, p, s, k: ("propose", (i.token(), i.hiddens(1), p, 200))),
    ("position_negative", False, lambda i, p, s, k: ("propose", (i.token(), i.hiddens(1), -1, 1))),
    ("catchup_misaligned", False, lambda i, p, s, k: ("catchup_drafter", (i.tokens(2), i.hiddens(2), s + 3, 0))),
    ("catchup_misaligned_nan", False,
     lambda i, p, s, k: ("catchup_drafter", (i.tokens(1), i.bad_hiddens(1, 0, 2, float("nan")), s + 3, 0))),
    ("catchup_nan", False,
     lambda i, p, s, k: ("catchup_drafter", (i.tokens(2), i.bad_hiddens(2, 1, 3, float("inf")), s, s))),
    ("catchup_past_capacity", False, lambda i, p, s, k: ("catchup_drafter", (i.tokens(3), i.hiddens(3), 95, 0))),
    ("catchup_len_mismatch", False, lambda i, p, s, k: ("catchup_drafter", (i.tokens(2), i.hiddens(3), s, s))),
    ("prefill_again", False, lambda i, p, s, k: ("prefill_drafter", (i.tokens(4), i.hiddens(4)))),
    ("prefill_too_long", False, lambda i, p, s, k: ("prefill_drafter", (i.tokens(65), i.hiddens(65)))),
]


def spec_decode(ls, inp, steps: int, k_max: int, misuse_every: int = 3) -> dict[str, int]:
    """A random spec-decode loop on ``ls`` (a conftest.DrafterPair); returns how often each path ran."""
    seen: dict[str, int] = {}
    cap = ls.opt.capacity

    def note(key: str) -> None:
        seen[key] = seen.get(key, 0) + 1

    def misuse(pending: bool, p: int, k: int) -> None:
        options = [m for m in MISUSE if m[1] == pending]
        name, _, make = options[inp.randint(0, len(options) - 1)]
        method, args = make(inp, p, ls.opt.drafter_rows(ls.os), k)
        result = ls.call(method, *args)
        note("misuse:" + name)
        if name not in ("catchup_misaligned", "prefill_again"):
            assert isinstance(result, Exception), f"{name} was not refused: {result!r}"

    n = inp.randint(2, 20)
    assert ls.call("prefill_drafter", inp.tokens(n), inp.hiddens(n)) == n - 1
    pos = n - 1  # the next propose's position: rows [0, pos) are held
    for step in range(steps):
        k = inp.randint(0, k_max)
        if pos + k > cap - 2:
            break
        if step % misuse_every == 1:
            misuse(False, pos, 0)
        # Sometimes propose behind the rows held (the drafter rewinds), sometimes as a tensor.
        at = pos - inp.randint(1, 3) if step % 5 == 4 and pos > 4 else pos
        tok = inp.token()
        token = torch.tensor(tok, device=inp.device) if step % 2 else tok
        hidden = inp.hiddens(1)[0] if step % 3 else inp.hiddens(1)
        drafts = ls.call("propose", token, hidden, at, k)
        assert len(drafts) == k
        note("rewind" if at < pos else "propose")
        pos = at
        if step % misuse_every == 2:
            misuse(True, pos, k)
        a = inp.randint(0, k)
        if step % 4 == 3 and a > 0:  # refeed: keep one row, rewrite the accepted ones with target hiddens
            ls.call("after_verify", 0)
            assert ls.call("catchup_drafter", inp.tokens(a), inp.hiddens(a), pos + 1, pos + 1) == a
            note("refeed")
        else:
            ls.call("after_verify", a)
            if a == k:  # all accepted (or nothing drafted): the drafter is one row behind
                last = drafts[-1] if k else tok
                assert ls.call("catchup_drafter", [last], inp.hiddens(1), pos + k, pos + k) == 1
                note("catchup")
        pos = pos + a + 1
    return seen


@pytest.mark.parametrize("feed_hidden", ["post_norm", "pre_norm"])
def test_lockstep_spec_decode(weights, lockstep, inputs, feed_hidden):
    ls = lockstep(weights, max_seq_len=64, feed_hidden=feed_hidden)
    seen = spec_decode(ls, inputs, steps=24 if feed_hidden == "post_norm" else 10, k_max=4)
    assert seen.get("propose", 0) >= 5 and seen.get("catchup", 0) + seen.get("refeed", 0) >= 1, seen
    assert sum(v for key, v in seen.items() if key.startswith("misuse:")) >= 5, seen
    # Freed: every call but the queries refuses; export shows the empty state in both.
    ls.call("free_state")
    ls.call("free_state")
    for method, args in [("propose", (1, inputs.hiddens(1), 0, 1)), ("after_verify", (0,)),
                         ("catchup_drafter", (inputs.tokens(1), inputs.hiddens(1), 0, 0)),
                         ("prefill_drafter", (inputs.tokens(3), inputs.hiddens(3)))]:
        assert isinstance(ls.call(method, *args), RuntimeError)


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_lockstep_cuda(weights, lockstep, make_inputs, cuda_graphs):
    """On CUDA: the Triton kernels, and the k steps captured once per num_drafts and replayed."""
    w = weights.to("cuda")
    ls = lockstep(w, max_seq_len=64, device="cuda", cuda_graphs=cuda_graphs)
    seen = spec_decode(ls, make_inputs(w, seed=21), steps=24, k_max=4)
    assert seen.get("propose", 0) >= 5, seen
    if cuda_graphs:
        assert set(ls.os.graphs) <= {GraphKey.catchup(), *(GraphKey.draft(k) for k in range(1, 5))}
        assert any(key.num_drafts > 0 for key in ls.os.graphs)
    else:
        assert ls.os.graphs == {}


def test_lockstep_with_interpreted_kernels(weights, lockstep, inputs, monkeypatch):
    """The same loop with every piece of the fused step a Triton kernel (through the interpreter)."""
    from glm_mtp.optimized import kernels
    from glm_mtp.optimized.step import PIECES

    launches = {name: 0 for name in PIECES} | {"torch twins": 0}

    def counted(key, fn):
        def wrapper(*args, **kwargs):
            launches[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name in PIECES:
        monkeypatch.setattr(kernels, f"{name}_triton", counted(name, getattr(kernels, f"{name}_triton")))
        monkeypatch.setattr(kernels, f"{name}_torch", counted("torch twins", getattr(kernels, f"{name}_torch")))
    ls = lockstep(weights, max_seq_len=32, kernels="triton")
    seen = spec_decode(ls, inputs, steps=4, k_max=3, misuse_every=2)
    assert seen.get("propose", 0) >= 2, seen
    ls.call("propose", inputs.token(), inputs.hiddens(1), ls.opt.drafter_rows(ls.os), 2)  # at least two drafts
    blocks = launches["block_input"]
    assert blocks >= 4 and launches["torch twins"] == 0, launches
    # Per block pass: three norm + GEMV launches, one of everything else; the head per draft.
    assert launches["norm_linear"] == 3 * blocks, launches
    # The other family's indexer pieces never run (GLM-5 here: the KPool ones).
    other = (("index_scores", "select_rows") if weights.config.is_next
             else ("pool_keys_write", "pool_scores", "select_pool_rows"))
    single = ("norm_linear", "head_partials", "argmax_reduce", "scatter_rows", "pools_forget", *other)
    assert all(launches[p] == blocks for p in PIECES if p not in single), str(launches)
    assert all(launches[p] == 0 for p in other), str(launches)
    assert launches["scatter_rows"] == launches["pools_forget"] == 0, launches  # the batched programs' only
    assert 2 <= launches["head_partials"] == launches["argmax_reduce"] <= blocks, str(launches)


def test_k_steps_from_zero_rows(weights, lockstep, inputs):
    """Proposing from an empty state (row 0: the zeroed embedding) and the num_drafts = 0 rewind."""
    ls = lockstep(weights, max_seq_len=32)
    ls.call("propose", inputs.token(), inputs.hiddens(1), 0, 5)
    ls.call("after_verify", 2)
    ls.call("propose", inputs.token(), inputs.hiddens(1), 1, 0)
    ls.call("after_verify", 0)
    ls.call("propose", inputs.token(), inputs.hiddens(1), 1, 31 + 2 * 16)  # up to the last row of capacity
    ls.call("after_verify", 63)
    assert ls.refused == 0 and ls.calls == 6  # both refusing every call would also agree
    assert ls.opt.drafter_rows(ls.os) == 64


def test_every_misuse(weights, lockstep, inputs):
    """Each misuse of the table once, in the state it needs: same exception type (or the same
    no-op result) from both, and nothing changes."""
    ls = lockstep(weights, max_seq_len=64)
    ls.call("prefill_drafter", inputs.tokens(11), inputs.hiddens(11))
    pos = 10
    for name, pending, make in MISUSE:
        k = 3
        if pending:
            ls.call("propose", inputs.token(), inputs.hiddens(1), pos, k)
        method, args = make(inputs, pos, ls.opt.drafter_rows(ls.os), k)
        result = ls.call(method, *args)
        if name not in ("catchup_misaligned", "prefill_again"):
            assert isinstance(result, Exception), f"{name} was not refused: {result!r}"
        else:
            assert result == 0
        if pending:
            ls.call("after_verify", 1)
            pos = ls.opt.drafter_rows(ls.os)


def test_lockstep_catches_broken_fusions(weights, lockstep, inputs, monkeypatch):
    """The lockstep checks can fail: a fused piece that forgets the row-0 zeroing, a cache
    write that ignores the ok gate, or a GEMV that sums in torch's order, is caught."""
    from glm_mtp.optimized import kernels
    from glm_mtp.reference.numerics import rms_norm

    tokens, hiddens = inputs.tokens(6), inputs.hiddens(6)
    with monkeypatch.context() as m:
        real_input = kernels.block_input_torch
        # Slots shifted by one: no row is ever at slot 0, so none is zeroed.
        m.setattr(kernels, "block_input_torch",
                  lambda embed, toks, slots, *rest: real_input(embed, toks, slots + 1, *rest))
        ls = lockstep(weights, max_seq_len=32)
        with pytest.raises(AssertionError, match="differs"):
            ls.call("prefill_drafter", tokens, hiddens)
    with monkeypatch.context() as m:
        real_write = kernels.cache_rows_write_torch
        m.setattr(kernels, "cache_rows_write_torch",
                  lambda *a, **kw: real_write(*a[:-1], torch.ones(1, dtype=torch.bool), **kw))
        ls = lockstep(weights, max_seq_len=32)
        ls.call("prefill_drafter", tokens, hiddens)
        # A refused propose behind the newest row: the ungated write overwrites rows 3 and 4,
        # below seq_len, which export_state shows. (NaN rows past seq_len would be harmless: the
        # attention reads only the rows the indexer selects among the visible ones.)
        with pytest.raises(AssertionError, match="a refused call changed the optimized state"):
            ls.call("propose", 3, inputs.bad_hiddens(1, 0, 4, float("nan")), 3, 2)
    if weights.dtype != torch.float32:
        return  # in bf16 another sum order rarely changes a rounded result on 6 rows (the kernel tests show it)

    def torch_order(x, norm_weight, eps, weights, acc=False, store_normed=False):
        a = rms_norm(x, norm_weight, eps)
        return [torch.nn.functional.linear(a, w) for w in weights], (a if store_normed else None)

    with monkeypatch.context() as m:
        m.setattr(kernels, "norm_linear_torch", torch_order)
        ls = lockstep(weights, max_seq_len=32)
        with pytest.raises(AssertionError, match="differs"):
            ls.call("prefill_drafter", tokens, hiddens)


@pytest.mark.parametrize("variant", ["rope_halves", "mixed_rope_ungrouped"])
def test_lockstep_config_variants(tiny_cfg, lockstep, make_inputs, variant):
    """Other layouts through the interpreted kernels: RoPE on halves (not interleaved), and MLA
    interleaved with the indexer on halves, ungrouped routing and a dense-wide index top-k."""
    if variant == "rope_halves":
        cfg = tiny_cfg.replace(rope_interleave=False, indexer_rope_interleave=False)
    else:
        cfg = tiny_cfg.replace(indexer_rope_interleave=False, n_group=1, topk_group=1, index_topk=64)
    from glm_mtp.reference import MtpWeights

    w = MtpWeights.random(cfg, seed=13, dtype=torch.bfloat16)
    ls = lockstep(w, max_seq_len=32, kernels="triton")
    seen = spec_decode(ls, make_inputs(w, seed=17), steps=4, k_max=3, misuse_every=10)
    assert seen.get("propose", 0) >= 2, seen


def test_strided_hiddens(weights, lockstep, inputs):
    """Hiddens that are strided views (a column of a wider tensor): the reference normalises the
    caller's tensor as it is, the optimized drafter a contiguous copy; the bytes agree."""
    ls = lockstep(weights, max_seq_len=32)
    H = weights.config.hidden_size
    wide = inputs.hiddens(8 * 3).reshape(8, H, 3)  # fresh values; [:, :, 1] is strided
    assert not wide[:, :, 1].is_contiguous()
    ls.call("prefill_drafter", inputs.tokens(8), wide[:, :, 1])
    for _ in range(3):
        h = inputs.hiddens(3).reshape(H, 3)[:, 2]
        ls.call("propose", inputs.token(), h, 7, 3)
        ls.call("after_verify", 3)
        ls.call("catchup_drafter", inputs.tokens(1), inputs.hiddens(3).reshape(1, H, 3)[:, :, 0], 10, 10)
        ls.call("propose", inputs.token(), h, 7, 0)
        ls.call("after_verify", 0)
    assert ls.refused == 0 and ls.calls == 16  # both refusing every call would also agree
