"""python -m glm_mtp.experiments.finetune (DESIGN.md §13) on a tiny checkpoint and a synthetic
trace in several shards: the output's layout, bytes and reproducibility, the trace read shard by
shard (the same bytes as the whole read, a shard's memory), the split, the replay record and its
history per eval step, refusals (the forward's disagreement with the drafter among them)."""

import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
from hydra import compose, initialize_config_module
from safetensors import safe_open

import glm_mtp.experiments.traces.format as trace_format
import glm_mtp.experiments.traces.shard_reader as shard_reader
import glm_mtp.experiments.traces.validate as trace_validate
import glm_mtp.experiments.training.finetune_agree as finetune_agree
import glm_mtp.experiments.training.finetune_run as finetune_run
from glm_mtp.experiments.traces.format import Trace, TraceItem, write_trace
from glm_mtp.experiments.traces.validate import open_trace
from glm_mtp.experiments.traces.identity import target_config_sha256
from glm_mtp.experiments.traces.prompt_id import prompt_identity
from glm_mtp.experiments.training.finetune_checks import check_finetune
from glm_mtp.experiments.training.finetune_run import run
from glm_mtp.reference.bytes import same_bytes
from glm_mtp.reference.checkpoint import checkpoint_weight_map
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.weights import MtpWeights

TARGET_LAYER = "model.layers.0.self_attn.o_proj.weight"  # a target tensor the output must not hold


def _checkpoint(directory, preset, shard_size=None):
    w = MtpWeights.random(MtpConfig.preset(preset), seed=2, dtype=torch.float32)
    w.save_pretrained(directory, shard_size=shard_size, extra={TARGET_LAYER: torch.randn(8, 8)})
    return w


def _trace(directory, model_dir, V, H, n=10, P=8, gen=10, K=3, mode="speculative", rows_per_shard=1 << 16):
    """A speculative greedy trace of a synthetic target whose next token is ``(7 t + 3) % V``
    (items of ``P + gen + K - 1`` rows, shards of at most ``rows_per_shard`` rows)."""
    g = torch.Generator().manual_seed(1)
    items = []
    for i in range(n):
        toks = torch.randint(0, V, (P,), generator=g).tolist()
        while len(toks) < P + gen + K - 1:
            toks.append((7 * toks[-1] + 3) % V)
        t = torch.tensor(toks, dtype=torch.int32)
        items.append(TraceItem(t, (7 * t + 3) % V, torch.randn(len(toks), H, generator=g), P,
                               prompt=prompt_identity("heldout", i, toks[:P])))
    meta = {"mode": mode, "vocab_size": V, "hidden_size": H, "hidden_dtype": "float32", "max_drafts": K,
            "target": {"target_config_sha256": target_config_sha256(model_dir)}, "tokenizer_sha256": None,
            "prompts": {"source": "heldout"}, "generation": {"temperature": 0, "top_p": None, "top_k": None,
                                                              "seed": None, "sampler": None}}
    write_trace(directory, meta, items, rows_per_shard)


ROWS_PER_SHARD = 60  # the fixture's items hold 20 rows: 3 a shard, 4 shards


def _cfg(model_dir, trace, out, *extra):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose("finetune", overrides=[f"model.path={model_dir}", "model=shipped", f"trace.path={trace}",
                                              f"finetune.out={out}", "finetune.steps=3", "finetune.eval_every=2",
                                              "finetune.batch_size=2", "finetune.lr=0.01", "logger=none", *extra])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    w = _checkpoint(str(root / "ck"), "glm5next_tiny", shard_size=7)
    _trace(str(root / "tr"), str(root / "ck"), w.config.vocab_size, w.config.hidden_size,
           rows_per_shard=ROWS_PER_SHARD)
    return root, w


def _run(root, out, *extra):
    cfg = _cfg(root / "ck", root / "tr", out, *extra)
    return run(cfg, str(root / f"run-{os.path.basename(out)}"), check_finetune(cfg), "test")


class HiddenBytes:
    """The bytes of trace hiddens alive at once, over every read wrapped (by storage: a view kept
    alive keeps its shard counted)."""

    def __init__(self):
        self.live = self.peak = 0

    def wrap(self, read):
        def tracked(*args, **kwargs):
            arrays = read(*args, **kwargs)  # a dict of arrays, or a TraceItem
            hidden = arrays.get("hidden") if isinstance(arrays, dict) else arrays.hidden
            if hidden is not None:
                storage = hidden.untyped_storage()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._drop, storage.nbytes())
            return arrays
        return tracked

    def _drop(self, n):
        self.live -= n

    def watch(self, mp):
        """Wrap every shard reader (the validator's, which ``open_trace`` and ``open_items``
        check with, and ``shard_reader``'s)."""
        mp.setattr(trace_validate, "read_item", self.wrap(trace_validate.read_item))
        mp.setattr(shard_reader, "read_rows", self.wrap(shard_reader.read_rows))


