"""Sampled traces (DESIGN.md §14): recorded with the seeded sampler, they hold ``sample`` and the
sampler's settings; a replay takes the trace's settings and ``verify=match`` (another value
refused naming the key) and, for the package's target under pinned numerics, equals the live
``verify=match`` run per prompt. One fast case per family here; the sweep is ``-m slow``."""

import pytest
import torch

from glm_mtp.experiments.traces.validate import open_trace
from glm_mtp.experiments.loop.sampler import NAME, VERSION

from glm_mtp.experiments.settings.validate import check_acceptance

from glm_mtp.experiments.targets.checkpoint import SHIPPED_NEXT, shipped_checkpoint
from glm_mtp.experiments.traces.drafter_only import write_drafter_only

from .test_traces import compose, per_prompt, record_trace, refusal

TINY = ["model=tiny_random", "target_numerics=pinned", "run.num_prompts=3", "run.prompt_tokens=8",
        "run.max_new_tokens=6"]
SAMPLING = ["temperature=1", "top_p=0.9", "seed=4"]


@pytest.fixture(scope="module")
def sampled_tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampled-tiny")
    meta = record_trace(root / "trace", [*TINY, *SAMPLING, "trace.max_drafts=2", "trace.cost_repeats=0"])
    return root / "trace", meta


def test_a_sampled_trace_records_its_sampler_and_samples(sampled_tiny):
    path, meta = sampled_tiny
    g = meta["generation"]
    assert (g["temperature"], g["top_p"], g["top_k"], g["seed"]) == (1.0, 0.9, None, 4)
    assert g["sampler"] == {"name": NAME, "version": VERSION}
    trace = open_trace(str(path))
    for it in trace.items:
        P = it.prompt_len
        assert torch.equal(it.tokens[P:], it.sample[P - 1 : -1])  # the path follows the seeded samples
    # at temperature 1 the samples leave the argmax somewhere (else this trace says nothing new)
    assert any(bool((it.sample != it.argmax).any()) for it in trace.items)
    assert meta["truncation"]["items"] == 0  # pinned numerics: pass 2 samples what pass 1 did


def test_replay_refuses_other_settings_naming_the_key(sampled_tiny, tmp_path):
    path, _ = sampled_tiny
    base = ["model=tiny_random", "run.max_new_tokens=6", "num_drafts=2", "verify=match", *SAMPLING]
    for override, key in (("temperature=0.5", "temperature"), ("top_p=0.8", "top_p"), ("top_k=3", "top_k"),
                          ("seed=5", "seed"), ("verify=rejection", "verify")):
        message = refusal(path, [*base, override])
        # the replay's settings rule (traces/replay_keys.py) names "key=value", the sampler's "key:"
        assert message.startswith((f"{key}:", f"{key}=")), (override, message)
        assert "\n" not in message
    check_acceptance(compose([*base, f"trace.path={path}", "logger=none"]))  # the trace's own settings run


def live_and_replay(model, trace, run, replay_model=()):
    """The live ``verify=match`` run (checked against the target's own seeded decode) and the
    trace's replay of the same settings: each one's per-prompt counts and its outputs' sha256."""
    live, lm = per_prompt([*model, *run, "verify=match", *SAMPLING, "run.check_lossless=true"])
    assert lm.check_lossless and lm.divergences == [], lm.divergences  # live match == the seeded decode
    replay, rm = per_prompt([*model, *replay_model, *run, "verify=match", *SAMPLING, f"trace.path={trace}"])
    return (live, lm.outputs_sha256), (replay, rm.outputs_sha256)


def test_sampled_replay_equals_live_tiny(sampled_tiny):
    path, _ = sampled_tiny
    for extra in (["num_drafts=2"], ["num_drafts=1", "policy=trim_all", "draft=sampled"]):
        live, replay = live_and_replay(TINY[:2], path, [*TINY[2:], *extra])
        assert replay == live, extra


NEXT = ["model=next_shipped", "target_numerics=pinned"]
NEXT_RUN = ["run.num_prompts=2", "run.prompt_tokens=16", "run.max_new_tokens=10"]


