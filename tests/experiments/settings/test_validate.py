"""The entry points' settings are checked before any work: one clear line, exit status 2, and no
run directory left behind (experiments/settings/validate.py)."""

import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module

from glm_mtp.experiments.settings import validate


def config(name, overrides=()):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose(name, overrides=list(overrides))


def test_the_shipped_configs_pass():
    validate.check_acceptance(config("config"))
    validate.check_acceptance(config("config",
                                     ["model=tiny_random", "experiment=smoke", "logger=none", "temperature=1"]))
    validate.check_acceptance(config("config", ["temperature=0.5", "draft=sampled", "target_numerics=pinned"]))
    validate.check_train(config("train"))


@pytest.mark.parametrize("override, key", [
    ("mode=bogus", "mode"),
    ("source=web", "source"),
    ("num_drafts=-1", "num_drafts"),
    ("num_drafts=0", "num_drafts"),
    ("num_drafts=2.5", "num_drafts"),
    ("policy=bogus", "policy"),
    ("temperature=nan", "temperature"),
    ("temperature=-1", "temperature"),
    ("temperature=inf", "temperature"),
    ("feed_hidden=mid", "feed_hidden"),
    ("draft=topk", "draft"),
    ("draft=sampled", "draft"),  # at the default temperature 0
    ("target_numerics=fast", "target_numerics"),
    ("threads=0", "threads"),
    ("model.max_seq_len=0", "model.max_seq_len"),
    ("model.dtype=int8", "model.dtype"),
    ("run.num_prompts=0", "run.num_prompts"),
    ("run.check_lossless=maybe", "run.check_lossless"),
    ("+backend.name=fast", "backend.name"),
    ("speedup.costs=fast", "speedup.costs"),
    ("speedup.repeats=0", "speedup.repeats"),
    ("seed=18446744073709551616", "seed"),
    ("seed=-1", "seed"),
    ("threads=2147483648", "threads"),
])
def test_a_bad_acceptance_value_names_its_key(override, key):
    if override.startswith("+backend"):
        cfg = config("config")
        cfg.backend.name = "fast"
    else:
        cfg = config("config", [override])
    with pytest.raises(ValueError, match=f"^{key} must"):
        validate.check_acceptance(cfg)


