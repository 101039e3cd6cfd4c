"""The stop-rule sweep: what stopping a round early is worth, against the hindsight oracle.

    python -m glm_mtp.experiments.stop_sweep                      # conf/stop_sweep.yaml: the glm5_next toy
    python -m glm_mtp.experiments.stop_sweep model=shipped        # the GLM-5 toy
    python -m glm_mtp.experiments.stop_sweep sweep.rescore=RUN/sweep.json speedup.costs=bytes:glm5next   # other costs
    python -m glm_mtp.experiments.stop_sweep sweep.rescore=RUN/sweep.json speedup.costs=glm53flash-m5max-ds4

One model, one target and one drafter are loaded once; on the same prompts the loop runs

- fixed k = 1..K (no stop rule); the K run records every round's confidences and outcome;
- each rule of ``sweep.thresholds`` (``prob``, ``cumprob``, ``margin``) at each of its thresholds,
  proposing K drafts a round and verifying the rule's prefix (``loop/stop_rules.py``);

and from the K run's rounds

- the hindsight oracle (``loop/oracle.py``): each round verifies exactly the drafts the target
  accepts, the ceiling of every rule;
- calibration per draft position: acceptance against ``p`` and ``margin`` in bins with bootstrap
  95% intervals over prompts, and Spearman's correlation of ``p_1``, ``margin_1`` and the
  product of the K probabilities with the accepted depth (``loop/calibration.py``).

Every entry gets tau, the mean verify width and the predicted speedup S at a verify width that
varies per step (``speedup.width_speedup_summary``), each with its 95% interval, at the run's
costs (``speedup.costs``, default GLM-5's from bytes), with drafting that stops at the first draft
the rule refuses, and in two verify regimes (``VERIFY_REGIMES``). ``sweep.rescore`` recomputes a
finished sweep's rows at other costs from its per-prompt counts, running nothing. Writes
``sweep.json``, ``sweep.md`` (the table), ``calibration.png`` and ``sweep.png`` into the run
directory and logs them to the logger.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import torch

from .loop import speedup as spd
from .settings.model import apply_drafter_settings, load_model, make_target
from .settings.windows import run_prompts
from .settings.prompts import check_prompt_lengths
from .loop.calibration import MARGIN_EDGES, PROB_EDGES, calibration, depth_correlation
from .loop.oracle import oracle_per_prompt
from .loop.stop_rules import NO_STOP, STOP_RULES, StopRule, check_stop_rule
from .loop.speculative import SpecStats, SpeculativeDecoder, make_proposer, speculative_results, teacher_forced
from .settings.sampling import decoder_sampling
from .reporting.kept import RecordLog, keeping, late_failure, replaced, write_json, write_text

SWEPT_RULES = tuple(r for r in STOP_RULES if r != "none")
# v(s) beside the run's costs, c kept: ``flat`` a verify of any width as cheap as a decode step
# (memory-bound dense layers, or experts a batch reads anyway: trimming can only lose tokens);
# ``compute`` each verified token as costly as a decoded one (a compute-bound server at high
# concurrency, where the verify's tokens take the batch's compute: what trimming saves most in).
VERIFY_REGIMES = {"flat": lambda s: 0.0, "compute": lambda s: float(s)}


def check_sweep(cfg: Any) -> None:
    """The acceptance settings (``validate.check_acceptance``), ``stop.rule=none`` (the sweep
    sets each run's rule), ``sweep.fixed_k`` a bool and ``sweep.thresholds`` a mapping from rules
    to non-empty lists of finite numbers."""
    from .settings.validate import check_acceptance_run, need_bool

    check_acceptance_run(cfg)
    check_sweep_reads(cfg)
    stop = cfg.get("stop") or {}
    if stop.get("rule", "none") != "none":
        raise ValueError(f"stop.rule must be none for the sweep (it runs every rule of sweep.thresholds); got "
                         f"{stop.get('rule')!r}")
    need_bool(cfg, "sweep.fixed_k")
    path = cfg.sweep.get("rescore")
    if path is not None:
        if cfg.speedup.costs == "measured":
            raise ValueError("sweep.rescore recomputes S from a finished sweep's counts without running anything: "
                             "speedup.costs must be bytes:glm5, bytes:glm5next, a cost table (python -m "
                             "glm_mtp.experiments.costs list) or a file, not measured")
        from .reporting.read_back import check_sweep_record, read_json_file

        check_rescore_reads(cfg)
        check_sweep_record(read_json_file(path, "sweep.rescore"), f"sweep.rescore: {path}")
    thresholds = cfg.get("sweep", {}).get("thresholds")
    if thresholds is None or not hasattr(thresholds, "items"):
        raise ValueError(f"sweep.thresholds must map rules ({', '.join(SWEPT_RULES)}) to lists of thresholds; got "
                         f"{thresholds!r}")
    for rule, values in thresholds.items():
        if rule not in SWEPT_RULES:
            raise ValueError(f"sweep.thresholds: {rule!r} is not a rule; the rules are {', '.join(SWEPT_RULES)}")
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or not len(values):
            raise ValueError(f"sweep.thresholds.{rule} must be a non-empty list of numbers; got {values!r}")
        for t in values:
            check_stop_rule(rule, t, key=f"sweep.thresholds.{rule}")


# What a rescore reads (it runs nothing): the finished sweep, the costs, the bootstrap's seed and
# the logger; Hydra's task_name names its run folder.
RESCORE_READS = ("sweep.rescore", "speedup.costs", "seed", "group", "task_name")


def check_rescore_reads(cfg: Any) -> None:
    """``sweep.rescore`` recomputes a finished sweep's rows from its counts: every key given
    another value than conf/stop_sweep.yaml's but ``RESCORE_READS`` and ``logger.*`` (the
    model, the prompts, the loop's keys, ``run.name``: the finished sweep's stand) is refused
    naming it, since the rescore would drop it."""
    from omegaconf import OmegaConf

    from .settings.explicit import given_keys, plain, value_at

    def leaves(node: Any, prefix: str = "") -> list[str]:
        out: list[str] = []
        for k, v in node.items():
            name = f"{prefix}.{k}" if prefix else str(k)
            out += leaves(v, name) if isinstance(v, dict) and v else [name]
        return out

    keys = [k for k in leaves(OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else cfg)
            if k not in RESCORE_READS and not k.startswith("logger.")]
    for key in given_keys(cfg, keys):
        raise ValueError(f"{key}={plain(value_at(cfg, key))!r}: sweep.rescore recomputes a finished sweep's rows "
                         "from its counts and runs nothing, so it does not read it (it reads speedup.costs and "
                         "seed): leave it unset")


def check_sweep_reads(cfg: Any) -> None:
    """Acceptance keys the sweep does not run with, refused rather than dropped: a grammar
    (``grammar=...`` or a ``source=jsonl`` line's ``json_schema``: the sweep's loop verifies
    unconstrained), ``attention=dense`` (its drafter keeps its own selection) and
    ``run.check_lossless`` (it decodes with no target-alone pass). ``ValueError`` naming the key."""
    node = cfg.get("grammar") or {}
    if node.get("kind", "none") != "none":
        raise ValueError(f"grammar={node.get('kind')}: the stop sweep verifies unconstrained (its loop takes no "
                         "grammar): run grammars with python -m glm_mtp.experiments.acceptance")
    if cfg.get("source") == "jsonl" and (cfg.get("trace") or {}).get("path") is None:
        from .grammars import jsonl_schemas

        for i, spec in enumerate(jsonl_schemas(cfg.prompts.path, cfg.run.num_prompts)):
            if spec is not None:
                raise ValueError(f"prompts.path: {cfg.prompts.path}: prompt {i} carries a json_schema, and the stop "
                                 "sweep verifies unconstrained (run per-prompt schemas with acceptance)")
    if cfg.get("attention", "sparse") != "sparse":
        raise ValueError(f"attention={cfg.get('attention')}: the stop sweep drafts with the drafter's own selection "
                         "(attention=sparse); run the dense ablation with acceptance")
    if (cfg.get("run") or {}).get("check_lossless"):
        raise ValueError("run.check_lossless=true: the stop sweep runs no target-alone decode to compare with (run it "
                         "with acceptance)")


class Runner:
    """The sweep's model, target, drafter and prompts, loaded once; ``run(k, stop)`` runs the
    loop (or teacher forcing) over every prompt and returns one ``SpecStats`` per prompt. With
    ``trace.path`` the target is the trace's replay (DESIGN.md §11: the drafter alone is loaded,
    the prompts are the trace's items), so each entry of the sweep costs only the drafter."""

    def __init__(self, cfg: Any) -> None:
        torch.set_num_threads(cfg.threads)
        logging.getLogger("glm_mtp").setLevel(logging.WARNING)  # the drafter logs every prefill at INFO
        self.cfg, self.trace = cfg, None
        if (cfg.get("trace") or {}).get("path") is not None:
            from .targets.replay import ReplayTarget
            from .traces.replay_run import load_drafter, open_for_replay, replay_prompts

            self.model = apply_drafter_settings(load_drafter(cfg.model), cfg.model)
            self.trace = open_for_replay(cfg, self.model.mtp.config)
            rp = replay_prompts(self.trace, cfg.run.max_new_tokens, cfg.num_drafts)
            self.windows, self.starts = rp.windows, rp.starts
            self.prompt_lens, self.budgets = rp.prompt_lens, rp.budgets
            max_seq_len = min(cfg.model.max_seq_len, self.model.mtp.config.max_position_embeddings)
            self.target, self.device = ReplayTarget(self.trace, self.model.mtp.device), self.model.mtp.device
        else:
            self.model = load_model(cfg.model)
            self.windows, self.starts = run_prompts(cfg, self.model, cfg.source)
            self.prompt_lens = [cfg.run.prompt_tokens] * len(self.windows)
            self.budgets = [cfg.run.max_new_tokens] * len(self.windows)
            max_seq_len = min(cfg.model.max_seq_len, self.model.mtp.config.max_position_embeddings)
            check_prompt_lengths(self.starts, cfg.run.max_new_tokens, cfg.num_drafts, max_seq_len, "prompts")
            numerics = "transformers" if self.model.hf is not None else cfg.get("target_numerics", "vendor")
            self.target, self.device = make_target(cfg, self.model, max_seq_len, numerics)
        self.proposer = make_proposer(cfg.backend.name, self.model.mtp, max_seq_len, cfg.feed_hidden)

    def run(self, k: int, stop: StopRule = NO_STOP, record_rounds: bool = False) -> list[SpecStats]:
        cfg = self.cfg
        draft = cfg.get("draft", "argmax")
        sampling = decoder_sampling(cfg)
        decoder = SpeculativeDecoder(self.target, self.proposer, k, cfg.policy, cfg.temperature, cfg.seed, draft,
                                     stop=stop, record_rounds=record_rounds, **sampling)
        if cfg.mode == "teacher_forced":
            return [teacher_forced(self.target, self.proposer, w, plen, k, cfg.policy, cfg.temperature, decoder.gen,
                                   self.device, draft, stop, record_rounds, **sampling, seed=cfg.seed)
                    for w, plen in zip(self.windows, self.prompt_lens)]
        results = speculative_results(decoder, self.starts, self.budgets, cfg.get("batch_size", 1), self.device)
        return [res.stats for _, res in results]


