"""No setting accepted and then ignored (issue 49): a replay takes the settings its trace fixes
(a key left at its default follows the trace; one given another value is refused naming the
key), and a recording refuses the keys it does not read (a grammar, per-prompt schemas, the
drafter's and the loop's keys). Named cases, then each key drawn."""

import json
import random

import pytest

from glm_mtp.experiments import record
from glm_mtp.experiments.acceptance_job.measure import measure
from glm_mtp.experiments.settings.explicit import config_defaults, given_keys, value_at
from glm_mtp.experiments.settings.validate import check_acceptance, check_acceptance_run
from glm_mtp.experiments.traces.replay_keys import FIXED, NOT_READ, RECORD_NOT_READ


def compose(overrides, name="config"):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return hydra_compose(name, overrides=overrides)


TINY = ["model=tiny_random", "run.num_prompts=2", "run.prompt_tokens=8", "run.max_new_tokens=5", "logger=none"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Two tiny traces of 2 prompts, 5 new tokens, k <= 2: ``vendor`` and ``pinned`` numerics."""
    root = tmp_path_factory.mktemp("given")
    out = {}
    for numerics in ("vendor", "pinned"):
        cfg = compose([*TINY, f"target_numerics={numerics}", "trace.max_drafts=2", "trace.cost_repeats=0",
                       f"trace.out={root / numerics}"])
        record.check_record(cfg)
        record.record(cfg)
        out[numerics] = root / numerics
    return out


def replay_cfg(trace, overrides):
    return compose(["model=tiny_random", "logger=none", "num_drafts=2", f"trace.path={trace}", *overrides])


def refused(cfg, check, *words):
    with pytest.raises(ValueError) as e:
        check(cfg)
    message = str(e.value)
    assert "\n" not in message
    for w in words:
        assert w in message, (w, message)
    return message


def test_replay_of_a_vendor_trace_refuses_pinned(traces):
    refused(replay_cfg(traces["vendor"], ["target_numerics=pinned"]), check_acceptance, "target_numerics='pinned'",
            "target.numerics='vendor'")
    cfg = replay_cfg(traces["pinned"], [])  # left at the default (vendor): the trace's pinned is taken
    check_acceptance(cfg)
    assert cfg.target_numerics == "pinned"


def test_replay_without_max_new_tokens_uses_the_traces(traces):
    cfg = replay_cfg(traces["pinned"], [])  # config.yaml's run.max_new_tokens is 64; the trace's 5
    assert cfg.run.max_new_tokens == 64
    check_acceptance(cfg)
    assert (cfg.run.max_new_tokens, cfg.run.num_prompts, cfg.run.prompt_tokens) == (5, 2, 8)
    replay = measure(cfg)
    live_cfg = compose([*TINY, "target_numerics=pinned", "num_drafts=2", "speedup.costs=glm5"])
    check_acceptance(live_cfg)
    live = measure(live_cfg)
    assert [(s.reached, s.accepted, s.steps) for s in replay.per_prompt] == \
        [(s.reached, s.accepted, s.steps) for s in live.per_prompt]
    assert replay.outputs_sha256 == live.outputs_sha256
    assert replay.numerics == "pinned"


def test_record_refuses_a_grammar(tmp_path):
    grammar = tmp_path / "g.regex"
    grammar.write_text("[a-z]+\n")
    for overrides in (["grammar=regex", f"grammar.path={grammar}"], ["grammar=regex", "grammar.pattern=a+"],
                      ["grammar=json_schema", "grammar.pattern={}"]):
        cfg = compose(["model=shipped", *overrides, f"trace.out={tmp_path / 'out'}"])
        refused(cfg, record.check_record, "grammar=", "unconstrained")
    assert not (tmp_path / "out").exists()


def test_record_refuses_per_prompt_schemas(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n    return x + 1\n"}) + "\n"
                       + json.dumps({"prompt": "import os\nimport sys\n", "json_schema": {"type": "object"}}) + "\n")
    cfg = compose(["model=shipped", "source=jsonl", f"prompts.path={prompts}", "run.num_prompts=2",
                   "run.max_new_tokens=4", f"trace.out={tmp_path / 'out'}", "trace.max_drafts=2"])
    refused(cfg, record.check_record, "prompts.path", "prompt 1 carries a json_schema")


DRAWN = {"mode": lambda r, v: "teacher_forced", "source": lambda r, v: "ood", "prompts.path": lambda r, v: "p.jsonl",
         "run.num_prompts": lambda r, v: v + r.randint(1, 9), "run.prompt_tokens": lambda r, v: v + r.randint(1, 9),
         "seed": lambda r, v: v + r.randint(1, 2**20), "run.max_new_tokens": lambda r, v: r.choice([1, 2, 3, 4, 6, 7]),
         "target_numerics": lambda r, v: "pinned", "trace.out": lambda r, v: "elsewhere",
         "trace.max_drafts": lambda r, v: r.randint(1, 4), "trace.batch_size": lambda r, v: r.randint(1, 7),
         "trace.cost_repeats": lambda r, v: r.randint(0, 14)}


def test_drawn_replay_keys_are_taken_or_refused(traces):
    """Each fixed key given another value than its trace's is refused naming it, and every
    other key is left as found; left alone, it takes the trace's value."""
    rng = random.Random(4949)
    meta = json.loads((traces["vendor"] / "trace.json").read_text())
    keys = [k for k in (*FIXED, *NOT_READ) if k in DRAWN]
    assert set(DRAWN) >= set(FIXED)
    for _ in range(12):
        key = rng.choice(keys)
        want = FIXED[key][1](meta) if key in FIXED else None
        value = DRAWN[key](rng, want if isinstance(want, int) else 0)
        cfg = replay_cfg(traces["vendor"], [f"{key}={value}"])
        before = {k: value_at(cfg, k) for k in FIXED}
        refused(cfg, check_acceptance, f"{key}=")
        assert {k: value_at(cfg, k) for k in FIXED} == before  # nothing taken on a refusal


def test_record_refuses_every_key_it_does_not_read(tmp_path):
    defaults = config_defaults("config", "tiny_random")
    other = {"num_drafts": 4, "policy": "refeed", "draft": "sampled", "feed_hidden": "pre_norm", "attention": "dense",
             "batch_size": 2, "backend.name": "optimized", "stop.rule": "prob", "stop.threshold": 0.5,
             "speedup.costs": "glm5", "speedup.repeats": 3, "run.check_lossless": True,
             "model.weights_dtype": "fp8", "model.index_share": True, "grammar.drafts": "unmasked", "verify": "match"}
    assert set(other) == set(RECORD_NOT_READ)
    for key, value in other.items():
        assert value_at(defaults, key) != value
        override = f"backend={value}" if key == "backend.name" else f"{key}={json.dumps(value)}"
        cfg = compose([*TINY, override, f"trace.out={tmp_path / 'out'}"])
        assert given_keys(cfg, [key]) == [key]
        refused(cfg, record.check_record, f"{key}=")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides, words", [
    (["model=shipped", "grammar=regex", "grammar.pattern='[a-z]+'"], ["grammar=regex", "unconstrained"]),
    (["attention=dense"], ["attention=dense", "own selection"]),  # the glm5_next default: dense is valid live
    (["model=tiny_random", "run.check_lossless=true"], ["run.check_lossless"]),
])
def test_stop_sweep_refuses_what_it_would_ignore(overrides, words):
    from glm_mtp.experiments import stop_sweep

    cfg = compose([*overrides, "logger=none"], "stop_sweep")
    refused(cfg, stop_sweep.check_sweep, *words)


