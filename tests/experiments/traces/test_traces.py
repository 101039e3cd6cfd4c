"""Traces (DESIGN.md §11): a recording replayed gives the live run's counts exactly under pinned
numerics, per prompt, from a directory holding only the drafter's tensors; a hostile trace is
refused before any work, naming the field.

The default run records one small trace per case; ``-m slow`` sweeps both shipped models over
k = 1..5, the three policies, both modes and the batched loop."""

import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm_mtp.experiments import record
from glm_mtp.experiments.acceptance_job.run import run as run_acceptance
from glm_mtp.experiments.acceptance_job.measure import measure
from glm_mtp.experiments.acceptance_job.measurement import target_record
from glm_mtp.experiments.targets.checkpoint import SHIPPED, SHIPPED_NEXT, shipped_checkpoint
from glm_mtp.experiments.targets.replay import ReplayTarget
from glm_mtp.experiments.targets.target import Target
from glm_mtp.reference.bytes import same_bytes
from glm_mtp.experiments.traces.drafter_only import write_drafter_only
from glm_mtp.experiments.traces.format import META, TraceItem, item_sha256, write_trace
from glm_mtp.experiments.traces.validate import open_trace, problems
from glm_mtp.experiments.settings.validate import check_acceptance

PY = sys.executable


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def record_trace(out, overrides):
    """Record in-process, checked as the entry point checks it; the trace's metadata."""
    cfg = compose([*overrides, f"trace.out={out}", "logger=none"])
    record.check_record(cfg)
    return record.record(cfg)


def per_prompt(overrides):
    """The acceptance run's per-prompt counts, measured in-process (checked first)."""
    cfg = compose([*overrides, "logger=none", "speedup.costs=glm5"])
    check_acceptance(cfg)
    m = measure(cfg)
    return [(s.reached, s.accepted, s.steps) for s in m.per_prompt], m


SMALL = ["run.num_prompts=2", "run.prompt_tokens=16", "run.max_new_tokens=8"]


@pytest.fixture(scope="module")
def next_trace(tmp_path_factory):
    """The shipped glm5_next model's trace (pinned numerics, k <= 3) and its drafter-only copy."""
    root = tmp_path_factory.mktemp("next-trace")
    meta = record_trace(root / "trace", ["target_numerics=pinned", *SMALL, "trace.max_drafts=3",
                                         "trace.cost_repeats=1"])
    write_drafter_only(str(shipped_checkpoint(SHIPPED_NEXT)), str(root / "drafter"))
    return root, meta


