"""The speedup model S(k) = tau(k) / (1 + k c + v(k)): its arithmetic, its intervals, GLM-5's
costs from bytes, and costs measured on a target and drafter."""

import itertools
import json

import numpy as np
import pytest
import torch

from glm_mtp.experiments import bench
from glm_mtp.experiments.loop import cost_tables, speedup
from glm_mtp.experiments.loop.speculative import make_proposer
from glm_mtp.reference.config import MtpConfig


def counts(P=12, K=4, seed=0):
    """Per-prompt counts of a chain of drafts: accepted[i] <= reached[i], reached[i+1] = accepted[i]."""
    rng = np.random.default_rng(seed)
    reached, accepted, steps = [], [], []
    for _ in range(P):
        s = int(rng.integers(10, 30))
        r, a = [], []
        n = s
        for i in range(K):
            acc = int(rng.binomial(n, 0.6 - 0.05 * i))
            r.append(n)
            a.append(acc)
            n = acc
        reached.append(r)
        accepted.append(a)
        steps.append(s)
    return {"reached": reached, "accepted": accepted, "steps": steps}


def test_tau_and_prediction_by_hand():
    assert speedup.tau_by_k([0.5, 0.25, 0.125]) == [1.5, 1.75, 1.875]
    pred = speedup.predict([1.5, 1.75, 1.875], 0.1, [0.0, 0.05, 0.1])
    assert pred == pytest.approx([1.5 / 1.1, 1.75 / 1.25, 1.875 / 1.4])
    assert speedup.best_k(pred) == 2
    assert speedup.best_k([1.0, 1.0]) == 1  # ties to the smaller k
    with pytest.raises(ValueError, match="one value per k"):
        speedup.predict([1.5, 1.75], 0.1, [0.0])


def test_summary_intervals_and_best_k():
    c = counts()
    sp = speedup.speedup_summary(c, 0.05, [0.0, 0.01, 0.02, 0.03], seed=1)
    K = 4
    assert len(sp["predicted"]) == len(sp["predicted_ci"]) == len(sp["tau"]) == len(sp["v"]) == K
    for x, (lo, hi) in zip(sp["predicted"], sp["predicted_ci"]):
        assert lo <= x <= hi and hi > lo
    assert sp["best_k"] == speedup.best_k(sp["predicted"]) and sum(sp["best_k_share"]) == pytest.approx(1.0)
    # tau(k) from the counts: 1 + sum_i accepted_i / steps over all prompts.
    a, s = np.asarray(c["accepted"]).sum(0), sum(c["steps"])
    assert sp["tau"] == pytest.approx([1 + a[:k].sum() / s for k in range(1, K + 1)])
    # A costlier drafter moves the best k down, never up.
    dear = speedup.speedup_summary(c, 0.9, [0.0] * K, seed=1)
    assert dear["best_k"] <= sp["best_k"] and dear["predicted"][0] < sp["predicted"][0]


def test_glm5_costs_from_bytes():
    cfg = MtpConfig.preset("glm5")
    # GLM-5 activates ~40 B parameters a token (744 B in all): a target step's weights.
    assert 38e9 < speedup.target_step_params(cfg, 1) < 42e9
    g = speedup.glm5_costs(5)
    assert 0.02 < g["c"] < 0.06  # one MTP layer + the 155k x 6144 head against 78 layers + the head
    assert g["draft_step_params"] > cfg.vocab_size * cfg.hidden_size
    # Verifying more tokens reads more routed experts: v grows with k, below n - 1 times the step.
    assert all(0 < a < b for a, b in zip(g["v"], g["v"][1:])) and g["v"][0] < 1
    assert speedup.expected_experts(cfg, 1) == pytest.approx(8) and speedup.expected_experts(cfg, 1000) <= 256
    # One expert, always chosen: a verify reads what a step reads but the k more embedding rows.
    dense = MtpConfig.preset("tiny").replace(n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1)
    d = speedup.bytes_costs(dense, 3)
    assert d["v"] == pytest.approx([k * dense.hidden_size / d["target_step_params"] for k in (1, 2, 3)])