def per_prompt(stats: list[SpecStats]) -> dict[str, Any]:
    """What ``speedup.width_speedup_summary`` reads: per prompt, committed tokens and widths."""
    return {"committed": [s.committed for s in stats], "widths": [s.widths for s in stats]}


def entry(name: str, rule: str, threshold: float | None, k: int, pp: dict[str, Any], costs: dict[str, Any],
          seed: int) -> dict[str, Any]:
    """One row of the sweep: its rule, threshold, k and the speedup summary at its widths, at the
    run's costs, in the two regimes of ``VERIFY_REGIMES`` and at the run's costs with drafting that
    stops at the first refused draft (``serial``: a step of width s drafts min(s + 1, k), not k)
    (``regimes``: S and its interval)."""
    sp = spd.width_speedup_summary(pp, costs["c"], costs["v"][:k], seed=seed)
    regimes = {}
    for regime, v_of in VERIFY_REGIMES.items():
        r = spd.width_speedup_summary(pp, costs["c"], [v_of(s) for s in range(1, k + 1)], seed=seed)
        regimes[regime] = {"predicted": r["predicted"], "predicted_ci": r["predicted_ci"]}
    r = spd.width_speedup_summary(pp, costs["c"], costs["v"][:k], seed=seed,
                                  drafted=[min(s + 1, k) for s in range(k + 1)])
    regimes["serial"] = {"predicted": r["predicted"], "predicted_ci": r["predicted_ci"]}
    return {"name": name, "rule": rule, "threshold": threshold, "num_drafts": k, **sp, "regimes": regimes,
            "counts": pp}