def test_replay_from_drafter_only_equals_live(next_trace):
    root, meta = next_trace
    assert meta["truncation"] == {"items": 0, "positions_dropped": 0, "items_dropped": 0}  # pinned: passes agree
    # The target's class path, read from the class: it imports back to the class a live run uses.
    module, _, name = meta["target"]["implementation"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is Target
    assert meta["forwards"]["total"] == 2 * (1 + (8 + 3 - 1 - 1)) + 2  # per item: prefill + decodes, then one TF pass
    names = load_file(str(root / "drafter" / "model.safetensors")).keys()
    assert not any(".layers.0." in n for n in names)  # no target layer: the replay cannot have read one
    for policy, k in (("first_row_kept", 3), ("refeed", 2), ("trim_all", 1)):
        common = [*SMALL, f"num_drafts={k}", f"policy={policy}"]
        live, live_m = per_prompt(["target_numerics=pinned", *common])
        replay, m = per_prompt([f"model.path={root / 'drafter'}", f"trace.path={root / 'trace'}", *common])
        assert replay == live, (policy, k)
        # A live run records the same implementation as the trace (one class path, from the class).
        assert target_record(live_m)["implementation"] == meta["target"]["implementation"]
        assert m.target.forwards == 2 + sum(s[2] for s in live)  # every prefill and verify answered from the trace


def test_summary_records_the_trace(next_trace, tmp_path):
    root, meta = next_trace
    cfg = compose([f"trace.path={root / 'trace'}", *SMALL, "num_drafts=2", "logger=none", "speedup.repeats=2"])
    check_acceptance(cfg)
    summary = run_acceptance(cfg, str(tmp_path / "run"))
    assert summary["trace"]["sha256"] == meta["sha256"]
    assert summary["trace"]["target"]["numerics"] == "pinned"
    assert summary["target"] == meta["target"]
    assert summary["target_forwards"] == summary["prompts"] + summary["counts"]["steps"]
    assert summary["speedup"]["cost_details"]["target_step_ms"] == meta["costs"]["target_step_ms"]
    assert summary["prompts_sha256"] == meta["prompts"]["windows_sha256"]


def test_replay_answers_only_the_targets_path(next_trace):
    root, _ = next_trace
    trace = open_trace(str(root / "trace"))
    it = trace.items[0]
    target = ReplayTarget(trace)
    state = target.alloc_state()
    P = it.prompt_len
    out = target.prefill(it.tokens[:P].tolist(), state)
    assert same_bytes(out.hidden, it.hidden[:P])
    on, off = int(it.tokens[P + 1]), (int(it.tokens[P + 1]) + 1) % trace.meta["vocab_size"]
    out = target.verify([int(it.tokens[P]), on, off], state)
    assert out.logits.argmax(-1).tolist()[:2] == it.argmax[P : P + 2].tolist()
    assert same_bytes(out.hidden[:2], it.hidden[P : P + 2])
    assert torch.isnan(out.hidden[2]).all()  # off the path: never read, NaN if it were
    target.rollback(state, P + 1)
    with pytest.raises(ValueError, match="a replay follows the target's greedy path"):
        target.verify([off if off != int(it.tokens[P + 1]) else on], state)


def test_teacher_forced_replay_equals_live(tmp_path):
    overrides = ["model=tiny_random", "target_numerics=pinned", "mode=teacher_forced", "run.num_prompts=2",
                 "run.prompt_tokens=8", "run.max_new_tokens=6"]
    meta = record_trace(tmp_path / "tf", [*overrides, "trace.max_drafts=2", "trace.cost_repeats=0"])
    assert meta["mode"] == "teacher_forced" and meta["truncation"]["items"] == 0
    for policy in ("first_row_kept", "trim_all"):
        live, _ = per_prompt([*overrides, "num_drafts=2", f"policy={policy}"])
        replay, _ = per_prompt([*overrides, "num_drafts=2", f"policy={policy}", f"trace.path={tmp_path / 'tf'}"])
        assert replay == live


@pytest.mark.slow
@pytest.mark.parametrize("shipped", [SHIPPED, SHIPPED_NEXT])
def test_replay_equals_live_sweep(shipped, tmp_path):
    """Both shipped models, k = 1..5, the three policies, the batched loop and teacher forcing."""
    model = ["model=shipped" if shipped == SHIPPED else "model=next_shipped", "target_numerics=pinned"]
    run = ["run.num_prompts=4", "run.prompt_tokens=24", "run.max_new_tokens=16"]
    record_trace(tmp_path / "spec", [*model, *run, "trace.max_drafts=5", "trace.cost_repeats=0"])
    write_drafter_only(str(shipped_checkpoint(shipped)), str(tmp_path / "drafter"))
    replay_model = [f"model.path={tmp_path / 'drafter'}"]
    for k in range(1, 6):
        for policy in ("first_row_kept", "refeed", "trim_all"):
            live, _ = per_prompt([*model, *run, f"num_drafts={k}", f"policy={policy}"])
            replay, _ = per_prompt([*model, *replay_model, *run, f"num_drafts={k}", f"policy={policy}",
                                    f"trace.path={tmp_path / 'spec'}"])
            assert replay == live, (k, policy)
    live, _ = per_prompt([*model, *run, "num_drafts=3", "batch_size=2"])
    replay, _ = per_prompt([*model, *run, "num_drafts=3", "batch_size=2", f"trace.path={tmp_path / 'spec'}"])
    assert replay == live
    tf = ["mode=teacher_forced", "run.num_prompts=2", "run.prompt_tokens=24", "run.max_new_tokens=8"]
    record_trace(tmp_path / "tf", [*model, *tf, "trace.max_drafts=3", "trace.cost_repeats=0"])
    for policy in ("first_row_kept", "refeed", "trim_all"):
        live, _ = per_prompt([*model, *tf, "num_drafts=3", f"policy={policy}"])
        replay, _ = per_prompt([*model, *tf, "num_drafts=3", f"policy={policy}", f"trace.path={tmp_path / 'tf'}"])
        assert replay == live, policy


# ------------------------------------------------------------------------------------------------
# Hostile traces


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-trace")
    record_trace(root / "trace", ["model=tiny_random", "target_numerics=pinned", "run.num_prompts=2",
                                  "run.prompt_tokens=8", "run.max_new_tokens=6", "trace.max_drafts=2",
                                  "trace.cost_repeats=0"])
    return root / "trace"


REPLAY = ["model=tiny_random", "run.max_new_tokens=6", "num_drafts=2"]


def damaged(src, dst, shard=None, meta=None):
    """A copy of trace ``src`` at ``dst``: ``shard(tensors)`` edits shard 0's arrays (saved
    back), ``meta(record)`` edits trace.json."""
    shutil.copytree(src, dst)
    if shard is not None:
        path = os.path.join(dst, "items-00000.safetensors")
        t = load_file(path)
        shard(t)
        save_file(t, path)
    if meta is not None:
        record_ = json.loads((dst / META).read_text())
        meta(record_)
        (dst / META).write_text(json.dumps(record_))
    return dst


def refusal(trace_dir, overrides=REPLAY):
    cfg = compose([*overrides, f"trace.path={trace_dir}", "logger=none"])
    with pytest.raises(ValueError) as e:
        check_acceptance(cfg)
    return str(e.value)


def rewrite_items(src, dst, edit):
    """Trace ``src`` re-written at ``dst`` with ``edit(item)`` applied to item 0 and every sha256
    recomputed (a trace whose digests are honest but whose content breaks a rule)."""
    trace = open_trace(str(src))
    items = [TraceItem(it.tokens.clone(), it.argmax.clone(), it.hidden.clone(), it.prompt_len, prompt=it.prompt)
             for it in trace.items]
    edit(items[0])
    meta = {k: v for k, v in trace.meta.items() if k not in ("format", "version", "shards", "items")}
    write_trace(str(dst), meta, items)
    return dst


def test_hostile_traces_are_refused_naming_the_field(tiny_trace, tmp_path):
    def flip(t):
        t["hidden"].view(torch.uint8)[0, 3] ^= 1

    cases = {
        "flipped byte": (damaged(tiny_trace, tmp_path / "a", shard=flip), "items[0].sha256"),
        "shape": (damaged(tiny_trace, tmp_path / "b", shard=lambda t: t.update(hidden=t["hidden"][:, :-1].clone())),
                  "shards[0].hidden: shape"),
        "dtype": (damaged(tiny_trace, tmp_path / "c", shard=lambda t: t.update(hidden=t["hidden"].float())),
                  "shards[0].hidden: dtype"),
        "another tokenizer": (damaged(tiny_trace, tmp_path / "d", meta=lambda r: r.update(tokenizer_sha256="0" * 64)),
                              "tokenizer_sha256"),
        "another target's config": (damaged(tiny_trace, tmp_path / "e",
                                            meta=lambda r: r["target"].update(target_config_sha256="1" * 64)),
                                    "target.target_config_sha256"),
        "version": (damaged(tiny_trace, tmp_path / "f", meta=lambda r: r.update(version=3)), "version"),
        "prompt identity": (damaged(tiny_trace, tmp_path / "k", meta=lambda r: r["items"][1].pop("prompt")),
                            "items[1].prompt"),
        "prompt sha256": (damaged(tiny_trace, tmp_path / "l",
                                  meta=lambda r: r["items"][0]["prompt"].update(sha256="2" * 64)),
                          "items[0].prompt.sha256"),
        "greedy trace with a sampler": (damaged(tiny_trace, tmp_path / "m",
                                                meta=lambda r: r["generation"].update(top_p=0.9)),
                                        "generation.top_p"),
        "non-finite": (rewrite_items(tiny_trace, tmp_path / "g",
                                     lambda it: it.hidden.__setitem__((3, 0), float("nan"))),
                       "items[0].hidden"),
        "token range": (rewrite_items(tiny_trace, tmp_path / "h", lambda it: it.tokens.__setitem__(0, 96)),
                        "items[0].tokens"),
        "inconsistent path": (rewrite_items(tiny_trace, tmp_path / "i",
                                            lambda it: it.argmax.__setitem__(10, (int(it.argmax[10]) + 1) % 96)),
                              "items[0].argmax"),
    }
    missing = shutil.copytree(tiny_trace, tmp_path / "j")
    os.remove(missing / "items-00000.safetensors")
    cases["missing shard"] = (missing, "shards[0].file")
    for name, (path, field) in cases.items():
        message = refusal(path)
        # one line: the trace, then the file (trace.json or the shard), the field and the rule
        # (the drafter's identity against the trace's is the replay's check, not the format's: no file)
        file = {"version": f"{META}: ", "items[1].prompt": f"{META}: ", "generation.top_p": f"{META}: ",
                "tokenizer_sha256": "", "target.target_config_sha256": ""}.get(field, "items-00000.safetensors: ")
        assert message.startswith(f"trace.path: {path}: {file}{field}"), (name, message)
        assert "\n" not in message
    assert ": hidden_size" in refusal(tiny_trace, ["model=next_shipped", "model.dtype=float64", "num_drafts=2"])
    assert ": hidden_dtype" in refusal(tiny_trace, [*REPLAY, "model.dtype=float32"])
    assert "temperature" in refusal(tiny_trace, [*REPLAY, "temperature=1"])
    assert "max_drafts" in refusal(tiny_trace, ["model=tiny_random", "num_drafts=3"])
    assert "mode" in refusal(tiny_trace, [*REPLAY, "mode=teacher_forced"])
    lines = problems(str(cases["flipped byte"][0]))
    assert lines == ["items-00000.safetensors: items[0].sha256: does not match the item's bytes (a changed or damaged "
                     "shard)"]


def test_item_sha256_covers_every_array(tiny_trace):
    it = open_trace(str(tiny_trace)).items[0]
    base = item_sha256(it)
    for edit in (lambda x: x.tokens.__setitem__(0, int(x.tokens[0]) ^ 1), lambda x: x.hidden.__setitem__((0, 0), 7.0),
                 lambda x: setattr(x, "prompt_len", x.prompt_len + 1)):
        copy = TraceItem(it.tokens.clone(), it.argmax.clone(), it.hidden.clone(), it.prompt_len)
        edit(copy)
        assert item_sha256(copy) != base


def test_commands_refuse_a_hostile_trace_in_one_line(tiny_trace, tmp_path):
    row = json.loads((tiny_trace / META).read_text())["items"][1]["start"]  # item 1's first position
    bad = damaged(tiny_trace, tmp_path / "bad", shard=lambda t: t["hidden"].view(torch.uint8)[row, 0].__ixor__(4))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([PY, "-m", "glm_mtp.experiments.acceptance", *REPLAY, f"trace.path={bad}", "logger=none",
                        f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()
    assert len(last) == 1 and "items[1].sha256" in last[0], r.stderr
    assert not run_dir.exists()
    r = subprocess.run([PY, "-m", "glm_mtp.experiments.traces", "check", str(bad)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 1 and r.stdout.startswith("items-00000.safetensors: items[1].sha256"), r.stdout
    r = subprocess.run([PY, "-m", "glm_mtp.experiments.record", "model=tiny_random", "temperature=1",
                        "mode=teacher_forced",
                        f"trace.out={tmp_path / 'new'}", f"hydra.run.dir={run_dir}"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 2 and "temperature" in r.stderr.strip().splitlines()[-1], r.stderr
    assert not (tmp_path / "new").exists() and not run_dir.exists()


# ------------------------------------------------------------------------------------------------
# transformers' target (model=hf): the tiny checkpoints of both families, float32


@pytest.mark.parametrize("family", ["glm5_next", pytest.param("glm_moe_dsa", marks=pytest.mark.slow)])
def test_hf_record_and_replay(family, tmp_path):
    from ..hf_checkpoints import write_hf_checkpoint

    write_hf_checkpoint(tmp_path / "ck", family)
    model = ["model=hf", f"model.path={tmp_path / 'ck'}", "run.num_prompts=3", "run.prompt_tokens=12",
             "run.max_new_tokens=8"]
    meta = record_trace(tmp_path / "trace", [*model, "trace.max_drafts=2", "trace.batch_size=3",
                                             "trace.cost_repeats=0"])
    # pass 1 batched: one forward per generated token for all three prompts, then one forward per item
    assert meta["forwards"] == {"generation": 8 + 2 - 1, "teacher_forced": 3, "total": 12}
    assert meta["target"]["class"] in ("Glm5NextForConditionalGeneration", "GlmMoeDsaForCausalLM")
    kept = 3 - meta["truncation"]["items_dropped"]
    live, _ = per_prompt([*model, "num_drafts=2"])
    replay, m = per_prompt([*model, "num_drafts=2", f"trace.path={tmp_path / 'trace'}"])
    assert len(replay) == kept
    if meta["truncation"]["items"] == 0:  # no near-tie: the replay is the live run's
        assert replay == live
    write_drafter_only(str(tmp_path / "ck"), str(tmp_path / "drafter"))
    only, _ = per_prompt([*model[:1], f"model.path={tmp_path / 'drafter'}", *model[2:], "num_drafts=2",
                          f"trace.path={tmp_path / 'trace'}"])
    assert only == replay


def test_trace_grid_reports_forwards_recorded_against_live(tmp_path, acceptance_jobs):
    from glm_mtp.experiments.traces.grid_report import format_grid, forwards, read_grid

    tiny = ["model=tiny_random", "run.num_prompts=2", "run.prompt_tokens=8", "run.max_new_tokens=6"]
    meta = record_trace(tmp_path / "trace", [*tiny, "model.dtype=bfloat16", "target_numerics=pinned",
                                             "trace.max_drafts=5", "trace.cost_repeats=1"])
    grid = ["experiment=trace_grid", *tiny, f"trace.path={tmp_path / 'trace'}", "speedup.repeats=1"]
    jobs = {(0, k, w): [*grid, f"num_drafts={k}", f"model.weights_dtype={w}", "policy=trim_all"]
            for k, w in ((1, "plain"), (5, "fp8"))}
    summaries = acceptance_jobs(tmp_path / "grid", jobs)
    assert {s["weights_dtype"] for s in summaries.values()} == {"plain", "fp8"}
    rows = read_grid(str(tmp_path / "grid"))
    f = forwards(rows)
    assert f["recorded"] == meta["forwards"]["total"] and f["traces"] == 1
    assert f["live"] == sum(s["prompts"] + s["counts"]["steps"] for s in summaries.values())
    assert f"the target ran {f['recorded']} forwards to record" in format_grid(rows)


def test_items_name_their_prompt_and_version_1_reads_as_unknown(tiny_trace, tmp_path):
    """Version 2 names each item's prompt (source, index, sha256 of its tokens); a version-1
    trace (no prompt identity, greedy) is still read, its prompts unknown."""
    from glm_mtp.experiments.traces.prompt_id import prompt_sha256

    trace = open_trace(str(tiny_trace))
    assert trace.meta["version"] == 2
    for i, it in enumerate(trace.items):
        assert it.prompt == {"source": "heldout", "index": i,
                             "sha256": prompt_sha256(it.tokens[: it.prompt_len].tolist())}
    assert prompt_sha256([1, 2]) != prompt_sha256([2, 1])

    def as_version_1(r):
        r["version"] = 1
        for key in ("top_p", "top_k", "seed", "sampler"):
            r["generation"].pop(key)
        for e in r["items"]:
            e.pop("prompt")

    old = open_trace(str(damaged(tiny_trace, tmp_path / "v1", meta=as_version_1)))
    assert [it.prompt for it in old.items] == [None] * len(trace.items)
    assert all(same_bytes(a.hidden, b.hidden) for a, b in zip(old.items, trace.items))
    with pytest.raises(ValueError, match="items\\[0\\].prompt"):
        write_trace(str(tmp_path / "out"), {}, [TraceItem(*[getattr(trace.items[0], n) for n in
                                                             ("tokens", "argmax", "hidden", "prompt_len")])])


def test_sampled_format_rules(tiny_trace, tmp_path):
    """A sampled trace (generation temperature > 0) holds ``sample`` beside ``argmax``, its
    trajectory follows ``sample``, and its generation names the sampler; each rule refused by field."""
    trace = open_trace(str(tiny_trace))
    gen = {**trace.meta["generation"], "temperature": 1.0, "top_p": 0.95, "top_k": None, "seed": 3,
           "sampler": {"name": "test", "version": 1}}
    meta = {k: v for k, v in trace.meta.items() if k not in ("format", "version", "shards", "items")}

    def write(dst, edit_item=lambda it: None, **generation):
        items = [TraceItem(it.tokens.clone(), it.argmax.clone(), it.hidden.clone(), it.prompt_len,
                           sample=it.argmax.clone(), prompt=it.prompt) for it in trace.items]
        edit_item(items[0])
        write_trace(str(tmp_path / dst), {**meta, "generation": {**gen, **generation}}, items)
        return tmp_path / dst

    ok = open_trace(str(write("ok")))
    assert all(same_bytes(it.sample, it.argmax) for it in ok.items)
    bad = {"generation.sampler": write("a", sampler=None), "generation.seed": write("b", seed=1.5),
           "generation.top_p": write("c", top_p=1.5), "generation.top_k": write("d", top_k=0),
           "items[0].sample": write("e", lambda it: it.sample.__setitem__(9, (int(it.sample[9]) + 1) % 96))}
    for field, path in bad.items():
        file = "items-00000.safetensors" if field.startswith("items") else META
        with pytest.raises(ValueError, match=f"^{file}: {field.replace('[', '.').replace(']', '.')}"):
            open_trace(str(path))
    no_sample = damaged(tmp_path / "ok", tmp_path / "f", shard=lambda t: t.pop("sample"))
    with pytest.raises(ValueError, match="^items-00000.safetensors: shards.0.: .* must hold exactly"):
        open_trace(str(no_sample))
