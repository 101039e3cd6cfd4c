"""Acceptance-rate experiment: speculative decoding on held-out prompts, per-position acceptance.

    python -m glm_mtp.experiments.acceptance                                   # the shipped model
    python -m glm_mtp.experiments.acceptance -m num_drafts=1,2,3,4,5 policy=first_row_kept,refeed
    python -m glm_mtp.experiments.report multirun/acceptance/<date>            # one table + plot

Prints a table, writes ``summary.json`` and ``acceptance.png`` into the Hydra run directory, and
logs to W&B (offline unless ``logger.mode=online``; ``logger=none`` for no tracker).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

import torch

from glm_mtp.registry import parse_dtype

from .checkpoint import LoadedModel, load_checkpoint, random_model
from .speculative import SpecStats, SpeculativeDecoder, make_proposer, target_decode
from .target import Target


def load_model(mcfg: Any) -> LoadedModel:
    """The ``model`` config group: ``kind: checkpoint`` (``path`` or the shipped one) or ``kind: random``."""
    dtype = parse_dtype(mcfg.dtype)
    if mcfg.kind == "checkpoint":
        return load_checkpoint(mcfg.path, dtype)
    if mcfg.kind == "random":
        return random_model(mcfg.preset, mcfg.seed, dtype)
    raise ValueError(f"model.kind must be 'checkpoint' or 'random', got {mcfg.kind!r}")


def build_prompts(model: LoadedModel, num_prompts: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """``num_prompts`` windows of ``prompt_tokens`` tokens, evenly spaced over the held-out items
    (joined as in training); random tokens for a model without a tokenizer."""
    if model.tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, model.target.config.vocab_size, (num_prompts, prompt_tokens), generator=gen).tolist()
    from .corpus import read_item

    texts = []
    for name in model.heldout:
        try:
            texts.append(read_item(name))
        except (OSError, KeyError):  # another Python version may lack a file or topic
            continue
    stream = model.tokenizer.encode("\n\n".join(texts))
    if len(stream) < prompt_tokens:
        raise ValueError(f"the held-out split holds {len(stream)} tokens, fewer than prompt_tokens={prompt_tokens}")
    stride = (len(stream) - prompt_tokens) // max(1, num_prompts)
    return [stream[i * stride : i * stride + prompt_tokens] for i in range(num_prompts)]


def format_table(summary: dict[str, Any]) -> str:
    """A Markdown table of one run: alpha per position, tau and the run's settings."""
    k = summary["num_drafts"]
    head = "| backend | policy | feed | temperature | k | " + " | ".join(f"α_{i + 1}" for i in range(k)) + " | τ | draft share |"
    sep = "|" + "---|" * (6 + k + 1)
    alphas = " | ".join(f"{a:.3f}" for a in summary["acceptance_per_position"])
    row = (f"| {summary['backend']} | {summary['policy']} | {summary['feed_hidden']} | {summary['temperature']:g} | {k} | "
           f"{alphas} | {summary['mean_accepted_length']:.3f} | {summary['draft_share']:.2f} |")
    return "\n".join([head, sep, row])


