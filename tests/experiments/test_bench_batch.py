"""The batched-drafting bench (experiments/bench_batch.py): records, table and plot for each
batch size; counters from the interpreter; bad arguments exit 2 before any work."""

import json
import subprocess
import sys

import pytest
import torch

from glm_mtp.experiments import bench_batch


def test_bench_batch_writes_records_table_and_plot(tmp_path, monkeypatch):
    """The counters' subprocess is replaced by its function in this process (measured itself in
    tests/tools/test_counters.py): the interpreter's run is the slow part."""
    from glm_mtp.tools import counters
    from glm_mtp.reference import MtpConfig, MtpWeights

    def in_process(a, batches, progress=None):
        w = MtpWeights.random(MtpConfig.preset(a.preset), seed=a.seed, dtype=torch.bfloat16)
        out = {}
        for b in batches:
            r = counters.measure_batch_step(w, b, "torch", context=a.context, max_seq_len=a.max_seq_len, seed=a.seed)
            out[b] = {k: r[k] for k in bench_batch.COUNTER_KEYS}
        return out

    monkeypatch.setattr(bench_batch, "batch_counters", in_process)
    out = tmp_path / "bb"
    bench_batch.main(["--preset", "tiny", "--batch-sizes", "1", "3", "--drafts", "2", "--context", "4", "--max-seq-len",
                      "32",
                      "--repeats", "2", "--warmup", "1", "--out", str(out)])
    data = json.loads((out / "bench_batch.json").read_text())
    records = data["records"]
    assert [r["batch"] for r in records] == [1, 3]
    for r in records:
        assert len(r["batched_s"]) == len(r["sequential_s"]) == 2
        assert r["batched_tokens_per_s"] == pytest.approx(r["batch"] * 2 / r["batched_s_median"])
        assert r["launches_per_step"] > 0 and r["kernel_bytes_per_step"] > 0
    assert records[1]["context_rows"] == [4, 7, 10]  # state b holds context + 3 b rows
    assert records[1]["kernel_bytes_per_step"] < 3 * records[0]["kernel_bytes_per_step"]
    assert "| 3 |" in (out / "bench_batch.md").read_text()
    assert (out / "bench_batch.png").stat().st_size > 0


def test_a_bad_argument_exits_2_through_the_command(tmp_path):
    """One refusal through the real command line (a fresh process); the rules themselves below,
    in this process (a subprocess costs seconds of imports per case)."""
    done = subprocess.run([sys.executable, "-m", "glm_mtp.experiments.bench_batch", "--batch-sizes", "0", "--out",
                           str(tmp_path / "x")],
                          capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("argv", [["--batch-sizes", "0"], ["--drafts", "0"], ["--preset", "nope"],
                                  ["--batch-sizes", "16", "--max-seq-len", "40"], ["--repeats", "0"]])
def test_bad_arguments_exit_2(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_batch.main([*argv, "--out", str(tmp_path / "x")])
    assert e.value.code == 2, capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # the counters themselves run in the default run: tests/tools/test_counters.py
def test_counters_run_in_subprocesses_through_the_interpreter(tmp_path):
    """The real counters path at tiny, two batch sizes in parallel subprocesses."""
    a = bench_batch.parse_args(["--preset", "tiny", "--batch-sizes", "1", "2", "--context", "4", "--max-seq-len", "32",
                                "--out", str(tmp_path / "c")])
    got = bench_batch.batch_counters(a, [1, 2])
    assert set(got) == {1, 2} and got[1]["launches_per_step"] == got[2]["launches_per_step"] > 0
    assert got[1]["kernel_bytes_per_step"] < got[2]["kernel_bytes_per_step"] < 2 * got[1]["kernel_bytes_per_step"]
