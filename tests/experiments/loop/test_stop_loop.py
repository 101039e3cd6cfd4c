"""Stop rules in the loop (DESIGN.md §12, experiments/loop/stop_rules.py) with the real drafter's
``draft_confidence``: a threshold every draft passes gives the fixed-k counts exactly, one no
draft passes gives tau 1, any rule keeps greedy output the target's and verifies exactly the
prefix the rule picks; the acceptance run and the sweep record them; bad settings are refused."""

import json

import pytest
from hydra import compose, initialize_config_module

from glm_mtp.experiments import stop_sweep
from glm_mtp.experiments.acceptance_job.run import run as run_acceptance
from glm_mtp.experiments.loop import speedup as spd
from glm_mtp.experiments.loop.speculative import POLICIES, SpeculativeDecoder, target_decode, teacher_forced
from glm_mtp.experiments.loop.stop_rules import StopRule, verify_width
from glm_mtp.experiments.reporting.wandb_log import read_offline_run
from glm_mtp.experiments.settings.validate import check_acceptance
from glm_mtp.reference import ReferenceProposer

from .test_speculative import oracle

COUNTS = ("reached", "accepted", "steps", "committed", "widths")


def counts(st):
    return {name: getattr(st, name) for name in COUNTS}


def config(name, overrides):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose(name, overrides=overrides)


@pytest.mark.parametrize("rule", ["prob", "cumprob"])
def test_threshold_zero_gives_the_fixed_k_counts_exactly(tiny64, target64, random_prompt, rule):
    prompt = random_prompt(96, 10, 4)
    fixed = SpeculativeDecoder(target64, ReferenceProposer(tiny64.mtp, 128), 3).generate(prompt, 24)
    stopped = SpeculativeDecoder(target64, ReferenceProposer(tiny64.mtp, 128), 3,
                                 stop=StopRule(rule, 0.0)).generate(prompt, 24)
    assert stopped.tokens == fixed.tokens and counts(stopped.stats) == counts(fixed.stats)
    assert stopped.stats.widths == [0, 0, 0, fixed.stats.steps]


def test_threshold_above_one_verifies_no_draft_tau_one(tiny64, target64, random_prompt):
    prompt = random_prompt(96, 10, 5)
    res = SpeculativeDecoder(target64, ReferenceProposer(tiny64.mtp, 128), 3,
                             stop=StopRule("prob", 1.5)).generate(prompt, 12)
    assert res.stats.tau == 1.0 and res.stats.reached == [0, 0, 0] and res.stats.widths == [res.stats.steps, 0, 0, 0]
    assert res.tokens == target_decode(target64, prompt, 12)