def oracle_condition(costs: dict[str, Any], best: float) -> dict[str, Any]:
    """Whether verifying exactly the accepted drafts is each round's best width at these costs:
    every step of v is below 1 / S (``loop/oracle.py``); S the best of the sweep."""
    steps = [b - a for a, b in zip([0.0, *costs["v"]], costs["v"])]
    return {"max_verify_step": max(steps), "one_over_best_S": 1.0 / best, "holds": max(steps) < 1.0 / best}


def progress(row: dict[str, Any], seconds: float) -> None:
    """One line per finished entry (a sweep takes minutes)."""
    print(f"{row['name']}: tau {row['tau']:.3f}, mean width {row['mean_width']:.2f}, S {row['predicted']:.3f} "
          f"({seconds:.0f}s)", flush=True)


def rescore(cfg: Any) -> dict[str, Any]:
    """The finished sweep at ``sweep.rescore`` (its ``sweep.json``) at this config's costs
    (``speedup.costs``: bytes:glm5, bytes:glm5next, a cost table or a file, ``speedup.resolve_costs``):
    every row again from its per-prompt
    counts, nothing run; calibration and correlations as recorded."""
    from .reporting.read_back import check_sweep_record, read_json_file

    path = cfg.sweep.rescore
    old = check_sweep_record(read_json_file(path, "sweep.rescore"), f"sweep.rescore: {path}")
    costs = spd.resolve_costs(cfg.speedup.costs, None, None, old["num_drafts"], [])
    rows = [entry(r["name"], r["rule"], r["threshold"], r["num_drafts"], r["counts"], costs, cfg.seed)
            for r in old["rows"]]
    best = max(r["predicted"] for r in rows)
    return {**old, "costs": costs, "rows": rows, "oracle_condition": oracle_condition(costs, best),
            "rescored_from": os.path.abspath(path)}


