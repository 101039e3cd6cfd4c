"""A run's ``summary.json``, section by section: each function below returns one section's keys
and ``summarise`` composes them in file order. Readers of the file (and of older ones, whose keys
differ) are ``experiments.reporting.summary_keys`` and ``experiments/report.py``."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..loop import speedup as spd
from ..loop import stats as acc_stats
from ..loop.recall import recall_summary
from ..loop.stop_rules import stop_rule
from ..settings.prompts import path_sha256, prompts_path
from ..settings.sampling import decoder_sampling
from ..settings.validate import index_share, weights_dtype
from ..targets.provenance import provenance
from .measurement import Measurement, target_record


def summarise(cfg: Any, m: Measurement) -> dict[str, Any]:
    """The run's summary (summary.json): acceptance per position with bootstrap intervals over
    prompts, the counts behind it, the settings, the prompts, the target, timings, the output
    under a grammar, the lossless check, the speedup model at this run's costs, at GLM-5's and at
    the released model's of the drafter's family (``speedup.released``), and provenance.

    Args:
        cfg: the run's config (it has passed ``settings.validate.check_acceptance``).
        m: what the run measured (``acceptance_job.measure``).
    """
    counts_pp = per_prompt_counts(m)
    return {
        **acceptance_section(m, acc_stats.bootstrap(counts_pp, seed=cfg.seed)),
        **counts_section(cfg, m, counts_pp),
        **settings_section(cfg, m),
        **prompts_section(cfg, m),
        **target_section(m),
        **timing_section(m),
        **output_section(m),
        "lossless": lossless_section(m),
        **drafter_section(cfg, m),
        "speedup": speedup_section(cfg, m, counts_pp),
        **provenance_section(cfg, m),
        "samples": m.samples,
    }


def per_prompt_counts(m: Measurement) -> dict[str, list[Any]]:
    """Each prompt's counts (``counts_per_prompt``), the unit the bootstrap resamples: drafts
    reached and accepted per position, verification steps, wasted and forbidden drafts, the verify
    width histogram and the tokens committed."""
    pp = m.per_prompt
    return {"reached": [s.reached for s in pp], "accepted": [s.accepted for s in pp], "steps": [s.steps for s in pp],
            "wasted": [s.wasted for s in pp], "forbidden": [s.forbidden for s in pp],
            "widths": [s.widths for s in pp], "committed": [s.committed for s in pp]}


def acceptance_section(m: Measurement, ci: dict[str, Any]) -> dict[str, Any]:
    """What was measured where, and the acceptance: conditional alpha_i = accepted / reached at
    draft i, cumulative P(at least i drafts accepted) per verification, tau, each with its
    bootstrap 95% interval (``ci``: ``loop.stats.bootstrap``)."""
    stats = m.stats
    return {
        "mode": m.mode,
        "source": m.source,
        "acceptance_per_position": stats.alpha,  # conditional: P(draft i accepted | drafts 1..i-1 accepted)
        "alpha_ci": ci["alpha_ci"],
        "cumulative": stats.alpha_cumulative,  # P(at least i drafts accepted) per verification
        "cumulative_ci": ci["cumulative_ci"],
        "mean_accepted_length": stats.tau,
        "tau_ci": ci["tau_ci"],
    }


def counts_section(cfg: Any, m: Measurement, counts_pp: dict[str, list[Any]]) -> dict[str, Any]:
    """The counts behind the acceptance, pooled and per prompt, how the intervals resampled them,
    and how many drafts each round made and verified (the stop rule, the verify widths)."""
    stats = m.stats
    return {
        "counts": {"reached": stats.reached, "accepted": stats.accepted, "steps": stats.steps},
        "counts_per_prompt": counts_pp,
        "bootstrap": {"unit": "prompt", "replicates": acc_stats.REPLICATES, "seed": cfg.seed,
                      "interval": "percentile 95%"},
        "num_drafts": cfg.num_drafts,
        "stop": stop_rule(cfg).record(),  # the stop rule and its threshold (loop/stop_rules.py)
        # drafts verified per step: mean, and the histogram over widths 0..num_drafts
        "verify_width": {"mean": stats.mean_width, "histogram": stats.widths},
    }


def settings_section(cfg: Any, m: Measurement) -> dict[str, Any]:
    """The loop's settings: policy, backend, temperature, the verification rule and the sampler's
    truncation, the feed, the drafter's attention and (glm5_next, reference backend) its recall."""
    return {
        "policy": cfg.policy,
        "backend": cfg.backend.name,
        "temperature": float(cfg.temperature),
        # the verification rule (greedy at temperature 0; rejection | match, DESIGN.md §14) and the
        # seeded sampler's truncation (null: off)
        "verify": "greedy" if cfg.temperature == 0 else decoder_sampling(cfg)["verify"],
        "top_p": cfg.get("top_p"),
        "top_k": cfg.get("top_k"),
        "feed_hidden": cfg.feed_hidden,
        "attention": m.attention,  # sparse (the drafter's KPool selection) | dense (every visible row)
        # The indexer's recall per drafted row (experiments.loop.recall): median, p10, per position; None
        # without a glm5_next drafter on the reference backend.
        "recall": None if m.recall is None else recall_summary(m.recall, cfg.num_drafts),
    }


