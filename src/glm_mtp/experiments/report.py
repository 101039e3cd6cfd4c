"""Aggregate a sweep of acceptance runs into Markdown tables and one plot.

    python -m glm_mtp.experiments.report multirun/acceptance/<date> [--out DIR] [--pair policy,mode]

Reads every ``summary.json`` under the directory; writes ``report.md`` and ``report.png`` into
``--out`` (default: the sweep directory) and prints the tables:

- one row per run: conditional ``α_i`` = P(draft i accepted | drafts 1..i-1 accepted) and
  cumulative ``P(acc ≥ i)`` = P(at least i drafts accepted), each with its bootstrap 95%
  interval over prompts, and ``τ`` (tokens per target forward);
- greedy runs with ``run.check_lossless=true``: prompts whose speculative output equals
  the target's own greedy decode, and where the others part;
- paired differences: for each setting named in ``--pair`` (``policy`` by default; comma-separated
  for several tables), runs that differ only in that setting and share their prompts (equal
  ``prompts_sha256``) are compared with the first of them, the
  difference's interval from resampling the prompts jointly (``stats.paired_difference``): Δα_i,
  ΔP(acc ≥ i) for i >= 2 (i = 1 is Δα_1) and Δτ. ``--pair index_share`` compares a drafter that
  shares step 1's selection across draft steps (DESIGN.md §9) with one that does not (``on − off``).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
from typing import Any

from glm_mtp.reference.config import read_json_object

from .reporting.sweep_jobs import refuse_incomplete
from .settings.validate import unwritable_dir
from .loop.stats import paired_difference

SETTINGS = ("mode", "source", "backend", "temperature", "feed_hidden", "policy", "num_drafts")
# Settings a paired table can vary besides SETTINGS (older summaries lack them: the defaults).
# index_share: what the drafter did (DESIGN.md §9); summaries written before sharing existed did not share.
EXTRA_SETTINGS = {"draft": "argmax", "target_numerics": "vendor", "weights_dtype": "plain", "attention": "sparse",
                  "index_share": False}
ORDER = {"first_row_kept": 0, "refeed": 1, "trim_all": 2, "speculative": 0, "teacher_forced": 1, "heldout": 0, "ood": 1}


# The fields of an acceptance run's summary.json that the report reads, with their JSON types: a
# file without one of them, or with a value of another type, is not a summary this report can read.
TEXT, NUMBER, COUNT, NUMBERS, OBJECT = "a string", "a number", "an integer >= 1", "a list of numbers", "an object"
SUMMARY_FIELDS = {"mode": TEXT, "source": TEXT, "backend": TEXT, "feed_hidden": TEXT, "policy": TEXT,
                  "temperature": NUMBER,
                  "num_drafts": COUNT, "prompts": COUNT, "acceptance_per_position": NUMBERS,
                  "mean_accepted_length": NUMBER}
# Read when present and not null (older summaries lack them, a speculative run scores no positions).
OPTIONAL_FIELDS = {"draft": TEXT, "target_numerics": TEXT, "weights_dtype": TEXT, "attention": TEXT,
                   "generated_tokens": NUMBER,
                   "scored_positions": NUMBER, "cumulative": NUMBERS, "acceptance_cumulative": NUMBERS,
                   "speedup": OBJECT}


def is_json_type(value: Any, kind: str) -> bool:
    """Whether ``value`` (parsed JSON) is of ``kind`` (a number is never a bool; a list of numbers
    may hold null or NaN where a position was never reached)."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    return {TEXT: isinstance(value, str), NUMBER: number(value), COUNT: number(value) and value == int(value) >= 1,
            NUMBERS: isinstance(value, list) and all(v is None or number(v) for v in value),
            OBJECT: isinstance(value, dict)}[kind]


