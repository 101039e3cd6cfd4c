"""Acceptance-rate experiment: per-position acceptance of the drafter on held-out or
out-of-distribution text, with counts and bootstrap intervals over prompts.

    python -m glm_mtp.experiments.acceptance                                   # the shipped model
    python -m glm_mtp.experiments.acceptance mode=teacher_forced source=ood    # natural contexts
    python -m glm_mtp.experiments.acceptance -m num_drafts=1,2,3,4,5 policy=first_row_kept,refeed
    python -m glm_mtp.experiments.report multirun/acceptance/<date>            # one table + plot
    python -m glm_mtp.experiments.acceptance temperature=1 draft=sampled       # drafts sampled from q
    python -m glm_mtp.experiments.acceptance model.dtype=bfloat16 target_numerics=pinned run.check_lossless=true
    python -m glm_mtp.experiments.acceptance batch_size=4                      # 4 prompts per propose_batch
    python -m glm_mtp.experiments.acceptance num_drafts=5 stop.rule=prob stop.threshold=0.6   # trim each round

Modes: ``speculative`` (default) runs the speculative loop from each prompt, so after the prompt
the contexts are the target's own output; ``teacher_forced`` scores one speculative step at
every position of natural text (``speculative.teacher_forced``). Sources: ``heldout`` (the
checkpoint's held-out items) or ``ood`` (the installed hydra and omegaconf sources, never in
training).

Prints a table, writes ``summary.json`` (the counts per prompt and position, conditional and
cumulative acceptance with bootstrap 95% intervals; ``stats``) and ``acceptance.png`` into the
Hydra run directory, and logs to W&B (offline unless ``logger.mode=online``; ``logger=none`` for
no tracker).

``draft``: ``argmax`` (default) or ``sampled`` (each draft drawn from the drafter's softmax at the
temperature, verified by full rejection sampling; needs ``temperature > 0``). ``target_numerics``:
``vendor`` (torch's kernels, default) or ``pinned`` (DESIGN.md §5: batch-invariant). With
``run.check_lossless=true`` (the greedy loop, and ``verify=match`` at temperature > 0, against
the target's own seeded sampling of the prompt) every prompt is also decoded by the target
alone, one token per forward, and ``summary.json`` records ``lossless: {prompts, identical,
diverged}`` (``diverged``: each parting prompt's index and first differing generated token),
against the greedy decode or, under ``verify: match``, the seeded one
(``reporting.summary_keys.lossless_greedy`` / ``lossless_seeded`` read it).

``stop.rule`` / ``stop.threshold`` (``loop/stop_rules.py``): each round verifies only the drafts
1..s on which the rule holds (from the drafter's ``draft_confidence``); ``summary.json`` records the
rule, the verify width per step (``verify_width``: mean and histogram) and the speedup at that
varying width (``speedup.at_width``).

``trace.path=DIR``: replay a trace (DESIGN.md §11; ``python -m glm_mtp.experiments.record``) instead
of running the target: the loop's prompts are the trace's items, the target's answers and hiddens
its record, and only the drafter is loaded (its MTP layer, embedding and head); greedy only.

``batch_size`` (default 1): the loop runs that many prompts together
(``SpeculativeDecoder.generate_batch``: one ``propose_batch`` per round for every live prompt);
greedy, its counts and tokens are those of ``batch_size=1`` (only the timings differ). Batches
need the speculative mode, ``policy=first_row_kept`` and ``draft=argmax``. At ``temperature > 0``
the batched loop draws from the generator in another order, so its samples differ from
``batch_size=1``'s (distributed alike).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from .loop import speedup as spd
from .loop import stats as acc_stats
from .targets.checkpoint import LoadedModel
from .settings.model import apply_drafter_settings, load_model, make_target
from .settings.prompts import check_prompt_lengths, path_sha256, prompts_path
from .settings.windows import run_prompts
from .reporting.measured import LateFailure, MeasuredFile
from .targets.provenance import provenance
from .loop.recall import ProbedProposer, RecallProbe, recall_summary, selection
from .loop.stop_rules import stop_rule
from .settings.sampling import decoder_sampling
from .loop.speculative import (SpecStats, SpeculativeDecoder, make_proposer, speculative_results, target_decode,
                               teacher_forced)
from .targets.target import class_path
from .settings.validate import (check_acceptance_run, check_attention, index_share,
                                weights_dtype)

def fmt_ci(x: float, ci: list[float]) -> str:
    """``0.612 [0.55, 0.67]``; an em dash where undefined."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.3f} [{ci[0]:.2f}, {ci[1]:.2f}]"


