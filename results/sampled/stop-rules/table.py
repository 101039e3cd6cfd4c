"""The stop rules' sweep at T = 1 beside T = 0 (RESULTS.md, "Stop rules at T = 1, replayed"): per
model, every row of the T = 1 sweep (results/sampled/stop-rules/<model>/sweep.json) beside the
same row of the published T = 0 sweep (results/stop-rules/<model>/sweep.json, the same 8 held-out
windows: checked by the traces' windows_sha256), with the paired T = 1 - T = 0 difference in tau
(the prompts resampled jointly, 95%).

    PYTHONPATH=src python results/sampled/stop-rules/table.py > results/sampled/stop-rules/table.md
"""

from __future__ import annotations

import json
import os

import numpy as np

from glm_mtp.experiments.loop.stats import REPLICATES

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.dirname(os.path.dirname(HERE))
MODELS = ("glm5next", "glm5")


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def tau_of(counts: dict, idx: np.ndarray | None = None) -> np.ndarray:
    com = np.asarray(counts["committed"], dtype=np.float64)
    steps = np.asarray(counts["widths"], dtype=np.float64).sum(-1)
    if idx is None:
        return com.sum() / steps.sum()
    return com[idx].sum(-1) / steps[idx].sum(-1)


def paired_tau(a: dict, b: dict, seed: int = 0) -> tuple[float, list[float]]:
    """tau(a) - tau(b) over the same prompts, 95% interval from resampling the prompts jointly."""
    n = len(a["committed"])
    idx = np.random.default_rng(seed).integers(0, n, size=(REPLICATES, n))
    d = tau_of(a, idx) - tau_of(b, idx)
    return float(tau_of(a) - tau_of(b)), np.percentile(d, [2.5, 97.5]).tolist()


def ci(x: float, lo_hi: list[float], nd: int = 2, sign: bool = False) -> str:
    f = f"{{:{'+' if sign else ''}.{nd}f}}"
    return f"{f.format(x)} [{f.format(lo_hi[0])}, {f.format(lo_hi[1])}]"


def main() -> None:
    for model in MODELS:
        if not os.path.exists(os.path.join(HERE, model, "sweep.json")):
            continue
        t1 = load(os.path.join(HERE, model, "sweep.json"))
        t0 = load(os.path.join(RESULTS, "stop-rules", model, "sweep.json"))
        w0, w1 = t0["trace"]["prompts"]["windows_sha256"], t1["trace"]["prompts"]["windows_sha256"]
        assert w0 == w1, f"{model}: the T = 0 and T = 1 sweeps hold other windows"
        assert t1["temperature"] == 1.0 and t0["temperature"] == 0.0 and t1["costs"]["source"] == t0["costs"]["source"]
        rows0 = {r["name"]: r for r in t0["rows"]}
        print(f"### {model} (K = {t1['num_drafts']}, {t1['prompts']} prompts x {t1['max_new_tokens']} tokens, "
              f"S at {t1['costs']['source']}, c = {t1['costs']['c']:.3f})\n")
        print("| entry | T = 1: mean width | τ [95% CI] | S [95% CI] | S, drafting stops | T = 0: mean width | τ | S "
              "| S, drafting stops | Δτ (T1 − T0) [95% CI] |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in t1["rows"]:
            o = rows0.get(r["name"])
            cells = [r["name"], f"{r['mean_width']:.2f}", ci(r["tau"], r["tau_ci"]),
                     ci(r["predicted"], r["predicted_ci"], 3), f"{r['regimes']['serial']['predicted']:.3f}"]
            if o is None:
                cells += ["—"] * 5
            else:
                d, dci = paired_tau(r["counts"], o["counts"])
                cells += [f"{o['mean_width']:.2f}", ci(o["tau"], o["tau_ci"]), f"{o['predicted']:.3f}",
                          f"{o['regimes']['serial']['predicted']:.3f}", ci(d, dci, 3, True)]
            print("| " + " | ".join(cells) + " |")
        for label, rec in (("T = 1", t1), ("T = 0", t0)):
            fixed = [r for r in rec["rows"] if r["rule"] == "none"]
            rules = [r for r in rec["rows"] if r["rule"] not in ("none", "oracle")]
            oracle = next(r for r in rec["rows"] if r["rule"] == "oracle")
            bf = max(fixed, key=lambda r: r["predicted"])
            br = max(rules, key=lambda r: r["predicted"])
            bs = max(rules, key=lambda r: r["regimes"]["serial"]["predicted"])
            print(f"\n{label}: best fixed k {bf['name']} S {bf['predicted']:.3f}; best rule, fused: {br['name']} "
                  f"{br['predicted']:.3f}; drafting stops: {bs['name']} {bs['regimes']['serial']['predicted']:.3f}; "
                  f"oracle {oracle['predicted']:.3f} (drafting stops {oracle['regimes']['serial']['predicted']:.3f}); "
                  f"calibration ECE of p {rec['calibration']['prob']['all']['ece']:.3f}; Spearman p_1 / margin_1 with "
                  f"the accepted depth {rec['depth_correlation']['prob_1']:.2f} / "
                  f"{rec['depth_correlation']['margin_1']:.2f} over {rec['depth_correlation']['rounds']} rounds")
        print()


if __name__ == "__main__":
    main()