@pytest.mark.parametrize("override, key", [
    ("train.steps=-1", "train.steps"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.lr=0", "train.lr"),
    ("train.lr=nan", "train.lr"),
    ("train.max_minutes=-1", "train.max_minutes"),
    ("train.mtp_distill=2", "train.mtp_distill"),
    ("tokenizer.vocab_size=0", "tokenizer.vocab_size"),
    ("train.base=/nonexistent", "train.base"),
    ("train.seed=18446744073709551616", "train.seed"),
    ("train.threads=2147483648", "train.threads"),
])
def test_a_bad_train_value_names_its_key(override, key):
    with pytest.raises(ValueError, match=f"^{key} must"):
        validate.check_train(config("train", [override]))


@pytest.mark.parametrize("override, key", [
    ("eval.feed_prompts=0", "eval.feed_prompts"),
    ("eval.common=x", "eval.common"),
    ("eval.runs.teacher_forced=x", "eval.runs.teacher_forced"),
    ("train.steps=0", "train.steps"),
])
def test_a_bad_grid_value_names_its_key(override, key):
    validate.check_grid(config("grid"))
    with pytest.raises(ValueError, match=f"^{key} must"):
        validate.check_grid(config("grid", [override]))


def test_dtype_names_are_registry_names():
    from glm_mtp.registry import DTYPES

    assert set(validate.MODEL_DTYPES) <= set(DTYPES)


def run_module(module, *overrides, cwd):
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", module, *overrides], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.parametrize("override", ["num_drafts=-1", "policy=bogus", "temperature=nan"])
def test_acceptance_refuses_a_bad_override_with_one_line_and_no_run_dir(tmp_path, override):
    run_dir = tmp_path / "run"
    proc = run_module("glm_mtp.experiments.acceptance", override, "logger=none", f"hydra.run.dir={run_dir}",
                      cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("python -m glm_mtp.experiments.acceptance: error: ") and "\n" not in err, err
    assert override.split("=")[0] in err
    assert not run_dir.exists()


def test_train_refuses_bad_steps_before_setup(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_module("glm_mtp.experiments.train", "train.steps=-1", "logger=none", "tokenizer.limit_items=4",
                      "tokenizer.vocab_size=300", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "python -m glm_mtp.experiments.train: error: train.steps must be >= 1, got -1"
    assert proc.stdout == "" and not run_dir.exists()  # no corpus, no model: nothing ran


def test_unwritable_dir(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("")
    assert validate.unwritable_dir(str(tmp_path / "a" / "b")) is None
    assert "not a directory" in validate.unwritable_dir(str(blocker))
    assert "not a directory" in validate.unwritable_dir(str(blocker / "sub"))


def test_exit_on_bad_config_removes_only_what_hydra_wrote(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("x: 1")
    (run_dir / "acceptance.log").write_text("")
    with pytest.raises(SystemExit) as e:
        validate.exit_on_bad_config(validate.check_acceptance, config("config", ["num_drafts=0"]), str(run_dir), "prog")
    assert e.value.code == 2 and not run_dir.exists()
    assert capsys.readouterr().err == "prog: error: num_drafts must be >= 1, got 0\n"
    # A folder holding anything else is left as it is.
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / "summary.json").write_text("{}")
    with pytest.raises(SystemExit):
        validate.exit_on_bad_config(validate.check_acceptance, config("config", ["policy=x"]), str(run_dir), "prog")
    assert sorted(os.listdir(run_dir)) == ["summary.json"]


# ---- settings whose rule needs another setting or a file: checked before any work ---------------


GRAMMAR_SAMPLING = r"^grammar=regex runs greedy or verify=rejection without top_p / top_k"


@pytest.mark.parametrize("overrides, match", [
    (["model=shipped", "num_drafts=100000"],
     r"^num_drafts must fit model.max_seq_len: .* = 100113 exceeds model.max_seq_len=256"),
    (["model=shipped", "run.prompt_tokens=250"], r"^num_drafts must fit model.max_seq_len"),
    (["model=tiny_random", "num_drafts=100", "experiment=smoke"], r"^num_drafts must fit model.max_seq_len"),
    (["model.path=/nonexistent/ckpt"], r"^model.path must be a checkpoint directory .*does not exist"),
    (["model=tiny_random", "model.preset=huge"], r"^model.preset must be a preset name"),
    (["draft=sampled", "temperature=1e-45"], r"^temperature must suit draft=sampled: .*too small"),
    (["draft=sampled", "temperature=1e39"], r"^temperature must suit draft=sampled"),
    (["grammar=regex", "grammar.pattern=abc", "temperature=1", "verify=match"], GRAMMAR_SAMPLING),
    (["grammar=regex", "grammar.pattern=abc", "temperature=1", "top_k=5"], GRAMMAR_SAMPLING),
])
def test_a_setting_that_breaks_another_or_a_file_is_refused_up_front(overrides, match):
    with pytest.raises(ValueError, match=match):
        validate.check_acceptance(config("config", overrides))


def test_model_path_that_is_a_file_and_a_costs_file_that_is_not_json(tmp_path):
    f = tmp_path / "f.txt"
    f.write_text("not json")
    with pytest.raises(ValueError, match="^model.path must be a checkpoint directory .*is not a directory"):
        validate.check_acceptance(config("config", [f"model.path={f}"]))
    with pytest.raises(ValueError, match=r"^speedup.costs: .*f.txt: not valid JSON"):
        validate.check_acceptance(config("config", [f"speedup.costs={f}"]))
    f.write_text('{"c": 0.1, "v": [0.0]}')
    with pytest.raises(ValueError, match=r"^speedup.costs: .*holds v for k <= 1, fewer than num_drafts = 3"):
        validate.check_acceptance(config("config", [f"speedup.costs={f}"]))
    f.write_text('{"c": 0.1, "v": [0.0, 0.01, 0.02]}')
    validate.check_acceptance(config("config", [f"speedup.costs={f}"]))


@pytest.mark.parametrize("override, match", [
    ("arch.hidden_size=-4", r"^arch must describe a valid model"),
    ("+arch.bogus=1", r"^arch.bogus must be a field of MtpConfig"),
    ("train.seq_len=300", r"^train.seq_len must be <= arch.index_topk"),
])
def test_a_bad_arch_is_refused_before_training(override, match):
    with pytest.raises(ValueError, match=match):
        validate.check_train(config("train", [override]))


def test_train_out_must_be_a_place_a_checkpoint_can_go(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("keep")
    for out, match in ((f, "exists and is not a folder"), (full, "not empty and holds no checkpoint")):
        with pytest.raises(ValueError, match=f"^out must be a new folder.*{match}"):
            validate.check_train(config("train", [f"out={out}"]))
    validate.check_train(config("train", [f"out={tmp_path / 'new'}"]))


@pytest.mark.parametrize("argv", [["num_drafts=100000"], ["model.path=/nonexistent/ckpt"]])
def test_acceptance_cli_refuses_a_run_that_cannot_fit_with_one_line_and_no_run_dir(tmp_path, argv):
    run_dir = tmp_path / "run"
    proc = run_module("glm_mtp.experiments.acceptance", *argv, "logger=none", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("python -m glm_mtp.experiments.acceptance: error: ") and "\n" not in err, err
    assert not run_dir.exists()


def test_train_cli_refuses_an_existing_file_as_out_before_training(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "taken"
    out.write_text("x")
    proc = run_module("glm_mtp.experiments.train", f"out={out}", "logger=none", "tokenizer.limit_items=4",
                      "tokenizer.vocab_size=300", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().startswith("python -m glm_mtp.experiments.train: error: out must be a new folder")
    assert proc.stdout == "" and not run_dir.exists() and out.read_text() == "x"