def test_stop_sweep_refuses_per_prompt_schemas(tmp_path):
    from glm_mtp.experiments import stop_sweep

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "import os\nimport sys\n", "json_schema": {"type": "object"}}) + "\n")
    cfg = compose(["model=shipped", "source=jsonl", f"prompts.path={prompts}", "run.num_prompts=1",
                   "run.max_new_tokens=4", "num_drafts=2", "logger=none"], "stop_sweep")
    refused(cfg, stop_sweep.check_sweep, "prompt 0 carries a json_schema")


def test_record_logs_to_the_logger(tmp_path, monkeypatch):
    """record honours logger=wandb (it was read and dropped): an offline W&B run, named run.name,
    holds the config and the trace's summary."""
    from glm_mtp.experiments.reporting.wandb_log import read_offline_run

    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = compose([*TINY[:-1], "logger=wandb", "run.name=mine", "trace.max_drafts=2", "trace.cost_repeats=0",
                   f"trace.out={tmp_path / 't'}"])
    record.check_record(cfg)
    meta = record.record(cfg, str(tmp_path / "run"))
    run = read_offline_run(str(tmp_path / "run"))
    assert run["summary"]["trace/sha256"] == meta["sha256"] and run["summary"]["trace/items"] == 2
    assert run["config"]["trace"]["out"] == str(tmp_path / "t") and run["config"]["run"]["name"] == "mine"


