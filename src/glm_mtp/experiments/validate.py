"""Checks of the entry points' settings, run before any work: a bad value is one clear line and
exit status 2, never a traceback from deep inside the run nor a failure after minutes of work.

- ``check_acceptance(cfg)`` / ``check_train(cfg)``: the Hydra configs (conf/config.yaml,
  conf/train.yaml) of ``acceptance`` and ``train``; each names the key and the rule;
- ``exit_on_bad_config(check, cfg, run_dir)``: the hook at the top of a Hydra main: on a bad
  value it prints one line, removes what Hydra already wrote into ``run_dir`` (so no empty run
  directory is left behind) and exits 2;
- ``unwritable_dir(path)``: why an output folder could not be written, checked before a run.

Plain Python: importing this module imports neither Hydra nor W&B.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from typing import Any, Callable

from glm_mtp.registry import BACKENDS

from .speculative import DRAFTS, POLICIES
from .target import TARGET_NUMERICS

FEED_HIDDEN = ("post_norm", "pre_norm")
MODEL_KINDS = ("checkpoint", "random")
MODEL_DTYPES = ("float32", "float64", "bfloat16")  # names of glm_mtp.registry.DTYPES (a test keeps them so)
LOGGERS = ("none", "wandb")
# An acceptance run's modes and text sources.
MODES = ("speculative", "teacher_forced")
SOURCES = ("heldout", "ood")


def _get(cfg: Any, key: str) -> Any:
    """``cfg``'s value at a dotted ``key``; ``ValueError`` naming it when it is missing."""
    node = cfg
    for part in key.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            raise ValueError(f"{key} is missing") from None
        except Exception as e:  # omegaconf: a mandatory value left as ??? or a bad interpolation
            raise ValueError(f"{key}: {e}") from None
    return node


def need_int(cfg: Any, key: str, minimum: int) -> int:
    v = _get(cfg, key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key} must be an integer >= {minimum}, got {v!r}")
    if v < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {v}")
    return v


def need_float(cfg: Any, key: str, minimum: float, strict: bool = False) -> float:
    """A finite number >= ``minimum`` (> with ``strict``)."""
    v = _get(cfg, key)
    bound = f"> {minimum}" if strict else f">= {minimum}"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number {bound}, got {v!r}")
    if v < minimum or (strict and v == minimum):
        raise ValueError(f"{key} must be {bound}, got {v!r}")
    return float(v)


def need_choice(cfg: Any, key: str, choices: tuple[str, ...]) -> str:
    v = _get(cfg, key)
    if v not in choices:
        raise ValueError(f"{key} must be one of {', '.join(choices)}; got {v!r}")
    return v


def need_bool(cfg: Any, key: str) -> bool:
    v = _get(cfg, key)
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be true or false, got {v!r}")
    return v


def check_logger(cfg: Any) -> None:
    need_choice(cfg, "logger.name", LOGGERS)
    if _get(cfg, "logger.name") == "wandb":
        need_choice(cfg, "logger.mode", ("offline", "online", "disabled"))


def check_batch_size(batch_size: object, mode: str, policy: str, draft: str) -> int:
    """``batch_size``: an integer >= 1; above 1 the loop runs batched (``generate_batch``), which
    needs the speculative mode, ``policy=first_row_kept`` and ``draft=argmax``. ``ValueError``
    naming the option otherwise."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if batch_size > 1:
        if mode != "speculative":
            raise ValueError(f"batch_size > 1 batches the speculative loop; mode={mode} runs one text at a time (batch_size=1)")
        if policy != "first_row_kept":
            raise ValueError(f"batch_size > 1 runs policy=first_row_kept only; policy={policy} is single-sequence (batch_size=1)")
        if draft != "argmax":
            raise ValueError(f"batch_size > 1 runs draft=argmax only; draft={draft} is single-sequence (batch_size=1)")
    return batch_size


WEIGHT_FORMATS = ("plain", "fp8")


def weights_dtype(mcfg: Any) -> str:
    """``model.weights_dtype``: ``plain`` (the default, also for configs without the key) or ``fp8``."""
    v = mcfg.get("weights_dtype", "plain") or "plain"
    if v not in WEIGHT_FORMATS:
        raise ValueError(f"model.weights_dtype must be one of {', '.join(WEIGHT_FORMATS)}; got {v!r}")
    return v


def check_weights_dtype(mcfg: Any, backend: str) -> str:
    """``model.weights_dtype`` (``weights_dtype``). Both backends draft with fp8 weights; the
    optimized one refuses, at construction, storage its fused step does not take (float64)."""
    return weights_dtype(mcfg)


def check_acceptance(cfg: Any) -> None:
    """The acceptance experiment's settings (conf/config.yaml and its groups)."""
    need_choice(cfg, "mode", MODES)
    need_choice(cfg, "source", SOURCES)
    need_int(cfg, "num_drafts", 1)
    need_choice(cfg, "policy", POLICIES)
    temperature = need_float(cfg, "temperature", 0.0)
    if need_choice(cfg, "draft", DRAFTS) == "sampled" and not temperature > 0:
        raise ValueError("draft must be argmax at temperature 0 (sampled drafts are drawn from the drafter's softmax at the "
                         "temperature: draft=sampled needs temperature > 0)")
    need_choice(cfg, "target_numerics", tuple(TARGET_NUMERICS))
    need_choice(cfg, "feed_hidden", FEED_HIDDEN)
    need_int(cfg, "seed", 0)
    need_int(cfg, "threads", 1)
    check_batch_size(_get(cfg, "batch_size"), _get(cfg, "mode"), _get(cfg, "policy"), _get(cfg, "draft"))
    need_choice(cfg, "backend.name", tuple(sorted(BACKENDS)))
    kind = need_choice(cfg, "model.kind", MODEL_KINDS)
    need_choice(cfg, "model.dtype", MODEL_DTYPES)
    check_weights_dtype(_get(cfg, "model"), _get(cfg, "backend.name"))
    need_int(cfg, "model.max_seq_len", 2)
    if kind == "random":
        need_int(cfg, "model.seed", 0)
    need_int(cfg, "experiment.num_prompts", 1)
    need_int(cfg, "experiment.prompt_tokens", 1)
    need_int(cfg, "experiment.max_new_tokens", 1)
    need_bool(cfg, "experiment.check_lossless")
    costs = _get(cfg, "speedup.costs")
    if not isinstance(costs, str) or (costs not in ("measured", "glm5") and not os.path.isfile(costs)):
        raise ValueError(f"speedup.costs must be measured, glm5 or the path of a costs.json, got {costs!r}")
    need_int(cfg, "speedup.repeats", 1)
    check_logger(cfg)


