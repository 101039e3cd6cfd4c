"""Record a trace (DESIGN.md §11, docs/traces.md): the target run once over the acceptance
experiment's prompts, so every drafter configuration can be replayed from it
(``python -m glm_mtp.experiments.acceptance trace.path=DIR ...``).

    python -m glm_mtp.experiments.record trace.out=DIR                                  # the shipped glm5_next toy
    python -m glm_mtp.experiments.record model=shipped target_numerics=pinned trace.out=DIR
    python -m glm_mtp.experiments.record model=hf model.path=CKPT source=jsonl prompts.path=P.jsonl trace.out=DIR
    python -m glm_mtp.experiments.record mode=teacher_forced trace.out=DIR             # natural text

It takes the acceptance experiment's keys (``model``, ``source``, ``prompts``, ``run.*``,
``target_numerics``, ``mode``) and ``trace.*``: ``out`` (the new trace's directory),
``max_drafts`` (the largest k it answers), ``batch_size`` (prompts per batched generation on
model=hf), ``cost_repeats`` (the target's forward costs timed for the speedup model; 0: none).
The speculative mode records two passes (the greedy continuation of ``run.max_new_tokens +
max_drafts - 1`` tokens, then one teacher-forced forward per item); items are cut at the first
near-tie of the two and counted. The teacher-forced mode (the package's target) records each
window and the target's greedy chain of ``max_drafts + 1`` tokens at every scored position.
Prints one line: items, truncations, target forwards, the trace's sha256. Logs that record (and
the config) to the ``logger`` (W&B offline by default, as every command does; ``logger=none``:
none), its run named ``run.name``.

Nothing recorded is lost (``reporting.kept``): the trace is written (``trace.json`` last) before
the logger runs; when timing the target's costs fails after the items were recorded, the trace is
written without costs (``costs: null``, as ``trace.cost_repeats=0`` writes it) and the failure is
one line naming it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch


def check_record(cfg: Any) -> None:
    """The recording's settings: the acceptance experiment's (without a trace to replay; no grammar,
    no per-prompt schema and none of the drafter's or loop's keys, ``replay_keys``), greedy,
    ``trace.out`` a new directory in a writable folder, ``trace.max_drafts`` >= 1, a mode the
    target can record, and the longest item within ``model.max_seq_len``."""
    from .settings.validate import _get, check_acceptance, need_int, unwritable_dir

    from .traces.replay_keys import check_recorded_prompts, check_recording_settings

    if (cfg.get("trace") or {}).get("path") is not None:
        raise ValueError("trace.path replays a trace; a recording writes trace.out (leave trace.path null)")
    check_recording_settings(cfg)
    check_acceptance(cfg)
    check_recorded_prompts(cfg)
    if _get(cfg, "temperature") != 0 and _get(cfg, "mode") != "speculative":
        raise ValueError(f"temperature: mode={_get(cfg, 'mode')} records the target's greedy chains (temperature 0); "
                         f"a sampled trace (temperature > 0) is mode=speculative, got {_get(cfg, 'temperature')}")
    out = _get(cfg, "trace.out")
    if not isinstance(out, str) or not out:
        raise ValueError(f"trace.out must be the new trace's directory, got {out!r}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"trace.out must be a new or empty directory; {out} is not")
    why = unwritable_dir(os.path.dirname(os.path.abspath(out)))
    if why is not None:
        raise ValueError(f"trace.out must be in a writable folder: {why}")
    from .traces.validate import MAX_DRAFTS

    K = need_int(cfg, "trace.max_drafts", 1, MAX_DRAFTS)  # the format's bound: a trace the validator reads
    need_int(cfg, "trace.batch_size", 1)
    need_int(cfg, "trace.cost_repeats", 0)
    check_record_reads(cfg)
    if _get(cfg, "mode") == "teacher_forced" and _get(cfg, "model.kind") == "hf":
        raise ValueError("mode=teacher_forced records the greedy chain at every position by rolling the target back "
                         "anywhere, which transformers' linear-attention caches cannot: record mode=speculative for "
                         "model=hf")
    from .settings.validate import model_config

    longest = _get(cfg, "run.prompt_tokens") + _get(cfg, "run.max_new_tokens") + 2 * K + 1
    cap = min(_get(cfg, "model.max_seq_len"), model_config(cfg).max_position_embeddings)
    if longest > cap:
        raise ValueError(f"trace.max_drafts: run.prompt_tokens + run.max_new_tokens + 2 * trace.max_drafts + 1 = "
                         f"{longest} (the longest item and one verify after it) exceeds model.max_seq_len={cap}")


def check_record_reads(cfg: Any) -> None:
    """Keys a recording reads only in some settings, refused where it would ignore them:
    ``trace.batch_size`` batches transformers' generation (``model=hf``; the package's target
    records one prompt at a time), and ``run.name`` names the recording's logged run (with
    ``logger=none`` nothing is logged). ``ValueError`` naming the key."""
    from .settings.explicit import given_keys, plain, value_at

    given = given_keys(cfg, ["trace.batch_size", "run.name"])
    if "trace.batch_size" in given and cfg.model.kind != "hf":
        raise ValueError(f"trace.batch_size={plain(value_at(cfg, 'trace.batch_size'))!r} batches transformers' "
                         f"generation (model=hf); model.kind={cfg.model.kind} records one prompt at a time: leave it "
                         "unset")
    if "run.name" in given and (cfg.get("logger") or {}).get("name") == "none":
        raise ValueError(f"run.name={cfg.run.name!r} names the recording's logged run, and logger=none logs none "
                         "(leave run.name unset, or log: logger=wandb)")


def progress_bar(total: int, desc: str) -> Any:
    """A tqdm bar over an iterable (to stderr), or the iterable itself without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda it: it
    return lambda it: tqdm(it, total=total, desc=desc, unit="batch" if desc.endswith("batches") else "item",
                           leave=False)


