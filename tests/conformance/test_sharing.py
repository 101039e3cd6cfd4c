"""Index sharing (DESIGN.md §9) in the conformance suite: every scenario draws it on or off for
both sides (the weights' config replaced), the spec model says which row a propose's later steps
share, and the sharing mutants (``conformance/mutants/sharing.py``) break only shared proposes."""

import dataclasses

import pytest
import torch

from glm_mtp.conformance import Harness, load_scenario, save_scenario, scenario
from glm_mtp.conformance.mutants import MUTANTS
from glm_mtp.conformance.mutants import sharing as mutants_sharing
from glm_mtp.conformance.scenarios import draws_index_share
from glm_mtp.conformance.ops import Hidden, TokenIds
from glm_mtp.conformance.spec import SpecModel
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.bytes import keyed_bytes, raw_bytes

SHARING_MUTANTS = {cls.name: cls for cls in mutants_sharing.MUTANTS}

FAMILIES = ["tiny", "glm5next_tiny"]


@pytest.mark.parametrize("preset", FAMILIES)
def test_scenarios_draw_sharing_on_and_off_for_both_sides(preset):
    cfg = MtpConfig.preset(preset)
    draws = [scenario(3, i, cfg, 64).index_share for i in range(16)]
    assert set(draws) == {True, False} and draws == [draws_index_share(3, i) for i in range(16)]
    h = Harness("reference", "reference", preset, torch.float32)
    for share in (True, False):
        ls = h.lockstep(share)
        for side in (ls.candidate, ls.baseline):
            assert side.proposer.config.index_share_for_mtp_iteration is share
    assert h.lockstep().candidate.proposer.config.index_share_for_mtp_iteration is cfg.index_share_for_mtp_iteration


def test_the_spec_model_names_the_shared_row():
    m = SpecModel(MtpConfig.preset("tiny"), 64, index_share=True)
    m.alloc()
    m.prefill(0, TokenIds(tuple(range(1, 11))), Hidden(1, 10))
    op = m.propose(0, TokenIds((3,), "int"), Hidden(2, 1), 9, 3)
    assert op.expect == "ok" and "steps 2..3 attend row 9's selection" in op.note and m.seqs[0].shared_from == 9
    m.verify(0, 1)
    assert m.seqs[0].shared_from is None  # the selection belongs to that propose alone
    assert m.propose(0, TokenIds((3,), "int"), Hidden(3, 1), 11, 1).note == "" and m.seqs[0].shared_from is None
    off = SpecModel(MtpConfig.preset("tiny"), 64)
    off.alloc()
    off.prefill(0, TokenIds(tuple(range(1, 11))), Hidden(1, 10))
    assert off.propose(0, TokenIds((3,), "int"), Hidden(2, 1), 9, 3).note == ""


def test_a_saved_scenario_keeps_its_sharing(tmp_path):
    sc = scenario(0, 0, MtpConfig.preset("tiny"), 64)
    save_scenario(str(tmp_path / "s.json"), sc.ops, index_share=sc.index_share)
    back = load_scenario(str(tmp_path / "s.json"))
    assert back.index_share is sc.index_share and back.ops == sc.ops


def _drive(prop, seed=0, rounds=2, k=3, accepted=2):
    """Prefill 14 rows, then ``rounds`` proposes of ``k`` drafts with ``accepted`` accepted after
    each: each propose's drafts and x (raw bytes), and the state's bytes at the end."""
    cfg = prop.config
    gen = torch.Generator().manual_seed(seed)
    st = prop.alloc_state("cpu")
    prop.prefill_drafter(torch.randint(1, cfg.vocab_size, (15,), generator=gen),
                         torch.randn(15, cfg.hidden_size, generator=gen), st)
    out = []
    position = 14
    for _ in range(rounds):
        drafts = prop.propose(int(torch.randint(1, cfg.vocab_size, (1,), generator=gen)),
                              torch.randn(cfg.hidden_size, generator=gen),
                              position, k, st)
        out.append((drafts, raw_bytes(prop.export_state(st)["x"])))
        prop.after_verify(accepted, st)
        position += accepted + 1
    return out, keyed_bytes(prop.export_state(st))


@pytest.mark.parametrize("name", sorted(SHARING_MUTANTS))
def test_sharing_mutants_are_the_reference_when_sharing_is_off(name):
    cls = MUTANTS[name]
    w = MtpWeights.random(MtpConfig.preset(cls.preset), seed=2, dtype=torch.float32).with_index_share(False)
    assert _drive(cls(w, 64)) == _drive(ReferenceProposer(w, 64))


def test_unwritten_shared_index_keys_show_when_a_later_propose_selects_over_them():
    """``share_skips_index_writes`` seen as an engine sees it (drafts and x only): its first
    propose drafts the same bytes (no step of a propose reads the writes it skipped); once its
    accepted shared rows key complete pools (stale keys and gates) above index_topk, a later
    propose selecting over them drafts differently (here the fourth; the lockstep, which compares
    ``index_rows``, names the first propose)."""
    cls = MUTANTS["share_skips_index_writes"]
    w = MtpWeights.random(MtpConfig.preset(cls.preset), seed=1, dtype=torch.float32)
    assert w.config.index_share_for_mtp_iteration
    mutant, _ = _drive(cls(w, 64), seed=1, rounds=4, k=4, accepted=3)
    reference, _ = _drive(ReferenceProposer(w, 64), seed=1, rounds=4, k=4, accepted=3)
    assert mutant[:3] == reference[:3]
    assert mutant[3][1] != reference[3][1]


def test_every_sharing_mutant_is_registered_once():
    assert set(SHARING_MUTANTS) <= set(MUTANTS) and all(MUTANTS[n] is c for n, c in SHARING_MUTANTS.items())
    assert {dataclasses.is_dataclass(c) for c in SHARING_MUTANTS.values()} == {False}


OTHER_FAMILY = {"tiny": "glm5next_tiny", "glm5next_tiny": "tiny"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHARING_MUTANTS))
def test_sharing_mutants_are_caught_in_the_other_family_too(name):
    """The default run catches each sharing mutant in one family (``test_mutants``); here, the other."""
    from glm_mtp.conformance import run

    r = run(f"mutant:{name}", "reference", scenarios=40, seed=0, preset=OTHER_FAMILY[MUTANTS[name].preset])
    assert not r.ok and r.first_difference.op.startswith("propose")
    print(f"\n  mutant {name} ({OTHER_FAMILY[MUTANTS[name].preset]}): "
          f"{r.first_difference.what}[{r.first_difference.tensor}] at step {r.first_difference.step} of scenario "
          f"{r.first_difference.scenario_index}")