def check_summary(path: str, s: dict[str, Any]) -> None:
    """``ValueError`` naming the file and the field unless ``s`` is an acceptance run's summary
    the report can read (``SUMMARY_FIELDS``, ``OPTIONAL_FIELDS``)."""
    for name in SUMMARY_FIELDS:
        if name not in s:
            raise ValueError(f"{path}: not an acceptance run's summary (no {name!r}; written by python -m "
                             "glm_mtp.experiments.acceptance)")
    for name, kind in {**SUMMARY_FIELDS, **OPTIONAL_FIELDS}.items():
        if name in s and not is_json_type(s[name], kind) and not (name in OPTIONAL_FIELDS and s[name] is None):
            raise ValueError(f"{path}: {name} must be {kind}, got {s[name]!r:.60}")
    if "generated_tokens" not in s and "scored_positions" not in s:
        raise ValueError(f"{path}: not an acceptance run's summary (neither 'generated_tokens' nor 'scored_positions')")


def load_summaries(root: str) -> list[dict[str, Any]]:
    """Every run's summary under ``root``, sorted by mode, source, backend, temperature, feed, policy, k.
    ``ValueError`` naming the file for one that is not JSON, not an object or not a summary
    (``check_summary``); ``FileNotFoundError`` when there is none."""
    runs = []
    for path in sorted(glob.glob(os.path.join(root, "**", "summary.json"), recursive=True)):
        s = read_json_object(path)
        check_summary(path, s)
        s["_dir"] = os.path.relpath(os.path.dirname(path), root)
        s.setdefault("mode", "speculative")  # summaries written before the modes existed
        s.setdefault("source", "heldout")
        s.setdefault("draft", "argmax")  # summaries written before sampled drafts and pinned targets
        s.setdefault("target_numerics", "vendor")
        runs.append(s)
    if not runs:
        raise FileNotFoundError(f"no summary.json under {root}")
    runs.sort(key=lambda s: (ORDER.get(s["mode"], 9), ORDER.get(s["source"], 9), s["backend"], s["temperature"],
                             s["feed_hidden"] != "post_norm", ORDER.get(s["policy"], 9), s["num_drafts"],
                             s.get("weights_dtype", "plain") != "plain",  # plain weights first: the baseline
                             s.get("attention", "sparse") != "sparse",  # the drafter's own selection first
                             # each step's own selection first: the baseline sharing is compared with
                             s.get("index_share", False)))
    return runs


def _cell(values: list[float], cis: list[list[float]] | None, i: int) -> str:
    if i >= len(values) or values[i] is None or (isinstance(values[i], float) and math.isnan(values[i])):
        return "—"
    if not cis:
        return f"{values[i]:.3f}"
    return f"{values[i]:.3f} [{cis[i][0]:.2f}, {cis[i][1]:.2f}]"


def markdown_table(runs: list[dict[str, Any]], view: str = "both") -> str:
    """One row per run: settings, conditional α_1..α_K and/or cumulative P(acc ≥ 1..K) with their
    intervals (K the largest k), τ with its interval, and the positions scored (teacher-forced) or
    tokens generated (loop). ``view``: ``conditional``, ``cumulative`` or ``both``."""
    if view not in ("conditional", "cumulative", "both"):
        raise ValueError(f"view must be 'conditional', 'cumulative' or 'both', got {view!r}")
    K = max(s["num_drafts"] for s in runs)
    cols = ([f"α_{i + 1}" for i in range(K)] if view != "cumulative" else []) + \
           ([f"P(acc ≥ {i + 1})" for i in range(K)] if view != "conditional" else [])
    lines = ["| mode | source | backend | T | draft | target | feed | "
             "policy | k | " + " | ".join(cols) + " | τ | best k: S(k) | prompts | tokens |",
             "|" + "---|" * (9 + len(cols) + 4)]
    for s in runs:
        cells = []
        if view != "cumulative":
            cells += [_cell(s["acceptance_per_position"], s.get("alpha_ci"), i) for i in range(K)]
        if view != "conditional":
            cum = s.get("cumulative", s.get("acceptance_cumulative", []))
            cells += [_cell(cum, s.get("cumulative_ci"), i) for i in range(K)]
        tokens = s.get("scored_positions") or s["generated_tokens"]
        backend = s["backend"] + (" fp8" if s.get("weights_dtype", "plain") == "fp8" else "")  # block-scaled weights
        backend += " dense" if s.get("attention", "sparse") == "dense" else ""  # every visible row attended (ablation)
        backend += " shared" if s.get("index_share", False) else ""  # later draft steps reuse step 1's selection
        lines.append(f"| {s['mode']} | {s['source']} | {backend} | {s['temperature']:g} | {s.get('draft', 'argmax')} | "
                     f"{s.get('target_numerics', 'vendor')} | {s['feed_hidden']} | {s['policy']} | "
                     f"{s['num_drafts']} | " + " | ".join(cells)
                     + f" | {_cell([s['mean_accepted_length']], [s['tau_ci']] if 'tau_ci' in s else None, 0)} | "
                       f"{_best(s)} | {s['prompts']} | {tokens} |")
    return "\n".join(lines)


