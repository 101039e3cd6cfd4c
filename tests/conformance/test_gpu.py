"""The suite on CUDA (marked ``gpu``; skipped without a device): the same scenarios, bf16 and
fp32, tiny and small presets. Run with ``pytest -m gpu tests/conformance``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from glm_mtp.conformance import MUTANTS, Harness, Hidden, run, scenario

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
CASES = [(p, d) for p in ("tiny", "small") for d in ("bfloat16", "float32")]
SEQ = {"tiny": 64, "small": 128}


@pytest.mark.parametrize("preset,dtype", CASES)
def test_reference_twice_on_cuda(preset, dtype):
    r = run("reference", "reference", scenarios=20, seed=21, device="cuda", dtype=dtype, preset=preset,
            max_seq_len=SEQ[preset])
    assert r.ok, r.first_difference


@pytest.mark.parametrize("preset,dtype", CASES)
def test_optimized_equals_reference_on_cuda(preset, dtype):
    r = run("optimized", "reference", scenarios=100 if preset == "tiny" else 40, seed=22, device="cuda",
            dtype=dtype, preset=preset, max_seq_len=SEQ[preset])
    assert r.ok, r.first_difference


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_every_mutant_is_caught_on_cuda(name):
    r = run(f"mutant:{name}", "reference", scenarios=40, seed=0, device="cuda")
    print(f"mutant {name} on cuda: caught after {r.scenarios_run} scenario(s)")
    assert not r.ok


@pytest.mark.parametrize("preset,dtype", CASES)
def test_cli_on_cuda(preset, dtype, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "glm_mtp.conformance", "--candidate", "optimized", "--baseline", "reference",
         "--device", "cuda", "--dtype", dtype, "--preset", preset, "--max-seq-len", str(SEQ[preset]),
         "--scenarios", "20", "--seed", "23", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(out.read_text())["device"].startswith("cuda")


def test_the_lockstep_really_runs_on_cuda():
    """The weights, the hidden arguments and every exported state of a scenario live on CUDA (a
    harness that silently fell back to the CPU would pass every test above)."""
    h = Harness("optimized", "reference", device="cuda")
    ls = h.lockstep()
    for op in scenario(0, 0, h.config, h.max_seq_len, ("realistic",)).ops:
        assert ls.step(op) is None
    assert all(w.embed_tokens.is_cuda for w in h.weights)
    assert ls.candidate._arg(Hidden(seed=1, rows=2), []).is_cuda
    exported = [t for side in (ls.candidate, ls.baseline) for v in side.view() if v.export for t in v.export.values()]
    assert exported and all(t.is_cuda for t in exported)
