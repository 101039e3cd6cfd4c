"""The commands of README.md and docs/*.md (the lines of their ```bash blocks) run as written,
with small overrides that make them cheap; every command is either run here or skipped by name
with its reason, so a new command in the docs must be placed in one of the two lists.

The cheap ones run in order in one child process (each module run as ``__main__``, so torch,
Hydra and the checkpoints load once), in a temporary folder: ``T`` and ``D`` are the folders the
docs' own earlier commands write, ``<time>`` the run folder they made."""

import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
FENCE = re.compile(r"^```bash\n(.*?)^```$", re.S | re.M)
CHEAP = ["run.num_prompts=2", "run.max_new_tokens=8", "logger=none", "speedup.repeats=1"]
SHIPPED_NEXT = "src/glm_mtp/checkpoints/glm5next-mtp-stdlib"

# doc command -> the overrides that make it cheap, appended (in the order they run)
RUN = {
    "python -m glm_mtp.conformance --candidate optimized --baseline reference --device cpu --dtype bfloat16 "
    "--preset tiny --scenarios 300 --seed 7": ["--scenarios", "2"],
    "bash scripts/setup.sh && .venv/bin/python -m glm_mtp.experiments.acceptance": CHEAP,
    "python -m glm_mtp.experiments.acceptance grammar=regex \"grammar.pattern='[a-z ]*'\"": CHEAP,
    "python -m glm_mtp.experiments.record model.dtype=bfloat16 target_numerics=pinned trace.out=T":
        ["run.num_prompts=2", "run.max_new_tokens=8", "trace.cost_repeats=1", "logger=none"],
    "python -m glm_mtp.experiments.traces check T": [],
    f"python -m glm_mtp.experiments.traces drafter-only {SHIPPED_NEXT} D": [],
    "python -m glm_mtp.experiments.acceptance trace.path=T model.path=D model.dtype=bfloat16 num_drafts=3 "
    "policy=refeed": ["logger=none", "speedup.repeats=1"],
    # one job of the grid (the swept keys set on the command line), from the bf16 trace above
    "python -m glm_mtp.experiments.acceptance -m experiment=trace_grid trace.path=T":
        ["num_drafts=1", "policy=refeed", "model.index_share=true", "model.weights_dtype=plain", "speedup.repeats=1"],
    "python -m glm_mtp.experiments.traces grid-report multirun/trace-grid/<time>": [],
    # docs/traces.md's sampled trace: record at T = 1, replay with seeded exact match
    "python -m glm_mtp.experiments.record target_numerics=pinned temperature=1 top_p=0.95 seed=0 trace.out=TS":
        ["run.num_prompts=2", "run.max_new_tokens=8", "trace.cost_repeats=1", "logger=none"],
    "python -m glm_mtp.experiments.acceptance trace.path=TS verify=match temperature=1 top_p=0.95 seed=0 num_drafts=3":
        ["logger=none", "speedup.repeats=1"],
    # docs/finetune.md: record, tune, replay the tuned head (6 prompts, 2 steps)
    "python -m glm_mtp.experiments.record trace.out=TRACE run.num_prompts=64 trace.max_drafts=3 trace.cost_repeats=0":
        ["run.num_prompts=6", "run.max_new_tokens=8", "logger=none"],
    "python -m glm_mtp.experiments.finetune trace.path=TRACE finetune.out=OUT": ["finetune.steps=2", "logger=none"],
    "python -m glm_mtp.experiments.acceptance model.path=OUT trace.path=TRACE": ["logger=none", "speedup.repeats=1"],
    # docs/costs.md
    "python -m glm_mtp.experiments.costs list": [],
    "python -m glm_mtp.experiments.costs show glm53flash-m5max-ds4": [],
    "python -m glm_mtp.experiments.costs check": [],
}