def prompts_section(cfg: Any, m: Measurement) -> dict[str, Any]:
    """The prompts: how many, batched how, their length, what was scored or generated after them,
    and their identity (sha256 of the token ids; of the file read for ``source=jsonl | text``)."""
    path = prompts_path(cfg)
    # source=jsonl / text read prompts.path (validation required it); a replay's files are in its trace record
    from_file = m.source in ("jsonl", "text") and m.trace is None and path is not None
    return {
        "prompts": len(m.windows),
        "batch_size": m.batch_size,
        # jsonl: each prompt its own length; a replay: the trace's
        "prompt_tokens": (None if m.source == "jsonl" else cfg.run.prompt_tokens if m.trace is None
                          else m.trace.meta["prompts"].get("prompt_tokens")),
        "scored_positions": m.stats.steps if m.mode == "teacher_forced" else None,
        "generated_tokens": m.generated,
        # sha256 of the windows' token ids (prompt + the text after it): runs with equal digests
        # saw the same prompts and are paired in report.py, across modes too.
        # (a replay: its trace's, the windows it was recorded from)
        "prompts_sha256": (hashlib.sha256(json.dumps(m.windows).encode()).hexdigest() if m.trace is None
                           else m.trace.meta["prompts"].get("windows_sha256")),
        # source=jsonl / text: the sha256 of the file read (of its files' names and sha256s for a folder)
        "prompts_file_sha256": path_sha256(path) if from_file and path is not None else None,
        "prompts_path": path if from_file else None,
    }


def target_section(m: Measurement) -> dict[str, Any]:
    """The target that verified, what the loop asked of it, and the trace replayed in its place."""
    return {
        # transformers' (version, class, config sha256, device map) or the package's
        "target": target_record(m),
        # what the loop asked of the target: a prefill per prompt and a forward per verification
        # (counts.steps; older summaries also wrote it as verify_forwards: reporting.summary_keys)
        # (a replay answers them from the trace; the live target runs them)
        "target_forwards": len(m.windows) + m.stats.steps,
        # the replayed trace (path, sha256 of its trace.json, its target, truncation, forwards); None: live
        "trace": None if m.trace is None else m.trace.record(),
    }


def timing_section(m: Measurement) -> dict[str, Any]:
    """Where the loop's time went: drafting, verifying, prefilling, the drafting share, the wall."""
    stats = m.stats
    return {
        "draft_seconds": stats.draft_s,
        "verify_seconds": stats.verify_s,
        "prefill_seconds": stats.prefill_s,
        "draft_share": stats.draft_share,
        "wall_seconds": m.wall,
    }


def output_section(m: Measurement) -> dict[str, Any]:
    """The output: its repetition, its grammar, its digest, and the drafts it forbade or wasted."""
    stats = m.stats
    return {
        # Distinct 4-grams / 4-grams within each generation: low values flag the repetition loops
        # a small model's greedy decoding falls into, which are easy to draft.
        "distinct_4gram_ratio": m.distinct / m.grams if m.grams else float("nan"),
        # The output's grammar (DESIGN.md §10): kind, sha256 of its text, origin, how the drafter
        # drafted (grammar.drafts); None without one. forbidden_drafts: drafts the grammar forbade
        # (per propose, the first forbidden draft and those after it; 0 with masked drafts).
        "grammar": None if m.grammars is None else m.grammars.record(),
        # sha256 of every prompt's generated tokens: greedy runs with equal digests emitted the same
        # text (masked and unmasked drafts under one grammar do: the target's verify decides).
        "outputs_sha256": m.outputs_sha256,
        "forbidden_drafts": stats.forbidden,
        # Drafts verified but not accepted, in all and per verification forward.
        "wasted_verify_slots": stats.wasted,
        "wasted_per_verify": stats.wasted / stats.steps if stats.steps else float("nan"),
    }