def format_table(summary: dict[str, Any]) -> str:
    """A Markdown table of one run: conditional and cumulative acceptance per position with their
    bootstrap 95% intervals, tau and the run's settings."""
    k = summary["num_drafts"]
    head = ("| mode | source | backend | weights | policy | feed | "
            "temperature | k | " + " | ".join(f"α_{i + 1}" for i in range(k)) + " | "
            + " | ".join(f"P(acc ≥ {i + 1})" for i in range(k)) + " | τ | draft share |")
    sep = "|" + "---|" * (8 + 2 * k + 2)
    alphas = " | ".join(fmt_ci(a, c) for a, c in zip(summary["acceptance_per_position"], summary["alpha_ci"]))
    cums = " | ".join(fmt_ci(a, c) for a, c in zip(summary["cumulative"], summary["cumulative_ci"]))
    row = (f"| {summary['mode']} | {summary['source']} | {summary['backend']} | "
           f"{summary.get('dtype', '?')} {summary.get('weights_dtype', 'plain')} | {summary['policy']} | "
           f"{summary['feed_hidden']} | {summary['temperature']:g} | {k} | {alphas} | {cums} | "
           f"{fmt_ci(summary['mean_accepted_length'], summary['tau_ci'])} | {summary['draft_share']:.2f} |")
    return "\n".join([head, sep, row, TABLE_LEGEND])


# What each column counts; under a stop rule alpha_i may read 1.000 beside a small P(acc >= i).
TABLE_LEGEND = ("α_i: of the rounds that verified draft i, the share that accepted it (a stop rule verifies only "
                "confident drafts); P(acc ≥ i): of all rounds, the share that accepted at least i drafts (unverified "
                "drafts count as not accepted); weights: activations' dtype and the drafter's matrices (plain | fp8)")

# How the τ line names a teacher-forced run's text, per source (source=text is the user's text files).
SOURCE_TEXT = {"heldout": "held-out text", "ood": "out-of-distribution text", "text": "prompts.path's text",
               "jsonl": "prompts.path's prompts"}


