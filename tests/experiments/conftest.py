"""Fixtures for the experiment tests: tiny random targets and drafters sharing embedding and head."""

import json

import pytest
import torch

from glm_mtp.experiments.targets.checkpoint import random_model
from glm_mtp.experiments.targets.target import Target


@pytest.fixture(autouse=True)
def one_thread():
    # The tests' models are tiny: more threads only contend with other test processes.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny64():
    """A random tiny target + MTP layer in float64 (near-ties cannot flip an argmax)."""
    return random_model("tiny", seed=3, dtype=torch.float64)


@pytest.fixture
def target64(tiny64):
    return Target(tiny64.target, max_seq_len=128)


def _random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def random_prompt():
    """``random_prompt(vocab, n, seed)``: n random token ids."""
    return _random_prompt


def _acceptance_jobs(root, jobs):
    """Run each acceptance job of ``jobs`` (key -> Hydra overrides) in-process, checked first as the
    entry point checks it, in its own directory under ``root``; key -> its summary.json."""
    from hydra import compose, initialize_config_module

    from glm_mtp.experiments.acceptance_job.run import run as run_acceptance
    from glm_mtp.experiments.settings.validate import check_acceptance

    summaries = {}
    for key, overrides in jobs.items():
        with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
            cfg = compose("config", overrides=overrides)
        check_acceptance(cfg)
        run_dir = root / "_".join(str(k) for k in key)
        run_acceptance(cfg, str(run_dir))
        summaries[key] = json.loads((run_dir / "summary.json").read_text())
    return summaries


@pytest.fixture(scope="session")
def acceptance_jobs():
    """``acceptance_jobs(root, {key: overrides})``: a sweep's jobs run in-process, key -> summary."""
    return _acceptance_jobs
