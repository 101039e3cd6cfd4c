"""RESULTS.md's tables for the fine-tuning measurements (issue #51 item 8 (b), (c)), from the
summaries under results/finetune/:

    python results/finetune/table.py > results/finetune/table.md

- ``domain/<model>/summary.json``: tuned on the OOD source's tune half; its own held-out split
  (prompts of the tune half), the judge half and the stdlib held-out trace (``eval_traces``).
- ``depth/<model>/d1``, ``d3``: the same trace and seed tuned at ``finetune.depth`` 1 and 3; the
  paired difference of the two tuned heads (d3 - d1) over the held-out prompts, by
  ``loop.stats.paired_difference`` on their per-prompt counts, written to ``depth/<model>/paired.json``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from glm_mtp.experiments.loop.stats import paired_difference

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("glm5next", "glm5")


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


def depth_table() -> list[str]:
    out = ["| model | depth | loss train / held-out, last | tuned tau (alpha_1/2/3) | delta tau vs base [95%] "
           "| delta alpha_2 vs base | delta alpha_3 vs base |", "|---|---|---|---|---|---|---|"]
    pairs = ["", "| model | d3 - d1: delta tau [95%] | delta alpha_1 | delta alpha_2 | delta alpha_3 |",
             "|---|---|---|---|---|"]
    for model in MODELS:
        s1, s3 = load("depth", model, "d1"), load("depth", model, "d3")
        if s1["split"] != s3["split"] or s1["replay"]["counts"]["base"] != s3["replay"]["counts"]["base"]:
            raise SystemExit(f"{model}: d1 and d3 were not judged on the same prompts with the same base")
        for depth, s in (("1", s1), ("3", s3)):
            r, last = s["replay"], s["loss"][-1]
            out.append(f"| {model} | {depth} | {last['train']:.3f} / {last['heldout']:.3f} | {head(r['tuned'])} "
                       f"| {ci(r['delta']['tau'])} | {ci(r['delta']['alpha_2'])} | {ci(r['delta']['alpha_3'])} |")
        d = paired_difference(s3["replay"]["counts"]["tuned"], s1["replay"]["counts"]["tuned"], seed=0)
        with open(os.path.join(HERE, "depth", model, "paired.json"), "w") as f:
            json.dump({"d3_minus_d1": d, "prompts": s1["replay"]["prompts"], "seed": 0}, f, indent=1)
        alphas = " | ".join(ci([a, *c]) for a, c in zip(d["alpha"], d["alpha_ci"]))
        pairs.append(f"| {model} | **{ci([d['tau'], *d['tau_ci']])}** | {alphas} |")
    return out + pairs


if __name__ == "__main__":
    print("\n".join(["## Domain adaptation", "", *domain_table(), "", "## Depth 1 vs 3", "", *depth_table()]))