def plot_acceptance(summary: dict[str, Any], path: str) -> None:
    """Conditional alpha per position (bars) and cumulative P(accepted >= i) (line), each with
    its bootstrap 95% interval; tau in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas, cum = summary["acceptance_per_position"], summary["cumulative"]
    pos = range(1, len(alphas) + 1)
    def err(xs: list[float], cis: list[list[float]]) -> list[list[float]]:
        return [[0 if math.isnan(x) else x - c[0] for x, c in zip(xs, cis)],
                [0 if math.isnan(x) else c[1] - x for x, c in zip(xs, cis)]]

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(pos, [0 if math.isnan(a) else a for a in alphas], yerr=err(alphas, summary["alpha_ci"]), color="tab:blue",
           capsize=3, label="α_i (conditional)")
    ax.errorbar(pos, cum, yerr=err(cum, summary["cumulative_ci"]), fmt="o-", color="tab:orange", capsize=3,
                label="P(accepted ≥ i)")
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance")
    ax.set_xticks(list(pos))
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"{summary['mode']}, {summary['source']}, {summary['policy']}, T={summary['temperature']:g}: τ = "
                 f"{summary['mean_accepted_length']:.2f}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class Measurement:
    """What one acceptance run measured, before any statistics: the pooled and per-prompt counts
    of the loop (or of teacher forcing), the generated text's 4-gram counts, the prompts whose
    greedy output parted from the target's own (``check_lossless``), two samples, the time, and
    (glm5_next, reference backend) the drafter's selection and each drafted row's recall.
    ``proposer`` is the drafter without the recording (the speedup model times it)."""

    mode: str
    source: str
    batch_size: int
    draft: str
    numerics: str
    model: LoadedModel
    target: Any  # Target, or HfTarget for model=hf
    proposer: Any
    windows: list[list[int]]
    stats: SpecStats
    per_prompt: list[SpecStats]
    generated: int
    grams: int
    distinct: int
    check_lossless: bool
    divergences: list[dict[str, int]]
    samples: list[dict[str, Any]]
    wall: float
    attention: str = "sparse"
    recall: list[dict[str, float]] | None = None  # per drafted row (experiments.loop.recall); None without KPool probe
    grammars: RunGrammars | None = None  # the prompts' grammars (DESIGN.md §10); None without any
    outputs_sha256: str | None = None  # of every prompt's generated tokens (speculative mode)
    trace: Any = None  # the replayed trace (traces.format.Trace); None for a live target


@dataclass
class RunGrammars:
    """The grammars of a run's prompts (``experiments.grammars``): the run's one grammar
    (``grammar=KIND``) for every prompt, or each ``source=jsonl`` line's ``json_schema`` (None for
    lines without one), compiled against the model's vocabulary.

    Args:
        specs: one ``GrammarSpec`` or None per prompt.
        run_spec: the run's grammar, None for per-prompt schemas.
        drafts: ``masked`` | ``unmasked`` (``grammar.drafts``).
        compiler: a ``grammars.compile.GrammarCompiler`` for the model's tokenizer.
    """

    specs: list[Any]
    run_spec: Any
    drafts: str
    compiler: Any

    def matcher(self, i: int) -> Any:
        """A fresh matcher of prompt ``i``'s grammar, or None when it has none."""
        spec = self.specs[i]
        return None if spec is None else self.compiler.matcher(spec)

    def record(self) -> dict[str, Any]:
        """summary.json's ``grammar``: kind, sha256 of the text and origin of the run's grammar,
        or, for per-prompt schemas, each prompt's sha256 (null where a prompt has none)."""
        if self.run_spec is not None:
            return {**self.run_spec.record(), "drafts": self.drafts}
        return {"kind": "json_schema", "origin": "per_prompt", "drafts": self.drafts,
                "sha256": [None if s is None else s.sha256 for s in self.specs]}


def run_grammars(cfg: Any, model: LoadedModel, num_prompts: int) -> RunGrammars | None:
    """The run's grammars (``grammar`` group, source=jsonl lines' json_schema), compiled for the
    model's tokenizer; None when no prompt has one."""
    from .grammars import jsonl_schemas, run_grammar

    node = cfg.get("grammar")
    spec = run_grammar(node)
    specs: list[Any] = [spec] * num_prompts
    if spec is None and cfg.get("source") == "jsonl":
        specs = jsonl_schemas(prompts_path(cfg), num_prompts)
    if all(s is None for s in specs):
        return None
    if model.tokenizer is None:
        raise ValueError("a grammar is compiled against the model's tokenizer; this model has none")
    from .grammars.compile import GrammarCompiler

    compiler = GrammarCompiler(model.tokenizer, model.mtp.config.vocab_size)
    for s in specs:
        if s is not None:
            compiler.compile(s)  # every grammar compiles before the loop starts
    return RunGrammars(specs, spec, node.get("drafts", "masked"), compiler)


def target_record(m: Measurement) -> dict[str, Any]:
    """What the target was: transformers' model (version, class, config sha256, device map,
    dtype, top-k ties) or the package's own."""
    if m.trace is not None:
        return m.trace.meta["target"]
    if m.model.hf is not None:
        return {**m.model.hf.info, "topk_ties": m.target.topk_ties}
    return {"implementation": class_path(m.target), "numerics": m.numerics}


