"""Batched lockstep conformance: ``propose_batch`` / ``catchup_batch`` of the candidate
against each state's own single calls on the baseline (``Side.per_state``), over the ``batched``
generator's scenarios: joins, leaves, random subsets and orders, per-state accept counts, misaligned
catch-up rows, single calls interleaved, and batched misuse (pending, freed, duplicate and foreign
states, wrong lengths, a bad token id, a NaN/inf hidden, a position ahead, a capacity overflow)."""

from collections import Counter

import pytest
import torch

from glm_mtp.conformance import MUTANTS, run
from glm_mtp.conformance.batched import BATCH_MISUSE
from glm_mtp.conformance.lockstep import Harness
from glm_mtp.conformance.scenarios import load_scenario, save_scenario, scenario
from glm_mtp.conformance.ops import FOREIGN, Hidden, Op, TokenIds
from glm_mtp.conformance.spec import SpecModel
from glm_mtp.reference import MtpConfig, ReferenceProposer

CFG = MtpConfig.preset("tiny")
BATCHED = ("batched",)

# Scenarios per (preset, dtype) in the lockstep test, sized so this file stays within ~90 s on
# one core (the CLI's batched runs take >= 200 in all).
COUNTS = {"tiny": 10, "small": 5}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_batched_lockstep_optimized_vs_reference_per_state(preset, dtype):
    r = run("optimized", "reference", scenarios=COUNTS[preset], seed=12, dtype=dtype, preset=preset, generators=BATCHED)
    assert r.ok, r.first_difference
    assert r.outcomes["propose_batch"].get("ok", 0) and r.outcomes["catchup_batch"].get("ok", 0)


class CountingReference(ReferenceProposer):
    """A reference that counts its batched calls that returned (a refusal raises)."""

    def __init__(self, weights, max_seq_len):
        super().__init__(weights, max_seq_len)
        self.batches_run = 0

    def propose_batch(self, *args):
        out = super().propose_batch(*args)
        self.batches_run += 1
        return out

    def catchup_batch(self, *args):
        out = super().catchup_batch(*args)
        self.batches_run += 1
        return out


def test_the_baseline_plays_a_valid_batch_as_single_calls_and_the_candidate_as_one():
    """The reference's own propose_batch as the candidate passes, and the baseline never runs a
    batched call to completion: each valid batch it plays as single calls on each state alone."""
    h = Harness(CountingReference, CountingReference, "tiny", torch.bfloat16)
    valid = 0
    for index in range(4):
        sc = scenario(1, index, h.config, h.max_seq_len, BATCHED)
        ls = h.lockstep()
        for op in sc.ops:
            finding = ls.step(op)
            assert finding is None, (op.call(), finding)
        valid += sum(op.kind.endswith("_batch") and op.expect == "ok" for op in sc.ops)
        assert ls.baseline.proposer.batches_run == 0
        assert ls.candidate.proposer.batches_run == sum(
            op.kind.endswith("_batch") and op.expect == "ok" for op in sc.ops
        )
    assert valid > 0


BATCH_MUTANTS = sorted(name for name, cls in MUTANTS.items() if cls.generators == BATCHED)


def test_the_batch_mutants_are_registered():
    assert set(BATCH_MUTANTS) == {"batch_permuted", "batch_checks_as_it_goes", "batch_x_of_state0",
                                  "catchup_batch_writes_misaligned"}


@pytest.mark.parametrize("name", BATCH_MUTANTS)
def test_a_broken_batched_candidate_is_caught(name):
    """Wrong order, a refusal after some states drafted, state 0's x in every state, misaligned
    rows written: each is a finding at a batched call (test_mutants.py pins where)."""
    r = run(f"mutant:{name}", "reference", scenarios=10, seed=0, generators=BATCHED)
    assert not r.ok, f"mutant {name} survived"
    assert r.first_difference.op.split("(")[0] in ("propose_batch", "catchup_batch")


