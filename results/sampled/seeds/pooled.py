"""Seeded match against rejection at T = 1 (k = 3, argmax drafts), over seeds 0, 1, 2: each seed's
paired difference, and the pooled one (RESULTS.md, "Seeded exact match against rejection sampling
at temperature 1").

    PYTHONPATH=src python results/sampled/seeds/pooled.py > results/sampled/seeds/pooled.md
    PYTHONPATH=src python results/sampled/seeds/pooled.py glm5 > results/sampled/glm5-live/seeds/pooled.md

The glm5_next toy (default): seed 0 is results/sampled/{match,rejection}, seeds 1 and 2
results/sampled/seeds/s<seed>/<verify>, and the last line the seed-0 pair at top_p 0.95
(results/sampled/top-p-0.95/<verify>), the same prompts. ``glm5``: the GLM-5 toy's, under
results/sampled/glm5-live/ (seed 0) and results/sampled/glm5-live/seeds/s<seed>/.
Every run holds the same 32 prompts (checked: prompts_sha256). Pooled: per prompt, the counts
(reached, accepted, steps, committed) summed over the three seeds, then the paired difference
with the prompts resampled jointly: a prompt's three seeds stay together (they share its text),
so the interval counts the prompts, not prompt-seed pairs, as independent.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from glm_mtp.experiments.loop.stats import paired_difference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # results/sampled
KEYS = ("reached", "accepted", "steps", "committed")


BASE = {"next": (ROOT, os.path.join(ROOT, "seeds")),
        "glm5": (os.path.join(ROOT, "glm5-live"), os.path.join(ROOT, "glm5-live", "seeds"))}
MODEL = sys.argv[1] if len(sys.argv) > 1 else "next"


def run_dir(seed: int, verify: str) -> str:
    seed0, seeds = BASE[MODEL]
    return os.path.join(seed0, verify) if seed == 0 else os.path.join(seeds, f"s{seed}", verify)


def load(seed: int, verify: str, folder: str | None = None, top_p: float | None = None) -> dict:
    with open(os.path.join(folder or run_dir(seed, verify), "summary.json")) as f:
        s = json.load(f)
    assert (s["seed"], s["verify"], s["temperature"], s["top_p"]) == (seed, verify, 1.0, top_p), (seed, verify)
    return s


def pooled(runs: list[dict]) -> dict:
    """Per-prompt counts summed over runs (same prompts, same order)."""
    return {k: np.sum([np.asarray(r["counts_per_prompt"][k]) for r in runs], axis=0).tolist() for k in KEYS}


def ci(x: float, lo_hi: list[float]) -> str:
    return f"{x:+.3f} [{lo_hi[0]:+.3f}, {lo_hi[1]:+.3f}]"


def main() -> None:
    seeds = (0, 1, 2)
    runs = {(s, v): load(s, v) for s in seeds for v in ("match", "rejection")}
    shas = {r["prompts_sha256"] for r in runs.values()}
    assert len(shas) == 1, f"the runs do not share their prompts: {shas}"
    record = {"prompts_sha256": shas.pop(), "per_seed": {}, "pooled": {}}
    print("| seed | τ rejection [95% CI] | τ match [95% CI] | rounds (rej / match) | match − rejection: Δτ | Δα_1 |")
    print("|---|---|---|---|---|---|")
    for s in seeds:
        m, r = runs[(s, "match")], runs[(s, "rejection")]
        d = paired_difference(m["counts_per_prompt"], r["counts_per_prompt"], seed=0)
        record["per_seed"][s] = {"tau": {"match": m["mean_accepted_length"], "rejection": r["mean_accepted_length"]},
                                 "rounds": {"match": m["counts"]["steps"], "rejection": r["counts"]["steps"]},
                                 "match_minus_rejection": d}
        print(f"| {s} | {r['mean_accepted_length']:.3f} [{r['tau_ci'][0]:.3f}, {r['tau_ci'][1]:.3f}] | "
              f"{m['mean_accepted_length']:.3f} [{m['tau_ci'][0]:.3f}, {m['tau_ci'][1]:.3f}] | "
              f"{r['counts']['steps']} / {m['counts']['steps']} | {ci(d['tau'], d['tau_ci'])} | "
              f"{ci(d['alpha'][0], d['alpha_ci'][0])} |")
    pm = pooled([runs[(s, "match")] for s in seeds])
    pr = pooled([runs[(s, "rejection")] for s in seeds])
    d = paired_difference(pm, pr, seed=0)
    tau = {v: sum(p["committed"]) / sum(p["steps"]) for v, p in (("match", pm), ("rejection", pr))}
    alpha = {v: [a / n if n else float("nan") for a, n in zip(np.sum(p["accepted"], 0), np.sum(p["reached"], 0))]
             for v, p in (("match", pm), ("rejection", pr))}
    record["pooled"] = {"tau": tau, "alpha": alpha, "rounds": {v: sum(p["steps"]) for v, p in
                                                              (("match", pm), ("rejection", pr))},
                        "match_minus_rejection": d}
    print(f"| pooled 0-2 | {tau['rejection']:.3f} | {tau['match']:.3f} | {sum(pr['steps'])} / {sum(pm['steps'])} | "
          f"{ci(d['tau'], d['tau_ci'])} | {ci(d['alpha'][0], d['alpha_ci'][0])} |")
    print(f"\npooled α_2, α_3: match − rejection {ci(d['alpha'][1], d['alpha_ci'][1])}, "
          f"{ci(d['alpha'][2], d['alpha_ci'][2])}")
    out = os.path.join(BASE[MODEL][1], "pooled.json")
    if MODEL != "next":
        with open(out, "w") as f:
            json.dump(record, f, indent=1)
        return
    tp = {v: load(0, v, os.path.join(ROOT, "top-p-0.95", v), 0.95) for v in ("match", "rejection")}
    assert tp["match"]["prompts_sha256"] == tp["rejection"]["prompts_sha256"] == record["prompts_sha256"]
    m, r = tp["match"], tp["rejection"]
    d = paired_difference(m["counts_per_prompt"], r["counts_per_prompt"], seed=0)
    record["top_p_0.95"] = {"tau": {"match": m["mean_accepted_length"], "rejection": r["mean_accepted_length"]},
                            "rounds": {"match": m["counts"]["steps"], "rejection": r["counts"]["steps"]},
                            "match_minus_rejection": d}
    print(f"\ntop_p 0.95, seed 0: τ rejection {r['mean_accepted_length']:.3f} "
          f"[{r['tau_ci'][0]:.3f}, {r['tau_ci'][1]:.3f}], "
          f"match {m['mean_accepted_length']:.3f} [{m['tau_ci'][0]:.3f}, {m['tau_ci'][1]:.3f}], rounds "
          f"{r['counts']['steps']} / {m['counts']['steps']}; match − rejection Δτ {ci(d['tau'], d['tau_ci'])}, "
          f"Δα_1 {ci(d['alpha'][0], d['alpha_ci'][0])}")
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
