"""The optimized drafter on expert-parallel weights (2 gloo ranks on CPU): it runs the
reference's collectives inside its block (uncaptured) and stays byte-identical to the
single-rank reference. Multi-process, so ``slow``."""

import pytest

from glm_mtp.conformance.sharded import check_sharded, check_sharded_runner

pytestmark = pytest.mark.slow


def test_expert_parallel_optimized_passes_the_conformance_runner():
    """The conformance runner's realistic scenarios, on every rank: sharded vs single-rank, bytes."""
    recs = check_sharded_runner(2, backend="optimized", scenarios=8, seed=2)
    for r in recs:
        assert r["ok"], r["first_difference"]
        assert r["scenarios_run"] == 8 and r["steps_run"] > 5 * 8


def test_expert_parallel_optimized_is_bit_exact():
    recs = check_sharded(2, backend="optimized", preset="tiny", dtype="bfloat16", scenarios=2, rounds=4, seed=11)
    for r in recs:
        assert r["needs_comm"] and r["experts_held"] == 4
        assert r["steps"] > 10 and r["byte_mismatch_steps"] == 0, r["first_mismatch"]
        assert r["draft_agree"] == r["draft_total"] > 0 and r["ranks_agree"]