def record(cfg: Any, run_dir: str | None = None) -> dict[str, Any]:
    """Record the trace of ``cfg`` into ``cfg.trace.out``, then log it (``run_dir``: where the
    logger writes, the Hydra run folder; None: the trace's parent folder). Returns its metadata
    (with ``sha256``). A failure after the items were recorded is a ``LateFailure`` naming what
    was kept (module docstring)."""
    from .reporting.kept import late_failure

    from .settings.model import load_model
    from .settings.windows import run_prompts
    from .settings.prompts import path_sha256, prompts_path
    from .targets.provenance import git_commit, provenance
    from .targets.target import Target, class_path
    from .traces.format import write_trace
    from .traces.identity import model_identity
    from .traces.recorder import (measure_target_costs, record_speculative, record_teacher_forced,
                                  sequential_continue)
    from .traces.replay_run import drafter_path
    from .settings.sampling import sampler_settings

    torch.set_num_threads(cfg.threads)
    logging.getLogger("glm_mtp").setLevel(logging.WARNING)
    mode, source, run, K = cfg.mode, cfg.source, cfg.run, cfg.trace.max_drafts
    model = load_model(cfg.model)
    windows, starts = run_prompts(cfg, model, source)
    max_seq_len = min(cfg.model.max_seq_len, model.mtp.config.max_position_embeddings)
    numerics = cfg.target_numerics
    settings = sampler_settings(cfg)
    if model.hf is not None:
        from .targets.hf_target import HfTarget
        from .traces.hf_record import batched_continue

        numerics = "transformers"
        target: Any = HfTarget(model.hf.model, K + 1, max_seq_len, "cpu", cfg.model.get("topk_ties", "lower_index"))
        continue_fn = batched_continue(model.hf.model, target.topk_ties, settings)
        target_info = {**model.hf.info, "topk_ties": target.topk_ties}
    else:
        target = Target(model.target, max_seq_len, numerics=numerics)
        continue_fn = sequential_continue(target, settings)
        target_info = {"implementation": class_path(target), "numerics": numerics}
    identity = model_identity(cfg.model, drafter_path(cfg.model))
    target_info = {**target_info, "numerics": numerics, "target_config_sha256": identity["target_config_sha256"],
                   "dtype": cfg.model.dtype, "checkpoint": model.path or f"random:{cfg.model.preset}",
                   **{k: v for k, v in provenance(model.path).items() if k != "git_commit"}}
    batch = cfg.trace.batch_size if model.hf is not None else 1
    if mode == "teacher_forced":
        items, stats = record_teacher_forced(target, windows, run.prompt_tokens, K,
                                             progress_bar(len(windows), "recording items"), source)
    else:
        items, stats = record_speculative(target, starts, run.max_new_tokens + K - 1, continue_fn, batch,
                                          progress_bar(-(-len(starts) // batch), "recording batches"), source,
                                          settings)
    if not items:
        raise RuntimeError("every item was cut at its first generated token (near-ties of the two passes): no trace")
    costs, costs_error = None, None
    if cfg.trace.cost_repeats:
        try:
            costs = measure_target_costs(target, K, windows[0][: max(2, run.prompt_tokens)], cfg.trace.cost_repeats)
        except Exception as e:  # the items are measured: written without costs below, then this is raised
            costs_error = e
    hidden = items[0].hidden
    meta = {
        "mode": mode,
        "vocab_size": model.mtp.config.vocab_size,
        "hidden_size": model.mtp.config.hidden_size,
        "hidden_dtype": str(hidden.dtype).removeprefix("torch."),
        "max_drafts": K,
        "target": target_info,
        "tokenizer_sha256": identity["tokenizer_sha256"],
        "prompts": {"source": source, "num_prompts": len(windows), "recorded_items": len(items),
                    "prompt_tokens": run.prompt_tokens if source != "jsonl" else None, "seed": cfg.seed,
                    "windows_sha256": _sha256_json(windows),
                    "path": prompts_path(cfg) if source in ("jsonl", "text") else None,
                    "file_sha256": path_sha256(prompts_path(cfg)) if source in ("jsonl", "text") else None},
        "generation": {**generation_record(settings), "max_new_tokens": run.max_new_tokens,
                       "continuation": run.max_new_tokens + K - 1 if mode == "speculative" else None,
                       "batch_size": batch},
        "truncation": stats.truncation(),
        "forwards": stats.forwards(),
        "costs": costs,
        "recorded_by": {"package": "glm_mtp", "git_commit": git_commit()},
    }
    sha = write_trace(cfg.trace.out, meta, items)
    if costs_error is not None:
        raise late_failure(f"timing the target's costs after {len(items)} items were recorded", costs_error,
                           [os.path.join(cfg.trace.out, "trace.json")]) from costs_error
    t = stats.truncation()
    print(f"recorded {len(items)} items ({mode}, {source}, temperature {settings.temperature:g}) into {cfg.trace.out}: "
          f"{stats.forwards()['total']} target "
          f"forwards; {t['items']} items cut at a near-tie ({t['positions_dropped']} positions dropped, "
          f"{t['items_dropped']} items dropped whole); trace.json sha256 {sha}")
    try:
        log_record(cfg, run_dir or os.path.dirname(os.path.abspath(cfg.trace.out)), meta, sha)
    except Exception as e:
        raise late_failure("logging the recording", e, [os.path.join(cfg.trace.out, "trace.json")]) from e
    return {**meta, "sha256": sha}


def log_record(cfg: Any, run_dir: str, meta: dict[str, Any], sha: str) -> None:
    """The recording's run on the configured logger (W&B offline by default, ``logger=none``:
    nothing): the config, and a summary of the trace (items, truncation, forwards, costs, its
    ``trace.json``'s sha256 and path), the run named ``run.name``."""
    from omegaconf import OmegaConf

    from .reporting.wandb_log import make_logger

    log = make_logger(cfg.logger, run_dir, OmegaConf.to_container(cfg, resolve=True), job_type="record",
                      name=cfg.run.name, group=cfg.get("group"))
    p = meta["prompts"]
    log.summary({"trace/path": os.path.abspath(cfg.trace.out), "trace/sha256": sha, "trace/mode": meta["mode"],
                 "trace/max_drafts": meta["max_drafts"], "trace/items": p["recorded_items"],
                 "trace/prompts": p["num_prompts"], "trace/truncation": meta["truncation"],
                 "trace/forwards": meta["forwards"], "trace/costs": meta["costs"],
                 "trace/target": meta["target"]})
    log.finish()


def generation_record(settings: Any) -> dict[str, Any]:
    """The trace's sampler fields: the seeded sampler's settings and name at temperature > 0;
    temperature 0 and the rest null for a greedy trace."""
    if settings.temperature == 0:
        return {"temperature": 0, "top_p": None, "top_k": None, "seed": None, "sampler": None}
    return settings.record()


def _sha256_json(x: Any) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(x).encode()).hexdigest()


def main() -> None:
    from .settings.entry import hydra_main

    hydra_main("config", "python -m glm_mtp.experiments.record", check_record,
               lambda cfg, hc: record(cfg, hc.runtime.output_dir))


if __name__ == "__main__":
    main()