def _best(s: dict[str, Any]) -> str:
    """``2: 1.31 [1.2, 1.4]``: the best k of the speedup model and its predicted speedup (— for
    summaries written before the model)."""
    sp = s.get("speedup")
    if not sp:
        return "—"
    k = sp["best_k"]
    return f"{k}: {_cell(sp['predicted'], sp.get('predicted_ci'), k - 1)}"


def _glm5(sp: dict[str, Any]) -> str:
    g = sp.get("glm5")
    return "—" if not g else ", ".join(f"{x:.2f}" for x in g["predicted"]) + f"; {g['best_k']}"


def speedup_table(runs: list[dict[str, Any]]) -> str:
    """Predicted speedup S(k) per run and k with intervals, the costs it used, and the best k."""
    runs = [s for s in runs if s.get("speedup")]
    if not runs:
        return ""
    K = max(len(s["speedup"]["predicted"]) for s in runs)
    lines = ["| mode | source | feed | policy | T | costs | c | " + " | ".join(f"S({k + 1})" for k in range(K))
             + " | best k | at GLM-5's costs: S(1..K), best k |", "|" + "---|" * (7 + K + 2)]
    for s in runs:
        sp = s["speedup"]
        cells = [_cell(sp["predicted"], sp.get("predicted_ci"), k) for k in range(K)]
        # every visible row attended
        feed = s["feed_hidden"] + (", dense" if s.get("attention", "sparse") == "dense" else "")
        lines.append(f"| {s['mode']} | {s['source']} | {feed} | {s['policy']} | {s['temperature']:g} | {sp['costs']} | "
                     f"{sp['c']:.3f} | " + " | ".join(cells) + f" | {sp['best_k']} | {_glm5(sp)} |")
    return "\n".join(lines)


def recall_table(runs: list[dict[str, Any]]) -> str:
    """The drafter's selection per run (glm5_next runs with a recall): median and lower decile of
    the recall over drafted rows, overall and per draft position, and how often selection was real."""
    runs = [s for s in runs if s.get("recall")]
    if not runs:
        return ""
    K = max(s["num_drafts"] for s in runs)
    lines = ["| mode | source | policy | attention | rows | recall median | "
             "recall p10 | " + " | ".join(f"p10 at {i + 1}" for i in range(K))
             + " | oracle median / p10 | dense entropy / log(visible) | selection real | attended / visible rows |",
             "|" + "---|" * (7 + K + 4)]
    for s in runs:
        r = s["recall"]
        per = ([f"{p['p10']:.3f}" if p["rows"] else "—" for p in r["per_position"]]
               + ["—"] * (K - len(r["per_position"])))
        attention = s.get("attention", "sparse") + (", shared" if s.get("index_share", False) else "")
        lines.append(f"| {s['mode']} | {s['source']} | {s['policy']} | {attention} | {r['rows']} | {r['median']:.4f} | "
                     f"{r['p10']:.4f} | " + " | ".join(per)
                     + f" | {r.get('oracle_median', math.nan):.4f} / {r.get('oracle_p10', math.nan):.4f} | "
                     f"{r.get('entropy_median', math.nan):.3f} | {r['selection_real_share']:.0%} | "
                     f"{r['mean_attended']:.0f} / {r['mean_visible']:.0f} |")
    return "\n".join(lines)


