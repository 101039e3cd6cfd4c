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

from .reporting.legend import acceptance_legend
from .reporting.sweep_jobs import refuse_incomplete
from .settings.validate import unwritable_dir
from .loop.stats import paired_difference, paired_ratio_difference

SETTINGS = ("mode", "source", "backend", "temperature", "feed_hidden", "policy", "num_drafts")
# Settings a paired table can vary besides SETTINGS (older summaries lack them: the defaults).
# index_share: what the drafter did (DESIGN.md §9); summaries written before sharing existed did not share.
EXTRA_SETTINGS = {"draft": "argmax", "target_numerics": "vendor", "weights_dtype": "plain", "attention": "sparse",
                  "index_share": False}
ORDER = {"first_row_kept": 0, "refeed": 1, "trim_all": 2, "speculative": 0, "teacher_forced": 1, "heldout": 0, "ood": 1}


# The fields of an acceptance run's summary.json that the report reads, with their JSON types: a
# file without one of them, or with a value of another type or shape, is not a summary this report
# can read. Every field the report reads is listed here, nested objects' fields too (INNER_FIELDS,
# ITEM_FIELDS), and checked before the report writes anything (check_summary).
TEXT, NUMBER, COUNT, NUMBERS, OBJECT = "a string", "a number", "an integer >= 1", "a list of numbers", "an object"
BOOL, PAIRS, MATRIX, OBJECTS = ("true or false", "a list of [low, high] pairs", "a list of lists of numbers",
                                "a list of objects")
SUMMARY_FIELDS = {"mode": TEXT, "source": TEXT, "backend": TEXT, "feed_hidden": TEXT, "policy": TEXT,
                  "temperature": NUMBER,
                  "num_drafts": COUNT, "prompts": COUNT, "acceptance_per_position": NUMBERS,
                  "mean_accepted_length": NUMBER}
# Read when present and not null (older summaries lack them, a speculative run scores no positions).
OPTIONAL_FIELDS = {"draft": TEXT, "target_numerics": TEXT, "weights_dtype": TEXT, "attention": TEXT,
                   "generated_tokens": NUMBER,
                   "scored_positions": NUMBER, "cumulative": NUMBERS, "acceptance_cumulative": NUMBERS,
                   "speedup": OBJECT, "index_share": BOOL, "alpha_ci": PAIRS, "cumulative_ci": PAIRS, "tau_ci": NUMBERS,
                   "prompts_sha256": TEXT, "checkpoint_sha256": TEXT, "dtype": TEXT, "recall": OBJECT,
                   "counts_per_prompt": OBJECT, "lossless": OBJECT}
# An object field's own fields, when the object is present and not empty: (required, optional).
INNER_FIELDS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "speedup": ({"best_k": COUNT, "predicted": NUMBERS, "costs": TEXT, "c": NUMBER},
                {"predicted_ci": PAIRS, "glm5": OBJECT, "released": OBJECT}),
    "speedup.glm5": ({"predicted": NUMBERS, "best_k": COUNT}, {}),
    "speedup.released": ({"predicted": NUMBERS, "best_k": COUNT}, {"model": TEXT}),
    "recall": ({"rows": NUMBER, "median": NUMBER, "p10": NUMBER, "selection_real_share": NUMBER,
                "mean_attended": NUMBER, "mean_visible": NUMBER, "per_position": OBJECTS},
               {"oracle_median": NUMBER, "oracle_p10": NUMBER, "entropy_median": NUMBER}),
    "counts_per_prompt": ({"reached": MATRIX, "accepted": MATRIX, "steps": NUMBERS}, {}),
    "lossless": ({"prompts": NUMBER, "identical": NUMBER}, {"diverged": OBJECTS}),
}
# The fields of each object of a list of objects.
ITEM_FIELDS = {"recall.per_position": {"rows": NUMBER, "p10": NUMBER}, "lossless.diverged": {"prompt": NUMBER,
                                                                                               "token": NUMBER}}


