"""Every command checks its settings before it works (docs/engine.md, "Exit status"): the named
cases of each measuring CLI and experiment entry point, run through their real entry points
(``python -m ...``): exit status 2, the last line of stderr is one ``<prog>: error:`` line naming
the flag, setting or file and the rule, no traceback, and no output folder left behind.

The argparse commands run in one child process (``DRIVER`` runs each module as ``__main__``, so
torch is imported once); the Hydra entry points and the audit (whose kernels must not be
interpreted) run in their own processes, all started together."""

import json
import os
import subprocess
import sys

import pytest

DRIVER = r"""
import contextlib, io, json, os, runpy, sys, traceback, warnings
warnings.simplefilter("ignore")
results = []
for case in json.loads(sys.stdin.read()):
    os.chdir(case["cwd"])
    sys.argv = [case["module"], *case["argv"]]
    err, rc = io.StringIO(), None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            rc = "raised"
    results.append({"rc": rc, "stderr": err.getvalue()})
print(json.dumps(results))
"""

SUMMARY = {"mode": "speculative", "source": "heldout", "backend": "reference", "feed_hidden": "post_norm",
           "policy": "first_row_kept",
           "temperature": 0.0, "num_drafts": 2, "prompts": 2, "acceptance_per_position": [0.5, 0.25],
           "mean_accepted_length": 1.75,
           "generated_tokens": 32}

# name -> (module, argv, words the error line must hold, what must not exist afterwards (relative to the case's folder))
ARGPARSE = {
    "counters dtype int8": ("glm_mtp.tools.counters", ["--dtype", "int8"], ["--dtype", "int8"], []),
    "counters max-position-embeddings 0": ("glm_mtp.tools.counters", ["--max-position-embeddings", "0"],
                                           ["--max-position-embeddings", "positive integer"], []),
    "counters fp8 in float16": ("glm_mtp.tools.counters", ["--dtype", "float16", "--weights", "fp8"],
                                ["--weights fp8 --dtype float16", "fused step"], []),
    "counters context past the capacity": ("glm_mtp.tools.counters", ["--context", "600", "--max-seq-len", "1024"],
                                           ["--context 600", "max_position_embeddings 512"], []),
    "counters batched context past the capacity": ("glm_mtp.tools.counters",
                                                   ["--batch", "4", "--context", "500", "--max-seq-len", "1024"],
                                                   ["--context 500", "513 rows"], []),
    "bench context past a preset's cap": ("glm_mtp.experiments.bench",
                                          ["--presets", "tiny", "--context", "600", "--max-seq-len", "1024", "--out",
                                           "bench-out"],
                                          ["--context 600", "preset tiny", "max_position_embeddings 512"],
                                          ["bench-out"]),
    "report not JSON": ("glm_mtp.experiments.report", ["sweep"], ["summary.json", "not valid JSON"],
                        ["sweep/report.md"]),
    "report another tool's JSON": ("glm_mtp.experiments.report", ["sweep"],
                                   ["summary.json", "not an acceptance run's summary"],
                                   ["sweep/report.md"]),
    "report a string for a number": ("glm_mtp.experiments.report", ["sweep"], ["summary.json", "num_drafts must be an "
                                                                                               "integer"],
                                     ["sweep/report.md"]),
    "conformance max-seq-len 1": ("glm_mtp.conformance", ["--max-seq-len", "1", "--json", "report.json"],
                                  ["--max-seq-len", ">= 2"],
                                  ["report.json"]),
}
SUMMARY_FILES = {"report not JSON": "{not json", "report another tool's JSON": json.dumps({"launches_per_draft": 22}),
                 "report a string for a number": json.dumps({**SUMMARY, "num_drafts": "2"})}

# Each its own process: the Hydra apps (one app per process), and the audit (compiled kernels).
PROCESSES = {
    "acceptance fp8 on the optimized drafter in float64": (
        "glm_mtp.experiments.acceptance", ["model=tiny_random", "backend=optimized", "model.weights_dtype=fp8"],
        ["model.weights_dtype=fp8", "model.dtype"], ["outputs"]),
    "a sweep with a bad later job": (
        "glm_mtp.experiments.acceptance", ["-m", "experiment=sparse_smoke", "model.preset=tiny"],
        ["job 2 of the sweep", "attention=dense"], ["multirun"]),
    "train seq_len 2 at depth 2": (
        "glm_mtp.experiments.train", ["training=next_stdlib", "train.seq_len=2", "logger=none"],
        ["train.seq_len must be > train.mtp_depth"], ["outputs"]),
    "train a tokenizer size it cannot honour": (
        "glm_mtp.experiments.train", ["training=next_stdlib", "tokenizer.vocab_size=4096", "logger=none"],
        ["tokenizer.vocab_size must be 2048", "tokenizer.path=shipped"], ["outputs"]),
    "step_tables an unknown table": ("glm_mtp.tools.step_tables", ["--tables", "fused,bogus"],
                                     ["--tables", "fused, next, sharing", "'fused,bogus'"], []),
    "audit an architecture LLVM does not know": (
        "glm_mtp.tools.audit", ["--arch", "sm_999", "--presets", "tiny"],
        ["--arch sm_999", "not a recognized processor"], []),
}


def child_env(interpret: bool) -> dict:
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "0"}
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case's (exit status, stderr, folder), all run at once."""
    folders = {name: tmp_path_factory.mktemp("case") for name in (*ARGPARSE, *PROCESSES)}
    for name, body in SUMMARY_FILES.items():
        (folders[name] / "sweep" / "0").mkdir(parents=True)
        (folders[name] / "sweep" / "0" / "summary.json").write_text(body)
    started = {name: subprocess.Popen([sys.executable, "-m", module, *argv], cwd=folders[name],
                                      stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True,
                                      env=child_env(interpret=module != "glm_mtp.tools.audit"))
               for name, (module, argv, _, _) in PROCESSES.items()}
    cases = [{"module": module, "argv": argv, "cwd": str(folders[name])}
             for name, (module, argv, _, _) in ARGPARSE.items()]
    driver = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(cases), capture_output=True, text=True,
                            env=child_env(interpret=True), timeout=600)
    assert driver.returncode == 0, driver.stderr
    results = {name: (r["rc"], r["stderr"], folders[name]) for name, r in zip(ARGPARSE, json.loads(driver.stdout))}
    for name, proc in started.items():
        _, err = proc.communicate(timeout=600)
        results[name] = (proc.returncode, err, folders[name])
    return results


@pytest.mark.parametrize("name", [*ARGPARSE, *PROCESSES])
def test_a_command_refuses_before_it_works(outcomes, name):
    module, _, words, left = {**ARGPARSE, **PROCESSES}[name]
    rc, err, folder = outcomes[name]
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, f"{name}: exit status {rc}\n{err}"
    assert "Traceback" not in err and lines, err
    prog = "python -m " + module
    assert lines[-1].startswith(f"{prog}: error: "), lines[-1]
    for word in words:
        assert word in lines[-1], f"{name}: {word!r} not in {lines[-1]!r}"
    for path in left:
        assert not (folder / path).exists(), f"{name} left {path}"
    made = {p.name for p in folder.iterdir()} - {"sweep"}
    assert not made, f"{name} left {made} in its working folder"