# Thresholds inside the tiny random drafter's range (p ~ 0.04-0.2, margin ~ 0-1.5): mixed widths.
MIXED = [StopRule("prob", 0.07), StopRule("cumprob", 0.0004), StopRule("margin", 0.3)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("stop", MIXED)
def test_a_rule_verifies_its_prefix_and_greedy_stays_the_target_decode(tiny64, target64, random_prompt, policy,
                                                                       stop):
    """Drafts from the target's greedy continuation, 30% wrong (test_speculative's oracle, the real
    drafter's state machine and confidences): every width and accept count, output the target's."""
    prompt = random_prompt(96, 9, 6)
    prop, greedy = oracle(tiny64, target64, prompt, 30, p_wrong=0.3, seed=2)
    res = SpeculativeDecoder(target64, prop, 3, policy, stop=stop, record_rounds=True).generate(prompt, 30)
    assert res.tokens == greedy[len(prompt) : len(prompt) + 30]
    st = res.stats
    assert len(st.rounds) == st.steps and sum(st.widths) == st.steps
    for r in st.rounds:  # the recorded confidences decide the width; a <= width
        assert r.width == verify_width(stop, r.prob, r.margin) and r.accepted <= r.width
        assert all(0.0 < p <= 1.0 for p in r.prob) and all(m >= 0.0 for m in r.margin)  # greedy: margin >= 0
    assert sum(1 for n in st.widths if n) >= 2, st.widths  # the rule trimmed some rounds, not all
    assert any(0 < r.accepted == r.width < 3 for r in st.rounds)  # a trimmed round fully accepted: no catch-up


def test_batched_rounds_trim_as_the_single_loop(tiny64, target64, random_prompt):
    prompts = [random_prompt(96, n, 20 + n) for n in (7, 9, 12)]
    stop = StopRule("prob", 0.3)
    dec = SpeculativeDecoder(target64, ReferenceProposer(tiny64.mtp, 128), 3, stop=stop)
    batch = dec.generate_batch(prompts, 16)
    for p, b in zip(prompts, batch):
        one = SpeculativeDecoder(target64, ReferenceProposer(tiny64.mtp, 128), 3, stop=stop).generate(p, 16)
        assert b.tokens == one.tokens and counts(b.stats) == counts(one.stats)


def test_teacher_forcing_trims_each_position(tiny64, target64, random_prompt):
    text = random_prompt(96, 20, 8)
    fixed = teacher_forced(target64, ReferenceProposer(tiny64.mtp, 128), text, 8, 3)
    zero = teacher_forced(target64, ReferenceProposer(tiny64.mtp, 128), text, 8, 3, stop=StopRule("prob", 0.0))
    none = teacher_forced(target64, ReferenceProposer(tiny64.mtp, 128), text, 8, 3, stop=StopRule("prob", 1.5))
    assert counts(zero) == counts(fixed)
    assert none.tau == 1.0 and none.widths == [none.steps, 0, 0, 0]


def test_sampled_drafts_at_threshold_zero_draw_as_the_fixed_loop(tiny64, target64, random_prompt):
    """Rejection sampling over the rule's prefix: at t = 0 the same draws as without a rule."""
    prompt = random_prompt(96, 10, 9)
    runs = [SpeculativeDecoder(target64, ReferenceProposer(tiny64.mtp, 128), 3, temperature=1.0, seed=3,
                               draft="sampled", stop=stop).generate(prompt, 16)
            for stop in (StopRule(), StopRule("cumprob", 0.0))]
    assert runs[0].tokens == runs[1].tokens and counts(runs[0].stats) == counts(runs[1].stats)


def test_acceptance_records_the_rule_and_the_widths(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    base = ["model=tiny_random", "experiment=smoke", "num_drafts=3", "speedup.costs=glm5"]
    out = {}
    for name, extra in {"none": ["logger=none"], "zero": ["logger=none", "stop.rule=prob", "stop.threshold=0"],
                        "above": ["stop.rule=prob", "stop.threshold=1.5"]}.items():
        cfg = config("config", base + extra)
        check_acceptance(cfg)
        run_acceptance(cfg, str(tmp_path / name))
        out[name] = json.loads((tmp_path / name / "summary.json").read_text())
    assert out["zero"]["stop"] == {"rule": "prob", "threshold": 0.0} and out["none"]["stop"]["rule"] == "none"
    assert out["zero"]["counts"] == out["none"]["counts"]
    assert out["zero"]["counts_per_prompt"] == out["none"]["counts_per_prompt"]
    steps = out["above"]["counts"]["steps"]
    assert out["above"]["mean_accepted_length"] == 1.0
    assert out["above"]["verify_width"] == {"mean": 0.0, "histogram": [steps, 0, 0, 0]}
    assert out["none"]["verify_width"]["mean"] == 3.0
    at = out["none"]["speedup"]["glm5"]["at_width"]  # at the full width: S(k) of the fixed-k model
    assert at["predicted"] == pytest.approx(out["none"]["speedup"]["glm5"]["predicted"][-1], rel=1e-12)
    assert out["above"]["speedup"]["at_width"]["mean_width"] == 0.0
    run = read_offline_run(str(tmp_path / "above"))  # W&B (offline): the rule, the mean width, the histogram
    assert run["summary"]["stop"] == {"rule": "prob", "threshold": 1.5}
    assert run["summary"]["verify_width/mean"] == 0.0
    assert run["summary"]["verify_width"]["histogram"] == [steps, 0, 0, 0]
    assert run["summary"]["verify_width/histogram/_type"] == "histogram"
    assert run["summary"]["verify_width/histogram/values"] == [steps, 0, 0, 0]


@pytest.mark.parametrize("overrides, words", [
    (["stop.rule=entropy", "stop.threshold=0.5"], "stop.rule must be one of none, prob, cumprob, margin"),
    (["stop.rule=margin"], "stop.threshold must be a finite number with stop.rule=margin"),
    (["stop.rule=prob", "stop.threshold=.inf"], "stop.threshold must be a finite number"),
    (["stop.rule=prob", "stop.threshold=abc"], "stop.threshold must be a finite number"),
    (["stop.rule=prob", "stop.threshold=true"], "stop.threshold must be a finite number"),
    (["stop.threshold=0.5"], "stop.threshold must be null with stop.rule=none"),
])
def test_bad_stop_settings_are_refused_before_work(overrides, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        check_acceptance(config("config", ["model=tiny_random", *overrides]))


@pytest.mark.parametrize("overrides, words", [
    (["stop.rule=prob", "stop.threshold=0.5"], "stop.rule must be none for the sweep"),
    (["+sweep.thresholds.entropy=[0.5]"], "'entropy' is not a rule"),
    (["sweep.thresholds.prob=[]"], "sweep.thresholds.prob must be a non-empty list"),
    (["sweep.thresholds.margin=[1.0,.nan]"], "sweep.thresholds.margin.threshold must be a finite number"),
])
def test_bad_sweep_settings_are_refused_before_work(overrides, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        stop_sweep.check_sweep(config("stop_sweep", ["model=tiny_random", *overrides]))


def test_the_sweep_runs_fixed_k_rules_and_the_oracle(tmp_path):
    cfg = config("stop_sweep", ["model=tiny_random", "num_drafts=2", "run.num_prompts=2", "run.prompt_tokens=8",
                                "run.max_new_tokens=12", "logger=none", "sweep.thresholds.prob=[0.0,1.5]",
                                "sweep.thresholds.cumprob=[0.01]", "sweep.thresholds.margin=[0.5]"])
    stop_sweep.check_sweep(cfg)
    rec = stop_sweep.run(cfg, str(tmp_path))
    rows = {r["name"]: r for r in rec["rows"]}
    assert list(rows) == ["fixed k=1", "fixed k=2", "oracle (K=2)", "prob >= 0", "prob >= 1.5", "cumprob >= 0.01",
                          "margin >= 0.5"]
    assert rows["prob >= 0"]["counts"] == rows["fixed k=2"]["counts"]
    assert rows["prob >= 1.5"]["tau"] == 1.0 and rows["prob >= 1.5"]["mean_width"] == 0.0
    oracle, full = rows["oracle (K=2)"], rows["fixed k=2"]
    assert oracle["tau"] == full["tau"] and oracle["mean_width"] == pytest.approx(full["tau"] - 1.0)
    assert oracle["predicted"] >= full["predicted"]
    cal = rec["calibration"]["prob"]
    assert sum(cal["per_position"][0]["reached"]) == sum(map(sum, full["counts"]["widths"]))
    for name in ("sweep.json", "sweep.md", "calibration.png", "sweep.png"):
        assert (tmp_path / name).stat().st_size > 0
    for r in rec["rows"]:  # drafting that stops at the first refused draft saves steps of width s < k - 1 only
        serial = r["regimes"]["serial"]["predicted"]
        if any(r["width_histogram"][: r["num_drafts"] - 1]):
            assert serial > r["predicted"]
        else:
            assert serial == pytest.approx(r["predicted"])
    # the finished sweep at other costs, from its counts: the same tau and widths, S at those costs
    again = config("stop_sweep", ["model=tiny_random", "logger=none", "speedup.costs=glm5next",
                                  f"sweep.rescore={tmp_path / 'sweep.json'}"])
    stop_sweep.check_sweep(again)
    re = stop_sweep.run(again, str(tmp_path / "rescored"))
    assert re["costs"]["source"] == "bytes:glm5next" and [r["name"] for r in re["rows"]] == list(rows)
    for old, new in zip(rec["rows"], re["rows"]):
        assert new["tau"] == old["tau"] and new["width_histogram"] == old["width_histogram"]
        assert new["predicted"] == pytest.approx(spd.width_speedup(sum(old["counts"]["committed"]),
                                                                   new["width_histogram"], re["costs"]["c"],
                                                                   re["costs"]["v"][: old["num_drafts"]]))
    # and at a measured cost table: its name in the sweep's table header, its c and v
    table = stop_sweep.rescore(config("stop_sweep", ["model=tiny_random", "speedup.costs=glm53flash-m5max-ds4",
                                                     f"sweep.rescore={tmp_path / 'sweep.json'}"]))
    assert table["costs"]["source"] == "table:glm53flash-m5max-ds4" and table["costs"]["v"][0] == pytest.approx(
        37.4 / (1000 / 33.0) - 1, rel=1e-4)
    assert "glm53flash-m5max-ds4: GLM-5.3-Flash on Apple M5 Max" in stop_sweep.format_table(table)
    with pytest.raises(ValueError, match="speedup.costs must be bytes:glm5, bytes:glm5next, a cost table"):
        stop_sweep.check_sweep(config("stop_sweep", ["model=tiny_random", "speedup.costs=measured",
                                                     f"sweep.rescore={tmp_path / 'sweep.json'}"]))
    with pytest.raises(ValueError, match="sweep.rescore: .*sweep.md is not valid JSON"):
        stop_sweep.check_sweep(config("stop_sweep", ["model=tiny_random", f"sweep.rescore={tmp_path / 'sweep.md'}"]))