def test_released_model_costs_follow_the_drafter_family(tmp_path, monkeypatch):
    """The main job's second S(k): the run's counts at the measured cost table of the released
    model of the drafter's family (GLM-5.2 on 8 x H200 for GLM-5, GLM-5.3-Flash on an M5 Max for
    glm5_next), the bytes limit beside it as the bound; both plotted, each labelled with its costs."""
    c = counts(K=3)
    for family, preset, name, table in (("glm5", "glm5", "GLM-5", "glm52-h200x8-mstar"),
                                        ("glm5_next", "glm5next", "GLM-5.3-Flash", "glm53flash-m5max-ds4")):
        rel = speedup.released_speedup(c, family, 3, seed=2)
        costs = cost_tables.costs_at(cost_tables.shipped_table(table), 3)
        assert rel["model"] == name and rel["preset"] == preset and rel["costs"] == f"table:{table}"
        assert rel["predicted"] == speedup.speedup_summary(c, costs["c"], costs["v"], seed=2)["predicted"]
        assert rel["table"]["name"] == table and rel["extrapolated"] == costs["extrapolated"]
        b = speedup.bytes_costs(MtpConfig.preset(preset), 3)
        assert rel["bound"] == speedup.speedup_summary(c, b["c"], b["v"], seed=2, source=f"bytes:{preset}")
        # The bytes limit is the bound: every S(k) at the measured table is at least the bytes'.
        assert all(m >= x for m, x in zip(rel["predicted"], rel["bound"]["predicted"]))
    # ds4#892 publishes forwards of widths 1 and 2 only: v(2), v(3) are extrapolated, and the line says so.
    assert rel["extrapolated"] == [2, 3]
    assert speedup.resolve_costs("glm5next", None, None, 3, [1, 2]) == speedup.preset_costs("glm5next", 3)
    # GLM-5.3-Flash reads fewer bytes a target step than GLM-5, so its drafter costs more of one.
    assert speedup.preset_costs("glm5", 3)["c"] < speedup.preset_costs("glm5next", 3)["c"] < 0.1
    toy = speedup.speedup_summary(c, 1.09, [0.3, 0.6, 0.9], seed=2, source="measured")
    line = speedup.released_line(rel, toy["c"])
    assert line.startswith("at GLM-5.3-Flash's family's measured costs (table glm53flash-m5max-ds4): S(1) = ")
    assert "glm53flash-m5max-ds4: GLM-5.3-Flash on Apple M5 Max, 128 GB" in line and "antirez/ds4#892" in line
    assert "v at k = 2, 3 extrapolated linearly" in line
    assert "bound at GLM-5.3-Flash's bytes (bytes:glm5next, the memory-bound limit): S(1) = " in line
    assert "this run's drafter costs c = 1.090 of its target's step" in line
    import matplotlib.figure

    labels = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, path, **kw: labels.extend(fig.axes[0].get_legend_handles_labels()[1]))
    speedup.plot_speedup(toy, str(tmp_path / "s.png"), released=rel)
    assert {"S(k), costs measured", "S(k) at GLM-5.3-Flash's costs (table:glm53flash-m5max-ds4)",
            "bound: GLM-5.3-Flash's bytes (bytes:glm5next, memory-bound limit)"} <= set(labels)


def test_measured_costs_follow_the_clock(tiny64):
    """With a clock that advances one tick per reading, every timed call lasts one tick: a draft
    step is 1/k of a propose, a verify of any length equals a step (v = 0), so c = 1/k."""
    from glm_mtp.experiments.targets.target import Target

    ticks = itertools.count()
    target = Target(tiny64.target, 64)
    prop = make_proposer("reference", tiny64.mtp, 64)
    ctx = torch.randint(0, tiny64.target.config.vocab_size, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    costs = speedup.measure_costs(target, prop, 4, ctx, repeats=3, clock=lambda: float(next(ticks)))
    assert costs["c"] == pytest.approx(0.25) and costs["v"] == [0.0] * 4 and costs["repeats"] == 3
    real = speedup.measure_costs(target, prop, 2, ctx, repeats=2)
    assert real["c"] > 0 and len(real["v"]) == 2 and real["target_step_ms"] > 0


def test_resolve_costs_from_a_file(tmp_path):
    p = tmp_path / "costs.json"
    p.write_text(json.dumps({"c": 0.2, "v": [0.1, 0.2]}))
    got = speedup.resolve_costs(str(p), None, None, 2, [1, 2])
    assert got["c"] == 0.2 and got["source"] == f"file:{p}"
    with pytest.raises(ValueError, match="fewer than num_drafts"):
        speedup.resolve_costs(str(p), None, None, 3, [1, 2])
    assert speedup.resolve_costs("glm5", None, None, 2, [1, 2])["source"] == "bytes:glm5"


def test_bench_target_costs_writes_costs_json(tmp_path):
    bc = bench.parse_args(["--target-costs", "--backends", "reference", "--drafts", "1", "2", "--repeats", "1",
                           "--context", "8", "--out", str(tmp_path)])
    costs = bench.run_target_costs(bc)
    on_disk = json.loads((tmp_path / "costs.json").read_text())
    assert (
        on_disk["c"] == costs["c"] > 0
        and len(on_disk["v"]) == 2
        and on_disk["per_backend"]["reference"]["backend"] == "reference"
    )
    assert on_disk["glm5"]["source"] == "bytes:glm5" and "GLM-5 (bytes)" in (tmp_path / "costs.md").read_text()