class WholeRead:
    """The trace read whole (``validate.open_trace``: every item held), behind
    ``shard_reader.TraceItems``' interface: how fine-tuning read it before."""

    def __init__(self, path):
        self.whole = open_trace(path)
        self.path, self.meta, self.sha256 = path, self.whole.meta, self.whole.sha256

    def __len__(self):
        return len(self.whole.items)

    def item(self, i):
        return self.whole.items[i]

    def prompt_tokens(self, i):
        it = self.whole.items[i]
        return tuple(it.tokens[: it.prompt_len].tolist())

    def trace_of(self, indices):
        return Trace(self.path, self.meta, self.sha256, [self.whole.items[i] for i in indices])

    def record(self):
        return self.whole.record()


def _shard_bytes(root):
    meta = json.loads((root / "tr" / "trace.json").read_text())
    return [sh["rows"] * meta["hidden_size"] * 4 for sh in meta["shards"]]  # float32 hiddens


@pytest.fixture(scope="module")
def tuned(tiny):
    """Three runs of 3 steps, evals at steps 0 and 2: o1 read shard by shard (the hiddens' bytes
    alive at once watched), o2 the same settings read whole, o3 one step only."""
    root, _ = tiny
    mem = HiddenBytes()
    with pytest.MonkeyPatch.context() as mp:
        mem.watch(mp)
        s1 = _run(root, str(root / "o1"), "finetune.depth=2", f"finetune.eval_traces=[{root / 'tr'}]")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(finetune_run, "open_items", WholeRead)
        s2 = _run(root, str(root / "o2"), "finetune.depth=2")
    s3 = _run(root, str(root / "o3"), "finetune.depth=2", "finetune.steps=1")
    return s1, s2, s3, mem


def test_the_trace_is_read_shard_by_shard_and_gives_the_whole_reads_bytes(tiny, tuned):
    root, _ = tiny
    s1, s2, _, mem = tuned
    shards = _shard_bytes(root)
    assert len(shards) == 4
    # At most one shard's hiddens alive at once (the shard-by-shard check; training holds a
    # batch's items, the judge a prompt's), never the trace's.
    assert 0 < mem.peak <= max(shards) < sum(shards)
    whole = HiddenBytes()  # the watch catches a whole read: every shard alive at once
    with pytest.MonkeyPatch.context() as mp:
        whole.watch(mp)
        held = open_trace(str(root / "tr"))
        assert whole.peak == sum(shards)
        del held
    o1, o2 = checkpoint_weight_map(root / "o1"), checkpoint_weight_map(root / "o2")
    assert o1 == o2
    for n, f in o1.items():
        with safe_open(root / "o1" / f, "pt") as b, safe_open(root / "o2" / f, "pt") as c:
            assert same_bytes(b.get_tensor(n), c.get_tensor(n)), n
    assert s1["loss"] == s2["loss"] and json.dumps(s1["replay"]) == json.dumps(s2["replay"])  # NaN where none reached


def test_the_judge_per_prompt_answers_as_one_target_of_every_judged_item(tiny):
    """Each prompt replays against the judged items of its prompt only: the counts of the former
    judge (one ``ReplayTarget`` holding every judged item), a duplicated prompt included."""
    from glm_mtp.experiments.loop.speculative import SpeculativeDecoder
    from glm_mtp.experiments.targets.replay import ReplayTarget, item_budget
    from glm_mtp.experiments.training.finetune_judge import replay_counts
    from glm_mtp.reference import ReferenceProposer

    root, w = tiny
    whole = open_trace(str(root / "tr"))
    items = [4, 0, 7, 4]
    sub = Trace(whole.path, whole.meta, whole.sha256, [whole.items[i] for i in items])
    decoder = SpeculativeDecoder(ReplayTarget(sub), ReferenceProposer(w, 64), 3, "first_row_kept", 0.0, 0)
    want = {"reached": [], "accepted": [], "steps": []}
    for it in sub.items:
        res = decoder.generate(it.tokens[: it.prompt_len].tolist(), max(1, item_budget(it, 3)))
        for k in want:
            want[k].append(getattr(res.stats, k))
    assert replay_counts(shard_reader.open_items(str(root / "tr")), items, w, 3, 64) == want


