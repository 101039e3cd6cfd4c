"""RESULTS.md's tables for the fine-tuning measurements (issue #51 item 8 (b), (c)), from the
summaries under results/finetune/:

    python results/finetune/table.py > results/finetune/table.md

- ``domain/<model>/summary.json``: tuned on the OOD source's tune half; its own held-out split
  (prompts of the tune half), the judge half and the stdlib held-out trace (``eval_traces``).
- domain against generic tuning: the domain head against the stdlib-tuned head (``depth/<model>/d1``)
  on the OOD judge half (the d1 head replayed there by ``acceptance``: ``domain/<model>/
  stdlib_tuned_on_judge/summary.json``) and on d1's 13 stdlib held-out prompts (the domain run's
  stdlib judge at those items); written to ``domain/<model>/vs_stdlib_tuned.json``.
- ``depth/<model>[/s<steps>]/d1``, ``d3``: the same trace and seed tuned at ``finetune.depth`` 1 and 3; the
  paired difference of the two tuned heads (d3 - d1) over the held-out prompts, by
  ``loop.stats.paired_difference`` on their per-prompt counts, written to ``paired.json`` beside them (``DEPTH_PAIRS``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from glm_mtp.experiments.loop.stats import paired_difference

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("glm5next", "glm5")
# Where each depth pair lies: the GLM-5 toy (index sharing off) tunes depth 3 in a loop per
# proposal, 10-33 s a step on the shared CPU, so its pairs ran 30 and 100 steps (RESULTS.md says so).
DEPTH_PAIRS = (("glm5next", ("depth", "glm5next")), ("glm5", ("depth", "glm5", "s30")),
               ("glm5", ("depth", "glm5", "s100")))


def load(*parts: str) -> dict[str, Any]:
    with open(os.path.join(HERE, *parts, "summary.json")) as f:
        return json.load(f)


def ci(v: list[float]) -> str:
    return f"{v[0]:+.3f} [{v[1]:+.3f}, {v[2]:+.3f}]"


def head(h: dict[str, Any]) -> str:
    return f"{h['tau']:.3f} ({' / '.join(f'{a:.3f}' for a in h['alpha'])})"


def replay_row(model: str, judged: str, r: dict[str, Any]) -> str:
    d = r["delta"]
    alphas = " / ".join(ci(d[f"alpha_{i}"]) for i in range(1, len(r["base"]["alpha"]) + 1))
    return (f"| {model} | {judged} | {r['prompts']} | {head(r['base'])} | {head(r['tuned'])} | **{ci(d['tau'])}** "
            f"| {alphas} |")


def domain_table() -> list[str]:
    out = ["| model | judged on | prompts | base tau (alpha_1/2/3) | tuned tau (alpha_1/2/3) | delta tau [95%] "
           "| delta alpha_1 / alpha_2 / alpha_3 [95%] |", "|---|---|---|---|---|---|---|"]
    names = ("OOD judge half (unseen files)", "stdlib held-out (forgetting)")
    for model in MODELS:
        s = load("domain", model)
        out.append(replay_row(model, "OOD tune half, held-out prompts", s["replay"]))
        for name, ev in zip(names, s["eval_traces"]):
            out.append(replay_row(model, name, ev))
    return out


def subset(counts: dict[str, Any], items: list[int]) -> dict[str, Any]:
    """Per-prompt counts at ``items`` (a judge's counts are in trace item order)."""
    return {k: [counts[k][i] for i in items] for k in ("reached", "accepted", "steps")}


def versus_table() -> list[str]:
    out = ["| model | judged on | prompts | stdlib-tuned tau | domain-tuned tau "
           "| domain - stdlib-tuned: delta tau [95%] | delta alpha_1 / alpha_2 / alpha_3 [95%] |",
           "|---|---|---|---|---|---|---|"]
    for model in MODELS:
        dom, d1 = load("domain", model), load("depth", model, "d1")
        generic = load("domain", model, "stdlib_tuned_on_judge")["counts_per_prompt"]
        generic = {k: generic[k] for k in ("reached", "accepted", "steps")}
        held = d1["split"]["heldout_item_indices"]
        std = dom["eval_traces"][1]["counts"]
        if subset(std["base"], held) != d1["replay"]["counts"]["base"]:
            raise SystemExit(f"{model}: the domain run's stdlib trace is not d1's at its held-out items")
        rows = {"OOD judge half": (generic, dom["eval_traces"][0]["counts"]["tuned"]),
                "stdlib held-out, d1's 13 prompts": (d1["replay"]["counts"]["tuned"], subset(std["tuned"], held))}
        record = {}
        for name, (g, t) in rows.items():
            d = paired_difference(t, g, seed=0)
            record[name] = d
            alphas = " / ".join(ci([a, *c]) for a, c in zip(d["alpha"], d["alpha_ci"]))
            out.append(f"| {model} | {name} | {len(g['steps'])} | {tau_of(g):.3f} | {tau_of(t):.3f} "
                       f"| **{ci([d['tau'], *d['tau_ci']])}** | {alphas} |")
        with open(os.path.join(HERE, "domain", model, "vs_stdlib_tuned.json"), "w") as f:
            json.dump({"domain_minus_stdlib_tuned": record, "seed": 0}, f, indent=1)
    return out


def tau_of(counts: dict[str, Any]) -> float:
    from glm_mtp.experiments.training.finetune_judge import head_stats

    return float(head_stats(counts)["tau"])


def depth_table() -> list[str]:
    out = ["| model | steps | depth | loss train / held-out, last | tuned tau (alpha_1/2/3) | delta tau vs base [95%] "
           "| delta alpha_2 vs base | delta alpha_3 vs base |", "|---|---|---|---|---|---|---|---|"]
    pairs = ["", "| model | steps | d3 - d1: delta tau [95%] | delta alpha_1 | delta alpha_2 | delta alpha_3 |",
             "|---|---|---|---|---|---|"]
    for model, where in DEPTH_PAIRS:
        s1, s3 = load(*where, "d1"), load(*where, "d3")
        same_base = s1["replay"]["counts"]["base"] == s3["replay"]["counts"]["base"]
        if s1["steps"] != s3["steps"] or s1["split"] != s3["split"] or not same_base:
            raise SystemExit(f"{model}: {where}'s d1 and d3 differ in steps, prompts or base")
        for depth, s in (("1", s1), ("3", s3)):
            r, last = s["replay"], s["loss"][-1]
            out.append(f"| {model} | {s['steps']} | {depth} | {last['train']:.3f} / {last['heldout']:.3f} "
                       f"| {head(r['tuned'])} | {ci(r['delta']['tau'])} | {ci(r['delta']['alpha_2'])} "
                       f"| {ci(r['delta']['alpha_3'])} |")
        d = paired_difference(s3["replay"]["counts"]["tuned"], s1["replay"]["counts"]["tuned"], seed=0)
        with open(os.path.join(HERE, *where, "paired.json"), "w") as f:
            json.dump({"d3_minus_d1": d, "prompts": s1["replay"]["prompts"], "seed": 0}, f, indent=1)
        alphas = " | ".join(ci([a, *c]) for a, c in zip(d["alpha"], d["alpha_ci"]))
        pairs.append(f"| {model} | {s1['steps']} | **{ci([d['tau'], *d['tau_ci']])}** | {alphas} |")
    return out + pairs


if __name__ == "__main__":
    print("\n".join(["## Domain adaptation", "", *domain_table(), "", "## Domain against generic tuning", "",
                     *versus_table(), "", "## Depth 1 vs 3", "", *depth_table()]))