def measure(cfg: Any, measured: MeasuredFile | None = None) -> Measurement:
    """Load the model, build the prompts and run the loop (or teacher forcing) over them;
    each prompt's counts go to ``measured`` as it finishes. ``cfg`` has passed
    ``settings.validate.check_acceptance``."""
    # cfg passed settings.validate.check_acceptance (the entry point runs it first): read, not re-checked
    mode, source = cfg.get("mode", "speculative"), cfg.get("source", "heldout")
    batch_size = cfg.get("batch_size", 1)
    torch.set_num_threads(cfg.threads)
    # The drafter logs every prefill at INFO; one line per prompt drowns the table.
    logging.getLogger("glm_mtp").setLevel(logging.WARNING)
    run = cfg.run
    draft, numerics = cfg.get("draft", "argmax"), cfg.get("target_numerics", "vendor")
    trace = None
    if (cfg.get("trace") or {}).get("path") is not None:  # a replay: the drafter alone, the trace's prompts
        from .targets.replay import ReplayTarget
        from .traces.replay_run import load_drafter, open_for_replay, replay_prompts

        model = apply_drafter_settings(load_drafter(cfg.model), cfg.model)
        trace = open_for_replay(cfg, model.mtp.config)
        source = trace.meta.get("prompts", {}).get("source", source)
        rp = replay_prompts(trace, run.max_new_tokens, cfg.num_drafts)
        windows, starts, prompt_lens, budgets = rp.windows, rp.starts, rp.prompt_lens, rp.budgets
        max_seq_len = min(cfg.model.max_seq_len, model.mtp.config.max_position_embeddings)
        numerics = trace.meta["target"].get("numerics", "recorded")
        target, device = ReplayTarget(trace, model.mtp.device), model.mtp.device
    else:
        model = load_model(cfg.model)
        windows, starts = run_prompts(cfg, model, source)
        prompt_lens, budgets = [run.prompt_tokens] * len(windows), [run.max_new_tokens] * len(windows)
        max_seq_len = min(cfg.model.max_seq_len, model.mtp.config.max_position_embeddings)
        check_prompt_lengths(starts, run.max_new_tokens, cfg.num_drafts, max_seq_len, "prompts")
        if model.hf is not None:
            numerics = "transformers"
        target, device = make_target(cfg, model, max_seq_len, numerics)
    attention = check_attention(cfg.get("attention", "sparse"), cfg.backend.name, model.mtp.config)
    probe = None
    if model.mtp.config.is_next and cfg.backend.name == "reference":  # the selection, and its recall recorded
        probe = RecallProbe(model.mtp, selection(attention))
        proposer = make_proposer(cfg.backend.name, model.mtp, max_seq_len, cfg.feed_hidden, kpool=probe)
    else:
        proposer = make_proposer(cfg.backend.name, model.mtp, max_seq_len, cfg.feed_hidden)
    drafter = proposer if probe is None else ProbedProposer(proposer, probe)
    grammars = run_grammars(cfg, model, len(starts))
    stop = stop_rule(cfg)
    sampling = decoder_sampling(cfg)
    decoder = SpeculativeDecoder(target, drafter, cfg.num_drafts, cfg.policy, cfg.temperature, cfg.seed, draft,
                                 "masked" if grammars is None else grammars.drafts, stop, **sampling)

    stats = SpecStats(cfg.num_drafts)
    per_prompt: list[SpecStats] = []
    generated, grams, distinct = 0, 0, 0
    # greedy: against the target's greedy decode; verify=match: against its own seeded sampling
    seeded = decoder.rules.sampler if decoder.seeded else None
    check_lossless = bool(run.check_lossless) and mode == "speculative" and (cfg.temperature == 0 or seeded is not None)
    divergences: list[dict[str, int]] = []  # per prompt that parts from the target's own (seeded) decode
    samples = []
    outputs: list[list[int]] = []  # each prompt's generated tokens
    decode = model.tokenizer.decode if model.tokenizer is not None else str
    t0 = time.perf_counter()
    results = speculative_results(decoder, starts, budgets, batch_size, device, grammars)
    for w, plen, want in zip(windows, prompt_lens, budgets):
        before = generated
        if mode == "teacher_forced":
            st = teacher_forced(target, drafter, w, plen, cfg.num_drafts, cfg.policy, cfg.temperature,
                                decoder.gen,
                                device=device, draft=draft, stop=stop, **sampling, seed=cfg.seed)
            if len(samples) < 2:
                samples.append({"prompt": decode(w[:plen]),
                                "continuation": decode(w[plen:]),
                                "steps": st.steps, "accepted": st.accepted})
        else:
            p, res = next(results)
            st = res.stats
            generated += len(res.tokens)
            outputs.append(res.tokens)
            four = [tuple(res.tokens[i : i + 4]) for i in range(len(res.tokens) - 3)]
            grams, distinct = grams + len(four), distinct + len(set(four))
            if check_lossless:  # the target's own (constrained, under a grammar) greedy or seeded decode
                if grammars is None:
                    plain = (target_decode(target, p, want) if seeded is None
                             else target_decode(target, p, want, seeded=seeded))
                else:
                    plain = target_decode(target, p, want, matcher=grammars.matcher(len(per_prompt)),
                                          vocab_size=model.mtp.config.vocab_size)
                if res.tokens != plain:  # first differing token; the shorter's length when one is the other's prefix
                    at = next((i for i, (x, y) in enumerate(zip(res.tokens, plain)) if x != y),
                              min(len(res.tokens), len(plain)))
                    divergences.append({"prompt": len(per_prompt), "token": at})
            if len(samples) < 2:
                samples.append({"prompt": decode(p), "continuation": decode(res.tokens), "steps": st.steps,
                                "accepted": st.accepted})
        stats.merge(st)
        per_prompt.append(st)
        if measured is not None:
            measured.append(st, generated - before)
    return Measurement(mode=mode, source=source, batch_size=batch_size, draft=draft, numerics=numerics, model=model,
                       target=target, proposer=proposer, windows=windows, stats=stats, per_prompt=per_prompt,
                       generated=generated, grams=grams, distinct=distinct, check_lossless=check_lossless,
                       divergences=divergences, samples=samples, wall=time.perf_counter() - t0, attention=attention,
                       recall=None if probe is None else probe.records, grammars=grammars,
                       outputs_sha256=hashlib.sha256(json.dumps(outputs).encode()).hexdigest() if outputs else None,
                       trace=trace)


