"""The trace tools' arguments are input (issue 49, docs/traces.md "Rules"): ``drafter-only``,
``grid-report`` and ``check`` refuse a missing, unreadable or non-empty path, an output that is
the source or lies inside it, and summaries missing fields or holding nulls: one line, exit 2,
nothing written and nothing overwritten. Named cases, then drawn ones (seeded)."""

import hashlib
import json
import os
import random
import shutil

import pytest

from glm_mtp.experiments.targets.checkpoint import shipped_checkpoint
from glm_mtp.experiments.traces.__main__ import main

PROG = "python -m glm_mtp.experiments.traces: error: "


def tree_digest(folder):
    """Every file under ``folder`` and its bytes' sha256 (what a refusal must leave unchanged)."""
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def refused(capsys, argv, *words):
    """Run the tool; it must exit 2 with one ``error:`` line holding ``words``."""
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(PROG), err
    for w in words:
        assert w in err[0], (w, err[0])
    return err[0]


@pytest.fixture()
def ck(tmp_path):
    """A copy of the shipped GLM-5 checkpoint (9 MB)."""
    return shutil.copytree(shipped_checkpoint(), tmp_path / "ck")


def test_drafter_only_onto_its_source_destroys_nothing(ck, capsys):
    before = tree_digest(ck)
    refused(capsys, ["drafter-only", str(ck), str(ck)], "out:", "source checkpoint")
    refused(capsys, ["drafter-only", str(ck), str(ck / "sub")], "out:", "inside it")
    refused(capsys, ["drafter-only", str(ck), str(ck) + "/."], "out:")
    os.symlink(ck, ck.parent / "alias")
    refused(capsys, ["drafter-only", str(ck), str(ck.parent / "alias")], "out:")  # a link to the source
    assert tree_digest(ck) == before
    assert sorted(os.listdir(ck.parent)) == ["alias", "ck"]


def test_drafter_only_refuses_bad_paths_writing_nothing(ck, tmp_path, capsys):
    other = shutil.copytree(ck, tmp_path / "other")  # another checkpoint: never overwritten either
    before = tree_digest(other)
    refused(capsys, ["drafter-only", str(ck), str(other)], "out:", "not empty")
    assert tree_digest(other) == before
    (tmp_path / "file").write_text("x")
    refused(capsys, ["drafter-only", str(ck), str(tmp_path / "file")], "out:", "not a folder")
    refused(capsys, ["drafter-only", str(tmp_path / "missing"), str(tmp_path / "new")], "src:", "does not exist")
    refused(capsys, ["drafter-only", str(tmp_path / "file"), str(tmp_path / "new")], "src:", "not a directory")
    (tmp_path / "empty").mkdir()
    refused(capsys, ["drafter-only", str(tmp_path / "empty"), str(tmp_path / "new")], "src:")
    (ck / "model.safetensors").write_bytes(b"\x00" * 64)  # unreadable tensors: refused before any write
    refused(capsys, ["drafter-only", str(ck), str(tmp_path / "new")], "src:", "not a readable checkpoint")
    assert not (tmp_path / "new").exists()


def test_drafter_only_into_a_new_folder_keeps_the_source(ck, tmp_path, capsys):
    before = tree_digest(ck)
    assert main(["drafter-only", str(ck), str(tmp_path / "out")]) == 0
    assert tree_digest(ck) == before and (tmp_path / "out" / "model.safetensors").is_file()


def test_check_refuses_a_missing_folder(tmp_path, capsys):
    refused(capsys, ["check", str(tmp_path / "missing")], "directory:", "not a readable folder")
    (tmp_path / "f").write_text("{}")
    refused(capsys, ["check", str(tmp_path / "f")], "directory:")


GOOD = {"index_share": True, "weights_dtype": "plain", "policy": "trim_all", "num_drafts": 2,
        "mean_accepted_length": 1.5, "cumulative": [0.5, 0.25], "speedup": {"predicted": [1.1, 1.2]},
        "target_forwards": 10, "trace": {"sha256": "a" * 64, "forwards": {"total": 5}}}


def sweep_with(tmp_path, summary):
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "summary.json").write_text(summary if isinstance(summary, str) else json.dumps(summary))
    return sweep


def test_grid_report_named_cases(tmp_path, capsys):
    sweep = sweep_with(tmp_path, GOOD)
    assert main(["grid-report", str(sweep), "--out", str(tmp_path / "t.md")]) == 0
    capsys.readouterr()
    before = (tmp_path / "t.md").read_text()
    refused(capsys, ["grid-report", str(sweep), "--out", str(tmp_path / "t.md")], "--out", "exists")
    refused(capsys, ["grid-report", str(sweep), "--out", str(sweep / "0" / "summary.json")], "--out", "exists")
    assert (tmp_path / "t.md").read_text() == before and json.loads((sweep / "0" / "summary.json").read_text()) == GOOD
    refused(capsys, ["grid-report", str(tmp_path / "nowhere")], "sweep_dir:", "not a folder")
    for name, summary, words in (("null", {**GOOD, "mean_accepted_length": None}, ["mean_accepted_length"]),
                                 ("missing", {k: v for k, v in GOOD.items() if k != "policy"}, ["policy", "missing"]),
                                 ("bool for int", {**GOOD, "num_drafts": True}, ["num_drafts"]),
                                 ("short", {**GOOD, "cumulative": [0.5]}, ["cumulative"]),
                                 ("not json", "{", ["not valid JSON"]),
                                 ("not utf-8", "\udcff", ["not valid JSON"]),
                                 ("deep", "[" * 100000 + "]" * 100000, ["summary"])):
        case = tmp_path / name.replace(" ", "_")
        case.mkdir()
        sweep = case / "sweep"
        (sweep / "0").mkdir(parents=True)
        body = summary if isinstance(summary, str) else json.dumps(summary)
        (sweep / "0" / "summary.json").write_bytes(body.encode("utf-8", "surrogateescape"))
        refused(capsys, ["grid-report", str(sweep), "--out", str(case / "t.md")], "summary.json", *words)
        assert not (case / "t.md").exists(), name


def test_grid_report_drawn_summaries(tmp_path, capsys):
    """Drawn damage to one field (removed, null, a bool, a string, a negative or short list) is
    refused naming that field, and nothing is written."""
    rng = random.Random(49)
    fields = ["index_share", "weights_dtype", "policy", "num_drafts", "mean_accepted_length", "target_forwards",
              "cumulative"]
    for n in range(30):
        name = rng.choice(fields)
        summary = json.loads(json.dumps(GOOD))
        damage = rng.choice(["drop", None, True, "x", -1, [], {}])
        if damage == "drop":
            del summary[name]
        else:
            summary[name] = damage
        if name == "index_share" and isinstance(damage, bool):
            continue  # a bool is this field's type
        if name in ("weights_dtype", "policy") and damage == "x":
            continue
        case = tmp_path / str(n)
        case.mkdir()
        sweep = sweep_with(case, summary)
        refused(capsys, ["grid-report", str(sweep), "--out", str(case / "t.md")], name)
        assert not (case / "t.md").exists()
