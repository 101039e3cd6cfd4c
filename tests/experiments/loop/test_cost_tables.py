"""Cost tables (experiments/loop/cost_tables.py): the shipped ones, the loader's refusals field by
field, c and v from ms, the linear extrapolation beyond a table's widths, and speedup.costs names."""

from __future__ import annotations

import copy
import json
import random

import pytest

from glm_mtp.experiments.loop import cost_tables, speedup


def good_table(batches=None) -> dict:
    return {"format": cost_tables.FORMAT, "name": "mine", "model": "GLM-5.3-Flash", "family": "glm5_next",
            "hardware": "one GPU", "engine": "transformers (model=hf)", "precision": "bf16", "source": "timed here",
            "batches": batches or [{"batch": 1, "forward_ms": [10.0, 12.0, 14.0], "draft_step_ms": 1.0}],
            "derived": {}, "derived_from_speedup": []}


def test_shipped_tables_and_observations_load_and_cite_their_sources():
    names = cost_tables.shipped_names()
    assert {"glm53flash-m5max-ds4", "glm52-h200x8-mstar", "glm52-m3ultra-omlx"} <= set(names)
    for name in names:
        t = cost_tables.shipped_table(name)
        assert t["name"] == name and "#" in t["source"]  # repository#number
    obs = cost_tables.shipped_observations()
    assert {o["id"] for o in obs["observations"]} >= {"ds4-892", "mstar-272", "vllm-272", "unsloth-10119"}
    # ds4#892 as published: 33.0 -> 40.5 tok/s, 89.6% at k = 1, verify2 37.4 ms, head + draft ~6 ms.
    ds4 = next(o for o in obs["observations"] if o["id"] == "ds4-892")
    assert (ds4["baseline_tok_s"], ds4["mtp_tok_s"], ds4["acceptance"], ds4["k"]) == (33.0, 40.5, [0.896], 1)
    m5 = cost_tables.shipped_table("glm53flash-m5max-ds4")["batches"][0]
    assert m5["forward_ms"][1] == 37.4 and m5["draft_step_ms"] == 6.0
    assert m5["forward_ms"][0] == pytest.approx(1000 / 33.0, abs=1e-3)
    # The server table came from a speedup and says so; the refs searched for and not found are listed.
    assert cost_tables.shipped_table("glm52-h200x8-mstar")["derived_from_speedup"] == ["mstar-272"]
    assert {x["ref"] for x in obs["not_found"]} >= {"ggml-org/llama.cpp#17034", "ikawrakow/ik_llama.cpp#2399"}


# (what to break, the value, the field the refusal must name)
BAD = [
    ("format", "glm-mtp-costs/0", "format must be"),
    ("name", "", "name must be"),
    ("name", "../x", "name must be"),
    ("model", "", "model must be a non-empty string"),
    ("hardware", None, "hardware must be a non-empty string"),
    ("engine", 3, "engine must be a non-empty string"),
    ("precision", "  ", "precision must be a non-empty string"),
    ("source", None, "source must be a non-empty string"),
    ("family", "glm6", "family must be one of"),
    ("batches", [], "batches must be a non-empty list"),
    ("batches", [[1, 2]], "batches[0] must be an object"),
    ("batches.0.batch", 0, "batches[0].batch must be an int >= 1"),
    ("batches.0.batch", True, "batches[0].batch must be an int >= 1"),
    ("batches.0.forward_ms", [10.0], "batches[0].forward_ms must list"),
    ("batches.0.forward_ms", "10, 12", "batches[0].forward_ms must list"),
    ("batches.0.forward_ms.1", -1.0, "batches[0].forward_ms[1] must be a finite number of ms > 0"),
    ("batches.0.forward_ms.2", float("nan"), "batches[0].forward_ms[2] must be a finite number"),
    ("batches.0.forward_ms.0", "10", "batches[0].forward_ms[0] must be a finite number"),
    ("batches.0.draft_step_ms", 0, "batches[0].draft_step_ms must be a finite number of ms > 0"),
    ("batches.0.draft_step_ms", None, "batches[0].draft_step_ms must be a finite number"),
    ("batches.0.width3_ms", 1.0, "batches[0].width3_ms is not a field"),
    ("derived", None, "derived must be an object"),
    ("derived", {"batches[0].forward_ms[7]": "guessed"}, "names no number of the table"),
    ("derived", {"batches[0].draft_step_ms": ""}, "must say how the number was derived"),
    ("derived_from_speedup", "ds4-892", "derived_from_speedup must be a list"),
    ("notes", 5, "notes must be a string"),
    ("forward", [1.0], "key 'forward' is not a field"),
]