def _broken_x_everywhere(w, n):
    from glm_mtp.optimized import OptimizedProposer

    class XOfState0(OptimizedProposer):
        def propose_batch(self, last_tokens, target_hiddens, positions, num_drafts, states):
            out = super().propose_batch(last_tokens, target_hiddens, positions, num_drafts, states)
            for st in states[1:]:
                st.x.copy_(states[0].x)  # the batch computed right, then state 0's x written into every state
            return out

    return XOfState0(w, n)


def test_a_broken_optimized_batch_is_caught():
    r = run(_broken_x_everywhere, "reference", scenarios=10, seed=0, generators=BATCHED)
    assert not r.ok and r.first_difference.what == "export_state" and r.first_difference.tensor == "x"


# ---- the generator and the spec model -------------------------------------------------------


def test_batched_scenarios_are_reproducible_and_round_trip_through_json(tmp_path):
    a, b = scenario(5, 3, CFG, 64, BATCHED), scenario(5, 3, CFG, 64, BATCHED)
    assert a == b and a.generator == "batched"
    assert scenario(5, 4, CFG, 64, BATCHED).ops != a.ops
    for i in range(6):
        ops = scenario(0, i, CFG, 64, BATCHED).ops
        save_scenario(str(tmp_path / "s.json"), ops)
        assert load_scenario(str(tmp_path / "s.json")).ops == ops
    # the default generators are untouched
    assert {scenario(0, i, CFG, 64).generator for i in range(4)} == {"realistic", "adversarial"}


def test_the_batched_generator_covers_every_batched_case():
    seen: Counter = Counter()
    for i in range(60):
        m_states = 0
        for op in scenario(0, i, CFG, 64, BATCHED).ops:
            if op.kind == "alloc" and op.expect == "ok":
                m_states += 1
            if op.kind in ("propose_batch", "catchup_batch"):
                seen[f"{op.kind} {op.expect}"] += 1
                B = len(op.args["states"])
                if op.expect == "ok":
                    seen[f"{op.kind} B={min(B, 4)}"] += 1
                if op.note.startswith("batched misuse: "):
                    for kind in op.note.split(": ", 1)[1].split(" + "):
                        seen[f"misuse {kind}"] += 1
                if op.note == "a pending state in the batch":
                    seen["misuse pending"] += 1
                if op.kind == "propose_batch" and op.expect == "ok":
                    pos = op.args["positions"].ids
                    seen[f"k={op.args['num_drafts']}"] += 1
                    if len(set(pos)) > 1:
                        seen["positions differ"] += 1
                    if any(p + op.args["num_drafts"] == SpecModel(CFG, 64).capacity for p in pos):
                        seen["drafts to the last row"] += 1
                if op.kind == "catchup_batch" and op.expect == "ok":
                    seen["catchup rows written"] += sum(op.returns)
                    seen["catchup rows no-op"] += len(op.returns) - sum(op.returns)
            if op.kind in ("propose", "free", "verify"):
                seen[op.kind] += 1
        seen[f"states={min(m_states, 6)}"] += 1
    need = (["propose_batch ok", "propose_batch ValueError", "propose_batch RuntimeError", "catchup_batch ok",
             "catchup_batch ValueError", "catchup_batch RuntimeError", "propose_batch B=0", "propose_batch B=1",
             "propose_batch B=4", "catchup_batch B=4", "positions differ", "drafts to the last row",
             "catchup rows written", "catchup rows no-op",
             "propose", "free", "verify", "states=2", "states=6"]
            + [f"k={k}" for k in range(5)] + [f"misuse {k}" for k in BATCH_MISUSE])
    missing = [k for k in need if not seen[k]]
    assert not missing, f"never generated: {missing}\n{seen}"


