"""The MTP training grid: train MTP variants (unroll depth x self-distillation share) and measure
each one's acceptance, teacher-forced and in the loop, and whether the pre-norm feed changes its
drafts.

    python -m glm_mtp.experiments.grid -m                       # conf/grid.yaml: depth 1,2,3 x distill 0,0.5
    python -m glm_mtp.experiments.grid_report multirun/grid/<time> [--out DIR]

One job (``run``):

1. trains per ``cfg.train`` (``experiments/train.py``; by default a fresh MTP layer on the shipped
   target, frozen, ``train.base=shipped``) and writes the checkpoint into ``<run dir>/checkpoint``;
2. runs the acceptance experiment on it once per entry of ``cfg.eval.runs`` (each a list of
   overrides of ``conf/config.yaml`` after ``cfg.eval.common``), into ``<run dir>/acceptance-<name>``;
3. compares the drafts of the two feeds (``loop.feed_agreement``): at every teacher-forced position of
   the first ``cfg.eval.feed_prompts`` held-out windows, the post-norm and the pre-norm drafter
   propose k drafts after the same text and hiddens; the share of positions where draft i is the
   same token under both feeds, per i (i = 1 reads the target's hidden under either feed, so it
   is 1 by construction);
4. writes ``grid.json`` (settings, final losses, the acceptance summaries' statistics and counts,
   the feed agreement) into the run directory.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Any

from .acceptance_job.run import run as run_acceptance
from .loop.feed_agreement import FEEDS, feed_agreement
from .training.train_run import run as run_training


def compose_config(name: str, overrides: list[str]) -> Any:
    """``conf/<name>.yaml`` composed with ``overrides`` (inside a Hydra app or outside one)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(name, overrides=overrides)
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose(name, overrides=overrides)


def eval_configs(cfg: Any, checkpoint: str) -> dict[str, Any]:
    """The acceptance configs of ``cfg.eval.runs``, each on ``checkpoint``."""
    common = list(cfg.eval.common)
    path = "model.path=" + quote(checkpoint)
    return {name: compose_config("config", [*common, *list(ov), path]) for name, ov in cfg.eval.runs.items()}


def quote(value: str) -> str:
    """A string as one Hydra override value (a sweep's run directories hold ``=`` and ``,``)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def evaluate_job(cfg: Any, run_dir: str, checkpoint: str, final: dict[str, Any],
                 train_minutes: float) -> dict[str, Any]:
    """A grid job's steps 2 and 3 on its trained ``checkpoint`` (module docstring): the
    acceptance runs and the feed agreement; returns what ``grid.json`` records."""
    from omegaconf import OmegaConf

    from .settings.model import load_model
    from .settings.windows import build_prompts
    from .targets.provenance import file_sha256, git_commit
    from .loop.speculative import make_proposer
    from .targets.target import Target

    t1 = time.perf_counter()
    evals = {}
    for name, acfg in eval_configs(cfg, checkpoint).items():
        s = run_acceptance(acfg, os.path.join(run_dir, f"acceptance-{name}"))
        evals[name] = {k: s[k] for k in ("mode", "source", "feed_hidden", "policy", "num_drafts", "temperature",
                                         "acceptance_per_position",
                                         "alpha_ci", "cumulative", "cumulative_ci", "mean_accepted_length", "tau_ci",
                                         "counts",
                                         "counts_per_prompt", "prompts", "prompts_sha256", "speedup")}
    # The feed ablation: do the two feeds draft different tokens at all on these weights?
    first = next(iter(eval_configs(cfg, checkpoint).values()))
    model = load_model(first.model)
    exp = first.run
    windows = build_prompts(model, exp.num_prompts, exp.prompt_tokens + exp.max_new_tokens, first.seed, first.source)
    windows = windows[: cfg.eval.feed_prompts]
    max_seq_len = min(first.model.max_seq_len, model.target.config.max_position_embeddings)
    proposers = {f: make_proposer(first.backend.name, model.mtp, max_seq_len, f) for f in FEEDS}
    agreement = feed_agreement(Target(model.target, max_seq_len), proposers, windows, exp.prompt_tokens,
                               first.num_drafts)
    eval_minutes = (time.perf_counter() - t1) / 60
    t = cfg.train
    result = {
        "mtp_depth": t.mtp_depth, "mtp_distill": float(t.mtp_distill), "base": t.get("base"), "steps": final["steps"],
        "batch_size": t.batch_size, "seq_len": t.seq_len, "seed": t.seed, "final": final,
        "train_minutes": train_minutes,
        "eval_minutes": eval_minutes, "evals": evals, "feed_agreement": agreement, "checkpoint": checkpoint,
        "checkpoint_sha256": file_sha256(os.path.join(checkpoint, "model.safetensors")),
        "git_commit": git_commit(), "config": OmegaConf.to_container(cfg, resolve=True),
    }
    return result


def run(cfg: Any, run_dir: str, command: str = "python -m glm_mtp.experiments.grid") -> dict[str, Any]:
    """One grid job (module docstring); returns what it writes to ``grid.json``."""
    from omegaconf import open_dict

    from .reporting.kept import late_failure, write_json
    from .settings.validate import check_acceptance_run, trained_model_config

    os.makedirs(run_dir, exist_ok=True)
    checkpoint = os.path.join(run_dir, "checkpoint")
    trained = trained_model_config(cfg)
    for c in eval_configs(cfg, checkpoint).values():  # refuse a bad evaluation before the training
        check_acceptance_run(c, trained)
    with open_dict(cfg):
        cfg.out = checkpoint
    t0 = time.perf_counter()
    final = run_training(cfg, os.path.join(run_dir, "train"), command)
    train_minutes = (time.perf_counter() - t0) / 60
    try:  # the head is trained and written: a later failure keeps it, and each evaluation's files
        result = evaluate_job(cfg, run_dir, checkpoint, final, train_minutes)
        write_json(os.path.join(run_dir, "grid.json"), result)  # whole or not at all: grid_report reads it
    except Exception as e:
        kept = [checkpoint, os.path.join(run_dir, "train", "final.json"),
                *sorted(glob.glob(os.path.join(run_dir, "acceptance-*", "summary.json"))),
                *sorted(glob.glob(os.path.join(run_dir, "acceptance-*", "measured.jsonl")))]
        raise late_failure("the grid job's evaluation", e, kept) from e
    t, evals, agreement = cfg.train, result["evals"], result["feed_agreement"]
    train_minutes, eval_minutes = result["train_minutes"], result["eval_minutes"]
    same = ", ".join(f"{x:.3f}" for x in agreement["same_per_position"])
    print(f"depth {t.mtp_depth}, distill {t.mtp_distill}: trained {train_minutes:.1f} min, evaluated "
          f"{eval_minutes:.1f} min; "
          + "; ".join(f"{n}: τ = {e['mean_accepted_length']:.3f}" for n, e in evals.items())
          + f"; feeds agree on draft i: [{same}] of {agreement['positions']} positions")
    return result


def main() -> None:
    from .settings.entry import command_line, hydra_main
    from .settings.validate import check_grid

    prog = "python -m glm_mtp.experiments.grid"
    hydra_main("grid", prog, check_grid, lambda cfg, hc: run(cfg, hc.runtime.output_dir, command_line(prog, hc)))


if __name__ == "__main__":
    main()