def is_json_type(value: Any, kind: str) -> bool:
    """Whether ``value`` (parsed JSON) is of ``kind`` (a number is never a bool; a list of numbers
    may hold null or NaN where a position was never reached)."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    numbers = lambda v: isinstance(v, list) and all(x is None or number(x) for x in v)  # noqa: E731
    return {TEXT: isinstance(value, str), NUMBER: number(value), COUNT: number(value) and value == int(value) >= 1,
            NUMBERS: numbers(value), OBJECT: isinstance(value, dict), BOOL: isinstance(value, bool),
            PAIRS: isinstance(value, list) and all(numbers(p) and len(p) == 2 for p in value),
            MATRIX: isinstance(value, list) and all(numbers(r) for r in value),
            OBJECTS: isinstance(value, list) and all(isinstance(x, dict) for x in value)}[kind]


def check_fields(path: str, obj: dict[str, Any], required: dict[str, str], optional: dict[str, str],
                 prefix: str = "") -> None:
    """``obj``'s ``required`` fields present and every field of ``required`` / ``optional`` of its
    type (an optional one may be null); objects and lists of objects checked inside. ``ValueError``
    naming the file and the dotted field."""
    for name in required:
        if name not in obj:
            raise ValueError(f"{path}: {prefix}{name} is missing")
    for name, kind in {**required, **optional}.items():
        value = obj.get(name)
        if name not in obj or (value is None and name in optional):
            continue
        if not is_json_type(value, kind):
            raise ValueError(f"{path}: {prefix}{name} must be {kind}, got {value!r:.60}")
        key = prefix + name
        if key in INNER_FIELDS and value:
            check_fields(path, value, *INNER_FIELDS[key], prefix=f"{key}.")
        for i, item in enumerate(value if key in ITEM_FIELDS else []):
            check_fields(path, item, ITEM_FIELDS[key], {}, prefix=f"{key}[{i}].")


def check_shapes(path: str, s: dict[str, Any]) -> None:
    """The lengths the tables index by: an interval per value, the best k among the predicted
    speedups, a per-prompt count row per prompt."""
    for values, cis in (("acceptance_per_position", "alpha_ci"), ("cumulative", "cumulative_ci")):
        if s.get(cis) and len(s[cis]) < len(s.get(values) or []):
            raise ValueError(f"{path}: {cis} must hold an interval per entry of {values} ({len(s[values])}), got "
                             f"{len(s[cis])}")
    if s.get("tau_ci") is not None and len(s["tau_ci"]) != 2:
        raise ValueError(f"{path}: tau_ci must be a [low, high] pair, got {s['tau_ci']!r:.60}")
    sp = s.get("speedup")
    if sp:
        if sp["best_k"] > len(sp["predicted"]):
            raise ValueError(f"{path}: speedup.best_k must be a k of speedup.predicted (1 to {len(sp['predicted'])}), "
                             f"got {sp['best_k']}")
        if sp.get("predicted_ci") and len(sp["predicted_ci"]) < len(sp["predicted"]):
            raise ValueError(f"{path}: speedup.predicted_ci must hold an interval per entry of speedup.predicted")
        g = sp.get("glm5")
        if g and g["best_k"] > len(g["predicted"]):
            raise ValueError(f"{path}: speedup.glm5.best_k must be a k of speedup.glm5.predicted, got {g['best_k']}")
    counts = s.get("counts_per_prompt")
    if counts:
        n = len(counts["steps"])
        rows = [len(r) for key in ("reached", "accepted") for r in counts[key]]
        if len(counts["reached"]) != n or len(counts["accepted"]) != n or len(set(rows)) > 1:
            raise ValueError(f"{path}: counts_per_prompt must hold one reached and one accepted row per prompt "
                             f"({n} prompts), all of one length")


def check_summary(path: str, s: dict[str, Any]) -> None:
    """``ValueError`` naming the file and the field unless ``s`` is an acceptance run's summary
    the report can read (``SUMMARY_FIELDS``, ``OPTIONAL_FIELDS``, nested ``INNER_FIELDS`` and
    ``ITEM_FIELDS``, and the lengths ``check_shapes`` states)."""
    for name in SUMMARY_FIELDS:
        if name not in s:
            raise ValueError(f"{path}: not an acceptance run's summary (no {name!r}; written by python -m "
                             "glm_mtp.experiments.acceptance)")
    check_fields(path, s, SUMMARY_FIELDS, OPTIONAL_FIELDS)
    if "generated_tokens" not in s and "scored_positions" not in s:
        raise ValueError(f"{path}: not an acceptance run's summary (neither 'generated_tokens' nor 'scored_positions')")
    check_shapes(path, s)


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
    tokens generated (loop), and under it (after a blank line, so Markdown ends the table) the
    legend of the acceptance columns shown (``reporting.legend``: what α_i and P(acc ≥ i) count).
    ``view``: ``conditional``, ``cumulative`` or ``both``."""
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
            cum = s.get("cumulative") or s.get("acceptance_cumulative") or []  # either may be null (optional)
            cells += [_cell(cum, s.get("cumulative_ci"), i) for i in range(K)]
        tokens = s.get("scored_positions") or s["generated_tokens"]
        backend = s["backend"] + (" fp8" if s.get("weights_dtype", "plain") == "fp8" else "")  # block-scaled weights
        backend += " dense" if s.get("attention", "sparse") == "dense" else ""  # every visible row attended (ablation)
        backend += " shared" if s.get("index_share", False) else ""  # later draft steps reuse step 1's selection
        draft = s.get("draft", "argmax")
        if (grammar := grammar_identity(s)) is not None:  # e.g. "argmax, regex cccfd83d masked"
            draft += f", {grammar[0]} {grammar[1][:8]} {grammar[2]}"
        lines.append(f"| {s['mode']} | {s['source']} | {backend} | {s['temperature']:g} | {draft} | "
                     f"{s.get('target_numerics', 'vendor')} | {s['feed_hidden']} | {s['policy']} | "
                     f"{s['num_drafts']} | " + " | ".join(cells)
                     + f" | {_cell([s['mean_accepted_length']], [s['tau_ci']] if 'tau_ci' in s else None, 0)} | "
                       f"{_best(s)} | {s['prompts']} | {tokens} |")
    return "\n".join(lines) + "\n\n" + acceptance_legend(view)