def check_train(cfg: Any) -> None:
    """The training run's settings (conf/train.yaml): the ``train`` and ``tokenizer`` groups."""
    for key, minimum in (("steps", 1), ("batch_size", 1), ("seq_len", 2), ("threads", 1), ("seed", 0), ("warmup", 0),
                         ("mtp_depth", 1), ("log_every", 1), ("eval_every", 1), ("eval_windows", 1)):
        need_int(cfg, f"train.{key}", minimum)
    need_float(cfg, "train.max_minutes", 0.0, strict=True)
    need_float(cfg, "train.lr", 0.0, strict=True)
    need_float(cfg, "train.min_lr", 0.0)
    for key in ("weight_decay", "grad_clip", "mtp_loss_weight", "bias_update_rate"):
        need_float(cfg, f"train.{key}", 0.0)
    distill = need_float(cfg, "train.mtp_distill", 0.0)
    if distill > 1:
        raise ValueError(f"train.mtp_distill must be in [0, 1], got {distill}")
    base = _get(cfg, "train").get("base")
    if base is not None and base != "shipped" and not (isinstance(base, str) and os.path.isfile(os.path.join(base, "config.json"))):
        raise ValueError(f"train.base must be null, shipped or a checkpoint directory (with config.json), got {base!r}")
    need_int(cfg, "tokenizer.vocab_size", 1)
    need_int(cfg, "tokenizer.sample_every", 1)
    if _get(cfg, "tokenizer.limit_items") is not None:
        need_int(cfg, "tokenizer.limit_items", 1)
    check_logger(cfg)


def check_grid(cfg: Any) -> None:
    """The training grid's settings (conf/grid.yaml): the training's, and the evaluation's."""
    check_train(cfg)
    runs = _get(cfg, "eval.runs")
    if not hasattr(runs, "items") or not len(runs):
        raise ValueError(f"eval.runs must map run names to lists of acceptance overrides, got {runs!r}")
    for name, ov in runs.items():
        if isinstance(ov, str) or not all(isinstance(x, str) for x in ov):
            raise ValueError(f"eval.runs.{name} must be a list of overrides (strings), got {ov!r}")
    common = _get(cfg, "eval.common")
    if isinstance(common, str) or not all(isinstance(x, str) for x in common):
        raise ValueError(f"eval.common must be a list of overrides (strings), got {common!r}")
    need_int(cfg, "eval.feed_prompts", 1)


def unwritable_dir(path: str) -> str | None:
    """Why files could not be written into the folder ``path`` (made if missing), or ``None``."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} exists and is not a directory"
    probe = os.path.abspath(path)
    while not os.path.exists(probe):  # the nearest existing ancestor is where the folder gets made
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{path}: {probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{path}: {probe} is not writable"
    return None


# What Hydra writes into a run directory before the task function runs.
HYDRA_FILES = (".hydra",)


def remove_hydra_run_dir(run_dir: str) -> None:
    """Remove what Hydra put into ``run_dir`` (``.hydra/`` and the job's log file), then the
    folder itself if that leaves it empty; anything else is left alone."""
    if not os.path.isdir(run_dir):
        return
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        if name in HYDRA_FILES and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif name.endswith(".log") and os.path.isfile(path) and os.path.getsize(path) == 0:
            os.remove(path)
    if not os.listdir(run_dir):
        os.rmdir(run_dir)


def _sweep_dir() -> str | None:
    """The sweep folder of a Hydra multirun job, or ``None`` (a single run, or no Hydra)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        return str(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
    except Exception:  # no Hydra context: called outside a Hydra main
        return None


def exit_on_bad_config(check: Callable[[Any], None], cfg: Any, run_dir: str, prog: str) -> None:
    """Run ``check(cfg)``; on a ``ValueError`` print ``prog: error: <why>``, remove the run
    directory Hydra made (``remove_hydra_run_dir``; in a multirun also the sweep folder when
    only Hydra's ``multirun.yaml`` is left in it) and exit with status 2."""
    try:
        check(cfg)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        remove_hydra_run_dir(run_dir)
        sweep = _sweep_dir()
        if sweep and os.path.isdir(sweep) and set(os.listdir(sweep)) <= {"multirun.yaml"}:
            shutil.rmtree(sweep, ignore_errors=True)
        sys.exit(2)
