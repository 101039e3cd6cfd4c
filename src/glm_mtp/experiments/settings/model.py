"""The acceptance run's drafter and target from its config (the ``model`` group): the checkpoint
loaded, the drafter's settings applied (fp8 weights, index sharing) and the target built. Used by
``experiments.acceptance``, ``record``, ``stop_sweep`` and ``grid``."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from glm_mtp.registry import parse_dtype

from ..targets.checkpoint import (SHIPPED, LoadedModel, load_checkpoint, load_hf_checkpoint, random_model,
                                  shipped_checkpoint)
from ..targets.target import Target
from .validate import index_share, weights_dtype


def load_model(mcfg: Any) -> LoadedModel:
    """The ``model`` config group: ``kind: checkpoint`` (``path`` or the shipped one), ``kind:
    random``, or ``kind: hf`` (a checkpoint in the release layout: transformers runs its target,
    the package drafts with its MTP layer); ``weights_dtype: fp8`` quantizes the drafter's §8
    matrices (``MtpWeights.quantize_fp8``; the target keeps its weights); ``index_share: true |
    false`` overrides the drafter's index sharing (DESIGN.md §9; ``null`` keeps the checkpoint's)."""
    dtype = parse_dtype(mcfg.dtype)
    if mcfg.kind == "checkpoint":  # path, or the shipped checkpoint model.shipped names (default: the GLM-5 one)
        model = load_checkpoint(mcfg.path or shipped_checkpoint(mcfg.get("shipped") or SHIPPED), dtype)
    elif mcfg.kind == "random":
        model = random_model(mcfg.preset, mcfg.seed, dtype)
    elif mcfg.kind == "hf":
        model = load_hf_checkpoint(mcfg.path, mcfg.get("device", "cpu"), dtype)
    else:
        raise ValueError(f"model.kind must be 'checkpoint', 'random' or 'hf', got {mcfg.kind!r}")
    return apply_drafter_settings(model, mcfg)


def apply_drafter_settings(model: LoadedModel, mcfg: Any) -> LoadedModel:
    """The drafter's settings of the ``model`` group: ``weights_dtype: fp8`` quantizes its §8
    matrices; ``index_share`` overrides its index sharing (``null`` keeps the checkpoint's)."""
    if weights_dtype(mcfg) == "fp8":
        model = dataclasses.replace(model, mtp=model.mtp.quantize_fp8())
    return dataclasses.replace(model, mtp=model.mtp.with_index_share(index_share(mcfg)))




def make_target(cfg: Any, model: LoadedModel, max_seq_len: int, numerics: str) -> tuple[Any, torch.device | str]:
    """The run's target (the package's ``Target``, or ``HfTarget`` for model=hf) and the device
    the drafter's states live on (beside the target's hidden rows)."""
    if model.hf is None:
        return Target(model.target, max_seq_len, numerics=numerics), "cpu"
    from ..targets.hf_target import HfTarget

    target = HfTarget(model.hf.model, cfg.num_drafts + 1, max_seq_len, model.mtp.device,
                      cfg.model.get("topk_ties", "lower_index"))
    return target, model.mtp.device
