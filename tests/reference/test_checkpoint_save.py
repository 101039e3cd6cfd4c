"""save_pretrained replaces a checkpoint as a whole or not at all: no stale shard or index of an
older save survives, a failure at any step leaves the previous checkpoint byte for byte, tied
embedding/head weights save and load back bit-exact, and a bad ``shard_size`` writes nothing."""

import json
import os
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import glm_mtp.reference.checkpoint as ck
from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.reference.weights import weights_equal

CFG = MtpConfig.preset("tiny")


def tree(root) -> dict[str, bytes | None]:
    """Every path under ``root`` (relative) -> its bytes (None for a directory)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def test_a_single_file_save_replaces_an_older_sharded_one(tmp_path):
    d = tmp_path / "ckpt"
    old, new = (MtpWeights.random(CFG, seed=s, dtype=torch.bfloat16) for s in (1, 2))
    old.save_pretrained(d, shard_size=5)
    new.save_pretrained(d)
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors"]
    assert weights_equal(MtpWeights.from_pretrained(d), new)


def test_a_sharded_save_replaces_an_older_one_with_more_shards(tmp_path):
    d = tmp_path / "ckpt"
    old, new = (MtpWeights.random(CFG, seed=s, dtype=torch.float32) for s in (3, 4))
    old.save_pretrained(d)
    old.save_pretrained(d, shard_size=4)
    new.save_pretrained(d, shard_size=40)
    files = sorted(os.listdir(d))
    n = len(new.state_dict())
    shards = [f"model-{i + 1:05d}-of-{-(-n // 40):05d}.safetensors" for i in range(-(-n // 40))]
    assert files == sorted(["config.json", ck.INDEX_FILE, *shards])
    assert weights_equal(MtpWeights.from_pretrained(d), new)


def test_companion_files_are_kept_and_foreign_directories_refused(tmp_path):
    d = tmp_path / "ckpt"
    MtpWeights.random(CFG, seed=5, dtype=torch.float32).save_pretrained(d, shard_size=6)
    (d / "tokenizer.json").write_text('{"v": 1}')
    (d / "logs").mkdir()
    (d / "logs" / "run.txt").write_bytes(os.urandom(64))
    os.chmod(d, 0o750)
    companions = {k: v for k, v in tree(d).items() if k in ("tokenizer.json", "logs", os.path.join("logs", "run.txt"))}
    new = MtpWeights.random(CFG, seed=6, dtype=torch.float32)
    new.save_pretrained(d)
    after = tree(d)
    assert {k: after[k] for k in companions} == companions
    assert sorted(after) == sorted([*companions, "config.json", "model.safetensors"])
    assert os.stat(d).st_mode & 0o777 == 0o750
    assert weights_equal(MtpWeights.from_pretrained(d), new)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary sibling left

    # A non-empty directory that holds no checkpoint is not ours to write into.
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (foreign / "config.json").write_text("{}")
    before = tree(tmp_path)
    with pytest.raises(ValueError, match="holds no checkpoint"):
        new.save_pretrained(foreign)
    assert tree(tmp_path) == before
    # An empty directory (train.py creates its output folder first) is fine.
    (tmp_path / "empty").mkdir()
    new.save_pretrained(tmp_path / "empty")
    assert weights_equal(MtpWeights.from_pretrained(tmp_path / "empty"), new)


class Injected(OSError):
    pass


def test_a_failure_at_any_step_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """Fail the k-th file-system step the checkpoint module takes (mkdir, each shard write,
    fsync, rename), for every k until a save gets through: each time the whole parent folder is
    byte-identical to before and the old weights load."""
    d = tmp_path / "ckpt"
    old, new = (MtpWeights.random(CFG, seed=s, dtype=torch.bfloat16) for s in (7, 8))
    old.save_pretrained(d, shard_size=9)
    (d / "README.md").write_text("model card")
    before = tree(tmp_path)

    calls = {"n": 0, "fail_at": 0}

    def failing(real):
        def f(*a, **k):
            if sys._getframe(1).f_globals.get("__name__") != ck.__name__:
                return real(*a, **k)  # a step inside os/shutil, not one of the save's own
            calls["n"] += 1
            if calls["n"] == calls["fail_at"]:
                raise Injected(f"injected failure at step {calls['n']}")
            return real(*a, **k)

        return f

    for name in ("rename", "replace", "fsync", "mkdir", "makedirs"):
        monkeypatch.setattr(os, name, failing(getattr(os, name)))
    monkeypatch.setattr(ck, "save_file", failing(ck.save_file))
    fail_at = 0
    while True:
        fail_at += 1
        calls.update(n=0, fail_at=fail_at)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                new.save_pretrained(d, shard_size=4)
            except Injected:
                assert tree(tmp_path) == before, f"failure at step {fail_at} changed the files"
                assert weights_equal(MtpWeights.from_pretrained(d), old)
                continue
        break
    # Through: no step failed, or only the last (flushing the parent after the swap), as a warning.
    assert calls["n"] < fail_at or (calls["n"] == fail_at and "flushing its parent" in str(caught[-1].message))
    assert fail_at > 20  # the loop really went through every shard write and rename
    assert weights_equal(MtpWeights.from_pretrained(d), new)
    assert (d / "README.md").read_text() == "model card"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def tied_checkpoint(path, dtype):
    """A checkpoint without lm_head and with tie_word_embeddings, as tied models ship."""
    MtpWeights.random(CFG, seed=9, dtype=dtype).save_pretrained(path)
    t = load_file(path / "model.safetensors")
    del t["lm_head.weight"]
    save_file(t, path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_weights_save_back_bit_exact(tmp_path, dtype):
    w = MtpWeights.from_pretrained(tied_checkpoint(tmp_path / "tied", dtype))
    assert w.lm_head is w.embed_tokens
    w.save_pretrained(tmp_path / "out", shard_size=7)
    assert weights_equal(MtpWeights.from_pretrained(tmp_path / "out"), w)
    w.save_pretrained(tmp_path / "tied")  # back into the folder it was loaded from
    back = MtpWeights.from_pretrained(tmp_path / "tied")
    assert weights_equal(back, w)
    assert w.lm_head is w.embed_tokens  # saving did not untie the caller's weights


@pytest.mark.parametrize("shard_size", [0, -1, True, 2.5, "3"])
def test_a_bad_shard_size_writes_nothing(tmp_path, shard_size):
    w = MtpWeights.random(CFG, seed=10, dtype=torch.float32)
    w.save_pretrained(tmp_path / "old", shard_size=11)
    before = tree(tmp_path)
    with pytest.raises(ValueError, match="shard_size must be a positive integer"):
        MtpWeights.random(CFG, seed=11, dtype=torch.float32).save_pretrained(tmp_path / "old", shard_size=shard_size)
    with pytest.raises(ValueError, match="shard_size"):
        w.save_pretrained(tmp_path / "new", shard_size=shard_size)
    assert tree(tmp_path) == before
    assert weights_equal(MtpWeights.from_pretrained(tmp_path / "old"), w)


def test_refused_targets_write_nothing_and_a_link_is_followed(tmp_path, monkeypatch):
    w = MtpWeights.random(CFG, seed=12, dtype=torch.float32)
    w.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "file").write_text("x")
    before = tree(tmp_path)
    with pytest.raises(ValueError, match="not a folder"):
        w.save_pretrained(tmp_path / "file")
    with pytest.raises(ValueError, match="tensors must map names"):
        w.save_pretrained(tmp_path / "new", extra={"model.norm.weight": [1.0, 2.0]})
    monkeypatch.chdir(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="current working directory"):
        w.save_pretrained(".")
    assert tree(tmp_path) == before
    monkeypatch.chdir(tmp_path)
    os.symlink(tmp_path / "ckpt", tmp_path / "link")
    new = MtpWeights.random(CFG, seed=13, dtype=torch.float32)
    new.save_pretrained(tmp_path / "link")
    assert os.path.islink(tmp_path / "link") and weights_equal(MtpWeights.from_pretrained(tmp_path / "ckpt"), new)
