"""Production import: ``glm_mtp.optimized`` alone pulls in neither Hydra nor W&B nor the measuring
tools (``glm_mtp.tools``) nor the experiments, and offers the proposer protocol."""

import subprocess
import sys


def test_import_without_hydra_or_wandb():
    code = (
        "import sys, glm_mtp.optimized as o\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf', 'wandb'))\n"
        "assert not bad, bad\n"
        "tools = sorted(m for m in sys.modules if m.startswith(('glm_mtp.tools', 'glm_mtp.experiments')))\n"
        "assert not tools, tools\n"
        "assert o.OptimizedProposer.__doc__ and o.OptimizedProposer.propose_device.__doc__\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_satisfies_the_protocol(weights):
    from glm_mtp.optimized import OptimizedProposer
    from glm_mtp.reference import DraftProposer

    assert isinstance(OptimizedProposer(weights, 64), DraftProposer)
