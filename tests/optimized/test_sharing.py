"""Index sharing across a propose's draft steps (DESIGN.md §9) in the optimized drafter, against
the reference byte for byte: GLM-5 (``tiny``) with sharing on and glm5_next (``glm5next_tiny``,
which shares by default, tests/optimized/test_next_family.py) with it off, through the
conformance scenarios (batched ones: one kept selection per state) with the torch twins; GLM-5
with every kernel interpreted, counting that a shared step launches none of the indexer's query
side; and a mutant whose shared steps read a stale selection buffer, caught."""

import pytest
import torch

from glm_mtp.conformance import run
from glm_mtp.optimized import kernels
from glm_mtp.reference import MtpConfig, MtpWeights

from .conftest import DrafterPair, Inputs

SHARED_GLM5 = MtpConfig.preset("tiny").replace(index_share_for_mtp_iteration=True)
UNSHARED_NEXT = MtpConfig.preset("glm5next_tiny").replace(index_share_for_mtp_iteration=False)
SHARED_NEXT = MtpConfig.preset("glm5next_tiny")
assert SHARED_NEXT.index_share_for_mtp_iteration


@pytest.mark.parametrize("cfg,dtype", [(SHARED_GLM5, torch.bfloat16), (UNSHARED_NEXT, torch.float32)],
                         ids=["glm5-shared-bf16", "glm5next-unshared-fp32"])
def test_lockstep_scenarios(cfg, dtype):
    r = run("optimized", "reference", scenarios=2, seed=13, preset=cfg, dtype=dtype,
            generators=("realistic", "batched"))
    assert r.ok, r.first_difference


def walk(pair: DrafterPair, inp: Inputs) -> None:
    """Context rows, then proposes of 3 and 4 drafts with drafts accepted between (later proposes
    select over accepted shared rows), a rewind, a catch-up and one more propose."""
    pair.call("prefill_drafter", inp.tokens(7), inp.hiddens(7))  # rows 0..5
    pair.call("propose", inp.token(), inp.hiddens(1), 6, 3)  # rows 6..8: 7 and 8 shared
    pair.call("after_verify", 2)
    pair.call("propose", inp.token(), inp.hiddens(1), 9, 4)  # rows 9..12
    pair.call("after_verify", 1)
    pair.call("propose", inp.token(), inp.hiddens(1), 8, 2)  # a rewind: rows 8..9
    pair.call("after_verify", 2)


def test_interpreted_kernels_and_the_shared_steps_launches(monkeypatch):
    """Every piece a Triton kernel (interpreted), GLM-5 sharing: byte-equal to the reference, and
    the indexer's scores and selection launch once per propose (its step 1) and once per call of
    context rows, never in a shared step."""
    launches = {name: 0 for name in ("block_input_triton", "index_scores_triton", "select_rows_triton")}

    def counted(name, fn):
        def call(*args, **kwargs):
            launches[name] += 1
            return fn(*args, **kwargs)
        return call

    for name in launches:
        monkeypatch.setattr(kernels, name, counted(name, getattr(kernels, name)))
    w = MtpWeights.random(SHARED_GLM5, seed=5, dtype=torch.bfloat16)
    pair = DrafterPair(w, max_seq_len=32, kernels="triton")
    walk(pair, Inputs(w, seed=6))
    assert pair.refused == 0
    assert launches == {"block_input_triton": 1 + 3 + 4 + 2, "index_scores_triton": 4,
                        "select_rows_triton": 4}, launches


@pytest.mark.slow  # ~2 min in the interpreter on this machine
def test_lockstep_scenarios_interpreted_glm5_shared():
    r = run("glm_mtp.optimized:with_triton_kernels", "reference", scenarios=2, seed=9, preset=SHARED_GLM5,
            max_seq_len=24,
            dtype=torch.bfloat16, generators=("realistic", "batched"))
    assert r.ok, r.first_difference


@pytest.mark.parametrize("cfg,select", [(SHARED_GLM5, "select_rows_torch"), (SHARED_NEXT, "select_pool_rows_torch")],
                         ids=["glm5", "glm5next"])
def test_mutant_stale_kept_selection_is_caught(cfg, select, monkeypatch):
    """Draft step 1 keeps its selection in the state's buffer only at the first propose: later
    proposes' shared steps read the previous propose's rows. The lockstep sees it at once."""
    real = getattr(kernels, select)
    kept_once = []

    def keeps_once(*args):
        *head, out = args
        if out is not None:  # a propose's step 1
            if kept_once:
                return real(*head, None)  # selects for its own row but leaves the kept buffer stale
            kept_once.append(True)
        return real(*args)

    monkeypatch.setattr(kernels, select, keeps_once)
    w = MtpWeights.random(cfg, seed=5, dtype=torch.float32)
    pair = DrafterPair(w, max_seq_len=32)
    with pytest.raises(AssertionError, match="optimized|differs"):
        walk(pair, Inputs(w, seed=6))
    assert len(kept_once) == 1 and pair.calls == 3  # the second propose differs


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("cfg", [SHARED_GLM5, SHARED_NEXT], ids=["glm5", "glm5next"])
def test_sharing_on_cuda(cfg, cuda_graphs):
    """On CUDA: the Triton kernels, the k steps (step 1 and the shared ones) captured once per
    num_drafts and replayed; then batched scenarios (one kept selection per state, a graph per bucket)."""
    w = MtpWeights.random(cfg, seed=5, dtype=torch.bfloat16).to("cuda")
    pair = DrafterPair(w, max_seq_len=32, device="cuda", cuda_graphs=cuda_graphs)
    walk(pair, Inputs(w, seed=6))
    assert pair.refused == 0
    assert any(key.num_drafts > 1 for key in pair.os.graphs) == cuda_graphs
    r = run("optimized", "reference", scenarios=6, seed=3, device="cuda", preset=cfg,
            generators=("realistic", "batched"))
    assert r.ok, r.first_difference