def test_the_spec_model_follows_the_check_order_of_a_batch():
    """The refusal a batch gets is the first failing check: the batch's own (duplicates, foreign
    states, lengths, num_drafts: ValueError) before any state's, then each state's in index order."""
    m = SpecModel(CFG, 64)
    for i in range(3):
        m.alloc()
        m.prefill(i, TokenIds(tuple(range(10 + i))), Hidden(i, 10 + i))
    rows = [s.seq_len for s in m.seqs]

    def propose(states, pos, k=2, fault=None, tokens=None):
        return m.propose_batch(states, TokenIds(tuple(tokens or [1] * len(states))),
                               Hidden(7, len(states), fault=fault),
                               TokenIds(tuple(pos)), k)

    # state 0's position is ahead (RuntimeError) and state 1's hidden has a NaN (ValueError): index order decides
    assert propose([0, 1], [rows[0] + 1, rows[1]], fault="nan@1").expect == "RuntimeError"
    assert propose([1, 0], [rows[1], rows[0] + 1], fault="nan@0").expect == "ValueError"
    # a duplicate or a foreign state is refused before any state's own checks
    assert propose([0, 0], [rows[0] + 1, rows[0] + 1]).expect == "ValueError"
    assert propose([0, FOREIGN], [rows[0] + 1, 0]).expect == "ValueError"
    # one row past the capacity in one state
    cap = m.capacity
    assert propose([0, 1], [rows[0], rows[1]], k=cap - rows[1] + 1).expect == "ValueError"
    assert [s.seq_len for s in m.seqs] == rows  # refusals change nothing
    ok = propose([2, 0], [rows[2], rows[0] - 3], k=3)
    assert ok.expect == "ok" and ok.returns == [3, 3] and ok.rows_after == [rows[2] + 3, rows[0]]
    # a pending state refuses the next batch; a misaligned catch-up row writes nothing
    assert propose([1, 0], [rows[1], 0]).expect == "RuntimeError"
    m.verify(2, 3), m.verify(0, 1)
    c = m.catchup_batch([0, 2, 1], TokenIds((4, "d3", 5)), Hidden(9, 3), TokenIds((rows[0] - 2, rows[2] + 3, rows[1])))
    assert c.expect == "ok" and c.returns == [0, 1, 1]
    assert Op.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("kind", ["propose_batch", "catchup_batch"])
def test_a_refusal_follows_index_order_across_data_and_host_checks(kind, preset):
    """DESIGN.md §4: a batch runs each state's own checks in index order, so with a NaN in row 0's
    hidden (a check that reads data) and a host-side fault in row 1 (a position ahead of the rows;
    a pending state), the refusal is row 0's ValueError, as the per-state calls give, not row 1's
    RuntimeError: a backend that checks data on the device must still report by index order."""
    m = SpecModel(MtpConfig.preset(preset), 64)
    ops = [m.info()]
    for i in range(2):
        ops += [m.alloc(), m.prefill(i, TokenIds(tuple(range(1, 12 + 3 * i))), Hidden(10 + i, 11 + 3 * i))]
    rows = [s.seq_len for s in m.seqs]
    if kind == "propose_batch":
        ops.append(m.propose_batch([0, 1], TokenIds((3, 4)), Hidden(20, 2, fault="nan@0"),
                                   TokenIds((rows[0], rows[1] + 2)), 2))
    else:
        ops.append(m.propose(1, TokenIds((5,), "int"), Hidden(21, 1), rows[1], 2))  # state 1 pending
        ops.append(m.catchup_batch([0, 1], TokenIds((3, 4)), Hidden(20, 2, fault="nan@0"),
                                   TokenIds((rows[0], rows[1] + 2))))
    assert ops[-1].expect == "ValueError"
    ls = Harness("optimized", "reference", preset, torch.bfloat16).lockstep()
    for op in ops:
        finding = ls.step(op)
        assert finding is None, (
            f"{op.call()}: {finding.where()}: {finding.detail}\n  candidate: {finding.candidate}\n"
            f"  baseline: {finding.baseline}"
        )