# doc command -> why CI does not run it here
SKIP = {
    "bash scripts/setup.sh && .venv/bin/python -m pytest -q -n auto --dist loadfile": "the suite itself",
    "pip install 'glm-mtp[hf]'": "installs from the registry",
    "export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1": "sets the shell's environment for the bench",
    "python -m glm_mtp.conformance --generators batched --scenarios 50 --preset small --dtype float32 --json ''":
        "50 batched scenarios at small: minutes on 2 cores (tests/conformance covers batched lockstep)",
    "python -m glm_mtp.experiments.acceptance model=shipped logger=none model.dtype=bfloat16 speedup.costs=glm5 "
    "[model.weights_dtype=fp8]": "32 prompts twice (tests/experiments/test_fp8_acceptance.py runs fp8 acceptance)",
    "python -m glm_mtp.experiments.report DIR --pair weights_dtype": "reads the two runs above",
    "python -m glm_mtp.experiments.bench": "the CPU bench: minutes",
    "bash scripts/gpu_check.sh": "needs a GPU",
    "python -m glm_mtp.experiments.bench_batch": "the CPU batch bench: minutes",
    "python -m glm_mtp.experiments.bench_batch --device cuda --no-counters": "needs a GPU",
    "python -m glm_mtp.experiments.bench --presets tiny small --backends reference --drafts 3 --repeats 15 "
    "--copy-mib 64": "a timed bench: minutes",
    "python -m glm_mtp.experiments.bench --presets small --drafts 3 --repeats 5 --warmup 1 --copy-mib 64 "
    "--max-position-embeddings 131072 --max-seq-len 256": "a timed bench at long capacity",
    "python -m glm_mtp.experiments.bench --presets small --drafts 3 --repeats 5 --warmup 1 --copy-mib 64 "
    "--max-position-embeddings 131072 --max-seq-len 131072": "a timed bench at long capacity",
    "python -m glm_mtp.tools.audit [--arch sm_90] [--presets tiny small glm5]": "compiles every kernel to PTX",
    "python -m glm_mtp.experiments.acceptance model=hf model.path=DIR run.check_lossless=true":
        "needs a released-layout checkpoint (tests/experiments/targets/test_hf_target.py runs model=hf)",
    "python -m glm_mtp.experiments.acceptance model=hf model.path=DIR source=jsonl prompts.path=prompts.jsonl":
        "needs a released-layout checkpoint",
    "python -m glm_mtp.experiments.acceptance model=hf model.path=DIR source=text prompts.path=my_texts/ "
    "mode=teacher_forced": "needs a released-layout checkpoint",
    "python -m glm_mtp.experiments.acceptance model=hf model.path=/models/GLM-5.3-Flash model.device=auto "
    "model.dtype=bfloat16 backend=optimized source=jsonl prompts.path=prompts.jsonl run.num_prompts=64 "
    "run.max_new_tokens=256 num_drafts=3 speedup.costs=glm5 threads=8": "GLM-5.3-Flash on GPUs",
    "python -m glm_mtp.experiments.record model=hf model.path=CKPT model.dtype=bfloat16 source=jsonl "
    "prompts.path=P.jsonl trace.out=T": "needs a released-layout checkpoint",
    "python -m glm_mtp.experiments.traces drafter-only CKPT D": "needs a released-layout checkpoint",
    "python -m glm_mtp.experiments.finetune model=hf model.path=CKPT trace.path=TRACE finetune.out=OUT":
        ("needs a released-layout checkpoint (tests/experiments/test_finetune_hf.py tunes tiny ones of "
         "both families, tests/experiments/test_finetune.py package-layout ones)"),
    "torchrun --standalone --nproc_per_node=WORLD -m glm_mtp.experiments.finetune trace.path=TRACE finetune.out=OUT "
    "finetune.batch_size=B hydra.run.dir=RUN": "several processes (tests/experiments/training/test_finetune_ddp.py "
                                               "runs it at world 2 against world 1)",
}


def doc_commands() -> list[str]:
    """Every command line of the docs' ```bash blocks (``\\`` continuations joined, a comment
    after the command dropped)."""
    out = []
    for doc in DOCS:
        with open(os.path.join(REPO, doc)) as f:
            text = f.read()
        for block in FENCE.findall(text):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                out.append(" ".join(line.split(" #")[0].split()))
    return out


def test_every_doc_command_is_run_or_skipped_by_name():
    found = set(doc_commands())
    assert not set(RUN) & set(SKIP)
    assert found - set(RUN) - set(SKIP) == set(), "a new command in the docs: run it here or skip it with a reason"
    assert set(RUN) | set(SKIP) <= found, "a listed command is no longer in the docs"


def test_the_quoted_grammar_pattern_parses_and_the_bare_one_does_not():
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    (quoted,) = shlex.split("\"grammar.pattern='[a-z ]*'\"")
    assert parser.parse_overrides([quoted])[0].value() == "[a-z ]*"
    with pytest.raises(OverrideParseException):
        parser.parse_overrides(["grammar.pattern=[a-z ]*"])


DRIVER = r"""
import contextlib, glob, io, json, os, runpy, sys, traceback, warnings
warnings.simplefilter("ignore")
results = []
for argv in json.loads(sys.stdin.read()):
    argv = [a if "<time>" not in a else sorted(glob.glob(a.replace("<time>", "*")))[-1] for a in argv]
    sys.argv = list(argv)
    out, rc = io.StringIO(), None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            rc = "raised"
    results.append({"argv": argv, "rc": rc, "output": out.getvalue()[-3000:]})
print(json.dumps(results))
"""


def module_argv(command: str) -> list[str]:
    """``python -m M ARGS`` (or the README's ``bash scripts/setup.sh && .venv/bin/python -m M ARGS``,
    whose install CI has run) as ``[M, *ARGS]``, the paths the docs name from the repository."""
    command = command.split("&&")[-1].strip()
    words = shlex.split(command)
    assert words[0].endswith("python") and words[1] == "-m", command
    return [os.path.join(REPO, w) if w == SHIPPED_NEXT else w for w in words[2:]]


def test_the_cheap_doc_commands_run(tmp_path):
    jobs = [module_argv(c) + extra for c, extra in RUN.items()]
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(jobs), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in results:
        assert r["rc"] == 0, f"{' '.join(r['argv'])} exited {r['rc']}:\n{r['output']}"
    main_job = results[1]["output"]
    assert f"wrote {tmp_path}/outputs/acceptance/" in main_job  # the run says where it wrote
    # the log holds the printed lines (two runs in one second share a folder, so: some run's log)
    logs = [open(p).read() for p in glob.glob(str(tmp_path / "outputs" / "acceptance" / "*" / "acceptance.log"))]
    assert any("τ = " in log and "wrote " in log for log in logs)
    assert glob.glob(str(tmp_path / "outputs" / "conformance" / "*" / "conformance-report.json"))


def test_model_device_auto_without_accelerate_is_one_line_naming_the_extra(monkeypatch):
    from omegaconf import OmegaConf

    from glm_mtp.experiments.settings.validate import check_hf_model

    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate raises ImportError
    cfg = OmegaConf.create({"model": {"device": "auto", "topk_ties": "lower_index"}, "backend": {"name": "reference"}})
    with pytest.raises(ValueError) as e:
        check_hf_model(cfg, "vendor")
    assert str(e.value) == ("model.device=auto places the layers with accelerate, which is not installed: "
                            "pip install 'glm-mtp[hf]'")
