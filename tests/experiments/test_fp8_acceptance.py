"""``model.weights_dtype=fp8``: the acceptance experiment drafts with the drafter's DESIGN §8
matrices block-scaled (``MtpWeights.quantize_fp8``), and report.py pairs it with the plain run."""

import pytest
from hydra import compose, initialize_config_module

from glm_mtp.experiments import report
from glm_mtp.experiments.acceptance_job.run import run as run_acceptance
from glm_mtp.experiments.settings import validate
from glm_mtp.experiments.settings.model import load_model


def config(overrides):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose("config", overrides=overrides)


COMMON = ["logger=none", "model=tiny_random", "experiment=smoke", "run.max_new_tokens=8", "speedup.costs=glm5"]


def test_fp8_weights_run_and_pair_with_plain(tmp_path):
    plain = run_acceptance(config(COMMON), str(tmp_path / "plain"))
    quant = run_acceptance(config(COMMON + ["model.weights_dtype=fp8"]), str(tmp_path / "fp8"))
    assert plain["weights_dtype"] == "plain" and quant["weights_dtype"] == "fp8"
    assert quant["prompts_sha256"] == plain["prompts_sha256"]
    table = report.paired_table([plain, quant], "weights_dtype")
    assert "fp8 − plain" in table
    rows = report.markdown_table([plain, quant]).splitlines()[2:]
    assert "| reference |" in rows[0] and "| reference fp8 |" in rows[1]


def test_fp8_model_is_block_scaled():
    model = load_model(config(COMMON + ["model.weights_dtype=fp8"]).model)
    assert model.mtp.block_scaled and not load_model(config(COMMON).model).mtp.block_scaled


def test_bad_weights_dtype_is_refused_before_work(tmp_path):
    overrides, match = ["model.weights_dtype=int4"], "model.weights_dtype must be one of plain, fp8"
    with pytest.raises(ValueError, match=match):
        validate.check_acceptance(config(COMMON + overrides))
    with pytest.raises(ValueError, match=match):
        run_acceptance(config(COMMON + overrides), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_fp8_on_the_optimized_backend_in_float64_is_refused(tmp_path):
    """tiny_random is float64: the fused step (which reads fp8) does not take it. The settings'
    check says so by setting before any model is built; the drafter's constructor says it too."""
    overrides = COMMON + ["model.weights_dtype=fp8", "backend=optimized"]
    with pytest.raises(ValueError,
                       match=r"model.weights_dtype=fp8 with backend=optimized needs model.dtype float32 or bfloat16"):
        validate.check_acceptance(config(overrides))
    validate.check_acceptance(config(overrides + ["model.dtype=bfloat16"]))
    with pytest.raises(ValueError, match="run in the fused step only"):
        run_acceptance(config(COMMON + ["model.weights_dtype=fp8", "backend=optimized"]), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
