"""A piece that cannot apply is refused when the drafter is built (DESIGN.md §4 and §7): a KPool
selection piece (``kpool.check_selection``) and weights that hold no data (``contract.drafter_sizes``),
both backends, each with a ``ValueError`` naming the argument. Integer arguments given as meta
tensors are refused by name too (``contract.check_strided``), single and batched."""

from dataclasses import dataclass
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.bytes import same_bytes
from glm_mtp.reference.kpool import kpool_all_rows, kpool_rows

WEIGHTS = {f: MtpWeights.random(MtpConfig.preset(p), seed=0, dtype=torch.bfloat16)
           for f, p in (("glm5", "tiny"), ("glm5_next", "glm5next_tiny"))}


@dataclass
class Probe:
    """A recording wrapper, shaped as ``experiments.recall.RecallProbe``: it runs ``select``."""

    select: object

    def __call__(self, *args, **kwargs):
        return self.select(*args, **kwargs)


SELECTIONS = {"kpool_rows": kpool_rows, "kpool_all_rows": kpool_all_rows}
NOT_SELECTIONS = {"None": None, "42": 42, "print": print, "lambda": lambda *a: (None, None),
                  "partial": partial(kpool_rows), "probe(print)": Probe(print), "str": "kpool_rows"}


@settings(max_examples=60, deadline=None, database=None)
@given(family=st.sampled_from(sorted(WEIGHTS)), name=st.sampled_from(sorted(SELECTIONS) + sorted(NOT_SELECTIONS)),
       wrapped=st.booleans())
def test_a_selection_piece_is_accepted_exactly_when_it_can_apply(family, name, wrapped):
    piece = SELECTIONS.get(name, NOT_SELECTIONS.get(name))
    if wrapped:
        piece = Probe(piece)
    is_selection = name in SELECTIONS
    applies = is_selection and (family == "glm5_next" or (piece is kpool_rows))
    if applies:
        ReferenceProposer(WEIGHTS[family], 32, kpool=piece)
    else:
        rule = "kpool must be a KPool selection" if not is_selection else "cannot apply to family 'glm5'"
        with pytest.raises(ValueError, match=rule):
            ReferenceProposer(WEIGHTS[family], 32, kpool=piece)


def test_the_dense_ablation_on_glm5_weights_is_refused():
    with pytest.raises(ValueError, match=r"kpool='kpool_all_rows' cannot apply to family 'glm5': only glm5_next"):
        ReferenceProposer(WEIGHTS["glm5"], 32, kpool=kpool_all_rows)


def test_a_piece_that_is_not_a_selection_is_refused_before_any_prefill():
    with pytest.raises(ValueError, match=r"kpool must be a KPool selection: .*got <built-in function print>"):
        ReferenceProposer(WEIGHTS["glm5_next"], 32, kpool=print)


@pytest.mark.parametrize("backend", [ReferenceProposer, OptimizedProposer])
@pytest.mark.parametrize("family", sorted(WEIGHTS))
def test_weights_on_the_meta_device_are_refused_by_name(backend, family):
    with pytest.raises(ValueError, match=r"^weights must hold data: they are on the meta device"):
        backend(WEIGHTS[family].to("meta"), 32)


@pytest.mark.parametrize("backend", [ReferenceProposer, OptimizedProposer])
def test_a_meta_position_is_refused_by_name_single_and_batched(backend):
    w = WEIGHTS["glm5"]
    prop = backend(w, 32)
    state = prop.alloc_state("cpu")
    hidden = torch.randn(w.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    before = {k: v.clone() for k, v in prop.export_state(state).items()}
    for position in (torch.tensor(0, device="meta"), torch.tensor([0], device="meta")):
        with pytest.raises(ValueError, match=r"^position must hold data: a tensor on the meta device"):
            prop.propose(1, hidden, position, 2, state)
    with pytest.raises(ValueError, match=r"positions must hold data: a tensor on the meta device"):
        prop.propose_batch([1], hidden[None], torch.tensor([0], device="meta"), 2, [state])
    after = prop.export_state(state)
    assert all(same_bytes(before[k], after[k]) for k in before) and state.poisoned is None
