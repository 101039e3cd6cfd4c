"""``python -m glm_mtp.conformance``: exit 0 when equal, 1 on a difference, 2 on bad arguments."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from glm_mtp.conformance.__main__ import main

REPO = Path(__file__).resolve().parents[2]


def test_equal_backends_exit_0_with_a_table_and_a_json_report(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "glm_mtp.conformance", "--candidate", "reference", "--baseline", "reference",
         "--device", "cpu", "--dtype", "bfloat16", "--preset", "tiny", "--scenarios", "4", "--seed", "3", "--json",
         str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: PASS" in proc.stdout and "propose" in proc.stdout
    rep = json.loads(out.read_text())
    assert rep["ok"] is True and rep["scenarios_run"] == 4 and rep["first_difference"] is None and rep["steps_run"] > 0


def test_a_difference_exits_1(tmp_path):
    out = tmp_path / "r.json"
    assert main(["--candidate", "mutant:trim_first_row", "--scenarios", "10", "--json", str(out)]) == 1
    rep = json.loads(out.read_text())
    assert rep["ok"] is False and rep["first_difference"]["replay"].startswith("python -m glm_mtp.conformance")


@pytest.mark.parametrize("argv", [
    ["--candidate", "fastest"],
    ["--candidate", "mutant:nope"],
    ["--preset", "huge"],
    ["--dtype", "int8"],
    ["--generators", "realistic,nope"],
    ["--scenario-file", "/nonexistent/scenario.json"],
])
def test_bad_names_exit_2(argv, capsys):
    assert main(argv + ["--scenarios", "1", "--json", ""]) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--scenarios", "0"], ["--seed", "x"], ["--no-such-flag"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


def test_cuda_where_there_is_none_exits_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["--candidate", "reference", "--device", "cuda", "--json", ""]) == 2


IMPORT_CHECK = """
import sys
sys.modules["hydra"] = None   # as on a GPU machine without them: any import of these fails
sys.modules["wandb"] = None
import glm_mtp.conformance
from glm_mtp.conformance.__main__ import main
assert "hypothesis" not in sys.modules and "omegaconf" not in sys.modules
sys.exit(main(["--candidate", "reference", "--scenarios", "1", "--json", ""]))
"""


def test_runs_without_hydra_or_wandb():
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m glm_mtp.conformance: error:") and "\n" not in err, err
    return err


@pytest.mark.parametrize("content", ['{"ops":', '{"x": 1}', '{"ops": 3}', '{"ops": [{"kind": "propose"}]}', "[1, 2]"])
def test_a_malformed_scenario_file_exits_2_with_one_line(tmp_path, capsys, content):
    path = tmp_path / "scenario.json"
    path.write_text(content)
    assert main(["--candidate", "reference", "--scenario-file", str(path), "--json", ""]) == 2
    assert str(path) in _one_line_error(capsys)


@pytest.mark.parametrize("max_drafts", ["200", "34"])
def test_max_drafts_past_what_the_generators_serve_exits_2(capsys, max_drafts):
    # max_seq_len 64: a state holds 96 rows, 33 are left after a 64-token prompt.
    assert main(["--candidate", "reference", "--scenarios", "2", "--max-drafts", max_drafts, "--json", ""]) == 2
    assert "--max-drafts must be <= 33" in _one_line_error(capsys)


def test_the_largest_max_drafts_runs():
    assert main(["--candidate", "reference", "--scenarios", "2", "--max-drafts", "33", "--json", ""]) == 0


@pytest.mark.parametrize("where", ["missing_dir", "a_directory"])
def test_an_unwritable_json_exits_2_before_running(tmp_path, capsys, where):
    path = tmp_path / "no" / "r.json" if where == "missing_dir" else tmp_path
    assert main(["--candidate", "reference", "--scenarios", "1", "--json", str(path)]) == 2
    assert "--json" in _one_line_error(capsys)
    assert "RESULT" not in capsys.readouterr().out  # nothing ran


def test_a_crash_exits_2_not_1(monkeypatch, capsys):
    """Exit 1 means a difference was found; a crash of the run is a 2 with one line."""
    import glm_mtp.conformance.runner as runner

    def crash(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(runner, "run", crash)
    assert main(["--candidate", "reference", "--scenarios", "1", "--json", ""]) == 2
    assert "RuntimeError: boom" in _one_line_error(capsys)


@pytest.mark.parametrize("argv", [["--world", "0"], ["--world", "-1"], ["--scenarios", "0"]])
def test_sharded_refuses_to_check_nothing(argv, capsys):
    from glm_mtp.conformance.sharded import main as sharded_main

    with pytest.raises(SystemExit) as e:
        sharded_main(argv)
    assert e.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


# The interpreted kernels through the CLI run in the default run with the glm5_next family
# (tests/conformance/test_next_family.py); this family's triton case with the slow sweep.
@pytest.mark.parametrize("kernels", [pytest.param("triton", marks=pytest.mark.slow), "torch"])
def test_kernels_choice_reaches_the_optimized_backend(kernels, tmp_path):
    """``--kernels`` picks the optimized backend's kernels (the Triton interpreter on CPU, or the
    torch twins) and the report names that backend, so its replay command runs it again."""
    out = tmp_path / "r.json"
    assert main(["--kernels", kernels, "--scenarios", "1", "--max-drafts", "2", "--max-seq-len", "24", "--seed", "5",
                 "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    want = "with_triton_kernels" if kernels == "triton" else "with_torch_twins"
    assert rep["ok"] is True and rep["candidate"].endswith(want), rep["candidate"]


@pytest.mark.parametrize("argv, match", [
    (["--dtype", "int8"], "--dtype must be one of"),
    (["--preset", "huge"], "--preset: unknown MtpConfig preset"),
    (["--device", "tpu"], "--device"),
    (["--scenario-file", "/nonexistent.json"], "--scenario-file /nonexistent.json is not a file"),
    (["--scenarios", "3", "--scenario-index", "5"], "--scenario-index must be < --scenarios (3)"),
])
def test_the_cli_checks_every_setting_before_building_weights(argv, match, capsys, monkeypatch):
    import glm_mtp.conformance.runner as runner

    monkeypatch.setattr(runner, "run", lambda *a, **k: pytest.fail("the run started"))
    assert main(argv + ["--json", ""]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, match", [
    (["--threads", "-1"], "argument --threads: must be in [0, 2147483647], got -1"),
    (["--seed", str(2**64)], "argument --seed: must be in [0, 9223372036854775807]"),
    (["--weights-seed", "x"], "argument --weights-seed: must be an integer in [0, "),
    (["--scenario-index", "-1"], "argument --scenario-index: must be >= 0, got -1"),
])
def test_a_number_outside_its_consumers_range_is_refused_by_argparse(argv, match, capsys, monkeypatch):
    import glm_mtp.conformance.runner as runner

    monkeypatch.setattr(runner, "run", lambda *a, **k: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as e:
        main(argv + ["--json", ""])
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_sharded_flags_are_checked_against_the_preset_before_spawning():
    """Drawn: 40 (--world, --row-parallel-o-proj) pairs per preset: accepted exactly when the
    world divides the preset's routed experts and, row-parallel, is a power of two."""
    import argparse
    import random

    from glm_mtp.conformance.sharded import settings_error
    from glm_mtp.reference import MtpConfig

    rng = random.Random(5)
    for preset in ("tiny", "glm5next_tiny", "small"):
        experts = MtpConfig.preset(preset).n_routed_experts
        for _ in range(40):
            world, row = rng.randint(1, 2 * experts), rng.random() < 0.5
            a = argparse.Namespace(preset=preset, world=world, row_parallel_o_proj=row, device="cpu")
            ok = experts % world == 0 and not (row and world & (world - 1))
            why = settings_error(a)
            assert (why is None) == ok, (preset, world, row, why)
            assert ok or ("--world" in why or "--row-parallel-o-proj" in why)
    bad = argparse.Namespace(preset="huge", world=1, row_parallel_o_proj=False, device="cpu")
    assert settings_error(bad).startswith("--preset: ")