def plot_acceptance(summary: dict[str, Any], path: str) -> None:
    """Bar chart of alpha per position, tau in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = summary["acceptance_per_position"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(range(1, len(alphas) + 1), [0 if math.isnan(a) else a for a in alphas], color="tab:blue")
    ax.plot(range(1, len(alphas) + 1), summary["acceptance_cumulative"], "o-", color="tab:orange", label="cumulative")
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("α_i")
    ax.set_xticks(range(1, len(alphas) + 1))
    ax.legend(loc="upper right")
    ax.set_title(f"{summary['policy']}, {summary['feed_hidden']}, T={summary['temperature']:g}: τ = {summary['mean_accepted_length']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: Any, run_dir: str) -> dict[str, Any]:
    """Run the experiment of ``cfg`` (conf/config.yaml); write its files into ``run_dir``."""
    from omegaconf import OmegaConf

    from .wandb_log import make_logger

    torch.set_num_threads(cfg.threads)
    # The drafter logs every prefill at INFO; one line per prompt drowns the table.
    logging.getLogger("glm_mtp").setLevel(logging.WARNING)
    exp = cfg.experiment
    model = load_model(cfg.model)
    prompts = build_prompts(model, exp.num_prompts, exp.prompt_tokens, cfg.seed)
    max_seq_len = min(cfg.model.max_seq_len, model.target.config.max_position_embeddings)
    need = exp.prompt_tokens + exp.max_new_tokens + cfg.num_drafts + 1
    if need > max_seq_len:
        raise ValueError(f"prompt_tokens + max_new_tokens + num_drafts + 1 = {need} exceeds model.max_seq_len={max_seq_len}")
    target = Target(model.target, max_seq_len)
    proposer = make_proposer(cfg.backend.name, model.mtp, max_seq_len, cfg.feed_hidden)
    decoder = SpeculativeDecoder(target, proposer, cfg.num_drafts, cfg.policy, cfg.temperature, cfg.seed)
    os.makedirs(run_dir, exist_ok=True)
    log = make_logger(cfg.logger, run_dir, OmegaConf.to_container(cfg, resolve=True), job_type="acceptance",
                      name=f"k{cfg.num_drafts}-{cfg.policy}-{cfg.feed_hidden}-T{cfg.temperature:g}")

    stats = SpecStats(cfg.num_drafts)
    generated, lossless, grams, distinct = 0, None, 0, 0
    samples = []
    t0 = time.perf_counter()
    for p in prompts:
        res = decoder.generate(p, exp.max_new_tokens)
        stats.merge(res.stats)
        generated += len(res.tokens)
        four = [tuple(res.tokens[i : i + 4]) for i in range(len(res.tokens) - 3)]
        grams, distinct = grams + len(four), distinct + len(set(four))
        if exp.check_lossless and cfg.temperature == 0:
            same = res.tokens == target_decode(target, p, exp.max_new_tokens)
            lossless = same if lossless is None else (lossless and same)
        if len(samples) < 2 and model.tokenizer is not None:
            samples.append({"prompt": model.tokenizer.decode(p), "generated": model.tokenizer.decode(res.tokens)})
    wall = time.perf_counter() - t0

    summary = {
        "acceptance_per_position": stats.alpha,
        "acceptance_cumulative": stats.alpha_cumulative,
        "mean_accepted_length": stats.tau,
        "num_drafts": cfg.num_drafts,
        "policy": cfg.policy,
        "backend": cfg.backend.name,
        "temperature": float(cfg.temperature),
        "feed_hidden": cfg.feed_hidden,
        "prompts": len(prompts),
        "prompt_tokens": exp.prompt_tokens,
        "generated_tokens": generated,
        # Distinct 4-grams / 4-grams within each generation: low values flag the repetition loops
        # a small model's greedy decoding falls into, which are easy to draft.
        "distinct_4gram_ratio": distinct / grams if grams else float("nan"),
        "verify_forwards": stats.steps,
        "draft_seconds": stats.draft_s,
        "verify_seconds": stats.verify_s,
        "prefill_seconds": stats.prefill_s,
        "draft_share": stats.draft_share,
        "wall_seconds": wall,
        "lossless_greedy": lossless,
        "checkpoint": model.path or f"random:{cfg.model.preset}",
        "seed": cfg.seed,
        "samples": samples,
    }
    table = format_table(summary)
    print(table)
    print(f"τ = {stats.tau:.3f} tokens per target forward; {generated} tokens from {len(prompts)} prompts in {wall:.1f}s "
          f"(drafting {stats.draft_share:.0%} of the loop)" + ("" if lossless is None else f"; greedy output equals the target's: {lossless}"))
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    png = os.path.join(run_dir, "acceptance.png")
    plot_acceptance(summary, png)

    log.log_acceptance(stats.alpha, f"alpha per position (k={cfg.num_drafts}, {cfg.policy})")
    log.log({"tau": stats.tau, **{f"alpha_{i + 1}": a for i, a in enumerate(stats.alpha)},
             "time/draft_s": stats.draft_s, "time/verify_s": stats.verify_s, "time/draft_share": stats.draft_share})
    log.log_image("acceptance_plot", png)
    log.summary({k: v for k, v in summary.items() if k != "samples"})
    log.finish()
    return summary


def main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    @hydra.main(version_base="1.3", config_path="pkg://glm_mtp.conf", config_name="config")
    def _main(cfg: Any) -> None:
        from .validate import check_acceptance, exit_on_bad_config

        exit_on_bad_config(check_acceptance, cfg, HydraConfig.get().runtime.output_dir, "python -m glm_mtp.experiments.acceptance")
        run(cfg, HydraConfig.get().runtime.output_dir)

    _main()


if __name__ == "__main__":
    main()