def test_the_replay_is_recorded_at_every_eval_step(tiny, tuned):
    root, _ = tiny
    s1, _, s3, _ = tuned
    hist = s1["replay"]["history"]
    assert [r["step"] for r in hist] == [r["step"] for r in s1["loss"]] == [0, 2]
    assert hist[-1]["tuned"] == s1["replay"]["tuned"] and hist[-1]["delta"] == s1["replay"]["delta"]
    # step 0's head (after one AdamW step) replays as the one-step run's written checkpoint
    (only,) = s3["replay"]["history"]
    assert json.dumps(hist[0]) == json.dumps({**only, "step": 0})
    assert json.dumps(hist[0]["tuned"]) == json.dumps(s3["replay"]["tuned"])
    assert "step 0:" in (root / "o1" / "README.md").read_text() and (root / "o1" / "loss_curve.png").stat().st_size


def test_output_layout_bytes_replay_and_reproducibility(tiny, tuned):
    root, base = tiny
    s1, s2, _, _ = tuned
    src, o1 = checkpoint_weight_map(root / "ck"), checkpoint_weight_map(root / "o1")
    assert TARGET_LAYER in src and TARGET_LAYER not in o1
    assert set(o1) == set(src) - {TARGET_LAYER}
    assert all(o1[n] == src[n] for n in o1)  # the same shard file names
    assert os.path.exists(root / "o1" / "model.safetensors.index.json")
    changed = 0
    for n, f in o1.items():
        with safe_open(root / "ck" / src[n], "pt") as a, safe_open(root / "o1" / f, "pt") as b, \
                safe_open(root / "o2" / f, "pt") as c:
            x, y, z = a.get_tensor(n), b.get_tensor(n), c.get_tensor(n)
        assert x.shape == y.shape and x.dtype == y.dtype, n
        assert same_bytes(y, z), n  # same trace + seed + one thread: the same bytes
        if n in ("model.language_model.embed_tokens.weight", "lm_head.weight") or n.endswith("e_score_correction_bias"):
            assert same_bytes(x, y), n
        changed += not same_bytes(x, y)
    assert changed > 10
    MtpWeights.from_pretrained(root / "o1")  # loads
    assert s1["split"]["train"] == 8 and s1["split"]["heldout"] == 2
    assert [r["step"] for r in s1["loss"]] == [0, 2] and set(s1["loss"][0]) == {"step", "train", "heldout"}
    rep = s1["replay"]
    assert set(rep["delta"]) == {"tau", "alpha_1", "alpha_2", "alpha_3"}
    lo, hi = rep["delta"]["tau"][1:]
    assert lo <= rep["delta"]["tau"][0] <= hi
    assert rep["delta"]["tau"][0] == pytest.approx(rep["tuned"]["tau"] - rep["base"]["tau"])
    (extra,) = s1["eval_traces"]  # every prompt of the eval trace, the held-out ones among them
    assert extra["prompts"] == 10 and set(extra["delta"]) == set(rep["delta"])
    assert json.dumps(s1["replay"]) == json.dumps(s2["replay"])  # NaN where no draft reached
    from glm_mtp.experiments.training.finetune_split import split_by_prompt

    sp = split_by_prompt(json.loads((root / "tr" / "trace.json").read_text()), 0.2, 0)
    assert s1["split"]["heldout_item_indices"] == sp.heldout_items and not set(sp.train_items) & set(sp.heldout_items)
    assert "sha256" in (root / "o1" / "README.md").read_text()


@pytest.mark.parametrize("override, message", [
    ("finetune.depth=4", "finetune.depth=4 exceeds"),
    ("finetune.heldout=0.01", "finetune.heldout=0.01"),
    ("finetune.lr=-1", "finetune.lr must be"),
    ("finetune.steps=0", "finetune.steps must be"),
    ("finetune.num_drafts=9", "finetune.num_drafts=9 exceeds"),
])
def test_bad_settings_are_refused_before_work(tiny, override, message):
    root, _ = tiny
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_finetune(_cfg(root / "ck", root / "tr", root / "never", override))
    assert not os.path.exists(root / "never")


def test_non_empty_out_and_another_target_are_refused(tiny, tmp_path):
    root, _ = tiny
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="finetune.out"):
        check_finetune(_cfg(root / "ck", root / "tr", tmp_path / "full"))
    other = tmp_path / "other"
    _checkpoint(str(other), "tiny")
    with pytest.raises(ValueError, match="trace.path"):
        check_finetune(_cfg(other, root / "tr", tmp_path / "new"))


