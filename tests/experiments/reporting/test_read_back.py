"""Result files read back are input (issue 49): ``sweep.rescore``'s sweep.json is checked field
by field (rows, names, counts, types, a bool never an integer) before any work, one line naming
the field; its size and nesting bounded before it is parsed. Named cases, then drawn damage."""

import copy
import json
import random

import pytest

from glm_mtp.experiments.reporting.read_back import check_sweep_record, json_depth, read_json_file

GOOD = {"num_drafts": 2, "rows": [
    {"name": "fixed k=1", "rule": "none", "threshold": None, "num_drafts": 1,
     "counts": {"committed": [5, 3], "widths": [[0, 3], [1, 1]]}},
    {"name": "oracle (K=2)", "rule": "oracle", "threshold": None, "num_drafts": 2,
     "counts": {"committed": [6, 4], "widths": [[1, 1, 1], [0, 2, 0]]}},
    {"name": "prob >= 0.5", "rule": "prob", "threshold": 0.5, "num_drafts": 2,
     "counts": {"committed": [6, 4], "widths": [[1, 1, 1], [0, 2, 0]]}}]}


def test_a_good_record_passes(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps(GOOD))
    assert check_sweep_record(read_json_file(str(tmp_path / "s.json"), "sweep.rescore"), "w") == GOOD


@pytest.mark.parametrize("body, words", [
    (b"{", "not valid JSON"), (b"\xff\xfe", "not UTF-8"), (b"[" * 40 + b"]" * 40, "nests deeper than 32"),
    (b'{"num_drafts": NaN}', "not valid JSON"),
])
def test_unreadable_files_are_refused_naming_the_key(tmp_path, body, words):
    (tmp_path / "s.json").write_bytes(body)
    with pytest.raises(ValueError, match="sweep.rescore: .*" + words):
        read_json_file(str(tmp_path / "s.json"), "sweep.rescore", allow_nan=False)
    with pytest.raises(ValueError, match="sweep.rescore: .* is not a file"):
        read_json_file(str(tmp_path / "missing.json"), "sweep.rescore")


def test_a_nan_in_a_checked_field_is_refused(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({**GOOD, "rows": [{**GOOD["rows"][2], "threshold": float("nan")}]}))
    with pytest.raises(ValueError, match="rows.0..threshold must be"):
        check_sweep_record(read_json_file(str(tmp_path / "s.json"), "sweep.rescore"), "w")


def test_json_depth_skips_strings():
    assert json_depth('{"a": "[[[[", "b": [[1]]}') == 3
    assert json_depth('["\\"[[["]') == 1


@pytest.mark.parametrize("edit, field", [
    (lambda r: r.update(num_drafts=True), "num_drafts"),
    (lambda r: r.update(rows=[]), "rows"),
    (lambda r: r["rows"][0].pop("name"), "rows[0].name"),
    (lambda r: r["rows"][0].update(rule="entropy"), "rows[0].rule"),
    (lambda r: r["rows"][2].update(threshold=None), "rows[2].threshold"),
    (lambda r: r["rows"][0].update(threshold=0.5), "rows[0].threshold"),
    (lambda r: r["rows"][1].update(num_drafts=3), "rows[1].num_drafts"),
    (lambda r: r["rows"][1]["counts"]["committed"].__setitem__(0, True), "rows[1].counts.committed"),
    (lambda r: r["rows"][1]["counts"]["widths"].pop(), "rows[1].counts.widths"),
    (lambda r: r["rows"][1]["counts"]["widths"][0].append(0), "rows[1].counts.widths[0]"),
    (lambda r: r["rows"][0]["counts"]["committed"].__setitem__(1, 99), "rows[0].counts.committed[1]"),
])
def test_named_damage_is_refused_naming_the_field(edit, field):
    record = copy.deepcopy(GOOD)
    edit(record)
    with pytest.raises(ValueError) as e:
        check_sweep_record(record, "sweep.rescore: f")
    assert str(e.value).startswith(f"sweep.rescore: f: {field} must be"), str(e.value)


def leaves(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from leaves(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from leaves(v, (*path, i))
    else:
        yield path


def test_drawn_damage_to_any_leaf_is_refused_or_harmless():
    """A leaf replaced by a drawn wrong-typed value (a bool, null, text, a negative, a list) is
    refused naming a field on its path, or the record still checks (the value fits its rule)."""
    rng = random.Random(49)
    paths = list(leaves(GOOD))
    refused = 0
    for _ in range(200):
        record = copy.deepcopy(GOOD)
        path = rng.choice(paths)
        node = record
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = rng.choice([True, False, None, "x", -1, [], {}, 1e308 * 10])
        try:
            check_sweep_record(record, "w")
        except ValueError as e:
            refused += 1
            top = path[0] if path[0] != "rows" else f"rows[{path[1]}]"
            assert f"w: {top}" in str(e), (path, str(e))
            continue
        # accepted: the drawn value fits the field's rule (a name's text, a rule's finite threshold)
        value = node[path[-1]]
        fits = {"name": isinstance(value, str) and value != "",
                "threshold": isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e308}
        assert fits.get(path[-1], False), (path, value)
    assert refused > 150
