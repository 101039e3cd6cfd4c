"""``python -m glm_mtp.experiments.finetune``'s refusals, before any work (DESIGN.md §13): each a
``ValueError`` naming the setting and the rule; the entry point prints it as one line and exits 2
with nothing written. Only metadata is read here (``trace.json``, ``config.json``, the tokenizer's
digest), never a shard or a weight.
"""

from __future__ import annotations

import math
import os
from typing import Any

from glm_mtp.reference.config import MtpConfig

from ..traces.format import TraceError, is_sampled
from ..traces.validate import read_meta
from ..traces.identity import check_drafter, model_identity
from ..traces.replay_run import drafter_path
from .finetune_split import PromptSplit, split_by_prompt

FEEDS = ("post_norm", "pre_norm")


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_hyperparameters(f: Any) -> None:
    """``finetune.*``'s ranges."""
    rules = (
        ("steps", "an integer >= 1", _int(f.steps) and f.steps >= 1),
        ("lr", "a number in (0, 1]", _number(f.lr) and 0 < f.lr <= 1),
        ("batch_size", "an integer >= 1", _int(f.batch_size) and f.batch_size >= 1),
        ("depth", "an integer >= 1", _int(f.depth) and f.depth >= 1),
        ("heldout", "a number in (0, 1)", _number(f.heldout) and 0 < f.heldout < 1),
        ("seed", "an integer >= 0", _int(f.seed) and f.seed >= 0),
        ("eval_every", "an integer >= 1", _int(f.eval_every) and f.eval_every >= 1),
        ("max_minutes", "a number > 0", _number(f.max_minutes) and f.max_minutes > 0),
        ("weight_decay", "a number in [0, 1)", _number(f.weight_decay) and 0 <= f.weight_decay < 1),
        ("grad_clip", "a number > 0", _number(f.grad_clip) and f.grad_clip > 0),
        ("num_drafts", "an integer >= 1 (the replay's k)", _int(f.num_drafts) and f.num_drafts >= 1),
        ("threads", "an integer >= 1", _int(f.threads) and f.threads >= 1),
    )
    for name, rule, ok in rules:
        if not ok:
            raise ValueError(f"finetune.{name} must be {rule}, got {f.get(name)!r}")


def check_world(batch_size: int) -> None:
    """Under ``torchrun`` (``finetune_dist``): ``WORLD_SIZE`` and ``RANK`` integers in range, and
    ``finetune.batch_size`` >= ``WORLD_SIZE`` (every rank takes a non-empty share of each step)."""
    from .finetune_dist import world_from_env

    _, world = world_from_env()
    if batch_size < world:
        raise ValueError(f"finetune.batch_size={batch_size} is below WORLD_SIZE={world}: data parallel gives every "
                         "rank a share of each step's batch, so the batch needs at least one item per rank")


def check_out(out: Any) -> str:
    """``finetune.out``: a new or empty directory."""
    if not isinstance(out, str) or not out:
        raise ValueError(f"finetune.out must name a new or empty directory, got {out!r}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"finetune.out: {out} exists and is not an empty directory (the tuned checkpoint needs a new "
                         "or empty one)")
    return out


def check_trace(key: str, path: Any, mcfg: Any, model_dir: str, cfg: MtpConfig, num_drafts: int,
                depth: int | None) -> dict[str, Any]:
    """A trace against this run: its metadata's rules, greedy, the model's target and tokenizer,
    the model's dtype, ``depth`` and ``num_drafts`` within its ``max_drafts``, its items within
    ``model.max_seq_len``. Returns the metadata."""
    if not isinstance(path, str):
        raise ValueError(f"{key} must be a trace directory, got {path!r}")
    try:
        meta = read_meta(path)
    except TraceError as e:
        raise ValueError(f"{key}: {path}: {e}") from None
    if is_sampled(meta):
        temp = meta["generation"]["temperature"]
        raise ValueError(f"{key}: {path} is a sampled trace (generation temperature {temp}): it gives `sample` "
                         "labels (the target's draw at that temperature) on a trajectory that is not greedy, but "
                         "fine-tuning here trains on the greedy `argmax` labels and judges by replay at greedy "
                         "verification; record a greedy trace (temperature 0)")
    try:
        check_drafter(meta, cfg, model_identity(mcfg, model_dir))
    except ValueError as e:
        raise ValueError(f"{key}: {path}: {e}") from None
    if meta["hidden_dtype"] != mcfg.dtype:
        raise ValueError(f"{key}: {path}: hidden_dtype: the trace holds {meta['hidden_dtype']} hiddens, the drafter "
                         f"runs in model.dtype={mcfg.dtype}")
    if depth is not None and depth > meta["max_drafts"]:
        raise ValueError(f"finetune.depth={depth} exceeds {key}'s max_drafts={meta['max_drafts']} (the unrolled depth "
                         "is at most the drafts the trace answers)")
    if num_drafts > meta["max_drafts"]:
        raise ValueError(f"finetune.num_drafts={num_drafts} exceeds {key}'s max_drafts={meta['max_drafts']}")
    longest = max(it["length"] for it in meta["items"]) + num_drafts + 1
    cap = min(mcfg.max_seq_len, cfg.max_position_embeddings)
    if longest > cap:
        raise ValueError(f"model.max_seq_len: {key}'s longest item + num_drafts + 1 = {longest} exceeds {cap}")
    return meta


def check_finetune(cfg: Any) -> tuple[str, MtpConfig, dict[str, Any], PromptSplit]:
    """Every refusal of a finetune run (module docstring). Returns the model's directory and
    config, the trace's metadata and the split."""
    f, mcfg = cfg.finetune, cfg.model
    check_hyperparameters(f)
    check_world(f.batch_size)
    if f.feed_hidden not in FEEDS:
        raise ValueError(f"finetune.feed_hidden must be one of {FEEDS}, got {f.feed_hidden!r}")
    if mcfg.kind not in ("checkpoint", "hf"):
        raise ValueError(f"model.kind={mcfg.kind}: fine-tuning reads a checkpoint directory (model=next_shipped, "
                         "model=shipped, model=hf model.path=DIR, or a drafter-only directory as model.path)")
    if mcfg.get("weights_dtype", "plain") != "plain":
        raise ValueError("model.weights_dtype must be plain: fine-tuning trains the checkpoint's own tensors (an fp8 "
                         "checkpoint is dequantized to train and requantized when written)")
    if mcfg.dtype not in ("float32", "float64", "bfloat16"):
        raise ValueError(f"model.dtype must be float32, float64 or bfloat16, got {mcfg.dtype!r}")
    model_dir = drafter_path(mcfg)
    if model_dir is None or not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"model.path: {model_dir} holds no config.json (not a checkpoint directory)")
    try:
        mtp_cfg = MtpConfig.from_hf_config(model_dir)
    except (ValueError, OSError) as e:
        raise ValueError(f"model.path: {model_dir}: {e}") from None
    check_out(f.out)
    meta = check_trace("trace.path", cfg.trace.path, mcfg, model_dir, mtp_cfg, f.num_drafts, f.depth)
    split = split_by_prompt(meta, f.heldout, f.seed)
    for i, extra in enumerate(f.get("eval_traces") or []):
        check_trace(f"finetune.eval_traces[{i}]", extra, mcfg, model_dir, mtp_cfg, f.num_drafts, None)
    return model_dir, mtp_cfg, meta, split