@pytest.mark.parametrize("name, overrides, words", [
    ("config", ["model=tiny_random", "trace.out=elsewhere"], ["trace.out='elsewhere'", "records nothing"]),
    ("config", ["model=tiny_random", "trace.cost_repeats=2"], ["trace.cost_repeats=2"]),
    ("config", ["model=tiny_random", "grammar.drafts=unmasked"], ["grammar.drafts=unmasked", "has none"]),
    ("stop_sweep", ["model=tiny_random", "logger=none", "trace.max_drafts=2"], ["trace.max_drafts=2"]),
])
def test_a_live_run_refuses_what_it_would_ignore(name, overrides, words):
    cfg = compose(overrides, name)
    from glm_mtp.experiments import stop_sweep

    refused(cfg, stop_sweep.check_sweep if name == "stop_sweep" else check_acceptance_run, *words)


@pytest.mark.parametrize("overrides, words", [
    (["train.base=shipped", "arch.hidden_size=64"], ["arch.hidden_size=64", "whose hidden_size is 128"]),
    (["training=next_stdlib", "train.base=shipped", "tokenizer.path=null"], ["arch.family='glm5_next'"]),
    (["train.base=shipped", "tokenizer.sample_every=2"], ["tokenizer.sample_every=2", "train.base=shipped"]),
    (["training=next_stdlib", "tokenizer.sample_every=1"], ["tokenizer.sample_every=1", "tokenizer.path=shipped"]),
])
def test_train_on_a_base_refuses_another_model(overrides, words):
    from glm_mtp.experiments.settings.validate import check_train

    refused(compose([*overrides, "logger=none"], "train"), check_train, *words)
    check_train(compose(["train.base=shipped", "logger=none"], "train"))  # the base's own arch: taken


def test_grid_refuses_out():
    from glm_mtp.experiments.settings.validate import check_grid

    refused(compose(["out=elsewhere"], "grid"), check_grid, "out='elsewhere'", "its own run folder")


def test_bench_target_costs_refuses_the_flags_it_does_not_read(tmp_path, capsys):
    from glm_mtp.experiments import bench

    for flags in (["--dtype", "float16"], ["--warmup", "3"], ["--presets", "small"], ["--counters", "tiny"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--target-costs", *flags, "--out", str(tmp_path / "b")])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and flags[0] in err and "--target-costs does not read it" in err, err
    assert bench.parse_args(["--target-costs", "--dtype", "float32", "--out", str(tmp_path / "b")]).target_costs


@pytest.mark.parametrize("override", ["num_drafts=3", "run.max_new_tokens=9", "sweep.fixed_k=false",
                                      "model.dtype=float32", "run.name=other"])
def test_a_rescore_refuses_what_it_would_not_read(override, tmp_path):
    """sweep.rescore runs nothing: a key it would drop (the model's, the loop's, the sweep's) is refused."""
    from glm_mtp.experiments import stop_sweep

    cfg = compose(["model=tiny_random", "logger=none", "speedup.costs=glm5", f"sweep.rescore={tmp_path / 's.json'}",
                   override], "stop_sweep")
    refused(cfg, stop_sweep.check_sweep, override.split("=")[0] + "=", "runs nothing")