def sweep(cfg: Any, rows_log: RecordLog | None = None) -> dict[str, Any]:
    """Run every entry (module docstring) and return the sweep's record. Each row goes to
    ``rows_log`` as it finishes (``reporting.kept``: a later failure keeps the rows before it)."""
    rows_log = rows_log or RecordLog(None)
    t0 = time.perf_counter()
    runner = Runner(cfg)
    K, seed = cfg.num_drafts, cfg.seed
    sp_cfg = cfg.get("speedup") or {}
    costs = spd.resolve_costs(sp_cfg.get("costs", "glm5"), runner.target, runner.proposer, K,
                              runner.windows[0][: max(2, cfg.run.prompt_tokens)], sp_cfg.get("repeats", 15))
    rows, timings = [], {}
    ks = range(1, K + 1) if cfg.sweep.fixed_k else [K]
    full: list[SpecStats] = []
    for k in ks:
        t = time.perf_counter()
        stats = runner.run(k, NO_STOP, record_rounds=k == K)
        timings[f"k={k}"] = time.perf_counter() - t
        rows.append(entry(f"fixed k={k}", "none", None, k, per_prompt(stats), costs, seed))
        rows_log.append(rows[-1])
        progress(rows[-1], timings[f"k={k}"])
        if k == K:
            full = stats
    rounds = [s.rounds or [] for s in full]
    rows.append(entry(f"oracle (K={K})", "oracle", None, K, oracle_per_prompt(rounds, K), costs, seed))
    rows_log.append(rows[-1])
    for rule, values in cfg.sweep.thresholds.items():
        for t_value in values:
            t = time.perf_counter()
            stats = runner.run(K, StopRule(rule, float(t_value)))
            timings[f"{rule}>={t_value:g}"] = time.perf_counter() - t
            rows.append(entry(f"{rule} >= {float(t_value):g}", rule, float(t_value), K, per_prompt(stats), costs,
                              seed))
            rows_log.append(rows[-1])
            progress(rows[-1], timings[f"{rule}>={t_value:g}"])
    best = max(r["predicted"] for r in rows)
    return {
        "num_drafts": K, "mode": cfg.mode, "source": cfg.source, "backend": cfg.backend.name,
        "run_name": cfg.run.name,
        "checkpoint": runner.model.path or f"random:{cfg.model.preset}", "model_shipped": cfg.model.get("shipped"),
        "trace": None if runner.trace is None else runner.trace.record(),
        "temperature": float(cfg.temperature), "draft": cfg.get("draft", "argmax"), "policy": cfg.policy,
        # the drafter and target keys it built from (issue 49: every key read is recorded)
        "feed_hidden": cfg.feed_hidden, "model_dtype": cfg.model.dtype,
        "weights_dtype": cfg.model.get("weights_dtype", "plain") or "plain",
        "index_share": bool(runner.model.mtp.config.index_share_for_mtp_iteration),
        "target_numerics": ("recorded: " + str(runner.trace.meta["target"].get("numerics"))
                            if runner.trace is not None else "transformers" if runner.model.hf is not None
                            else cfg.get("target_numerics", "vendor")),
        "batch_size": cfg.get("batch_size", 1), "seed": cfg.seed,
        "prompts": len(runner.windows), "prompt_tokens": cfg.run.prompt_tokens,
        "max_new_tokens": cfg.run.max_new_tokens, "costs": costs, "rows": rows,
        "oracle_condition": oracle_condition(costs, best),
        "calibration": {"prob": calibration(rounds, K, "prob", PROB_EDGES, seed),
                        "margin": calibration(rounds, K, "margin", MARGIN_EDGES, seed)},
        "depth_correlation": depth_correlation(rounds), "seconds": timings,
        "wall_seconds": time.perf_counter() - t0,
    }