def _best(s: dict[str, Any]) -> str:
    """``2: 1.31 [1.2, 1.4]``: the best k of the speedup model and its predicted speedup (— for
    summaries written before the model)."""
    sp = s.get("speedup")
    if not sp:
        return "—"
    k = sp["best_k"]
    return f"{k}: {_cell(sp['predicted'], sp.get('predicted_ci'), k - 1)}"


def _released(sp: dict[str, Any]) -> str:
    """The run's counts at the released model's costs, as the run printed them (``speedup.released``:
    GLM-5's, or GLM-5.3-Flash's for a glm5_next drafter), named; summaries written before it
    recorded only GLM-5's (``speedup.glm5``)."""
    g, name = sp.get("released"), None
    if g:
        name = g.get("model", "released")
    elif sp.get("glm5"):
        g, name = sp["glm5"], "GLM-5"
    return "—" if not g else f"{name}: " + ", ".join(f"{x:.2f}" for x in g["predicted"]) + f"; {g['best_k']}"


def speedup_table(runs: list[dict[str, Any]]) -> str:
    """Predicted speedup S(k) per run and k with intervals, the costs it used, and the best k."""
    runs = [s for s in runs if s.get("speedup")]
    if not runs:
        return ""
    K = max(len(s["speedup"]["predicted"]) for s in runs)
    lines = ["| mode | source | feed | policy | T | costs | c | " + " | ".join(f"S({k + 1})" for k in range(K))
             + " | best k | at the released model's costs: S(1..K), best k |", "|" + "---|" * (7 + K + 2)]
    for s in runs:
        sp = s["speedup"]
        cells = [_cell(sp["predicted"], sp.get("predicted_ci"), k) for k in range(K)]
        # every visible row attended
        feed = s["feed_hidden"] + (", dense" if s.get("attention", "sparse") == "dense" else "")
        lines.append(f"| {s['mode']} | {s['source']} | {feed} | {s['policy']} | {s['temperature']:g} | {sp['costs']} | "
                     f"{sp['c']:.3f} | " + " | ".join(cells) + f" | {sp['best_k']} | {_released(sp)} |")
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
            + (s.get("prompts_sha256"), s.get("checkpoint_sha256"), s.get("dtype"), grammar_identity(s))
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


