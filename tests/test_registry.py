"""glm_mtp.registry: the one map of backend and dtype names the suite, the experiments and the
bench share."""

import subprocess
import sys

import pytest
import torch

from glm_mtp.registry import BACKENDS, DTYPES, backend_class, dtype_name, parse_dtype


def test_each_backend_name_gives_its_proposer():
    from glm_mtp.optimized import OptimizedProposer
    from glm_mtp.reference import ReferenceProposer

    assert {n: backend_class(n) for n in BACKENDS} == {"reference": ReferenceProposer, "optimized": OptimizedProposer}
    with pytest.raises(ValueError, match="backend must be one of"):
        backend_class("fastest")


def test_dtype_names_round_trip():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    for name, dtype in DTYPES.items():
        assert parse_dtype(dtype_name(dtype)) is dtype, name
    with pytest.raises(ValueError, match="^dtype: unknown dtype 'int8'"):
        parse_dtype("int8")


def test_importing_the_registry_imports_no_backend_hydra_or_wandb():
    code = (
        "import sys, glm_mtp.registry\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf', 'wandb')\n"
        "             or m.startswith(('glm_mtp.optimized', 'glm_mtp.conformance', 'glm_mtp.experiments')))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
