"""The tables of RESULTS.md's "Acceptance at T in {0, 0.6, 1}, replayed" (issue #48 items 4-5)
from the replays' summaries under results/sampled/{next,glm5}/<T>/k<k>/summary.json.

    PYTHONPATH=src python results/sampled/table.py > results/sampled/table.md

Per model and temperature, per k: alpha_i (accepted / reached at draft i) with the summary's 95%
intervals (bootstrap over prompts), tau with its interval, the rounds, and the predicted speedup
S(k) at the run's own k under the summary's cost table; then the k = 5 run's best_k (over k' = 1..5,
from its own trajectories) and the paired T = 1 - T = 0 difference in tau at each k (same prompts).
"""

from __future__ import annotations

import json
import os
import sys

from glm_mtp.experiments.loop.stats import paired_difference

ROOT = os.path.dirname(os.path.abspath(__file__))
MODELS = {"next": "glm5next (`model=next_shipped`)", "glm5": "glm5 (`model=shipped`)"}
TEMPS = ["T0", "T0.6", "T1", "T1-p0.95"]


def load(model: str, temp: str, k: int) -> dict | None:
    path = os.path.join(ROOT, model, temp, f"k{k}", "summary.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def ci(x: float, lo_hi: list[float], nd: int = 3) -> str:
    return f"{x:.{nd}f} [{lo_hi[0]:.{nd}f}, {lo_hi[1]:.{nd}f}]"


def main() -> None:
    out = sys.stdout
    for model, title in MODELS.items():
        out.write(f"### {title}\n\n")
        out.write("| T | top_p | k | verify | rounds | τ [95% CI] | α_1 | α_2 | α_3 | α_4 | α_5 | S(k) [95% CI] |\n")
        out.write("|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        costs = None
        for temp in TEMPS:
            for k in range(1, 6):
                s = load(model, temp, k)
                if s is None:
                    continue
                sp = s["speedup"]
                costs = sp["costs"]
                alphas = [ci(a, c, 2) for a, c in zip(s["acceptance_per_position"], s["alpha_ci"])]
                alphas += [""] * (5 - len(alphas))
                out.write(f"| {s['temperature']:g} | {s['top_p'] if s['top_p'] is not None else 'off'} | {k} | "
                          f"{s['verify'] if s['temperature'] > 0 else 'greedy'} | {s['counts']['steps']} | "
                          f"{ci(s['mean_accepted_length'], s['tau_ci'])} | " + " | ".join(alphas) + " | "
                          f"{ci(sp['predicted'][k - 1], sp['predicted_ci'][k - 1])} |\n")
        out.write(f"\nCost table: `{costs}`. The k = 5 runs' counts per draft position (α_i rests on `reached`):\n\n")
        for temp in TEMPS:
            s5 = load(model, temp, 5)
            if s5 is not None:
                out.write(f"- T = {s5['temperature']:g}: reached {s5['counts']['reached']}, "
                          f"accepted {s5['counts']['accepted']}\n")
        out.write("\n")
        out.write("| T | best_k of the k = 5 run (S over k' = 1..5) | S(k') from the k = 5 run | "
                  "best k over the five runs (S at each run's own k) |\n|---|---|---|---|\n")
        for temp in ("T0", "T0.6", "T1"):
            s5 = load(model, temp, 5)
            runs = [load(model, temp, k) for k in range(1, 6)]
            if s5 is None or any(r is None for r in runs):
                continue
            own = [r["speedup"]["predicted"][k] for k, r in enumerate(runs)]
            best_own = max(range(5), key=lambda i: own[i]) + 1
            sk = ", ".join(f"{x:.3f}" for x in s5["speedup"]["predicted"])
            out.write(f"| {s5['temperature']:g} | {s5['speedup']['best_k']} (share over bootstrap: "
                      f"{', '.join(f'{x:.2f}' for x in s5['speedup']['best_k_share'])}) | {sk} | {best_own} "
                      f"({', '.join(f'{x:.3f}' for x in own)}) |\n")
        out.write("\nPaired by prompt, T = 1 − T = 0 (the same 24 windows; 95% CI over prompts):\n\n")
        out.write("| k | Δτ | Δα_1 |\n|---|---|---|\n")
        for k in range(1, 6):
            a, b = load(model, "T1", k), load(model, "T0", k)
            if a is None or b is None:
                continue
            assert a["prompts_sha256"] == b["prompts_sha256"], "paired runs must share their prompts"
            d = paired_difference(a["counts_per_prompt"], b["counts_per_prompt"], seed=0)
            out.write(f"| {k} | {ci(d['tau'], d['tau_ci'])} | {ci(d['alpha'][0], d['alpha_ci'][0])} |\n")
        a, b = load(model, "T1-p0.95", 3), load(model, "T1", 3)
        if a is not None and b is not None:
            assert a["prompts_sha256"] == b["prompts_sha256"], "paired runs must share their prompts"
            d = paired_difference(a["counts_per_prompt"], b["counts_per_prompt"], seed=0)
            out.write(f"\nPaired by prompt at T = 1, k = 3, top_p 0.95 − off: Δτ = {ci(d['tau'], d['tau_ci'])}.\n")
        out.write("\n")


if __name__ == "__main__":
    main()