def fmt(x: float, ci: list[float], digits: int = 2) -> str:
    if x is None or math.isnan(x):
        return "—"
    return f"{x:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def format_table(record: dict[str, Any]) -> str:
    """The sweep as a Markdown table: one row per entry, S's best row marked."""
    best = max(record["rows"], key=lambda r: r["predicted"])
    costs = spd.costs_label({**record["costs"], "costs": record["costs"].get("source")})
    lines = ["| entry | mean verify width | τ | S (costs " + costs + ") | S, drafting "
             "stops with the rule | S (v = 0) | S (v(s) = s) |", "|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        mark = " **best**" if r is best else ""
        cells = " | ".join(fmt(r["regimes"][k]["predicted"], r["regimes"][k]["predicted_ci"], 3)
                           for k in ("serial", "flat", "compute"))
        lines.append(f"| {r['name']}{mark} | {fmt(r['mean_width'], r['mean_width_ci'])} | {fmt(r['tau'], r['tau_ci'])} "
                     f"| {fmt(r['predicted'], r['predicted_ci'], 3)} | {cells} |")
    return "\n".join(lines)


def format_calibration(record: dict[str, Any]) -> str:
    """Acceptance per bin of p (positions pooled and draft 1), and the depth correlations."""
    cal = record["calibration"]["prob"]
    edges = cal["edges"]
    lines = ["| p bin | drafts (all positions) | acceptance [95% CI] | mean p | drafts (d_1) | acceptance d_1 |",
             "|---|---|---|---|---|---|"]
    for b in range(len(edges) - 1):
        a, one = cal["all"], cal["per_position"][0]
        if not a["reached"][b]:
            continue
        lines.append(f"| [{edges[b]:.1f}, {edges[b + 1]:.1f}) | {a['reached'][b]} | "
                     f"{fmt(a['acceptance'][b], a['ci'][b])} | {a['mean'][b]:.2f} | {one['reached'][b]} | "
                     f"{fmt(one['acceptance'][b], one['ci'][b])} |")
    dc = record["depth_correlation"]
    lines.append(f"\nECE of p (all positions): {cal['all']['ece']:.3f}; Spearman with the accepted depth over "
                 f"{dc['rounds']} rounds: p_1 {dc['prob_1']:.2f}, margin_1 {dc['margin_1']:.2f}, "
                 f"prod p {dc['cumprob_K']:.2f}")
    return "\n".join(lines)


def plot_calibration(record: dict[str, Any], path: str) -> None:
    """Acceptance against p (left) and margin (right) per draft position, with 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, which in zip(axes, ("prob", "margin")):
        cal = record["calibration"][which]
        for i, pos in enumerate(cal["per_position"]):
            xs, ys, lo, hi = [], [], [], []
            for b, (n, rate, ci, mean) in enumerate(zip(pos["reached"], pos["acceptance"], pos["ci"], pos["mean"])):
                if n < 5:  # a bin with fewer than 5 drafts says nothing
                    continue
                xs.append(mean if which == "prob" else b)
                ys.append(rate)
                lo.append(rate - ci[0])
                hi.append(ci[1] - rate)
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", capsize=2, ms=3, label=f"draft {i + 1}")
        if which == "prob":
            ax.plot([0, 1], [0, 1], "k--", lw=0.8)
            ax.set_xlabel("p (mean of the bin)")
        else:
            edges = cal["edges"]
            ax.set_xticks(range(len(edges) - 1))
            ax.set_xticklabels([f"[{a:g},{b:g})" for a, b in zip(edges[:-1], edges[1:])], rotation=30, fontsize=7)
            ax.set_xlabel("margin bin")
        ax.set_ylim(0, 1.02)
        ax.set_ylabel("acceptance (drafts reached)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{record['checkpoint'].split('/')[-1]}: acceptance against the drafter's confidence (K = "
                 f"{record['num_drafts']}, {record['prompts']} prompts)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(record: dict[str, Any], path: str) -> None:
    """S against the mean verify width: each rule's thresholds as a line, fixed k and the oracle
    as points, with 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    styles = {"none": ("ks", "fixed k"), "oracle": ("r*", "oracle"), "prob": ("o-", "prob"),
              "cumprob": ("^-", "cumprob"), "margin": ("d-", "margin")}
    for rule, (style, label) in styles.items():
        rows = [r for r in record["rows"] if r["rule"] == rule]
        if not rows:
            continue
        xs, ys = [r["mean_width"] for r in rows], [r["predicted"] for r in rows]
        err = [[y - r["predicted_ci"][0] for y, r in zip(ys, rows)],
               [r["predicted_ci"][1] - y for y, r in zip(ys, rows)]]
        ax.errorbar(xs, ys, yerr=err, fmt=style, capsize=2, ms=8 if rule == "oracle" else 4, label=label)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xlabel("mean drafts verified per step")
    ax.set_ylabel(f"predicted speedup S (costs {record['costs'].get('source')})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{record['checkpoint'].split('/')[-1]}: stop rules at K = {record['num_drafts']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(cfg: Any, record: dict[str, Any], run_dir: str) -> None:
    """Print the tables; write sweep.json, sweep.md and the two plots; log them."""
    from omegaconf import OmegaConf

    from .reporting.wandb_log import make_logger

    table, cal = format_table(record), format_calibration(record)
    print(table)
    print(cal)
    oc = record["oracle_condition"]
    print(f"oracle = verify exactly the accepted drafts: best per round at these costs: {oc['holds']} (largest step of "
          f"v {oc['max_verify_step']:.3f} vs 1/S {oc['one_over_best_S']:.3f}); {record['wall_seconds']:.0f}s")
    os.makedirs(run_dir, exist_ok=True)
    write_json(os.path.join(run_dir, "sweep.json"), record)  # first, and whole or not at all (reporting.kept)
    write_text(os.path.join(run_dir, "sweep.md"), table + "\n\n" + cal + "\n")
    with replaced(os.path.join(run_dir, "calibration.png")) as tmp:
        plot_calibration(record, tmp)
    with replaced(os.path.join(run_dir, "sweep.png")) as tmp:
        plot_sweep(record, tmp)
    log = make_logger(cfg.logger, run_dir, OmegaConf.to_container(cfg, resolve=True), job_type="stop_sweep",
                      name=f"stop-sweep-K{record['num_drafts']}-{cfg.mode}", group=cfg.get("group"))
    log.log({f"S/{r['name']}": r["predicted"] for r in record["rows"]})
    log.log_image("calibration_plot", os.path.join(run_dir, "calibration.png"))
    log.log_image("sweep_plot", os.path.join(run_dir, "sweep.png"))
    log.summary({k: v for k, v in record.items() if k != "rows"})
    log.finish()


ROWS_FILE = "rows.jsonl"


def run(cfg: Any, run_dir: str) -> dict[str, Any]:
    """Sweep (or rescore a finished sweep, ``sweep.rescore``), then write into ``run_dir``.
    Returns the record. Each finished row is in ``run_dir/rows.jsonl`` as it finishes; a failure
    after one is a ``LateFailure`` naming what was kept (``reporting.kept``)."""
    rows_log = RecordLog(os.path.join(run_dir, ROWS_FILE))
    with keeping("the sweep", rows_log, "row(s)"):
        record = rescore(cfg) if cfg.sweep.get("rescore") is not None else sweep(cfg, rows_log)
    try:
        write(cfg, record, run_dir)
    except Exception as e:
        raise late_failure("writing the sweep's files", e,
                           [os.path.join(run_dir, "sweep.json"), os.path.join(run_dir, "sweep.md"),
                            os.path.join(run_dir, ROWS_FILE)]) from e
    return record


def main() -> None:
    from .settings.entry import hydra_main

    hydra_main("stop_sweep", "python -m glm_mtp.experiments.stop_sweep", check_sweep,
               lambda cfg, hc: run(cfg, hc.runtime.output_dir))


if __name__ == "__main__":
    main()
