"""Fine-tuning a release checkpoint (DESIGN.md §13, issue 51's "a tiny transformers checkpoint of each
family"): ``model=hf model.path=CKPT`` on the tiny random checkpoints of both families
(``hf_checkpoints``: the target's layers and the MTP layer in one sharded release layout, a
tokenizer beside them). transformers' target records a small greedy trace, fine-tuning tunes the
head from it, and the output holds the input's drafter tensors (names, shapes, dtypes, shard
files), no target layer, loads with ``MtpWeights.from_pretrained`` and replays through the
acceptance experiment to the counts the fine-tuning's own judge recorded."""

import json
import os

import pytest
import torch
from hydra import compose, initialize_config_module
from safetensors import safe_open

pytest.importorskip("transformers")

from glm_mtp.experiments.traces.drafter_only import drafter_tensor_names  # noqa: E402
from glm_mtp.experiments.training.finetune_checks import check_finetune  # noqa: E402
from glm_mtp.experiments.training.finetune_run import run  # noqa: E402
from glm_mtp.reference.bytes import same_bytes  # noqa: E402
from glm_mtp.reference.checkpoint import checkpoint_weight_map  # noqa: E402
from glm_mtp.reference.config import MtpConfig  # noqa: E402
from glm_mtp.reference.weights import MtpWeights  # noqa: E402

from .hf_checkpoints import FAMILIES, write_hf_checkpoint  # noqa: E402
from .traces.test_traces import per_prompt, record_trace  # noqa: E402

K = 2  # the trace's max_drafts, the replay's k and the unrolled depth


@pytest.fixture(scope="module", params=FAMILIES)
def tuned_hf(request, tmp_path_factory):
    """A tiny checkpoint of one family, a 3-prompt greedy trace of its transformers target and
    the head tuned from it (2 steps, depth 2, the replay at both steps)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp(f"ft-{request.param}")
    ck, trace, out = root / "ck", root / "trace", root / "out"
    write_hf_checkpoint(ck, request.param)
    model = ["model=hf", f"model.path={ck}"]
    meta = record_trace(trace, [*model, "run.num_prompts=3", "run.prompt_tokens=10", "run.max_new_tokens=6",
                                f"trace.max_drafts={K}", "trace.batch_size=3", "trace.cost_repeats=0"])
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        cfg = compose("finetune", overrides=[*model, f"trace.path={trace}", f"finetune.out={out}", "finetune.steps=2",
                                             "finetune.eval_every=1", "finetune.batch_size=2", "finetune.lr=0.01",
                                             f"finetune.depth={K}", f"finetune.num_drafts={K}",
                                             "logger=none"])
    summary = run(cfg, str(root / "run"), check_finetune(cfg), "test")
    return request.param, ck, trace, out, meta, summary


def test_a_release_checkpoint_is_tuned_into_its_own_layout_and_replays(tuned_hf):
    family, ck, trace, out, meta, summary = tuned_hf
    assert meta["target"]["class"] == {"glm5_next": "Glm5NextForConditionalGeneration",
                                       "glm_moe_dsa": "GlmMoeDsaForCausalLM"}[family]
    cfg = MtpConfig.from_hf_config(str(ck))
    src, got = checkpoint_weight_map(ck), checkpoint_weight_map(out)
    drafter = drafter_tensor_names(str(ck), cfg)
    assert len(src) > len(drafter)  # the input holds the target's layers too
    assert sorted(got) == sorted(drafter)  # the drafter's tensors only: no target layer
    assert all(got[n] == src[n] for n in got)  # in the input's shard files
    assert (out / "config.json").read_bytes() == (ck / "config.json").read_bytes()
    assert (out / "tokenizer.json").read_bytes() == (ck / "tokenizer.json").read_bytes()
    moved = 0
    for n in got:
        with safe_open(ck / src[n], "pt") as a, safe_open(out / got[n], "pt") as b:
            x, y = a.get_tensor(n), b.get_tensor(n)
        assert (x.shape, x.dtype) == (y.shape, y.dtype), n
        if not n.startswith(cfg.layer_prefix):
            assert same_bytes(x, y), n  # the embedding and the head are the input's bytes
        moved += not same_bytes(x, y)
    assert moved > 10
    MtpWeights.from_pretrained(out)
    assert [r["step"] for r in summary["replay"]["history"]] == [0, 1]
    # The tuned checkpoint replays under the acceptance experiment (the drafter from OUT, the
    # target from the trace) to the fine-tuning judge's counts, prompt by prompt.
    replay, _ = per_prompt(["model=hf", f"model.path={out}", f"num_drafts={K}", f"trace.path={trace}"])
    tuned = summary["replay"]["counts"]["tuned"]
    held = summary["split"]["heldout_item_indices"]
    assert [replay[i] for i in held] == list(zip(tuned["reached"], tuned["accepted"], tuned["steps"]))
    assert json.loads((out / "summary.json").read_text())["replay"]["prompts"] == len(held) >= 1
    assert os.path.getsize(out / "loss_curve.png") > 0
