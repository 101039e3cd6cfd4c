"""The core install: ``pip install glm-mtp`` without the ``experiments`` extra is enough to draft.

pyproject.toml's core dependencies are what ``glm_mtp.reference`` and ``glm_mtp.optimized``
import; Hydra (and OmegaConf), W&B, matplotlib and tqdm come with the ``experiments`` extra, the
test tools with ``dev``. A subprocess whose imports of those packages fail, as if they were not
installed, builds both drafters and drafts with them (and imports the conformance suite, which
the GPU workflow runs in the core install).
"""

import subprocess
import sys

# Every package the extras bring (experiments, then dev), by top-level import name.
EXTRAS = ("hydra", "omegaconf", "wandb", "matplotlib", "tqdm", "pytest", "hypothesis", "xdist", "transformers")

DRAFT = """
import sys

EXTRAS = set(sys.argv[1:])


class NotInstalled:
    \"\"\"A finder ahead of every other: an extra's packages cannot be found.\"\"\"

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in EXTRAS:
            raise ModuleNotFoundError(f"No module named {name!r} (an extra, not installed)", name=name)
        return None


sys.meta_path.insert(0, NotInstalled)

import torch

import glm_mtp.conformance  # noqa: F401  (the GPU workflow's core-install job runs the suite)
from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.bytes import keyed_bytes

torch.set_num_threads(1)
cfg = MtpConfig.preset("tiny")
weights = MtpWeights.random(cfg, seed=3, dtype=torch.float32)
gen = torch.Generator().manual_seed(11)
tokens = torch.randint(cfg.vocab_size, (9,), generator=gen)
hiddens = torch.randn(9, cfg.hidden_size, generator=gen)
results = []
for prop in (ReferenceProposer(weights, 64), OptimizedProposer(weights, 64, kernels="torch")):
    state = prop.alloc_state("cpu")
    prop.prefill_drafter(tokens, hiddens, state)
    drafts = prop.propose(int(tokens[-1]), hiddens[-1], 8, 3, state)
    results.append((drafts, keyed_bytes(prop.export_state(state))))
    prop.free_state(state)
(ref_drafts, ref_state), (opt_drafts, opt_state) = results
assert len(ref_drafts) == 3 and ref_drafts == opt_drafts, (ref_drafts, opt_drafts)
assert ref_state == opt_state, "export_state differs"
loaded = sorted({m.split(".")[0] for m in sys.modules} & EXTRAS)
assert not loaded, loaded
print("drafted", ref_drafts)
"""


def test_drafters_draft_without_the_extras():
    out = subprocess.run([sys.executable, "-c", DRAFT, *EXTRAS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("drafted ["), out.stdout