def summarise(cfg: Any, m: Measurement) -> dict[str, Any]:
    """The run's summary (summary.json): acceptance per position with bootstrap intervals over
    prompts, the speedup model at this run's costs, at GLM-5's and at the released model's of the
    drafter's family (``speedup.released``), timings, provenance."""
    stats, windows, divergences = m.stats, m.windows, m.divergences
    # Greedy speculative decoding against the target's own one-token greedy decode, per prompt:
    # "token" is the first generated token (0-based) where the two part.
    lossless = ({"prompts": len(windows), "identical": len(windows) - len(divergences), "diverged": divergences}
                if m.check_lossless else None)
    counts_pp = {"reached": [s.reached for s in m.per_prompt], "accepted": [s.accepted for s in m.per_prompt],
                 "steps": [s.steps for s in m.per_prompt], "wasted": [s.wasted for s in m.per_prompt],
                 "forbidden": [s.forbidden for s in m.per_prompt], "widths": [s.widths for s in m.per_prompt],
                 "committed": [s.committed for s in m.per_prompt]}
    ci = acc_stats.bootstrap(counts_pp, seed=cfg.seed)
    # The speedup model (speedup.py): tau(k) for k <= num_drafts from these counts, with costs c
    # and v(k) measured here on this run's target and drafter (or GLM-5's from bytes, or a file).
    sp_cfg = cfg.get("speedup") or {}
    if m.trace is not None and sp_cfg.get("costs", "measured") == "measured":  # the target's, as recorded
        from .traces.replay_run import replay_costs

        costs = replay_costs(m.trace, m.proposer, cfg.num_drafts, sp_cfg.get("repeats", 15))
    else:
        costs = spd.resolve_costs(sp_cfg.get("costs", "measured"), m.target, m.proposer, cfg.num_drafts,
                                  windows[0][: max(2, cfg.run.prompt_tokens)], sp_cfg.get("repeats", 15))
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
    return {
        "mode": m.mode,
        "source": m.source,
        "acceptance_per_position": stats.alpha,  # conditional: P(draft i accepted | drafts 1..i-1 accepted)
        "alpha_ci": ci["alpha_ci"],
        "cumulative": stats.alpha_cumulative,  # P(at least i drafts accepted) per verification
        "cumulative_ci": ci["cumulative_ci"],
        "mean_accepted_length": stats.tau,
        "tau_ci": ci["tau_ci"],
        "counts": {"reached": stats.reached, "accepted": stats.accepted, "steps": stats.steps},
        "counts_per_prompt": counts_pp,
        "bootstrap": {"unit": "prompt", "replicates": acc_stats.REPLICATES, "seed": cfg.seed,
                      "interval": "percentile 95%"},
        "num_drafts": cfg.num_drafts,
        "stop": stop_rule(cfg).record(),  # the stop rule and its threshold (loop/stop_rules.py)
        # drafts verified per step: mean, and the histogram over widths 0..num_drafts
        "verify_width": {"mean": stats.mean_width, "histogram": stats.widths},
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
        "prompts": len(windows),
        "batch_size": m.batch_size,
        # jsonl: each prompt its own length; a replay: the trace's
        "prompt_tokens": (None if m.source == "jsonl" else cfg.run.prompt_tokens if m.trace is None
                          else m.trace.meta["prompts"].get("prompt_tokens")),
        "scored_positions": stats.steps if m.mode == "teacher_forced" else None,
        "generated_tokens": m.generated,
        # sha256 of the windows' token ids (prompt + the text after it): runs with equal digests
        # saw the same prompts and are paired in report.py, across modes too.
        # (a replay: its trace's, the windows it was recorded from)
        "prompts_sha256": (hashlib.sha256(json.dumps(windows).encode()).hexdigest() if m.trace is None
                           else m.trace.meta["prompts"].get("windows_sha256")),
        # source=jsonl / text: the sha256 of the file read (of its files' names and sha256s for a folder)
        "prompts_file_sha256": (path_sha256(prompts_path(cfg)) if m.source in ("jsonl", "text") and m.trace is None
                                else None),  # a replay's are in its trace record
        "prompts_path": prompts_path(cfg) if m.source in ("jsonl", "text") and m.trace is None else None,
        # The target that verified: transformers' (version, class, config sha256, device map) or the package's
        "target": target_record(m),
        # Distinct 4-grams / 4-grams within each generation: low values flag the repetition loops
        # a small model's greedy decoding falls into, which are easy to draft.
        "distinct_4gram_ratio": m.distinct / m.grams if m.grams else float("nan"),
        # what the loop asked of the target: a prefill per prompt and a forward per verification
        # (counts.steps; older summaries also wrote it as verify_forwards: reporting.summary_keys)
        # (a replay answers them from the trace; the live target runs them)
        "target_forwards": len(windows) + stats.steps,
        # the replayed trace (path, sha256 of its trace.json, its target, truncation, forwards); None: live
        "trace": None if m.trace is None else m.trace.record(),
        "draft_seconds": stats.draft_s,
        "verify_seconds": stats.verify_s,
        "prefill_seconds": stats.prefill_s,
        "draft_share": stats.draft_share,
        "wall_seconds": m.wall,
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
        "lossless": lossless,
        "draft": m.draft,
        "target_numerics": m.numerics,
        "dtype": cfg.model.dtype,
        "weights_dtype": weights_dtype(cfg.model),  # fp8: the drafter's matrices block-scaled (DESIGN.md §8)
        # Whether the drafter shared step 1's selection across a propose's steps (DESIGN.md §9):
        # model.index_share, or the checkpoint's index_share_for_mtp_iteration where that is null.
        "index_share": m.model.mtp.config.index_share_for_mtp_iteration,
        "index_share_setting": index_share(cfg.model),
        "speedup": speedup,
        "checkpoint": m.model.path or f"random:{cfg.model.preset}",
        **provenance(m.model.path),
        "group": cfg.get("group", None),
        "run_name": cfg.run.get("name"),  # the experiment's label (run.name)
        "seed": cfg.seed,
        "samples": m.samples,
    }


