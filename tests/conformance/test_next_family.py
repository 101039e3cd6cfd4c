"""The conformance suite on the glm5_next family (GLM-5.3-Flash's KPool indexer, DESIGN.md §7).

The family's lockstep runs the reference against a second reference (and the KPool mutants
against the reference, tests/conformance/test_mutants.py; the optimized drafter against the
reference: tests/optimized/test_next_family.py), with the spec model checking every step's
bookkeeping and the KPool contract (a pool is complete exactly when its rows are held). The
scenarios of ``glm5next_tiny`` (kpool 4) cross pool boundaries in prefill, catch-up, propose and
trim.
"""

from collections import Counter

import pytest

from glm_mtp.conformance import run
from glm_mtp.conformance.__main__ import main
from glm_mtp.reference import kpool
from glm_mtp.reference.proposer import ReferenceProposer

PRESET = "glm5next_tiny"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_reference_equals_a_second_reference_long(dtype):
    r = run("reference", "reference", scenarios=12, seed=1, preset=PRESET, dtype=dtype,
            generators=("realistic", "adversarial", "batched"))
    assert r.ok, r.first_difference


def test_reference_equals_a_second_reference_across_pool_boundaries(monkeypatch):
    """Two scenarios pass in lockstep, and in them prefill, catch-up and propose complete pools
    and after_verify trims cut into complete ones (counted per call)."""
    events: Counter[str] = Counter()
    current = {"call": None}

    def tagged(name, method):
        def call(self, *args, **kwargs):
            current["call"] = name
            try:
                return method(self, *args, **kwargs)
            finally:
                current["call"] = None
        return call

    for name in ("prefill_drafter", "catchup_drafter", "propose", "after_verify"):
        monkeypatch.setattr(ReferenceProposer, name, tagged(name, getattr(ReferenceProposer, name)))
    write_pools, forget_from = kpool.write_pools, kpool.KPoolCache.forget_from

    def counting_write(ix, cfg, gates, slots, cache, *ops):
        if kpool.complete_pools(slots, cfg.index_kpool).numel():
            events[f"{current['call']} completes a pool"] += 1
        return write_pools(ix, cfg, gates, slots, cache, *ops)

    def counting_forget(self, n):
        if bool(self.complete[n // self.kpool :].any()):
            events[f"{current['call']} cuts a complete pool"] += 1
        return forget_from(self, n)

    monkeypatch.setattr(kpool, "write_pools", counting_write)
    monkeypatch.setattr(kpool.KPoolCache, "forget_from", counting_forget)
    r = run("reference", "reference", scenarios=2, seed=0, preset=PRESET)
    assert r.ok, r.first_difference
    print(dict(events))
    for what in ("prefill_drafter completes a pool", "catchup_drafter completes a pool", "propose completes a pool",
                 "after_verify cuts a complete pool"):
        assert events[what] > 0, (what, dict(events))


def test_the_cli_runs_the_family_on_both_backends(capsys):
    assert main(["--candidate", "reference", "--baseline", "reference", "--preset", PRESET, "--scenarios", "1",
                 "--json", ""]) == 0
    assert main(["--candidate", "optimized", "--preset", PRESET, "--scenarios", "1", "--json", ""]) == 0
    assert "PASS" in capsys.readouterr().out


def test_the_cli_runs_the_family_through_the_interpreted_kernels(tmp_path):
    """``--kernels triton``: the fused step's Triton kernels (the KPool ones included), through
    the interpreter on CPU, against the reference; the report names that backend."""
    import json

    out = tmp_path / "r.json"
    assert main(["--kernels", "triton", "--preset", PRESET, "--scenarios", "1", "--max-drafts", "2", "--max-seq-len",
                 "24",
                 "--seed", "5", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["ok"] is True and rep["candidate"].endswith("with_triton_kernels"), rep["candidate"]


def test_a_kpool_mutant_fails_the_cli(capsys):
    assert main(["--candidate", "mutant:kpool_misaligned", "--preset", PRESET, "--scenarios", "2", "--json", ""]) == 1