def paired_table(runs: list[dict[str, Any]], pair: str = "policy") -> str:
    """Differences ``run - baseline`` between runs equal in every setting but ``pair`` and run on
    the same prompts; the baseline is the group's first run in report order. Empty when no
    group has two runs with counts per prompt."""
    if pair not in SETTINGS + tuple(EXTRA_SETTINGS):
        raise ValueError(f"pair must be one of {SETTINGS + tuple(EXTRA_SETTINGS)}, got {pair!r}")
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for s in runs:
        if "counts_per_prompt" not in s:
            continue
        key = (
            tuple(s[k] for k in SETTINGS if k != pair)
            + tuple(s.get(k, v) for k, v in EXTRA_SETTINGS.items() if k != pair)
            + (s.get("prompts_sha256"), s.get("checkpoint_sha256"), s.get("dtype"))
        )
        groups.setdefault(key, []).append(s)
    K = max(s["num_drafts"] for s in runs)
    others = [k for k in SETTINGS if k != pair]  # what the paired runs share
    names = {"temperature": "T", "feed_hidden": "feed", "num_drafts": "k"}
    lines = [f"| {pair}: run − baseline | " + " | ".join(names.get(k, k) for k in others) + " | "
             + " | ".join(f"Δα_{i + 1}" for i in range(K)) + " | "
             + " | ".join(f"ΔP(acc ≥ {i + 1})" for i in range(1, K)) + " | Δτ |",
             "|" + "---|" * (1 + len(others) + K + (K - 1) + 1)]
    for ss in groups.values():
        base = ss[0]
        for s in ss[1:]:
            d = paired_difference(s["counts_per_prompt"], base["counts_per_prompt"])
            cells = [_signed(d["alpha"], d["alpha_ci"], i) for i in range(K)]
            cells += [_signed(d["cumulative"], d["cumulative_ci"], i) for i in range(1, K)]  # P(acc ≥ 1) is α_1
            shared = " | ".join(f"{s[k]:g}" if k == "temperature" else _labelled(s, k, pair) for k in others)
            lines.append(f"| {_value(s, pair)} − {_value(base, pair)} | {shared} | " + " | ".join(cells)
                         + f" | {_signed([d['tau']], [d['tau_ci']], 0)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _value(s: dict[str, Any], pair: str) -> str:
    """The paired setting's value in a row's label (index sharing reads ``on`` / ``off``)."""
    v = s.get(pair, EXTRA_SETTINGS.get(pair))
    return ("on" if v else "off") if pair == "index_share" else str(v)


def _labelled(s: dict[str, Any], key: str, pair: str) -> str:
    """A setting's value for a table cell; the backend cell also names a dense drafter
    (``attention=dense``) and a sharing one (``index_share``) unless that is what the table varies."""
    label = str(s[key])
    if key == "backend" and pair != "attention" and s.get("attention", "sparse") == "dense":
        label += " dense"
    if key == "backend" and pair != "index_share" and s.get("index_share", False):
        label += " shared"
    return label


def lossless_table(runs: list[dict[str, Any]]) -> str:
    """One row per greedy run that checked losslessness (``run.check_lossless``): the
    target's numerics and dtype, prompts, how many gave the target's own greedy decode token for
    token, and where the others part (prompt index @ first differing generated token, 0-based).
    Empty when no run checked."""
    lines = ["| target numerics | dtype | backend | policy | k | prompts | identical | diverged (prompt @ token) |",
             "|---|---|---|---|---|---|---|---|"]
    for s in runs:
        ll = s.get("lossless")
        if not ll:
            continue
        where = ", ".join(f"{d['prompt']} @ {d['token']}" for d in ll.get("diverged", [])) or "—"
        lines.append(f"| {s.get('target_numerics', 'vendor')} | {s.get('dtype', '?')} | {s['backend']} | {s['policy']} "
                     f"| {s['num_drafts']} | {ll['prompts']} | {ll['identical']} | {where} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _signed(values: list[float], cis: list[list[float]], i: int) -> str:
    if i >= len(values) or math.isnan(values[i]):
        return "—"
    return f"{values[i]:+.3f} [{cis[i][0]:+.2f}, {cis[i][1]:+.2f}]"


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """tau against k (left) and alpha per position at the largest k with its interval (right),
    one line per (mode, source, policy, feed, temperature, backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[dict[str, Any]]] = {}
    for s in runs:
        groups.setdefault(f"{s['mode']}, {s['source']}, {s['policy']}, {s['feed_hidden']}, T={s['temperature']:g}, "
                          f"{s['backend']}", []).append(s)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, ss in groups.items():
        ss = sorted(ss, key=lambda s: s["num_drafts"])
        ax1.plot([s["num_drafts"] for s in ss], [s["mean_accepted_length"] for s in ss], "o-", label=label)
        top = ss[-1]
        a = top["acceptance_per_position"]
        ci = top.get("alpha_ci")
        yerr = None if not ci else [[0 if math.isnan(x) else x - c[0] for x, c in zip(a, ci)],
                                    [0 if math.isnan(x) else c[1] - x for x, c in zip(a, ci)]]
        ax2.errorbar(range(1, len(a) + 1), a, yerr=yerr, fmt="o-", capsize=3, label=f"{label} (k={top['num_drafts']})")
    ax1.set_xlabel("k (drafts per step)")
    ax1.set_ylabel("τ (tokens per target forward)")
    ax1.grid(alpha=0.3)
    ax2.set_xlabel("draft position i")
    ax2.set_ylabel("α_i (conditional), 95% interval")
    ax2.set_ylim(0, 1)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    """CLI entry point; returns the printed Markdown."""
    ap = argparse.ArgumentParser(prog="python -m glm_mtp.experiments.report", description=__doc__.split("\n")[1])
    ap.add_argument("sweep_dir")
    ap.add_argument("--out", default=None, help="where report.md and report.png go (default: the sweep directory)")
    ap.add_argument("--pair", default="policy",
                    help="comma-separated settings that paired differences vary, of "
                         f"{SETTINGS + tuple(EXTRA_SETTINGS)} (default: policy)")
    ap.add_argument("--view", default="both", choices=("conditional", "cumulative", "both"),
                    help="acceptance columns (default: both)")
    ap.add_argument("--partial", action="store_true",
                    help="report a sweep with failed or missing jobs anyway (they are listed first)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.sweep_dir):
        ap.error(f"sweep_dir: {args.sweep_dir} is not a directory")
    known = SETTINGS + tuple(EXTRA_SETTINGS)
    for pair in args.pair.split(","):
        if pair not in known:
            ap.error(f"--pair: {pair!r} is not a setting; choose from {', '.join(known)}")
    if args.out is not None and (why := unwritable_dir(args.out)) is not None:
        ap.error(f"--out: {why}")
    incomplete = refuse_incomplete(ap, args.sweep_dir, "summary.json", args.partial)
    try:
        runs = load_summaries(args.sweep_dir)
    except (FileNotFoundError, ValueError) as e:
        ap.error(str(e))
    out = args.out or args.sweep_dir
    os.makedirs(out, exist_ok=True)
    text = markdown_table(runs, args.view)
    if incomplete:  # --partial: say so before any table
        text = f"**Incomplete sweep:** {incomplete}.\n\n" + text
    sp = speedup_table(runs)
    if sp:
        text += ("\n\nPredicted speedup S(k) = τ(k) / (1 + k c + v(k)) (experiments/loop/speedup.py; "
                 "τ(k) from each run's counts, 95% intervals over prompts; c and v as each run states):\n\n" + sp)
    recall = recall_table(runs)
    if recall:
        text += ("\n\nThe drafter's selection: recall = the share of the dense head-averaged attention mass on "
                 "the rows each drafted row attended (experiments/loop/recall.py):\n\n" + recall)
    for pair in args.pair.split(","):
        pairs = paired_table(runs, pair)
        if pairs:
            text += f"\n\nPaired differences (same prompts, {pair} varied; 95% intervals over prompts):\n\n{pairs}"
    lossless = lossless_table(runs)
    if lossless:
        text += ("\n\nGreedy speculative decoding against the target's own greedy decode (one token per forward), "
                 f"per prompt:\n\n{lossless}")
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(f"# Acceptance sweep: {os.path.abspath(args.sweep_dir)}\n\n{text}\n")
    plot(runs, os.path.join(out, "report.png"))
    print(text)
    return text


if __name__ == "__main__":
    main()
