"""A trace is untrusted data (issue 49 item 1, docs/traces.md "A trace is input"): one validator
(``traces/validate.py``) bounds ``trace.json`` before parsing it, checks every field, reads each
shard's header before its arrays, and ``traces check`` and the replay run it alike: what check
calls valid replays, and the first line it reports is exactly what a replay refuses.

Named cases (deep nesting, 1e400, huge integers, negative counts, a bool for an integer, a shard
``../x``, a link out of the folder, a truncated shard, ...), then drawn corruptions of one real
tiny trace (hypothesis, a few examples by default; ``-m slow`` sweeps more)."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_mtp.experiments.settings.validate import check_acceptance
from glm_mtp.experiments.traces import validate
from glm_mtp.experiments.traces.__main__ import main
from glm_mtp.experiments.traces.format import META, TraceError
from glm_mtp.experiments.traces.validate import open_trace, problems

from .test_traces import compose, record_trace

SHARD = "items-00000.safetensors"
REPLAY = ["model=tiny_random", "num_drafts=2"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """One tiny greedy speculative trace (tiny_random, pinned, 2 items, K = 2, costs timed once)."""
    root = tmp_path_factory.mktemp("validate-trace")
    record_trace(root / "trace", ["model=tiny_random", "target_numerics=pinned", "run.num_prompts=2",
                                  "run.prompt_tokens=8", "run.max_new_tokens=6", "trace.max_drafts=2",
                                  "trace.cost_repeats=1"])
    return root / "trace"


@pytest.fixture(scope="module")
def record(trace):
    return json.loads((trace / META).read_text())


def copy_of(trace, dst, meta=None, text=None):
    """A copy of ``trace`` at ``dst`` with trace.json replaced by ``meta`` (dumped) or ``text``."""
    shutil.copytree(trace, dst)
    if meta is not None:
        text = json.dumps(meta)
    if text is not None:
        (dst / META).write_text(text)
    return dst


def edited(record, edit):
    """A deep copy of ``record`` with ``edit(copy)`` applied."""
    copy = json.loads(json.dumps(record))
    edit(copy)
    return copy


def first_problem(path):
    """The problems ``check`` reports and the replay's own refusal (``open_trace``): the first
    line is the refusal, exactly."""
    lines = problems(str(path))
    assert lines, path
    with pytest.raises(TraceError) as e:
        open_trace(str(path))
    assert str(e.value) == lines[0]
    assert all("\n" not in line for line in lines)
    return lines[0]


def test_a_recorded_trace_and_the_committed_version_1_records_are_valid(trace, capsys):
    assert problems(str(trace)) == []
    assert main(["check", str(trace)]) == 0
    assert "a valid trace (version 2" in capsys.readouterr().out
    link = trace.parent / "alias"  # the trace's folder itself may be a link: its files are inside it
    os.symlink(trace, link)
    assert problems(str(link)) == []
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..", "results", "stop-rules")
    for model in ("glm5", "glm5next"):  # version 1 (greedy, no prompt identity), recorded by an older package
        with open(os.path.join(root, model, META), "rb") as f:
            validate.check_meta(validate.parse_bounded_json(f.read(), META))


def test_bounds_before_parsing(trace, record, tmp_path, monkeypatch):
    deep = copy_of(trace, tmp_path / "deep", text="[" * 100000 + "]" * 100000)
    assert first_problem(deep).startswith("trace.json: the record: nests deeper than 8 levels")
    nested = edited(record, lambda r: r["items"][0]["prompt"].update(source=[[[[[["x"]]]]]]))
    assert first_problem(copy_of(trace, tmp_path / "nested", nested)).startswith("trace.json: the record: nests deeper")
    text = json.dumps(record)
    cases = {  # a raw literal in place of one field's value -> (its field, what the rule says)
        "1e400": ("vocab_size", "holds the number 1e400 (past float64: not finite)"),
        "-1e400": ("costs.target_step_ms", "holds the number -1e400"),
        "NaN": ("costs.verify_ms[0]", "holds NaN (not a JSON number)"),
        "Infinity": ("generation.temperature", "holds Infinity"),
        "1" + "0" * 30: ("items[0].length", "holds an integer of 31 digits, past int64"),
        "9" * 5000: ("items[1].start", "holds an integer of 5000 digits, past int64"),
        str(1 << 63): ("prompts.seed", f"holds the integer {1 << 63}, past int64"),
        "0." + "0" * 80 + "1": ("generation.temperature", "holds a number literal of 83 characters"),
    }
    for n, (raw, (field, rule)) in enumerate(cases.items()):
        path = field.replace("[", ".").replace("]", "").split(".")
        marker = f"@@{n}@@"

        def put(r, path=path, marker=marker):
            node = r
            for key in path[:-1]:
                node = node[int(key)] if key.isdigit() else node[key]
            node[int(path[-1]) if path[-1].isdigit() else path[-1]] = marker

        body = json.dumps(edited(record, put)).replace(f'"{marker}"', raw)
        line = first_problem(copy_of(trace, tmp_path / f"raw{n}", text=body))
        assert line.startswith(f"trace.json: {field}: {rule}"), (raw, line)
    dup = text.replace('"version": 2,', '"version": 2, "version": 1,', 1)
    assert first_problem(copy_of(trace, tmp_path / "dup", text=dup)) == (
        "trace.json: the record: holds an object holding the key 'version' twice")
    long = edited(record, lambda r: r["target"].update(checkpoint="x" * 5000))
    assert first_problem(copy_of(trace, tmp_path / "long", long)).startswith(
        "trace.json: target.checkpoint: holds a string of 5000 characters")
    (tmp_path / "bytes").mkdir()
    bad_utf8 = copy_of(trace, tmp_path / "bytes" / "t")
    (bad_utf8 / META).write_bytes(b'{"format": "\xff"}')
    assert first_problem(bad_utf8) == "trace.json: the record: is not UTF-8 (byte 12)"
    monkeypatch.setattr(validate, "MAX_META_BYTES", 1000)  # the size bound, without writing 64 MiB
    line = first_problem(trace)
    assert line.startswith("trace.json: the record: holds ") and line.endswith("bytes, past the bound of 1000"), line


def test_every_field_by_type_range_and_key(trace, record, tmp_path):
    def item0(**kv):
        return lambda r: r["items"][0].update(kv)

    cases = {
        "negative dropped": (item0(dropped=-1), "items[0].dropped: must be an integer >= 0, got -1"),
        "negative count": (lambda r: r["truncation"].update(items=-3), "truncation.items: must be an integer >= 0"),
        "negative length": (item0(length=-15), "items[0].length: must be an integer in [2, 2147483647], got -15"),
        "bool for int": (item0(length=True), "items[0].length: must be an integer in [2, 2147483647], got True"),
        "bool vocab": (lambda r: r.update(vocab_size=True), "vocab_size: must be an integer in [1, 2147483647]"),
        "bool version": (lambda r: r.update(version=True), "version: must be one of (1, 2)"),
        "string version": (lambda r: r.update(version="2"), "version: must be one of (1, 2)"),
        "version 3": (lambda r: r.update(version=3), "version: must be one of (1, 2)"),
        "float for int": (lambda r: r.update(max_drafts=2.0), "max_drafts: must be an integer in [1, 64], got 2.0"),
        "huge hidden": (lambda r: r.update(hidden_size=1 << 40), "hidden_size: must be an integer in [1, 65536]"),
        "shard ../x": (lambda r: r["shards"][0].update(file="../x"),
                       "shards[0].file: must be 'items-00000.safetensors' (shard 0's name: a file inside the trace's "
                       "folder), got '../x'"),
        "shard absolute": (lambda r: r["shards"][0].update(file="/etc/passwd"), "shards[0].file: must be"),
        "unknown key": (lambda r: r.update(extra=1), "extra: is not a field of the format"),
        "unknown item key": (item0(weight=1), "items[0].weight: is not a field of the format"),
        "unknown target key": (lambda r: r["target"].update(foo="x"), "target.foo: is not a field"),
        "missing sha256": (lambda r: r["items"][0].pop("sha256"), "items[0].sha256: is missing"),
        "missing generation": (lambda r: r.pop("generation"), "generation: is missing"),
        "null shards": (lambda r: r.update(shards=None), "shards: must be a non-empty list, got None"),
        "not hex": (lambda r: r["items"][1].update(sha256="A" * 64), "items[1].sha256: must be a sha256 hex"),
        "prompt index": (lambda r: r["items"][1]["prompt"].update(index=-1), "items[1].prompt.index: must be"),
        "forwards sum": (lambda r: r["forwards"].update(total=1), "forwards.total: must be generation +"),
        "costs per k": (lambda r: r["costs"].update(verify_ms=[1.0]), "costs.verify_ms: must be max_drafts=2"),
        "costs zero": (lambda r: r["costs"].update(target_step_ms=0), "costs.target_step_ms: must be a finite number"),
        "recorded items": (lambda r: r["prompts"].update(recorded_items=3), "prompts.recorded_items: must be the"),
        "continuation": (lambda r: r["generation"].update(continuation=9), "generation.continuation: must be"),
        "another length": (item0(length=14), "items[0].dropped: length + dropped must be prompt_len + "
                                             "generation.continuation = 15, got 14 + 0"),
        "not tiling": (lambda r: r["items"][1].update(start=14), "items[1].start: items must tile their"),
        "past its shard": (lambda r: r["items"][1].update(length=99), "items[1].length: runs past shards[0].rows"),
        "shard index": (item0(shard=1), "items[0].shard: must name one of the 1 shards"),
        "sampled tf": (lambda r: r.update(mode="teacher_forced"), "generation.continuation: must be null"),
        "greedy with a seed": (lambda r: r["generation"].update(seed=3), "generation.seed: must be null in a greedy"),
        "sampled without sampler": (lambda r: r["generation"].update(temperature=1.0, seed=1),
                                    "generation.sampler: must be {'name': str, 'version': int >= 1} in a sampled"),
        "sampler field": (lambda r: r["generation"].update(temperature=1.0, seed=1, sampler={"name": "s", "v": 1}),
                          "generation.sampler.v: is not a field"),
        "version 1 prompt": (lambda r: r.update(version=1), "generation.top_p: is not a field of the format"),
    }
    for n, (name, (edit, line)) in enumerate(cases.items()):
        got = first_problem(copy_of(trace, tmp_path / str(n), edited(record, edit)))
        assert got.startswith(f"trace.json: {line}"), (name, got)

    def as_version_1(r):
        r["version"] = 1
        for key in ("top_p", "top_k", "seed", "sampler"):
            r["generation"].pop(key)

    got = first_problem(copy_of(trace, tmp_path / "v1", edited(record, as_version_1)))
    assert got.startswith("trace.json: items[0].prompt: is not a field of the format"), got


def test_shards_by_their_headers(trace, tmp_path, capsys):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    linked = copy_of(trace, tmp_path / "link")
    shutil.copy(linked / SHARD, outside / SHARD)  # a valid shard, but outside the folder
    os.remove(linked / SHARD)
    os.symlink(outside / SHARD, linked / SHARD)
    assert first_problem(linked).startswith(f"{SHARD}: shards[0].file: is a symbolic link")
    meta_link = copy_of(trace, tmp_path / "meta-link")
    shutil.copy(meta_link / META, outside / META)
    os.remove(meta_link / META)
    os.symlink(outside / META, meta_link / META)
    assert first_problem(meta_link).startswith("trace.json: the record: is a symbolic link")
    size = os.path.getsize(trace / SHARD)
    for name, edit, line in (
            ("truncated", lambda f: f.truncate(size - 100), "shards[0].file: holds "),
            ("trailing", lambda f: (f.seek(0, 2), f.write(b"\0" * 8)), "shards[0].file: holds "),
            ("cut to 4 bytes", lambda f: f.truncate(4), "shards[0].file: holds 4 bytes: not a safetensors file"),
            ("header past the file", lambda f: f.write((1 << 40).to_bytes(8, "little")),
             "shards[0].file: declares a header of 1099511627776 bytes")):
        path = copy_of(trace, tmp_path / name.replace(" ", "-"))
        with open(path / SHARD, "r+b") as f:
            edit(f)
        got = first_problem(path)
        assert got.startswith(f"{SHARD}: {line}"), (name, got)
        if name in ("truncated", "trailing"):
            assert got.endswith("truncated" if name == "truncated" else "trailing bytes"), got
    directory = copy_of(trace, tmp_path / "dir")
    os.remove(directory / SHARD)
    os.mkdir(directory / SHARD)
    assert first_problem(directory) == f"{SHARD}: shards[0].file: is not a regular file"
    missing = copy_of(trace, tmp_path / "missing")
    os.remove(missing / SHARD)
    assert first_problem(missing).startswith(f"{SHARD}: shards[0].file: ")
    assert main(["check", str(missing)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == problems(str(missing))


def test_a_recording_refuses_what_the_format_would(tmp_path):
    """``trace.max_drafts`` past the format's bound is refused before recording (else the trace
    written would be refused on every read)."""
    from glm_mtp.experiments import record as record_entry

    cfg = compose(["model=tiny_random", f"trace.max_drafts={validate.MAX_DRAFTS + 1}", f"trace.out={tmp_path / 't'}",
                   "logger=none"])
    with pytest.raises(ValueError, match="^trace.max_drafts"):
        record_entry.check_record(cfg)
    assert not (tmp_path / "t").exists()


def header_edited(trace, dst, edit):
    """A copy whose shard header is ``edit(header)`` (the data bytes kept), re-padded."""
    path = copy_of(trace, dst)
    data = (path / SHARD).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    edit(header)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    (path / SHARD).write_bytes(len(body).to_bytes(8, "little") + body + data[8 + n :])
    return path


def test_shard_header_fields(trace, tmp_path):
    for n, (edit, line) in enumerate((
            (lambda h: h["tokens"].update(dtype="I64"), "shards[0].tokens: dtype must be int32 (hidden_dtype / the "
                                                        "format), got 'I64'"),
            (lambda h: h["hidden"].update(dtype="F32"), "shards[0].hidden: dtype must be float64 (hidden_dtype / the "
                                                        "format), got float32"),
            (lambda h: h["argmax"].update(shape=[31]), "shards[0].argmax: shape must be (30,)"),
            (lambda h: h["argmax"].update(shape=[True] * 1), "shards[0].argmax: shape must be a list of sizes"),
            (lambda h: h["tokens"].update(data_offsets=[0, 4]), "shards[0].tokens: data_offsets must be [begin, "
                                                               "begin + 120]"),
            (lambda h: h.update(extra={"dtype": "I32", "shape": [0], "data_offsets": [0, 0]}), "shards[0]: "),
            (lambda h: h["tokens"].update(more=1), "shards[0].tokens: must be {'dtype', 'shape', 'data_offsets'}"),
            (lambda h: h.update(__metadata__={"a": 1}), "shards[0].__metadata__: must be an object of strings"))):
        got = first_problem(header_edited(trace, tmp_path / str(n), edit))
        assert got.startswith(f"{SHARD}: {line}"), got

    def swap(h):  # two arrays' byte ranges exchanged: tiling still holds, sizes do not
        h["tokens"]["data_offsets"], h["hidden"]["data_offsets"] = h["hidden"]["data_offsets"], h["tokens"][
            "data_offsets"]

    assert "data_offsets must be" in first_problem(header_edited(trace, tmp_path / "swap", swap))


# ------------------------------------------------------------------------------------------------
# Drawn corruptions: check and the replay agree


def paths_of(x, prefix=()):
    """Every path (keys and indices) into ``x`` below its root."""
    out = []
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out += paths_of(v, (*prefix, k))
    return out


VALUES = [None, True, False, -1, 0, 1, 3, 1 << 31, 1 << 63, 1.5, -0.0, float("inf"), float("nan"), "", "x", "../x",
          "a" * 64, [], [1], {}, {"x": 1}, [[[[[[[[1]]]]]]]]]


@st.composite
def corruptions(draw, record):
    """One damage: a field set to a drawn value, removed or joined by an unknown key; or a byte of
    trace.json or the shard flipped, the shard cut short or extended."""
    kind = draw(st.sampled_from(["set", "set", "set", "drop", "add", "meta byte", "shard byte", "cut", "extend"]))
    if kind in ("set", "drop", "add"):
        path = draw(st.sampled_from(paths_of(record)))
        return kind, path, draw(st.sampled_from(VALUES)) if kind == "set" else None
    return kind, None, draw(st.integers(0, 1 << 20))


def corrupt(trace, record, dst, damage):
    kind, path, value = damage
    shutil.copytree(trace, dst)
    if kind in ("set", "drop", "add"):
        r = json.loads(json.dumps(record))
        node = r
        for key in path[:-1]:
            node = node[key]
        if kind == "set":
            node[path[-1]] = value
        elif kind == "drop":
            del node[path[-1]]
        elif isinstance(node[path[-1]], dict):
            node[path[-1]]["unknown"] = 0
        else:
            node[path[-1]] = [node[path[-1]]]
        (dst / META).write_text(json.dumps(r))
        return dst
    name = META if kind == "meta byte" else SHARD
    data = bytearray((dst / name).read_bytes())
    at = value % len(data)
    if kind.endswith("byte"):
        data[at] ^= 1 << (value % 8)
    elif kind == "cut":
        del data[at:]
    else:
        data += bytes(1 + value % 64)
    (dst / name).write_bytes(bytes(data))
    return dst


def agree(trace, record, damage, replay):
    """``check``'s lines and the replay: no line, it opens (and, where ``replay``, the run's
    check refuses nothing the format rules); lines, it refuses with the first, exactly."""
    with tempfile.TemporaryDirectory(dir=trace.parent) as tmp:
        path = corrupt(trace, record, Path(tmp) / "t", damage)
        lines = problems(str(path))
        if not lines:
            open_trace(str(path))
        else:
            with pytest.raises(TraceError) as e:
                open_trace(str(path))
            assert str(e.value) == lines[0], damage
        if replay:
            cfg = compose([*REPLAY, f"trace.path={path}", "logger=none"])
            try:
                check_acceptance(cfg)
                message = None
            except ValueError as e:
                message = str(e)
            prefix = f"trace.path: {path}: "
            if lines:
                assert message == prefix + lines[0], (damage, message, lines[0])
            else:  # a valid trace: any refusal is the run's against the trace (its drafter, settings), not the format's
                assert message is None or not message.startswith((prefix + META, prefix + "items-")), (damage, message)
        return lines


def test_drawn_corruptions_check_agrees_with_open(trace, record):
    @settings(max_examples=20, deadline=None, database=None, derandomize=True)
    @given(corruptions(record))
    def run(damage):
        agree(trace, record, damage, replay=False)

    run()


def test_drawn_corruptions_check_agrees_with_the_replay(trace, record):
    @settings(max_examples=6, deadline=None, database=None, derandomize=True)
    @given(corruptions(record))
    def run(damage):
        agree(trace, record, damage, replay=True)

    run()


@pytest.mark.slow
def test_drawn_corruptions_sweep(trace, record):
    @settings(max_examples=400, deadline=None, database=None)
    @given(corruptions(record), st.booleans())
    def run(damage, replay):
        agree(trace, record, damage, replay and damage[0] != "extend")

    run()