def grammar_line(summary: dict[str, Any]) -> str:
    """The printed line of a run under a grammar: its kind, text's sha256 (first 12 digits; per
    prompt: how many prompts had one), how the drafter drafted, forbidden drafts, wasted slots."""
    g = summary["grammar"]
    sha = g["sha256"]
    which = (f"sha256 {sha[:12]}" if isinstance(sha, str)
             else f"per prompt on {sum(x is not None for x in sha)}/{len(sha)} prompts")
    return (f"grammar: {g['kind']} ({which}), drafts {g['drafts']}: forbidden_drafts {summary['forbidden_drafts']}, "
            f"wasted verify slots {summary['wasted_verify_slots']} ({summary['wasted_per_verify']:.3f} per verify)")


def write(cfg: Any, summary: dict[str, Any], run_dir: str) -> None:
    """Print the run's table and lines; write summary.json, acceptance.png and speedup.png into
    ``run_dir``; log it all to the configured logger (W&B offline, or none)."""
    from omegaconf import OmegaConf

    from .reporting.wandb_log import make_logger

    mode, source, k = summary["mode"], summary["source"], cfg.num_drafts
    counts, speedup, lossless = summary["counts"], summary["speedup"], summary["lossless"]
    printed: list[str] = []
    say = _echo(printed)  # every line said is printed and is also written to the run's acceptance.log
    say(format_table(summary))
    what = (f"{counts['steps']} positions of {SOURCE_TEXT.get(source, source)}" if mode == "teacher_forced"
            else f"{summary['generated_tokens']} tokens")
    say(f"τ = {summary['mean_accepted_length']:.3f} tokens per target forward; {what} from {summary['prompts']} "
          f"prompts in {summary['wall_seconds']:.1f}s (drafting {summary['draft_share']:.0%} of the loop)"
          + ("" if lossless is None else f"; {'greedy' if cfg.temperature == 0 else 'seeded'} output equals the "
                                         f"target's on {lossless['identical']}/{lossless['prompts']} prompts"))
    if lossless is not None and lossless["diverged"]:
        say("diverged (prompt, first differing "
              "token): " + ", ".join(f"({d['prompt']}, {d['token']})" for d in lossless["diverged"]))
    say(spd.format_line(speedup, f"predicted speedup at this run's costs ({speedup['costs']}):"))
    say(spd.released_line(speedup["released"], speedup["c"]))
    width, stop, at = summary["verify_width"], summary["stop"], speedup["at_width"]
    say(f"stop.rule={stop['rule']}" + ("" if stop["threshold"] is None else f" threshold={stop['threshold']:g}")
          + f": {width['mean']:.2f} of {k} drafts verified per step (histogram over 0..{k}: {width['histogram']}); "
          f"S at that width = {at['predicted']:.2f} [{at['predicted_ci'][0]:.2f}, {at['predicted_ci'][1]:.2f}]")
    grammar = summary.get("grammar")
    if grammar is not None:
        say(grammar_line(summary))
    recall = summary.get("recall")
    if recall is not None:
        say(f"attention={summary['attention']}: recall of the drafted rows median {recall['median']:.4f}, p10 "
              f"{recall['p10']:.4f} (oracle {recall['oracle_median']:.4f}, {recall['oracle_p10']:.4f}; dense entropy / "
              f"log(visible) {recall['entropy_median']:.3f}) ({recall['rows']} rows; selection real in "
              f"{recall['selection_real_share']:.0%}, {recall['mean_attended']:.0f} of {recall['mean_visible']:.0f} "
              "visible rows attended on average)")
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    png = os.path.join(run_dir, "acceptance.png")
    plot_acceptance(summary, png)
    spd.plot_speedup(speedup, os.path.join(run_dir, "speedup.png"),
                     f"{mode}, {source}, k ≤ {k}: S(k) = τ(k) / (1 + k·{speedup['c']:.2f} + v(k)), costs "
                     f"{speedup['costs']}", released=speedup["released"])

    log = make_logger(cfg.logger, run_dir, OmegaConf.to_container(cfg, resolve=True), job_type="acceptance",
                      name=f"{mode}-{source}-k{k}-{cfg.policy}-{cfg.feed_hidden}-T{cfg.temperature:g}",
                      group=summary["group"])
    alpha, cumulative = summary["acceptance_per_position"], summary["cumulative"]
    log.log_acceptance(alpha, f"alpha per position (k={k}, {cfg.policy}, {mode})", summary)
    log.log({"tau": summary["mean_accepted_length"], **{f"alpha_{i + 1}": a for i, a in enumerate(alpha)},
             **{f"cumulative_{i + 1}": a for i, a in enumerate(cumulative)},
             "speedup/best_k": speedup["best_k"],
             "verify_width/mean": summary["verify_width"]["mean"], "speedup/at_width": speedup["at_width"]["predicted"],
             **{f"speedup/S_{i + 1}": x for i, x in enumerate(speedup["predicted"])},
             **{f"speedup/released_S_{i + 1}": x for i, x in enumerate(speedup["released"]["predicted"])},
             "time/draft_s": summary["draft_seconds"], "time/verify_s": summary["verify_seconds"],
             "time/draft_share": summary["draft_share"],
             "forbidden_drafts": summary["forbidden_drafts"], "wasted_per_verify": summary["wasted_per_verify"],
             **({} if recall is None else {"recall/median": recall["median"], "recall/p10": recall["p10"],
                                           "recall/mean": recall["mean"],
                                           "recall/oracle_median": recall["oracle_median"],
                                           "recall/oracle_p10": recall["oracle_p10"],
                                           "recall/entropy_median": recall["entropy_median"],
                                           "recall/selection_real_share": recall["selection_real_share"],
                                           **{f"recall/p10_{i + 1}": p["p10"]
                                              for i, p in enumerate(recall["per_position"])},
                                           **{f"recall/median_{i + 1}": p["median"]
                                              for i, p in enumerate(recall["per_position"])}})})
    log.log_histogram("verify_width/histogram", summary["verify_width"]["histogram"])
    log.log_samples(summary["samples"])
    log.log_image("acceptance_plot", png)
    log.log_image("speedup_plot", os.path.join(run_dir, "speedup.png"))
    log.summary({k: v for k, v in summary.items() if k not in ("samples", "counts_per_prompt")})
    log.finish()
    say(f"wrote {run_dir}/ (summary.json, acceptance.png, speedup.png, acceptance.log)")
    with open(os.path.join(run_dir, "acceptance.log"), "a") as f:
        f.write("".join(line + "\n" for line in printed))


