"""What an acceptance run leaves: its lines printed and kept in ``acceptance.log``,
``summary.json``, ``acceptance.png`` and ``speedup.png`` in the run's folder, and the same
logged to the configured logger (W&B offline, or none)."""

from __future__ import annotations

import os
from typing import Any, cast

from ..loop import speedup as spd
from ..reporting.kept import replaced, write_json
from .lines import run_lines
from .plot import plot_acceptance


def write(cfg: Any, summary: dict[str, Any], run_dir: str) -> None:
    """Print the run's table and lines; write summary.json, acceptance.png, speedup.png and
    acceptance.log (every line printed) into ``run_dir``; log it all to ``cfg.logger``.

    Args:
        cfg: the run's config.
        summary: its summary (``acceptance_job.summary.summarise``).
        run_dir: the run's folder (made if missing).
    """
    from omegaconf import OmegaConf

    from ..reporting.wandb_log import make_logger

    mode, source, k = summary["mode"], summary["source"], cfg.num_drafts
    speedup = summary["speedup"]
    printed = run_lines(summary)
    for line in printed:
        print(line)
    os.makedirs(run_dir, exist_ok=True)
    write_json(os.path.join(run_dir, "summary.json"), summary)  # whole or not at all (reporting.kept)
    png = os.path.join(run_dir, "acceptance.png")
    with replaced(png) as tmp:
        plot_acceptance(summary, tmp)
    with replaced(os.path.join(run_dir, "speedup.png")) as tmp:
        spd.plot_speedup(speedup, tmp,
                         f"{mode}, {source}, k ≤ {k}: S(k) = τ(k) / (1 + k·{speedup['c']:.2f} + v(k)), costs "
                         f"{speedup['costs']}", released=speedup["released"])

    config = cast("dict[str, Any]", OmegaConf.to_container(cfg, resolve=True))  # a composed config: str keys
    log = make_logger(cfg.logger, run_dir, config, job_type="acceptance",
                      name=f"{mode}-{source}-k{k}-{cfg.policy}-{cfg.feed_hidden}-T{cfg.temperature:g}",
                      group=summary["group"])
    log.log_acceptance(summary["acceptance_per_position"], f"alpha per position (k={k}, {cfg.policy}, {mode})",
                       summary)
    log.log(logged_metrics(summary))
    log.log_histogram("verify_width/histogram", summary["verify_width"]["histogram"])
    log.log_samples(summary["samples"])
    log.log_image("acceptance_plot", png)
    log.log_image("speedup_plot", os.path.join(run_dir, "speedup.png"))
    log.summary({key: v for key, v in summary.items() if key not in ("samples", "counts_per_prompt")})
    log.finish()
    last = f"wrote {run_dir}/ (summary.json, acceptance.png, speedup.png, acceptance.log)"
    print(last)
    printed.append(last)
    with open(os.path.join(run_dir, "acceptance.log"), "a") as f:
        f.write("".join(line + "\n" for line in printed))


def logged_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The scalars a run logs: tau, alpha_i and P(acc >= i) per position, the speedup model's S(k)
    (at this run's costs and the released model's), best k, the verify width, timings, forbidden
    and wasted drafts, and (glm5_next, reference backend) the recall."""
    speedup, recall = summary["speedup"], summary.get("recall")
    return {"tau": summary["mean_accepted_length"],
            **{f"alpha_{i + 1}": a for i, a in enumerate(summary["acceptance_per_position"])},
            **{f"cumulative_{i + 1}": a for i, a in enumerate(summary["cumulative"])},
            "speedup/best_k": speedup["best_k"],
            "verify_width/mean": summary["verify_width"]["mean"], "speedup/at_width": speedup["at_width"]["predicted"],
            **{f"speedup/S_{i + 1}": x for i, x in enumerate(speedup["predicted"])},
            **{f"speedup/released_S_{i + 1}": x for i, x in enumerate(speedup["released"]["predicted"])},
            "time/draft_s": summary["draft_seconds"], "time/verify_s": summary["verify_seconds"],
            "time/draft_share": summary["draft_share"],
            "forbidden_drafts": summary["forbidden_drafts"], "wasted_per_verify": summary["wasted_per_verify"],
            **({} if recall is None else recall_metrics(recall))}


def recall_metrics(recall: dict[str, Any]) -> dict[str, Any]:
    """The recall's scalars (``summary["recall"]``): median, p10, mean, the oracle's, the dense
    entropy, the share of real selections, and p10 and median per position."""
    return {"recall/median": recall["median"], "recall/p10": recall["p10"], "recall/mean": recall["mean"],
            "recall/oracle_median": recall["oracle_median"], "recall/oracle_p10": recall["oracle_p10"],
            "recall/entropy_median": recall["entropy_median"],
            "recall/selection_real_share": recall["selection_real_share"],
            **{f"recall/p10_{i + 1}": p["p10"] for i, p in enumerate(recall["per_position"])},
            **{f"recall/median_{i + 1}": p["median"] for i, p in enumerate(recall["per_position"])}}
