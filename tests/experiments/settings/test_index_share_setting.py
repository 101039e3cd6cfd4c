"""``model.index_share=null|true|false``: the acceptance experiment drafts with the checkpoint's
index sharing (DESIGN.md §9) or the override, and records which in summary.json and W&B (``test_entrypoints``'s
W&B run checks the record)."""

import pytest
from hydra import compose, initialize_config_module

from glm_mtp.experiments.acceptance_job.run import run as run_acceptance
from glm_mtp.experiments.settings import validate
from glm_mtp.experiments.settings.model import load_model


def config(overrides):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose("config", overrides=overrides)


COMMON = ["model=tiny_random", "experiment=smoke", "run.max_new_tokens=6", "run.num_prompts=1", "speedup.costs=glm5",
          "num_drafts=3"]


@pytest.mark.parametrize("preset,setting,drafts_with", [("tiny", None, False), ("tiny", True, True),
                                                        ("glm5next_tiny", None, True), ("glm5next_tiny", False, False)])
def test_the_drafter_follows_the_setting(preset, setting, drafts_with):
    over = [f"model.preset={preset}"] + ([] if setting is None else [f"model.index_share={str(setting).lower()}"])
    model = load_model(config(COMMON + over).model)
    assert model.mtp.config.index_share_for_mtp_iteration is drafts_with
    assert model.target.config.num_hidden_layers >= 1  # the target is untouched: sharing is the drafter's


def test_bad_setting_is_refused_before_work(tmp_path):
    match = "model.index_share must be true, false or null"
    with pytest.raises(ValueError, match=match):
        validate.check_acceptance(config(COMMON + ["model.index_share=yes"]))
    with pytest.raises(ValueError, match=match):
        run_acceptance(config(COMMON + ["logger=none", "model.index_share=2"]), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
