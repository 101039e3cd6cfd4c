"""The benchmark's bookkeeping (not its timings): records, files, the byte count, the counters."""

import json

import pytest
import torch

from glm_mtp.experiments import bench
from glm_mtp.reference import MtpConfig


def test_bench_writes_records_table_and_plot(tmp_path):
    backends = ["reference"]
    try:
        import glm_mtp.optimized  # noqa: F401

        backends.append("optimized")
    except ImportError:
        pass
    bench.main(["--presets", "tiny", "--backends", *backends, "--drafts", "1", "2", "--repeats", "2", "--warmup", "1",
                "--context", "16", "--max-seq-len", "64", "--copy-mib", "8", "--counters", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench.json").read_text())
    recs = data["records"]
    assert len(recs) == 2 * len(backends) and data["meta"]["copy_bandwidth_gb_s"] > 0
    for r in recs:
        for key in ("backend", "preset", "device", "dtype", "num_drafts", "latency_per_draft_ms_median",
                    "host_syncs_per_propose", "bytes_per_draft_step", "floor_ratio", "speedup_vs_reference"):
            assert key in r, key
        assert r["latency_per_draft_ms_median"] > 0 and r["floor_ratio"] > 0
    assert (tmp_path / "bench.md").read_text().count("| tiny |") == len(recs)
    assert (tmp_path / "bench.png").stat().st_size > 1000
    for r in recs:  # --counters with no preset: the fields are there, empty
        assert all(r[key] is None for key in bench.COUNTER_FIELDS)


@pytest.mark.slow
def test_bench_records_the_draft_step_counters(tmp_path):
    """Each record carries its backend's launches and bytes per draft step (a CPU subprocess in
    Triton's interpreter), the same for every k, and the table shows them."""
    from glm_mtp.tools.floor import floor_bytes_per_draft

    bench.main(["--presets", "tiny", "--backends", "reference", "optimized", "--drafts", "1", "2", "--repeats", "1",
                "--warmup", "0", "--context", "8", "--max-seq-len", "32", "--copy-mib", "8", "--dtype", "float32",
                "--out", str(tmp_path)])
    recs = json.loads((tmp_path / "bench.json").read_text())["records"]
    floor = floor_bytes_per_draft(MtpConfig.preset("tiny"), torch.float32, 8 + 2)
    for backend in ("reference", "optimized"):
        rs = [r for r in recs if r["backend"] == backend]
        assert len(rs) == 2 and all(
            {k: r[k] for k in bench.COUNTER_FIELDS} == {k: rs[0][k] for k in bench.COUNTER_FIELDS} for r in rs
        )
        r = rs[0]
        assert r["launches_per_draft"] > 0 and r["kernel_bytes_per_draft"] > 0 and r["floor_bytes_per_draft"] == floor
        assert r["kernel_floor_ratio"] == pytest.approx(r["kernel_bytes_per_draft"] / floor)
        assert (r["triton_launches_per_draft"] > 0) == (backend == "optimized")
        assert r["latency_per_draft_ms_median"] > 0  # the CPU step time stays
    table = (tmp_path / "bench.md").read_text()
    assert "launches/draft" in table and "kernel/floor bytes" in table
    assert f"| {recs[0]['launches_per_draft']} | " in table


def test_glm5_next_is_benched_with_its_counters_and_its_h200_projection(tmp_path):
    """``--presets glm5next_tiny`` counts the family's fused step (a CPU subprocess in the
    interpreter) and projects glm5next's full-width draft step 1 and shared step (it shares like the
    release) from it: each floor at 4,096 rows times its counted ratio at the H200's bandwidth, plus
    the counted launches."""
    from glm_mtp.tools.floor import GRAPH_LAUNCH_S, H200_BYTES_PER_S, floor_bytes_per_draft

    bench.main(["--presets", "glm5next_tiny", "--backends", "optimized", "--drafts", "1", "--repeats", "1", "--warmup",
                "0",
                "--context", "8", "--max-seq-len", "32", "--copy-mib", "8", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench.json").read_text())
    (r,) = data["records"]
    assert r["preset"] == "glm5next_tiny" and r["launches_per_draft"] <= 24 and r["kernel_floor_ratio"] <= 1.15
    # glm5next shares the indexer's selection (DESIGN.md §9): draft step 1, then a shared step
    assert r["shared_step"] and r["launches_step_1"] <= 24 and r["kernel_floor_ratio_step_1"] <= 1.15
    first, shared = data["projection"]
    big = MtpConfig.preset("glm5next")
    for p, step, floor, ratio, launches in (
            (first, "1", floor_bytes_per_draft(big, torch.bfloat16, 4096), r["kernel_floor_ratio_step_1"],
             r["launches_step_1"]),
            (shared, "shared", floor_bytes_per_draft(big, torch.bfloat16, 4096, selected_at=4095),
             r["kernel_floor_ratio"],
             r["launches_per_draft"])):
        got = (p["preset"], p["counted_at"], p["step"], p["floor_bytes"], p["launches"])
        assert got == ("glm5next", "glm5next_tiny", step, floor, launches)
        want_ms = (floor * ratio / H200_BYTES_PER_S + launches * GRAPH_LAUNCH_S) * 1e3
        assert p["step_ms"] == pytest.approx(want_ms, rel=1e-12) and 0.3 < p["step_ms"] < 1.0
    assert shared["floor_bytes"] < first["floor_bytes"] and shared["launches"] < first["launches"]
    assert "H200 projection (a model, not a measurement" in (tmp_path / "bench.md").read_text()


def test_the_projection_takes_each_familys_widest_counted_preset():
    def rec(preset, floor, ratio, launches, backend="optimized"):
        return dict(preset=preset, backend=backend, floor_bytes_per_draft=floor, kernel_floor_ratio=ratio,
                    launches_per_draft=launches)

    records = [rec("tiny", 1e5, 1.07, 22), rec("small", 3e6, 1.01, 22), rec("small", 3e6, 9.0, 800, "reference"),
               rec("glm5next_tiny", 1e5, 1.06, 21), rec("glm5_shape", 1e8, None, None)]
    got = {
        p["preset"]: (p["counted_at"], p["kernel_floor_ratio"], p["launches"])
        for p in bench.projections(records, torch.bfloat16)
    }
    assert got == {"glm5": ("small", 1.01, 22), "glm5next": ("glm5next_tiny", 1.06, 21)}


def test_counters_default_to_tiny_and_small_among_the_presets_run(tmp_path):
    assert bench.parse_args(["--out", str(tmp_path)]).counters == ["tiny", "small"]
    assert bench.parse_args(["--presets", "small", "glm5_shape", "--out", str(tmp_path)]).counters == ["small"]
    assert bench.parse_args(["--presets", "glm5next_small", "glm5_shape", "--out", str(tmp_path)]).counters == [
        "glm5next_small"
    ]
    assert bench.parse_args(["--counters", "--out", str(tmp_path)]).counters == []
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--presets", "tiny", "--counters", "small", "--out", str(tmp_path)])
    assert e.value.code == 2


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--presets", "huge"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv", [
    ["--repeats", "0"],  # refused, not replaced by the default
    ["--repeats", "-2"],
    ["--copy-mib", "-1"],
    ["--context", "-4"],
    ["--warmup", "-1"],
    ["--device", "bogus"],
    ["--device", "cuda:x"],
])
def test_bad_counts_and_devices_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m glm_mtp.experiments.bench: error: --") and "Traceback" not in "".join(err)


def test_an_unwritable_out_is_refused_before_measuring(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for out in (blocker, blocker / "bench"):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--out", str(out)])
        assert e.value.code == 2
        assert "--out" in capsys.readouterr().err


def test_defaults_still_apply_when_a_count_is_not_given(tmp_path):
    bc = bench.parse_args(["--out", str(tmp_path / "new" / "dir")])
    assert bc.repeats == 7 and bc.copy_mib == 256 and bc.context == 64
    assert not (tmp_path / "new").exists()  # checked, not made, before the run


class NoProgress:
    def update(self, n: int) -> None:
        pass


def test_max_position_embeddings_lifts_the_capacity_cap():
    # tiny caps max_seq_len at its max_position_embeddings (512): without the override a capacity
    # of 1024 silently becomes 512, and the record says so.
    base = dict(presets=["tiny"], backends=["reference"], drafts=[1], context=8, max_seq_len=1024, repeats=1, warmup=0)
    capped = bench.bench_preset(bench.BenchConfig(**base), "tiny", 1e9, NoProgress())
    lifted = bench.bench_preset(bench.BenchConfig(**base, max_position_embeddings=2048), "tiny", 1e9, NoProgress())
    assert capped[0]["max_seq_len"] == 512 and lifted[0]["max_seq_len"] == 1024
    assert lifted[0]["state_bytes"] > capped[0]["state_bytes"]  # the state really holds the larger capacity
    assert (
        bench.parse_args(["--max-position-embeddings", "131072", "--max-seq-len", "131072"]).max_position_embeddings
        == 131072
    )
    assert bench.parse_args([]).max_position_embeddings is None


def test_bad_max_position_embeddings_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--max-position-embeddings", "0"])
    assert e.value.code == 2 and "--max-position-embeddings must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--checkpoint", "/nonexistent/ckpt", "--target-costs"],
     "--checkpoint: directory '/nonexistent/ckpt' does not exist"),
    (["--checkpoint", "."], "--checkpoint is the toy target of --target-costs"),
    (["--max-position-embeddings", "8"], "--max-position-embeddings must exceed"),
])
def test_bench_checks_every_setting_before_measuring(argv, match, capsys):
    from glm_mtp.experiments.bench import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err