def grammar_identity(s: dict[str, Any]) -> tuple[str, str, str] | None:
    """A run's grammar as (kind, sha256 of its text or texts, drafts), None without one: runs under
    different grammars, or drafting differently under one, are never paired on another setting
    (``grammar_table`` pairs the drafts)."""
    g = s.get("grammar")
    if not g:
        return None
    sha = g["sha256"] if isinstance(g["sha256"], str) else ",".join(str(x) for x in g["sha256"])
    return g["kind"], sha, g.get("drafts", "masked")


def grammar_table(runs: list[dict[str, Any]]) -> str:
    """Masked − unmasked drafts (``grammar.drafts``, DESIGN.md §10) for runs under one grammar
    (kind and sha256) on the same prompts and model, equal in every other setting: Δα_i, Δτ and
    Δ wasted verify slots per verification, with 95% intervals from resampling the prompts jointly;
    the unmasked run's forbidden drafts per verification, and whether both emitted the same tokens
    (``outputs_sha256``; greedy runs do, the target's masked verify deciding). Empty when no run
    has a pair."""
    groups: dict[tuple, dict[str, dict[str, Any]]] = {}
    for s in runs:
        grammar = grammar_identity(s)
        if grammar is None or "counts_per_prompt" not in s or "wasted" not in s["counts_per_prompt"]:
            continue
        key = (tuple(s[k] for k in SETTINGS) + tuple(s.get(k, v) for k, v in EXTRA_SETTINGS.items())
               + grammar[:2] + (s.get("prompts_sha256"), s.get("checkpoint"), s.get("checkpoint_sha256"),
                                s.get("dtype")))
        groups.setdefault(key, {})[grammar[2]] = s
    pairs = [(d["masked"], d["unmasked"]) for d in groups.values() if {"masked", "unmasked"} <= set(d)]
    if not pairs:
        return ""
    K = max(m["num_drafts"] for m, _ in pairs)
    lines = ["| model | grammar | prompts | same output | forbidden / verify (unmasked) | "
             + " | ".join(f"Δα_{i + 1}" for i in range(K)) + " | Δτ | Δ wasted slots / verify |",
             "|" + "---|" * (5 + K + 2)]
    for m, u in pairs:
        d = paired_difference(m["counts_per_prompt"], u["counts_per_prompt"])
        w = paired_ratio_difference(m["counts_per_prompt"], u["counts_per_prompt"], "wasted", "steps")
        g = m["grammar"]
        name = f"{g['kind']} {g['sha256'][:8]}" if isinstance(g["sha256"], str) else f"{g['kind']} per prompt"
        same = "yes" if m.get("outputs_sha256") and m.get("outputs_sha256") == u.get("outputs_sha256") else "no"
        forbidden = u.get("forbidden_drafts", 0) / max(1, u["counts"]["steps"])
        cells = [_signed(d["alpha"], d["alpha_ci"], i) for i in range(K)]
        lines.append(f"| {os.path.basename(str(m.get('checkpoint', '?')))} | {name} | {m['prompts']} | {same} | "
                     f"{forbidden:.2f} | " + " | ".join(cells) + f" | {_signed([d['tau']], [d['tau_ci']], 0)} | "
                     f"{_signed([w['diff']], [w['ci']], 0)} |")
    return "\n".join(lines)


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
    grammars = grammar_table(runs)
    if grammars:
        text += ("\n\nDrafts under a grammar, masked − unmasked (grammar.drafts; the target's verify masked either "
                 f"way; same prompts, 95% intervals over prompts):\n\n{grammars}")
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
