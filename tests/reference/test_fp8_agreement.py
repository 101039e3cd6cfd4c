"""The block-scaled drafter against its own weights dequantized (DESIGN.md §8), on the golden
cases (tests/data/golden) quantized with ``quantize_fp8``.

Three runs of one real function: the fp8 weights at S = float32 (the §8 order: a tree per
128-wide block, the block's scale, a tree over blocks), the same weights dequantized to float32
(``up(W8) * s`` rounded once per value, then the ordinary pinned float32 reference), and
dequantized to float64 (exact: an e4m3 significand of 4 bits times a float32 scale of 24 fits 53
bits), which is the function's value up to float64 rounding.

The tolerance. test_golden.py bounds a float32 run of these very cases by 1e-4 of max|.| against
float64 (the same model, the same inputs). The fp8 order computes each dot in float32 too, with
the same tree depth plus at most two roundings (one per block product with its scale, one per
block's tree root instead of one per dequantized value), so it lies within that bound of the
float64 run; the dequantized float32 run does by test_golden's statement. Hence:
|fp8 - deq64| <= 1e-4 and |fp8 - deq32| <= 2e-4, relative to max|deq64| (measured: about 2e-7,
so the bound is loose, not tight). Drafts (an argmax with margins far above that) agree on every row.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glm_mtp.reference import MtpWeights, ReferenceProposer
from glm_mtp.reference.attention import Rope
from glm_mtp.reference.block import draft_logits, mtp_rows
from glm_mtp.reference.state import LayerCache

GOLDEN = Path(__file__).parents[1] / "data" / "golden"
CASES = [c["name"] for c in json.loads((GOLDEN / "cases.json").read_text())]
FLOAT32_TOL = 1e-4  # test_golden.py's float32-vs-float64 tolerance for these cases


def forward(w: MtpWeights, tokens, hiddens):
    """(x, logits, drafts) of every row, the MTP layer run once over the case."""
    n, dt = hiddens.shape[0], w.dtype
    cache = LayerCache.allocate(w.config, n // 16 + 2, dt, "cpu")
    out = mtp_rows(w, tokens, hiddens.to(dt), torch.arange(n), cache, Rope.build(w.config, cache.capacity, "cpu", dt))
    logits = draft_logits(w, out.x)
    return out.x.double(), logits.double(), logits.argmax(-1)


@pytest.mark.parametrize("case", CASES)
def test_fp8_agrees_with_its_dequantized_weights(case):
    q = MtpWeights.from_pretrained(GOLDEN / case, dtype=torch.float32).quantize_fp8()
    exp = load_file(GOLDEN / case / "expected.safetensors")
    tokens, hiddens = exp["tokens"][1:], exp["hiddens"]
    fp8 = forward(q, tokens, hiddens)
    deq32 = forward(q.dequantize(torch.float32), tokens, hiddens)
    deq64 = forward(q.dequantize(torch.float64), tokens, hiddens)
    for i, name in enumerate(("x", "logits")):
        scale = deq64[i].abs().max()
        assert ((fp8[i] - deq64[i]).abs().max() / scale).item() <= FLOAT32_TOL, name
        assert ((fp8[i] - deq32[i]).abs().max() / scale).item() <= 2 * FLOAT32_TOL, name
        assert not torch.equal(fp8[i], deq32[i])  # the orders do differ: the check compares two computations
    assert fp8[2].tolist() == deq32[2].tolist() == deq64[2].tolist()


@pytest.mark.parametrize("case", CASES)
def test_fp8_at_bf16_drafts_as_the_dequantized_weights(case):
    """The production setting: fp8 matrices with bf16 activations (S = bf16). bf16 rounds every
    stage's output (u = 2^-8), so values move by ~1e-2 relative; the drafts of these cases
    still equal the exact (float64, dequantized) ones on every row."""
    q = MtpWeights.from_pretrained(GOLDEN / case, dtype=torch.bfloat16).quantize_fp8()
    exp = load_file(GOLDEN / case / "expected.safetensors")
    tokens, hiddens = exp["tokens"][1:], exp["hiddens"]
    assert forward(q, tokens, hiddens)[2].tolist() == forward(q.dequantize(torch.float64), tokens, hiddens)[2].tolist()


def test_prefill_then_propose_with_fp8_gives_the_dequantized_draft():
    case = CASES[-1]
    q = MtpWeights.from_pretrained(GOLDEN / case, dtype=torch.float32).quantize_fp8()
    exp = load_file(GOLDEN / case / "expected.safetensors")
    n = exp["hiddens"].shape[0]
    drafts = []
    for w in (q, q.dequantize(torch.float32)):
        prop = ReferenceProposer(w, max_seq_len=64)
        st = prop.alloc_state("cpu")
        hid = exp["hiddens"].float()
        prop.prefill_drafter(exp["tokens"][:n], hid, st)
        drafts.append(prop.propose(int(exp["tokens"][n]), hid[n - 1], n - 1, 3, st))
    assert drafts[0] == drafts[1]