def test_a_sampled_trace_is_refused_naming_its_labels(tiny, tmp_path):
    root, _ = tiny
    meta = json.loads((root / "tr" / "trace.json").read_text())
    (tmp_path / "s").mkdir()
    for f in os.listdir(root / "tr"):
        (tmp_path / "s" / f).write_bytes((root / "tr" / f).read_bytes())
    meta["generation"] = {"temperature": 1.0, "top_p": None, "top_k": None, "seed": 0,
                          "sampler": {"name": "x", "version": 1}}
    (tmp_path / "s" / "trace.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="sampled trace.*`sample` labels"):
        check_finetune(_cfg(root / "ck", tmp_path / "s", tmp_path / "new"))


def test_the_entry_point_exits_2_writing_nothing(tiny, tmp_path):
    root, _ = tiny
    r = subprocess.run([sys.executable, "-m", "glm_mtp.experiments.finetune", f"model.path={root / 'ck'}",
                        f"trace.path={root / 'tr'}", f"finetune.out={tmp_path / 'o'}", "finetune.depth=9",
                        "logger=none", f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "finetune.depth=9" in r.stderr
    assert not os.path.exists(tmp_path / "o") and not os.path.exists(tmp_path / "run")


def test_a_forward_that_disagrees_with_the_drafter_exits_2_in_one_line(tiny, tmp_path, monkeypatch, capsys):
    """The training forward checked against the reference drafter before any work: one value of
    depth 2's output moved, the entry point (in-process, so the forward can be broken) names the
    item, the depth and the row in one line, exits 2 and writes nothing."""
    root, _ = tiny
    real = finetune_agree.drafter_forward

    def broken(*args, **kwargs):
        outs = real(*args, **kwargs)
        outs[1].x[3, 5] += 1.0
        return outs

    monkeypatch.setattr(finetune_agree, "drafter_forward", broken)
    err = _refused_in_process(root / "ck", root / "tr", tmp_path, monkeypatch, capsys)
    assert "disagrees with the reference drafter" in err and "depth 2, row 3: 1 of" in err, err


def _refused_in_process(ck, trace, tmp_path, monkeypatch, capsys):
    """The entry point run in this process: it exits 2 with one line on stderr and writes neither
    ``finetune.out`` nor its run directory; the line."""
    from glm_mtp.experiments import finetune

    monkeypatch.setattr(sys, "argv", ["finetune", f"model.path={ck}", "model=shipped", f"trace.path={trace}",
                                      f"finetune.out={tmp_path / 'o'}", "finetune.depth=2", "logger=none",
                                      f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as e:
        finetune.main()
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "o") and not os.path.exists(tmp_path / "run")
    return err


def test_a_damaged_shard_is_refused_before_work_in_one_line(tiny, tmp_path, monkeypatch, capsys):
    """The shard-by-shard check before training: one byte of shard 2's hiddens flipped (trace.json,
    which ``check_finetune`` reads, unchanged) is refused naming the item, exit 2, nothing written."""
    import shutil

    from safetensors.torch import load_file, save_file

    root, _ = tiny
    shutil.copytree(root / "tr", tmp_path / "tr")
    shard = tmp_path / "tr" / trace_format.shard_name(2)
    arrays = load_file(shard)
    arrays["hidden"].view(torch.uint8)[0, 3] ^= 1
    save_file(arrays, shard)
    err = _refused_in_process(root / "ck", tmp_path / "tr", tmp_path, monkeypatch, capsys)
    assert "items[6].sha256" in err, err  # shard 2 begins with item 6 (3 items a shard)


def test_fp8_layers_are_requantized_on_write(tmp_path):
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=2, dtype=torch.float32).quantize_fp8()
    w.save_pretrained(tmp_path / "ck")
    _trace(str(tmp_path / "tr"), str(tmp_path / "ck"), w.config.vocab_size, w.config.hidden_size)
    cfg = _cfg(tmp_path / "ck", tmp_path / "tr", tmp_path / "o")
    run(cfg, str(tmp_path / "run"), check_finetune(cfg), "test")
    with safe_open(tmp_path / "ck" / "model.safetensors", "pt") as a, safe_open(tmp_path / "o" / "model.safetensors",
                                                                                 "pt") as b:
        assert set(a.keys()) == set(b.keys())
        fp8_names = [n for n in a.keys() if a.get_tensor(n).dtype == torch.float8_e4m3fn]
        assert fp8_names and all(b.get_tensor(n).dtype == torch.float8_e4m3fn for n in fp8_names)
        assert any(not same_bytes(a.get_tensor(n), b.get_tensor(n)) for n in fp8_names)
    assert MtpWeights.from_pretrained(tmp_path / "o").block_scaled