def set_path(table: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = table
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


@pytest.mark.parametrize("path,value,message", BAD, ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_loader_refuses_each_broken_field_naming_it(path, value, message, tmp_path):
    """Each bad value of each field is refused with the field and its rule, in the file's name;
    the table is otherwise good (so the refusal is that field's)."""
    assert cost_tables.check_table(good_table(), "t.json")
    table = good_table()
    set_path(table, path, value)
    f = tmp_path / "t.json"
    f.write_text(json.dumps(table))
    with pytest.raises(ValueError, match="t.json: ") as e:
        cost_tables.read_table(f)
    assert message in str(e.value)


def test_loader_refuses_missing_fields_and_unordered_batches(tmp_path):
    for key in ("format", "name", "model", "hardware", "engine", "precision", "source", "batches", "derived",
                "derived_from_speedup"):
        table = good_table()
        del table[key]
        with pytest.raises(ValueError, match=key):
            cost_tables.check_table(table, "t.json")
    two = good_table([{"batch": 8, "forward_ms": [10.0, 11.0], "draft_step_ms": 1.0},
                      {"batch": 8, "forward_ms": [10.0, 11.0], "draft_step_ms": 1.0}])
    with pytest.raises(ValueError, match=r"batches\[1\].batch must be larger than the batch before it \(8\)"):
        cost_tables.check_table(two, "t.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        cost_tables.read_table(tmp_path / "bad.json")


def test_drawn_bad_tables_are_refused_good_ones_kept():
    """Random tables: each good one passes; one number of it drawn bad (<= 0, nan, inf, a string,
    a bool) is refused naming its path."""
    rng = random.Random(0)
    for _ in range(40):
        batches = [{"batch": b, "forward_ms": sorted(rng.uniform(1, 50) for _ in range(rng.randint(2, 6))),
                    "draft_step_ms": rng.uniform(0.1, 5)} for b in sorted(rng.sample(range(1, 257), rng.randint(1, 3)))]
        table = good_table(batches)
        cost_tables.check_table(table, "t")
        paths = cost_tables.number_paths(table)
        path = rng.choice(paths)
        bad = copy.deepcopy(table)
        i = int(path.split("[")[1].split("]")[0])
        value = rng.choice([0.0, -rng.uniform(0, 9), float("nan"), float("inf"), "3", True])
        if path.endswith("draft_step_ms"):
            bad["batches"][i]["draft_step_ms"] = value
        else:
            bad["batches"][i]["forward_ms"][int(path.rsplit("[", 1)[1][:-1])] = value
        with pytest.raises(ValueError) as e:
            cost_tables.check_table(bad, "t")
        assert path in str(e.value)


def test_costs_from_ms_and_linear_extrapolation_beyond_the_widths():
    t = good_table()  # forwards 10, 12, 14 ms; draft 1 ms
    got = cost_tables.costs_at(t, 4)
    assert got["c"] == pytest.approx(0.1)
    assert got["v"] == pytest.approx([0.2, 0.4, 0.6, 0.8])  # widths 4 and 5 extrapolated: 16, 18 ms
    assert got["extrapolated"] == [3, 4] and got["source"] == "table:mine"
    assert cost_tables.costs_at(t, 2)["extrapolated"] == []
    with pytest.raises(ValueError, match="has no batch 4"):
        cost_tables.costs_at(t, 2, batch=4)


def test_speedup_costs_names(tmp_path):
    """bytes:NAME is the bytes model (glm5 / glm5next the same), a shipped name its table, a file a
    table or bench's costs.json; anything else is refused listing the names, before any work."""
    assert speedup.resolve_costs("bytes:glm5", None, None, 3, []) == speedup.preset_costs("glm5", 3)
    assert speedup.resolve_costs("glm5", None, None, 3, []) == speedup.resolve_costs("bytes:glm5", None, None, 3, [])
    assert speedup.resolve_costs("bytes:glm5next", None, None, 3, [])["source"] == "bytes:glm5next"
    shipped = speedup.resolve_costs("glm53flash-m5max-ds4", None, None, 3, [])
    assert shipped["source"] == "table:glm53flash-m5max-ds4" and shipped["per_batch"] is None
    assert shipped["c"] == pytest.approx(6.0 / (1000 / 33.0), rel=1e-4)
    assert shipped["v"][0] == pytest.approx(37.4 / (1000 / 33.0) - 1, rel=1e-4) and shipped["extrapolated"] == [2, 3]
    f = tmp_path / "mine.json"
    f.write_text(json.dumps(good_table()))
    mine = speedup.resolve_costs(str(f), None, None, 2, [])
    assert mine["source"] == f"file:{f}" and mine["v"] == pytest.approx([0.2, 0.4])
    legacy = tmp_path / "costs.json"
    legacy.write_text(json.dumps({"c": 0.2, "v": [0.1, 0.2]}))
    assert speedup.resolve_costs(str(legacy), None, None, 2, [])["c"] == 0.2
    for bad in ("bytes:glm6", "nope", "", 3):
        with pytest.raises(ValueError, match="speedup.costs must be measured, bytes:glm5, bytes:glm5next"):
            speedup.check_costs_spec(bad, 3)
    broken = good_table()
    broken["batches"][0]["draft_step_ms"] = -1
    f.write_text(json.dumps(broken))
    with pytest.raises(ValueError, match=r"batches\[0\].draft_step_ms must be a finite number"):
        speedup.check_costs_spec(str(f), 3)


def test_per_batch_tables_give_the_best_k_per_batch(tmp_path):
    """A table per batch size: a cheap verify at batch 1 (best k large), a verify as dear as its
    tokens at batch 64 (best k = 1); summary.json's per_batch holds each batch's best k."""
    table = good_table([{"batch": 1, "forward_ms": [10.0, 10.5, 11.0, 11.5], "draft_step_ms": 0.2},
                        {"batch": 64, "forward_ms": [10.0, 20.0, 30.0, 40.0], "draft_step_ms": 0.2}])
    f = tmp_path / "per_batch.json"
    f.write_text(json.dumps(table))
    costs = speedup.resolve_costs(str(f), None, None, 3, [])
    assert [b["batch"] for b in costs["per_batch"]] == [1, 64] and costs["batch"] == 1
    # 8 prompts, every draft accepted with probability 0.8 at each position.
    reached = [[10, 8, 6] for _ in range(8)]
    accepted = [[8, 6, 5] for _ in range(8)]
    counts = {"reached": reached, "accepted": accepted, "steps": [10] * 8}
    per = speedup.per_batch_summary(counts, costs, seed=0)
    assert [p["batch"] for p in per] == [1, 64]
    assert per[0]["best_k"] == 3 and per[1]["best_k"] == 1
    assert speedup.per_batch_summary(counts, speedup.preset_costs("glm5", 3)) is None
