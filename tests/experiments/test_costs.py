"""python -m glm_mtp.experiments.costs: list, show, and the check's table and exit code
(experiments/loop/cost_check.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from glm_mtp.experiments import costs as costs_cli
from glm_mtp.experiments.loop import cost_check, cost_tables


def test_check_passes_on_the_shipped_pairs_and_says_what_is_no_check(capsys):
    assert costs_cli.main(["check"]) == 0
    out = capsys.readouterr().out
    rows, ok = cost_check.run_check(cost_tables.shipped_observations()["observations"],
                                    {n: cost_tables.shipped_table(n) for n in cost_tables.shipped_names()})
    ds4 = next(r for r in rows if r["id"] == "ds4-892")
    # tau 1.896 over (1 + c + v(1)) = (30.303 + 6.0 + 37.4 - 30.303) / 30.303: ds4's own numbers.
    assert ds4["kind"] == "check" and ds4["predicted"] == pytest.approx(1.896 / ((37.4 + 6.0) / (1000 / 33.0)))
    assert ds4["measured"] == pytest.approx(40.5 / 33.0) and ds4["in_band"]
    assert {r["id"]: r["kind"] for r in rows}["mstar-272"] == "derived"
    assert "| ds4-892 (antirez/ds4#892)" in out and "not a check" in out and "check passed" in out
    assert "unsloth-10119" in out and "not published" in out


SHIPPED_DIR = cost_tables.TABLES_DIR


def broken_dir(tmp_path, draft_ms: float):
    """The shipped tables copied, ds4's draft step replaced."""
    tmp_path = tmp_path / f"draft{draft_ms:g}"
    tmp_path.mkdir()
    for p in SHIPPED_DIR.glob("*.json"):
        shutil.copy(p, tmp_path / p.name)
    path = tmp_path / "glm53flash-m5max-ds4.json"
    table = json.loads(path.read_text())
    table["batches"][0]["draft_step_ms"] = draft_ms
    path.write_text(json.dumps(table))
    return tmp_path


def test_check_fails_when_a_ratio_leaves_the_band(tmp_path, monkeypatch, capsys):
    """A drafter step 8x too cheap (0.75 ms for ds4's ~6) predicts S too high: exit 1, the row NO;
    one 4x too dear predicts it too low: exit 1 as well."""
    monkeypatch.setattr(cost_tables, "TABLES_DIR", broken_dir(tmp_path, 0.75))
    assert costs_cli.main(["check"]) == 1
    assert "| NO |" in capsys.readouterr().out
    monkeypatch.setattr(cost_tables, "TABLES_DIR", broken_dir(tmp_path, 24.0))
    assert costs_cli.main(["check"]) == 1


def test_check_needs_an_independent_pair():
    tables = {n: cost_tables.shipped_table(n) for n in cost_tables.shipped_names()}
    obs = [o for o in cost_tables.shipped_observations()["observations"] if o["id"] != "ds4-892"]
    rows, ok = cost_check.run_check(obs, tables)
    assert not ok and not [r for r in rows if r["kind"] == "check"]


def test_list_and_show(capsys, tmp_path):
    assert costs_cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "glm53flash-m5max-ds4 (GLM-5.3-Flash on Apple M5 Max" in out and "ggml-org/llama.cpp#17034" in out
    assert "bytes:glm5, bytes:glm5next" in out and "memory-bound limit" in out
    assert costs_cli.main(["show", "glm53flash-m5max-ds4"]) == 0
    out = capsys.readouterr().out
    assert "forward ms by width {1: 30.303*, 2: 37.4}" in out and "antirez/ds4#892" in out
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"format": cost_tables.FORMAT}))
    for name in ("no-such-table", str(bad)):
        assert costs_cli.main(["show", name]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1
