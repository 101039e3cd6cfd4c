"""The glm5_next forward against golden vectors from an independent float64 implementation
(``next_golden_model.py`` beside this file: DESIGN.md §7 from its prose, expanded keys and values,
plain torch float64) for two tiny checkpoints in GLM-5.3-Flash's layout
(tests/data/golden/README.md). Selection ties are pinned to the lower pool id on both sides, so
every row is compared: float64 to float64 rounding, float32 to 1e-4, drafts exactly."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glm_mtp.reference import MtpWeights, ReferenceProposer
from glm_mtp.reference.attention import Rope
from glm_mtp.reference.block import draft_logits, mtp_rows
from glm_mtp.reference.state import LayerCache

from .next_golden_model import NEXT_CASES, forward, read_checkpoint

GOLDEN = Path(__file__).parents[1] / "data" / "golden"
CASES = [c[0] for c in NEXT_CASES]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-4)], ids=["fp64", "fp32"])
def test_block_matches_golden(case, dtype, tol):
    w = MtpWeights.from_pretrained(GOLDEN / case, dtype=dtype)
    exp = load_file(GOLDEN / case / "expected.safetensors")
    n = exp["hiddens"].shape[0]
    cache = LayerCache.allocate(w.config, n // 16 + 2, dtype, "cpu")
    out = mtp_rows(w, exp["tokens"][1:], exp["hiddens"].to(dtype), torch.arange(n), cache,
                   Rope.build(w.config, cache.capacity, "cpu", dtype))
    logits = draft_logits(w, out.x)
    errors = {}
    for name, got in (("pre_norm_out", out.pre_norm), ("x", out.x), ("logits", logits)):
        errors[name] = ((got.double() - exp[name]).abs().max() / exp[name].abs().max()).item()
    pools = n // w.config.index_kpool
    errors["pool_keys"] = (
        (cache.kpool.keys[:pools].double() - exp["pool_keys"]).abs().max() / exp["pool_keys"].abs().max()
    ).item()
    print(case, dtype, {k: f"{v:.2e}" for k, v in errors.items()})
    assert max(errors.values()) < tol, errors
    assert logits.argmax(-1).tolist() == exp["drafts"].tolist()


@pytest.mark.parametrize("case", CASES)
def test_prefill_then_propose_gives_the_last_row(case):
    w = MtpWeights.from_pretrained(GOLDEN / case, dtype=torch.float64)
    exp = load_file(GOLDEN / case / "expected.safetensors")
    n = exp["hiddens"].shape[0]
    prop = ReferenceProposer(w, max_seq_len=64)
    state = prop.alloc_state("cpu")
    hiddens = exp["hiddens"].double()
    assert prop.prefill_drafter(exp["tokens"][:n], hiddens, state) == n - 1
    assert prop.propose(int(exp["tokens"][n]), hiddens[n - 1], n - 1, 1, state) == [int(exp["drafts"][n - 1])]
    snap = prop.export_state(state)
    assert ((snap["x"] - exp["x"][n - 1]).abs().max() / exp["x"][n - 1].abs().max()).item() < 1e-12
    assert snap["pool_complete"].sum() == n // w.config.index_kpool


def test_the_golden_is_reproduced_by_its_model():
    """The stored vectors are this file's model's output (regenerating changes nothing)."""
    case = CASES[0]
    text, tensors = read_checkpoint(GOLDEN / case)
    exp = load_file(GOLDEN / case / "expected.safetensors")
    out = forward(text, tensors, exp["tokens"], exp["hiddens"].double())
    assert torch.equal(out["drafts"], exp["drafts"]) and torch.allclose(out["x"], exp["x"], rtol=0, atol=1e-13)


def test_the_cases_select_pools_sparsely_and_clamp():
    """The first case is long enough that rows drop pools (7 complete, 2 selected) and its
    MoE inputs are large enough that the clamp bites (swiglu_limit 1.0)."""
    text, tensors = read_checkpoint(GOLDEN / CASES[0])
    assert 30 // text["index_kpool"] > text["index_topk"] // text["index_kpool"] and text["swiglu_limit"] == 1.0
    exp = load_file(GOLDEN / CASES[0] / "expected.safetensors")
    unclamped = forward({**text, "swiglu_limit": 1e30}, tensors, exp["tokens"], exp["hiddens"].double())
    assert (unclamped["x"] - exp["x"]).abs().max() > 1e-3