def lossless_section(m: Measurement) -> dict[str, Any] | None:
    """``lossless``: with ``run.check_lossless``, the prompts whose speculative output equals the
    target's own decode (greedy, or seeded under ``verify=match``), and per parting prompt its
    index and first differing generated token (0-based); None without the check."""
    if not m.check_lossless:
        return None
    n = len(m.windows)
    return {"prompts": n, "identical": n - len(m.divergences), "diverged": m.divergences}


def drafter_section(cfg: Any, m: Measurement) -> dict[str, Any]:
    """How the drafter drafted and in which numerics: draft rule, the target's numerics, the
    activations' dtype, the weights' (plain | fp8) and index sharing (DESIGN.md §9)."""
    return {
        "draft": m.draft,
        "target_numerics": m.numerics,
        "dtype": cfg.model.dtype,
        "weights_dtype": weights_dtype(cfg.model),  # fp8: the drafter's matrices block-scaled (DESIGN.md §8)
        # Whether the drafter shared step 1's selection across a propose's steps (DESIGN.md §9):
        # model.index_share, or the checkpoint's index_share_for_mtp_iteration where that is null.
        "index_share": m.model.mtp.config.index_share_for_mtp_iteration,
        "index_share_setting": index_share(cfg.model),
    }


def run_costs(cfg: Any, m: Measurement) -> dict[str, Any]:
    """The costs c and v(k) the speedup model uses: measured here on this run's target and
    drafter (a replay: the target's as its trace recorded them), GLM-5's from bytes, or a file's
    (``speedup.costs``)."""
    sp_cfg = cfg.get("speedup") or {}
    spec, repeats = sp_cfg.get("costs", "measured"), sp_cfg.get("repeats", 15)
    if m.trace is not None and spec == "measured":  # the target's, as recorded
        from ..traces.replay_run import replay_costs

        return replay_costs(m.trace, m.proposer, cfg.num_drafts, repeats)
    return spd.resolve_costs(spec, m.target, m.proposer, cfg.num_drafts,
                             m.windows[0][: max(2, cfg.run.prompt_tokens)], repeats)


def speedup_section(cfg: Any, m: Measurement, counts_pp: dict[str, list[Any]]) -> dict[str, Any]:
    """``speedup``: the speedup model (``loop/speedup.py``): tau(k) for k <= num_drafts from
    these counts and S(k) at this run's costs (``run_costs``), per batch, at this run's verify
    width per step, at GLM-5's costs, and at the released model's of the drafter's family."""
    costs = run_costs(cfg, m)
    speedup = spd.speedup_summary(counts_pp, costs["c"], costs["v"], seed=cfg.seed, source=costs["source"])
    speedup["cost_details"] = costs
    speedup["per_batch"] = spd.per_batch_summary(counts_pp, costs, seed=cfg.seed)  # a per-batch table: best k each
    glm5 = spd.glm5_costs(cfg.num_drafts)
    g = spd.predict(speedup["tau"], glm5["c"], glm5["v"])
    # these taus at GLM-5's costs
    speedup["glm5"] = {"c": glm5["c"], "v": glm5["v"], "predicted": g, "best_k": spd.best_k(g)}
    # S at this run's verify width per step (a stop rule trims it; without one it is S(num_drafts))
    speedup["at_width"] = spd.width_speedup_summary(counts_pp, costs["c"], costs["v"], seed=cfg.seed)
    speedup["glm5"]["at_width"] = spd.width_speedup_summary(counts_pp, glm5["c"], glm5["v"], seed=cfg.seed)
    # these counts at the released model's costs (GLM-5, or GLM-5.3-Flash for glm5_next): what a toy cannot show
    speedup["released"] = spd.released_speedup(counts_pp, m.model.mtp.config.family, cfg.num_drafts, seed=cfg.seed)
    return speedup


def provenance_section(cfg: Any, m: Measurement) -> dict[str, Any]:
    """Where the drafter came from (its checkpoint, git commit and the checkpoint's and corpus'
    sha256: ``targets.provenance``), the W&B group and the seed."""
    return {
        "checkpoint": m.model.path or f"random:{cfg.model.preset}",
        **provenance(m.model.path),
        "group": cfg.get("group", None),
        "run_name": cfg.run.get("name"),  # the experiment's label (run.name)
        "seed": cfg.seed,
    }
