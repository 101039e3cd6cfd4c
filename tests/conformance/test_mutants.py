"""Proof the suite can fail: every mutant (a reference that breaks one rule) is caught."""

import pytest
import torch

from glm_mtp.conformance import MUTANTS, run
from glm_mtp.conformance.mutants.block import topk_ties_high
from glm_mtp.conformance.lockstep import Harness
from glm_mtp.conformance.runner import record
from glm_mtp.reference import attention, indexer, layers, proposer
from glm_mtp.reference.layers import topk_indices
from glm_mtp.reference.bytes import same_bytes

# Scenarios each mutant may take before the test gives up (seed 0). The counts they needed when
# this was written are printed; most fall in scenario 0 or 1.
BUDGET = 40

# Where each mutant's first difference must show: (what, export_state key or None, call). The
# place follows from the rule it breaks: bookkeeping rules show in drafter_rows, outcomes or rows
# returned at the call that breaks them; numerics rules in the bytes of the rows written (or the
# drafts) at the first call that writes with the broken rule.
SHOWS_AT = {
    "block_table_off_by_one": ("export_state", "block_table", "alloc"),  # the blocks a fresh state claims
    "catchup_writes_x": ("export_state", "x", "catchup"),  # only propose may write x
    "last_token_shape_unchecked": ("outcome", None, "propose"),  # a bad last_token is not refused
    # another summation order rounds differently: first in the float32 softmax of a draft's probability (§12)
    "library_sums": ("confidence", "prob", "propose"),
    "misaligned_catchup": ("return", None, "catchup"),  # a misaligned catch-up must write 0 rows
    "no_rewind_when_ahead": ("drafter_rows", None, "propose"),  # propose must rewind to position
    "pair_shift": ("export_state", "kv_rows", "prefill"),  # the (token, hidden) pairing of every row
    "pos_base_rope": ("export_state", "kv_rows", "catchup"),  # the RoPE position of a catch-up row
    "pre_norm_feed": ("return", "drafts", "propose"),  # draft 2's row is fed the wrong x: draft 2 differs
    "rewind_before_validate": ("refused call changed the state", None, "propose"),
    "second_verify": ("outcome", None, "verify"),  # a verify with nothing pending is refused
    # rows past seq_len leak into a draft row's selection: its rows (here under a grammar whose masks keep the drafts)
    "stale_indexer_view": ("export_state", "kv_rows", "propose"),
    "topk_ties_high": ("return", "drafts", "propose"),  # the tie breaks change the drafts
    "trim_first_row": ("drafter_rows", None, "verify"),  # after_verify keeps num_accepted + 1 rows
    # batches (generator "batched"): each state as its own call alone
    "batch_permuted": ("return", None, "propose_batch"),  # the drafts come back at the wrong indices
    "batch_checks_as_it_goes": ("refused call changed the state", None, "propose_batch"),  # earlier states drafted
    "batch_x_of_state0": ("export_state", "x", "propose_batch"),  # state 0's x in every state
    "catchup_batch_writes_misaligned": ("return", None, "catchup_batch"),  # a misaligned row must write 0
    # the KPool indexer (preset glm5next_tiny, kpool 4)
    "kpool_stale_key": ("export_state", "pool_keys", "propose"),  # a rewritten pool keeps its old key
    "kpool_tail_dropped": ("return", "drafts", "propose"),  # the row's own pool's rows are not attended
    "kpool_misaligned": ("export_state", "pool_keys", "prefill"),  # pools pooled one row early
    # equal pool scores select another pool (step 1's, shared by the rest): the rows attend other rows
    "kpool_ties_high": ("export_state", "kv_rows", "propose"),
    "kpool_cut_stays_complete": ("export_state", "pool_complete", "verify"),  # a cut pool must be incomplete
    # index sharing (DESIGN.md §9; scenarios drawn with sharing on)
    "share_wrong_row": ("return", "drafts", "propose"),  # step 2 attends row p+1's selection: draft 2 differs
    "share_left_over": ("return", "drafts", "propose"),  # a later propose's steps attend the earlier S
    "share_attends_own_row": ("return", "drafts", "propose"),  # step 2 attends its own row too
    "share_skips_index_writes": ("export_state", "index_rows", "propose"),  # a shared row's index key is not written
    # grammar-constrained drafts (DESIGN.md §10; scenarios drawn with grammars)
    "grammar_one_mask": ("return", "drafts", "propose"),  # draft 2 masked with A_1: another token
    # step 1 drafts unmasked: a token its matcher refuses when the walk accepts it (ValueError vs drafts)
    "grammar_mask_one_step_late": ("outcome", None, "propose"),
    "grammar_no_rollback": ("matcher", "grammar", "propose"),  # the matcher is left with the drafts accepted
    "grammar_finite_sentinel": ("confidence", "margin", "propose"),  # one allowed token: a finite margin, not +inf
    "grammar_terminated_drafts_on": ("return", "drafts", "propose"),  # drafts past the walk's end
    # another vocabulary's matcher asked for step 1 after the rewind: its own RuntimeError (and a poisoning),
    # not the ValueError before any write
    "grammar_asked_after_writing": ("outcome", None, "propose"),
    # draft confidence (§12)
    "confidence_margin_unmasked": ("confidence", "margin", "propose"),  # the best other logit is a forbidden one
    "confidence_prob_at_temperature_one": ("confidence", "prob", "propose"),  # a sampled draft's prob at T = 1
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_every_mutant_is_caught_where_it_breaks_its_rule(name, capsys):
    r = run(f"mutant:{name}", "reference", scenarios=BUDGET, seed=0, generators=MUTANTS[name].generators,
            preset=MUTANTS[name].preset)
    d = r.first_difference
    with capsys.disabled():
        where = (
            ""
            if d is None
            else f"step {d.step} {d.what}" + (f"[{d.tensor}]" if d.tensor else "") + f" at {d.op.split('(')[0]}"
        )
        print(f"\n  mutant {name}: caught after {r.scenarios_run} scenario(s), {r.steps_run} steps: {where}")
    assert not r.ok, f"mutant {name} ({MUTANTS[name].rule}) survived {BUDGET} scenarios"
    assert (d.what, d.tensor, d.op.split("(")[0]) == SHOWS_AT[name], (
        f"mutant {name} ({MUTANTS[name].rule}) caught elsewhere:\n{d}"
    )


def test_every_mutant_is_registered_and_names_its_rule():
    """Every ``Mutant`` subclass defined in a module of mutants (``mutants.GROUPS``) is in
    ``MUTANTS`` (a mutant left out would never be run) with a rule, every module of mutants in this
    package is a group, and every mutant has a place it must show in ``SHOWS_AT``."""
    import pkgutil

    import glm_mtp.conformance.mutants as mutants
    from glm_mtp.conformance.mutants import GROUPS
    from glm_mtp.conformance.mutants.base import Mutant

    modules = {m.name for m in pkgutil.iter_modules(mutants.__path__)}
    assert modules - {"base"} == {g.__name__.rsplit(".", 1)[1] for g in GROUPS}
    defined = {cls for group in GROUPS for cls in vars(group).values()
               if isinstance(cls, type) and issubclass(cls, Mutant) and "name" in vars(cls)}
    assert defined == set(MUTANTS.values())
    assert all(cls.rule for cls in defined) and set(SHOWS_AT) == set(MUTANTS)


def test_tie_mutant_differs_only_on_ties():
    scores = torch.tensor([[0.5, 0.0, -1.0, 0.0, 0.0, 0.25]])
    assert sorted(topk_indices(scores, 3)[0].tolist()) == [0, 1, 5]  # the zero-score tie goes low
    assert sorted(topk_ties_high(scores, 3)[0].tolist()) == [0, 4, 5]
    distinct = torch.randn(3, 40)
    assert torch.equal(topk_indices(distinct, 6).sort().values, topk_ties_high(distinct, 6).sort().values)


def test_swapped_functions_never_leak_into_the_reference_beside_a_mutant():
    originals = (attention.select_rows, indexer.topk_indices, proposer.mtp_rows)
    # Lockstep a swapping mutant against the reference and keep what the reference side exported ...
    h = Harness("mutant:stale_indexer_view", "reference", dtype=torch.bfloat16)
    from glm_mtp.conformance.scenarios import scenario

    sc = scenario(0, 0, h.config, 64, grammars=bool(h.grammars))
    ls = h.lockstep(sc.index_share)
    beside = {}
    for step, op in enumerate(sc.ops):
        ls.step(op)  # differences are expected; the reference side is what matters here
        for i, v in enumerate(ls.baseline.view()):
            for k, t in v.export.items():
                beside[f"0/{step}/{i}/{k}"] = t
    assert (
        attention.select_rows,
        indexer.topk_indices,
        proposer.mtp_rows,
    ) == originals and indexer.topk_indices is layers.topk_indices
    # ... which must equal the reference run alone, byte for byte.
    _, alone = record("reference", [0], seed=0)
    assert beside.keys() == alone.keys()
    assert all(same_bytes(beside[k], alone[k]) for k in alone)


# Mutants whose bug is in the row bookkeeping: the spec model alone catches them, with no
# reference beside them (the mutant is its own baseline), so the oracle is proven able to fail too.
BOOKKEEPING = ["trim_first_row", "no_rewind_when_ahead", "second_verify", "misaligned_catchup",
               "block_table_off_by_one", "rewind_before_validate"]


@pytest.mark.parametrize("name", BOOKKEEPING + ["kpool_cut_stays_complete", "grammar_terminated_drafts_on"])
def test_the_spec_model_catches_bookkeeping_mutants_on_its_own(name):
    r = run(f"mutant:{name}", f"mutant:{name}", scenarios=BUDGET, seed=0, preset=MUTANTS[name].preset)
    assert not r.ok and r.first_difference.what in ("contract", "refused call changed the state")
    assert r.first_difference.side == "baseline"


def test_real_drafter_inputs_tie_at_the_top_k_boundary():
    """Why ``topk_ties_high`` is catchable: relu makes a row's index score exactly 0 whenever
    every head's dot product is negative, and when the head weights are negative those zeros are
    the best scores, so exact ties straddle the top-k boundary on ordinary random inputs."""
    from glm_mtp.conformance.mutants.base import swapped
    from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer

    cfg = MtpConfig.preset("tiny")
    prop = ReferenceProposer(MtpWeights.random(cfg, seed=0, dtype=torch.bfloat16), 64)
    seen = []
    original = attention.index_scores

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out.detach().clone())
        return out

    gen = torch.Generator().manual_seed(0)
    state = prop.alloc_state("cpu")
    with swapped(attention, "index_scores", spy):
        prop.prefill_drafter(torch.randint(cfg.vocab_size, (48,), generator=gen),
                             torch.randn(48, cfg.hidden_size, generator=gen).bfloat16(), state)
    scores = seen[0]  # (47 new rows, capacity)
    k, ties = cfg.index_topk, 0
    for t in range(k + 1, scores.shape[0]):  # rows that see more than k rows
        best = scores[t, : t + 1].sort(descending=True).values
        ties += bool(best[k - 1] == best[k])
    assert attention.index_scores is original
    assert ties > 0, "no exact tie at the top-k boundary: the tie mutant would be caught only by luck"