def test_sampled_replay_equals_live_next(tmp_path):
    """The shipped glm5_next model: a sampled trace replayed from the drafter's tensors alone."""
    record_trace(tmp_path / "trace", [*NEXT, *NEXT_RUN, *SAMPLING, "trace.max_drafts=2", "trace.cost_repeats=0"])
    write_drafter_only(str(shipped_checkpoint(SHIPPED_NEXT)), str(tmp_path / "drafter"))
    live, replay = live_and_replay(NEXT, tmp_path / "trace", [*NEXT_RUN, "num_drafts=2"],
                                   [f"model.path={tmp_path / 'drafter'}"])
    assert replay == live


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_random", "next_shipped"])
def test_sampled_replay_equals_live_sweep(model, tmp_path):
    """k = 1..3, the three policies, sampled drafts, and the batched loop."""
    m = [f"model={model}", "target_numerics=pinned"]
    run = ["run.num_prompts=3", "run.prompt_tokens=16", "run.max_new_tokens=10"]
    record_trace(tmp_path / "trace", [*m, *run, *SAMPLING, "trace.max_drafts=3", "trace.cost_repeats=0"])
    replay_model = []
    if model == "next_shipped":
        write_drafter_only(str(shipped_checkpoint(SHIPPED_NEXT)), str(tmp_path / "drafter"))
        replay_model = [f"model.path={tmp_path / 'drafter'}"]
    cases = [[f"num_drafts={k}", f"policy={p}", f"draft={d}"] for k in (1, 2, 3)
             for p in ("first_row_kept", "refeed", "trim_all") for d in ("argmax", "sampled")]
    cases.append(["num_drafts=3", "batch_size=2"])
    for case in cases:
        live, replay = live_and_replay(m, tmp_path / "trace", [*run, *case], replay_model)
        assert replay == live, case


def test_a_greedy_trace_refuses_match_at_temperature(tmp_path):
    greedy = tmp_path / "greedy"
    record_trace(greedy, [*TINY, "trace.max_drafts=2", "trace.cost_repeats=0"])
    message = refusal(greedy, ["model=tiny_random", "run.max_new_tokens=6", "num_drafts=2", "verify=match",
                               "temperature=1"])
    assert message.startswith("temperature:") and "greedy" in message, message


@pytest.mark.slow  # ~9 s: a transformers checkpoint written and loaded
def test_hf_sampled_record_counts_its_cuts(tmp_path, capsys):
    """transformers' tiny glm5_next checkpoint, its batched pass 1 sampled per row: the trace is
    valid, follows its samples, and counts the items pass 2 cut (near-ties of the two passes)."""
    from ..hf_checkpoints import write_hf_checkpoint

    write_hf_checkpoint(tmp_path / "ck", "glm5_next")
    meta = record_trace(tmp_path / "trace", ["model=hf", f"model.path={tmp_path / 'ck'}", "run.num_prompts=3",
                                             "run.prompt_tokens=12", "run.max_new_tokens=8", "trace.max_drafts=2",
                                             "trace.batch_size=3", "trace.cost_repeats=0", *SAMPLING])
    t = meta["truncation"]
    trace = open_trace(str(tmp_path / "trace"))
    assert len(trace.items) == 3 - t["items_dropped"] and meta["generation"]["sampler"]["name"] == NAME
    assert f"{t['items']} items cut" in capsys.readouterr().out


def stop_sweep_rows(overrides):
    """The stop sweep in-process (checked as its entry point checks it; its files and plots not
    written): per row, its name and per-prompt counts (committed tokens and verify widths)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from glm_mtp.experiments import stop_sweep

    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        cfg = hydra_compose("stop_sweep", overrides=[*overrides, "logger=none", "speedup.costs=glm5"])
    stop_sweep.check_sweep(cfg)
    rec = stop_sweep.sweep(cfg)
    return [(r["name"], r["counts"]) for r in rec["rows"]], rec


def test_the_stop_sweep_replays_a_sampled_trace_as_live(sampled_tiny):
    """The stop rules at T > 0 from a trace: the sweep's every row (fixed K, the oracle, each rule)
    replayed under verify=match at the trace's settings equals the live sweep's, prompt by prompt;
    the sampled trace refuses the sweep under verify=rejection, naming the key."""
    from glm_mtp.experiments import stop_sweep

    path, _ = sampled_tiny
    sweep = ["num_drafts=2", "verify=match", *SAMPLING, "sweep.fixed_k=false",
             "sweep.thresholds.prob=[0.05]",
             "~sweep.thresholds.cumprob", "~sweep.thresholds.margin"]
    live, _ = stop_sweep_rows([*TINY, *sweep])
    replay, replay_rec = stop_sweep_rows(["model=tiny_random", "run.max_new_tokens=6", *sweep, f"trace.path={path}"])
    assert replay == live
    assert replay_rec["trace"]["generation"]["temperature"] == 1.0 and replay_rec["temperature"] == 1.0
    rows = dict(live)
    assert list(rows) == ["fixed k=2", "oracle (K=2)", "prob >= 0.05"]
    assert any(w[0] for w in rows["prob >= 0.05"]["widths"])  # the rule trimmed somewhere (else says nothing)
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        cfg = hydra_compose("stop_sweep", overrides=["model=tiny_random", "run.max_new_tokens=6", "num_drafts=2",
                                                     *SAMPLING, "verify=rejection", f"trace.path={path}",
                                                     "logger=none"])
    with pytest.raises(ValueError, match="verify"):
        stop_sweep.check_sweep(cfg)
