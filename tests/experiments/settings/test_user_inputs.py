"""A user's files and settings are checked before any model loads, and nothing measured is lost
(docs/engine.md, "Every command refuses before it works"): the named cases of the hostile pass
over prompts files and ``model=hf`` checkpoints, drawn damaged prompts files and checkpoints,
and a failure forced after the loop."""

import json
import random

import pytest

pytest.importorskip("transformers")

from hydra import compose, initialize_config_module  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from glm_mtp.experiments.acceptance_job import run as job  # noqa: E402
from glm_mtp.experiments.reporting.measured import MEASURED_FILE, LateFailure, read_measured  # noqa: E402
from glm_mtp.experiments.settings import validate  # noqa: E402

from ..hf_checkpoints import write_hf_checkpoint  # noqa: E402

SMALL = ["logger=none", "num_drafts=2", "run.num_prompts=2", "run.max_new_tokens=4", "speedup.costs=glm5"]


def config(overrides):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.fixture(scope="module")
def dsa(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dsa") / "ck"
    write_hf_checkpoint(directory, "glm_moe_dsa")
    return directory


def copy_checkpoint(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def drop_tensor(directory, name, from_index):
    """Remove tensor ``name`` from its shard (a truncated download), and from the index too
    when ``from_index``."""
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = directory / index["weight_map"][name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    if from_index:
        del index["weight_map"][name]
        index_file.write_text(json.dumps(index))


def target_tensors(directory):
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    layers = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
    return sorted(n for n in index if f".layers.{layers}." not in n)


# ---- the three named cases ------------------------------------------------------------------


def test_a_checkpoint_missing_one_target_tensor_is_refused_by_name(dsa, tmp_path):
    """A release checkpoint with one target tensor missing was measured against a target that
    transformers filled with random values, and the run exited 0."""
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    broken = copy_checkpoint(dsa, tmp_path / "ck")
    drop_tensor(broken, name, from_index=True)
    with pytest.raises(ValueError, match=f"^model.path: the target's tensor '{name}' .* is not in the checkpoint"):
        validate.check_acceptance(config(SMALL + ["model=hf", f"model.path={broken}"]))


def test_a_one_character_first_prompt_is_refused_before_the_model_loads(dsa, tmp_path):
    """A prompts file whose first prompt is one character ran the whole loop, then died in the
    summary step (the speedup model's costs need two tokens) with a traceback and no summary."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "x"}) + "\n" + json.dumps({"prompt": "hello there"}) + "\n")
    with pytest.raises(ValueError, match=r"^prompts.path: .*p.jsonl: prompt 0 holds 1 token\(s\), fewer than 2"):
        validate.check_acceptance(config(SMALL + ["model=hf", f"model.path={dsa}", "source=jsonl",
                                                  f"prompts.path={path}"]))


def test_model_dtype_float64_runs_the_hf_target(dsa, tmp_path):
    """model.dtype=float64, which docs/hf_target.md lists, died inside transformers' MoE (its
    grouped matmul takes no float64): the target runs its eager experts in float64."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "def f(x):"}) + "\n" + json.dumps({"prompt": "import os"}) + "\n")
    cfg = config(SMALL + ["model=hf", f"model.path={dsa}", "model.dtype=float64", "source=jsonl",
                          f"prompts.path={path}"])
    validate.check_acceptance(cfg)
    s = job.run(cfg, str(tmp_path / "run"))
    assert s["target"]["dtype"] == "float64" and s["prompts"] == 2 and s["generated_tokens"] == 8


def test_a_model_type_without_a_transformers_target_is_refused(dsa, tmp_path):
    """deepseek_v32: a drafter the package reads (MtpConfig takes it), but no target class here."""
    broken = copy_checkpoint(dsa, tmp_path / "ck")
    config_file = broken / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_type": "deepseek_v32"}))
    with pytest.raises(ValueError, match="^model.path: model_type must be glm5_next or glm_moe_dsa for model=hf"):
        validate.check_acceptance(config(SMALL + ["model=hf", f"model.path={broken}"]))


def test_a_device_the_target_cannot_run_on_is_refused(dsa):
    import torch

    cfg = config(SMALL + ["model=hf", f"model.path={dsa}", "model.device=cuda"])
    if torch.cuda.is_available():
        validate.check_acceptance(cfg)
    else:
        with pytest.raises(ValueError, match="^model.device=cuda runs the target on a GPU, but CUDA is not available"):
            validate.check_acceptance(cfg)


# ---- drawn damaged checkpoints ----------------------------------------------------------------


def test_any_missing_target_tensor_is_refused_by_name(dsa, tmp_path):
    """Drawn: 6 target tensors, each removed from its shard alone (the index still naming it, or
    not): the refusal names that tensor or the shard that lacks it."""
    names = target_tensors(dsa)
    rng = random.Random(45)
    for i, name in enumerate(rng.sample(names, 6)):
        broken = copy_checkpoint(dsa, tmp_path / f"ck{i}")
        from_index = bool(i % 2)
        drop_tensor(broken, name, from_index)
        with pytest.raises(ValueError) as e:
            validate.check_acceptance(config(SMALL + ["model=hf", f"model.path={broken}"]))
        assert str(e.value).startswith("model.path: ") and name in str(e.value) and "\n" not in str(e.value)


# ---- drawn damaged prompts files ------------------------------------------------------------


def damaged_jsonl(rng):
    """A JSONL prompts file with one damaged line among good ones, and the words its refusal holds."""
    good = [json.dumps({"prompt": "".join(rng.choice("abcdef ") for _ in range(rng.randint(3, 20)))})
            for _ in range(rng.randint(0, 2))]
    kind = rng.choice(["not json", "one char", "bad utf-8", "empty prompt", "too long", "no key"])
    bad = {"not json": (b"{oops", "not a JSON object"),
           "one char": (json.dumps({"prompt": rng.choice("xyz")}).encode(), "fewer than 2"),
           "bad utf-8": (b'{"prompt": "\xff\xfe"}', "not UTF-8"),
           "empty prompt": (b'{"prompt": ""}', "non-empty text"),
           "too long": (json.dumps({"prompt": "a" * 5000}).encode(), "exceeds model.max_seq_len"),
           "no key": (b'{"text": "abc"}', 'either "prompt"')}[kind]
    return b"\n".join([g.encode() for g in good] + [bad[0]]) + b"\n", bad[1], len(good) + 1


def test_drawn_damaged_prompts_files_are_refused_naming_the_line(dsa, tmp_path):
    """Drawn: 12 JSONL files, each with one damaged line after 0 to 2 good ones: refused naming
    the file and the line (or the prompt), before any model loads."""
    rng = random.Random(7)
    for i in range(12):
        body, words, line = damaged_jsonl(rng)
        path = tmp_path / f"p{i}.jsonl"
        path.write_bytes(body)
        cfg = config(SMALL + ["model=hf", f"model.path={dsa}", "source=jsonl", f"prompts.path={path}",
                              "run.num_prompts=5", "model.max_seq_len=64"])
        with pytest.raises(ValueError) as e:
            validate.check_acceptance(cfg)
        message = str(e.value)
        assert str(path) in message and words in message, (body, message)
        assert f"{path}:{line}:" in message or f"prompt {line - 1}" in message, (body, message)


@pytest.mark.parametrize("overrides, words", [
    (["prompts.path=pyproject.toml"], "source=heldout reads no file and would ignore"),
    (["model=tiny_random", "source=jsonl", "prompts.path=pyproject.toml"], "this model has none"),
])
def test_a_prompts_setting_the_run_would_ignore_or_cannot_read_is_refused(overrides, words):
    with pytest.raises(ValueError, match=words):
        validate.check_acceptance(config(["logger=none", *overrides]))


def test_a_text_file_that_is_not_utf8_or_too_short_for_a_window(dsa, tmp_path):
    for body, words in ((b"caf\xe9 " * 40, r"is not UTF-8 text \(byte 3"), (b"short", "fewer than prompt_tokens")):
        path = tmp_path / "t.txt"
        path.write_bytes(body)
        with pytest.raises(ValueError, match=words):
            validate.check_acceptance(config(SMALL + ["model=hf", f"model.path={dsa}", "source=text",
                                                      f"prompts.path={path}", "run.prompt_tokens=8"]))


# ---- nothing measured is lost -----------------------------------------------------------------


def test_a_failure_after_the_loop_keeps_the_counts_and_is_one_line(monkeypatch, tmp_path):
    """The summary step forced to fail after the loop: the per-prompt counts are on disk, equal
    to what the run measured, and the failure is one line naming the file."""
    cfg = config(["model=tiny_random", "experiment=smoke", "logger=none", "run.num_prompts=3", "speedup.repeats=1"])
    validate.check_acceptance(cfg)
    measured = {}

    def failing_summary(cfg, m):
        measured["counts"] = [(s.reached, s.accepted, s.steps) for s in m.per_prompt]
        raise KeyError("speedup")

    monkeypatch.setattr(job, "summarise", failing_summary)  # the name the job calls
    run_dir = tmp_path / "run"
    with pytest.raises(LateFailure) as e:
        job.run(cfg, str(run_dir))
    message = str(e.value)
    assert "\n" not in message and f"{run_dir / MEASURED_FILE}" in message and "after 3 prompt(s)" in message
    records = read_measured(str(run_dir / MEASURED_FILE))
    assert [(r["reached"], r["accepted"], r["steps"]) for r in records] == measured["counts"]
    assert [r["prompt"] for r in records] == [0, 1, 2]


LATE_FAILURE_DRIVER = """
import sys
from glm_mtp.experiments import acceptance
from glm_mtp.experiments.acceptance_job import run as job

def failing_summary(cfg, m):
    raise KeyError("speedup")

job.summarise = failing_summary
sys.argv = ["acceptance", *sys.argv[1:]]
acceptance.main()
"""


def test_a_late_failure_through_the_entry_point_is_one_line_and_exit_1(tmp_path):
    """The entry point with its summary step forced to fail: exit status 1, the last line of
    stderr one ``error:`` line naming measured.jsonl, no traceback; the counts are on disk."""
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[3] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
           "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run([sys.executable, "-c", LATE_FAILURE_DRIVER, "model=tiny_random", "experiment=smoke",
                           "logger=none", "speedup.repeats=1", f"hydra.run.dir={run_dir}"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and lines, proc.stderr
    assert lines[-1].startswith("python -m glm_mtp.experiments.acceptance: error: the summary failed after 2 prompt(s)")
    assert str(run_dir / MEASURED_FILE) in lines[-1]
    assert len(read_measured(str(run_dir / MEASURED_FILE))) == 2


# ---- drawn damaged checkpoints of the package's own layout ------------------------------------


def damage(file, rng):
    """One drawn damage of a checkpoint's single tensors file; returns what it did."""
    import torch

    kind = rng.choice(["truncate", "int dtype", "drop mtp", "drop target", "nan"])
    if kind == "truncate":
        size = file.stat().st_size
        with open(file, "r+b") as f:
            f.truncate(rng.randint(1, size - 1))
        return kind
    tensors = load_file(file)
    layers = json.loads((file.parent / "config.json").read_text())["num_hidden_layers"]
    mtp = sorted(n for n in tensors if f".layers.{layers}." in n and tensors[n].dim() == 2)
    target = sorted(n for n in tensors if ".layers." in n and f".layers.{layers}." not in n)
    name = rng.choice(target if kind == "drop target" else mtp)
    if kind == "int dtype":
        tensors[name] = tensors[name].to(torch.int32)
    elif kind == "nan":
        flat = tensors[name].clone().reshape(-1)
        flat[rng.randrange(flat.numel())] = float("nan")
        tensors[name] = flat.reshape(tensors[name].shape)
    else:
        del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
    return f"{kind} {name}"


def test_drawn_damaged_checkpoints_are_refused_as_the_api_refuses_them(tmp_path):
    """Drawn: 10 copies of the shipped checkpoint, each damaged once (truncated at a random
    byte, a drafter matrix stored as int32 or holding a NaN, a drafter or target tensor
    removed): every command's check refuses it in one line after the setting's name."""
    import shutil

    from glm_mtp.experiments.targets.checkpoint import check_checkpoint_loads, shipped_checkpoint

    rng = random.Random(3)
    kinds = set()
    for i in range(10):
        directory = tmp_path / f"ck{i}"
        shutil.copytree(shipped_checkpoint(), directory)
        what = damage(directory / "model.safetensors", rng)
        kinds.add(what.rsplit(" ", 1)[0] if what != "truncate" else what)
        with pytest.raises(ValueError) as e:
            check_checkpoint_loads("model.path", str(directory), "float32", package_target=True)
        assert str(e.value).startswith("model.path: ") and "\n" not in str(e.value), (what, str(e.value))
    assert len(kinds) >= 4, kinds  # the draws cover most kinds of damage
