"""The Hydra layout: one root config per entry point, experiment files as ``_global_`` overrides
selected by one ``experiment=NAME`` that win over every root's own values, run directories set
once (conf/hydra/default.yaml) and named by each root's task_name."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

import glm_mtp.conf

CONF = Path(glm_mtp.conf.__file__).parent


def config(name, overrides=(), hydra_cfg=False):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose(name, overrides=list(overrides), return_hydra_config=hydra_cfg)


@pytest.mark.parametrize("root, task", [("config", "acceptance"), ("train", "train"), ("grid", "grid")])
def test_each_root_names_its_run_directories(root, task):
    c = config(root, hydra_cfg=True)
    assert c.task_name == task
    assert c.hydra.run.dir.startswith(f"outputs/{task}/") and c.hydra.sweep.dir.startswith(f"multirun/{task}/")
    assert c.hydra.job.chdir is False and c.hydra.runtime.choices["hydra/launcher"] == "basic"
    # Set once: no root config states its own run directory.
    assert "dir:" not in (CONF / f"{root}.yaml").read_text()


def test_every_experiment_file_is_a_global_override():
    files = sorted((CONF / "experiment").glob("*.yaml"))
    assert {f.stem for f in files} >= {"smoke", "results", "temperature1", "grid_smoke"}
    for f in files:
        assert f.read_text().startswith("# @package _global_\n"), f


def test_the_readme_and_test_overrides_still_compose():
    # no override: the README's first command, on the glm5_next toy (the production drafter's family)
    c = config("config")
    assert c.run.num_prompts == 32 and c.model.kind == "checkpoint" and c.logger.name == "wandb"
    assert c.mode == "speculative"
    assert c.model.shipped == "glm5next-mtp-stdlib" and c.model.path is None and c.model.index_share is None
    assert config("config", ["model=shipped"]).model.get("shipped") is None  # model=shipped: the GLM-5 checkpoint
    for name in ("results", "temperature1", "speedup"):  # RESULTS' GLM-5 tables keep their model
        assert config("config", [f"experiment={name}"]).model.get("shipped") is None, name
    c = config("config", ["model=tiny_random", "experiment=smoke", "num_drafts=2", "policy=refeed", "logger=none"])
    assert c.run.num_prompts == 2 and c.run.check_lossless is True and c.model.kind == "random" and c.num_drafts == 2
    c = config("config", ["experiment=smoke", "run.num_prompts=5", "mode=teacher_forced", "source=ood"])
    assert c.run.num_prompts == 5 and c.run.prompt_tokens == 12
    c = config("train", ["out=/tmp/x", "train.steps=3", "arch.hidden_size=32", "tokenizer.limit_items=4"])
    assert c.train.steps == 3 and c.arch.hidden_size == 32 and c.train.mtp_depth == 2 and c.train.base is None


def test_one_override_selects_a_whole_sweep():
    c = config("config", ["experiment=results"], hydra_cfg=True)
    assert dict(c.hydra.sweeper.params) == {"mode": "speculative,teacher_forced", "source": "heldout,ood",
                                            "policy": "first_row_kept,refeed"}
    assert c.hydra.sweep.dir == "multirun/results" and c.logger.name == "none"
    c = config("config", ["experiment=temperature1"], hydra_cfg=True)
    assert c.temperature == 1.0 and c.hydra.sweep.dir == "multirun/results-t1"


def test_an_experiment_wins_over_the_root_it_extends():
    # The grid root sets its own training values over conf/training/stdlib.yaml; an experiment
    # file comes after both (a root that put it earlier would silently lose its values).
    g = config("grid")
    assert g.train.steps == 60 and g.train.base == "shipped" and g.logger.name == "none"
    s = config("grid", ["experiment=grid_smoke"], hydra_cfg=True)
    assert s.train.steps == 2 and s.tokenizer.limit_items == 6 and "experiment=smoke" in s.eval.common
    assert s.train.base == "shipped" and s.arch == g.arch  # what the experiment does not name stays
    assert dict(s.hydra.sweeper.params) == {"train.mtp_depth": "1,2", "train.mtp_distill": "0.0,0.5"}
    # The training root and the grid start from the same training settings.
    t = config("train")
    assert t.arch == g.arch and t.tokenizer == g.tokenizer and t.train.lr == g.train.lr