def _echo(lines: list[str]) -> Any:
    """A ``print`` of one string that also appends it to ``lines``."""
    import builtins

    def echo(line: str) -> None:
        builtins.print(line)
        lines.append(line)

    return echo


def run(cfg: Any, run_dir: str) -> dict[str, Any]:
    """Run the experiment of ``cfg`` (conf/config.yaml; it has passed
    ``settings.validate.check_acceptance``): measure, summarise, write its files into ``run_dir``.
    Returns the summary. Each prompt's counts are written to ``run_dir`` as it
    finishes (``reporting.measured``); a failure once one is measured is a ``LateFailure``
    naming that file."""
    measured = MeasuredFile(run_dir)
    try:
        m = measure(cfg, measured)
    except Exception as e:
        if not measured.count:
            raise
        raise measured.late_failure(e, "the loop") from e
    try:
        summary = summarise(cfg, m)
        write(cfg, summary, run_dir)
    except Exception as e:
        raise measured.late_failure(e, "the summary") from e
    return summary


def main() -> None:
    from .settings.entry import hydra_main

    def body(cfg: Any, hc: Any) -> None:
        from omegaconf import open_dict

        if cfg.get("group") is None and hc.mode is not None and hc.mode.name == "MULTIRUN":
            with open_dict(cfg):  # a sweep's runs share a W&B group: its directory's name
                cfg.group = os.path.basename(os.path.normpath(hc.sweep.dir))
        try:
            run(cfg, hc.runtime.output_dir)
        except LateFailure as e:  # one line: what was measured is on disk
            print(f"python -m glm_mtp.experiments.acceptance: error: {e}", file=sys.stderr)
            sys.exit(1)

    hydra_main("config", "python -m glm_mtp.experiments.acceptance", check_acceptance_run, body)


if __name__ == "__main__":
    main()
