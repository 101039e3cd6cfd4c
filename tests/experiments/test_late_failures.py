"""Nothing measured is lost (issue 49 item 7): each command, failed late by an exception injected
into its last steps (a plot, a file, the logger, a later measurement), keeps what it measured
(a records file written as it went, or its results written before the failing step) and leaves
no half-written file that reads as complete (results are written under a temporary name and
renamed whole: no ``.partial-`` file is left, and the failing step's file is absent). The
failure is one ``LateFailure`` line naming the files kept. Tiny sizes, in process."""

import json
import os

import pytest

from glm_mtp.experiments import bench, bench_batch, grid, grid_report, record, stop_sweep
from glm_mtp.experiments.reporting import kept, wandb_log
from glm_mtp.experiments.reporting.measured import LateFailure
from glm_mtp.experiments.training import train_run
from glm_mtp.experiments.settings.explicit import compose_config
from glm_mtp.experiments.settings.validate import check_grid, check_train


class Injected(RuntimeError):
    """The failure a test injects."""


def fail(*args, **kwargs):
    raise Injected("injected late failure")


def fail_on_call(n, real):
    """``real``, except that its ``n``-th call (1-based) raises ``Injected``."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise Injected(f"injected failure at call {n}")
        return real(*args, **kwargs)

    return wrapped


def late(fn, *names):
    """Run ``fn``; it must raise one ``LateFailure`` line naming each of ``names``."""
    with pytest.raises(LateFailure) as e:
        fn()
    message = str(e.value)
    assert "\n" not in message and "injected" in message, message
    for name in names:
        assert str(name) in message, (name, message)
    return message


def no_partials(folder):
    left = [os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if ".partial-" in f]
    assert not left, left


def test_replaced_leaves_the_old_file_on_a_failing_write(tmp_path):
    path = tmp_path / "summary.json"
    kept.write_json(str(path), {"run": 1})
    with pytest.raises(TypeError):
        kept.write_json(str(path), {"run": {1, 2}})  # a set: JSON cannot hold it
    with pytest.raises(Injected), kept.replaced(str(path)) as tmp:
        with open(tmp, "w") as f:
            f.write('{"run": ')  # half a file
        fail()
    assert json.loads(path.read_text()) == {"run": 1}
    no_partials(tmp_path)


TINY = ["model=tiny_random", "run.num_prompts=2", "run.prompt_tokens=8", "run.max_new_tokens=4", "logger=none"]


def test_stop_sweep_keeps_its_rows(tmp_path, monkeypatch):
    cfg = compose_config("stop_sweep", [*TINY, "num_drafts=2", "sweep.thresholds.prob=[0.5]",
                                        "sweep.thresholds.cumprob=[0.5]", "sweep.thresholds.margin=[1.0]",
                                        "speedup.costs=glm5"])
    stop_sweep.check_sweep(cfg)
    # a plot fails after sweep.json: the record is whole, the plot absent
    monkeypatch.setattr(stop_sweep, "plot_sweep", fail)
    run_dir = tmp_path / "plot"
    late(lambda: stop_sweep.run(cfg, str(run_dir)), run_dir / "sweep.json", run_dir / "rows.jsonl")
    record_ = json.loads((run_dir / "sweep.json").read_text())
    rows = kept.read_records(str(run_dir / "rows.jsonl"))
    assert [r["name"] for r in rows] == [r["name"] for r in record_["rows"]] and len(rows) == 6
    assert (run_dir / "calibration.png").exists() and not (run_dir / "sweep.png").exists()
    no_partials(run_dir)
    # a later entry fails: the rows before it are kept, no sweep.json
    monkeypatch.setattr(stop_sweep.Runner, "run", fail_on_call(3, stop_sweep.Runner.run))
    run_dir = tmp_path / "entry"
    late(lambda: stop_sweep.run(cfg, str(run_dir)), "after 3 row(s)", run_dir / "rows.jsonl")
    assert [r["name"] for r in kept.read_records(str(run_dir / "rows.jsonl"))] == ["fixed k=1", "fixed k=2",
                                                                                   "oracle (K=2)"]
    assert not (run_dir / "sweep.json").exists()


def test_record_keeps_its_trace(tmp_path, monkeypatch):
    from glm_mtp.experiments.traces import recorder
    from glm_mtp.experiments.traces.validate import open_trace

    # the cost timing fails after the items: the trace is written without costs
    cfg = compose_config("config", [*TINY, "trace.max_drafts=2", "trace.cost_repeats=2",
                                    f"trace.out={tmp_path / 'costs'}"])
    record.check_record(cfg)
    monkeypatch.setattr(recorder, "measure_target_costs", fail)
    late(lambda: record.record(cfg), "timing the target's costs after 2 items", tmp_path / "costs" / "trace.json")
    trace = open_trace(str(tmp_path / "costs"))
    assert len(trace.items) == 2 and trace.meta["costs"] is None
    # the logger fails after the trace: the trace is whole
    cfg = compose_config("config", [*TINY, "trace.max_drafts=2", "trace.cost_repeats=0",
                                    f"trace.out={tmp_path / 'logger'}"])
    record.check_record(cfg)
    monkeypatch.setattr(wandb_log, "make_logger", fail)
    late(lambda: record.record(cfg), "logging the recording", tmp_path / "logger" / "trace.json")
    assert len(open_trace(str(tmp_path / "logger")).items) == 2


TRAIN = ["train.base=shipped", "tokenizer.limit_items=4", "train.steps=2", "train.batch_size=2", "train.seq_len=16",
         "train.eval_every=10", "train.eval_windows=1", "train.log_every=1", "train.warmup=1", "logger=none"]


def test_train_keeps_its_records_and_checkpoint(tmp_path, monkeypatch):
    cfg = compose_config("train", [*TRAIN, f"out={tmp_path / 'ck'}"])
    check_train(cfg)
    # the plot fails: final.json, every record and the checkpoint are kept
    monkeypatch.setattr(train_run, "plot_curves", fail)
    run_dir = tmp_path / "plot"
    late(lambda: train_run.run(cfg, str(run_dir)), run_dir / "final.json", run_dir / "training_log.jsonl",
         tmp_path / "ck")
    final = json.loads((run_dir / "final.json").read_text())
    assert final["steps"] == 2
    records = kept.read_records(str(run_dir / "training_log.jsonl"))
    assert [(r["kind"], r["step"]) for r in records] == [("train", 0), ("heldout", 0), ("train", 1),
                                                         ("heldout", 1)]
    assert (tmp_path / "ck" / "model.safetensors").exists() and not (run_dir / "loss_curve.png").exists()
    no_partials(run_dir)
    # the last evaluation fails: the steps before it are kept, nothing looks finished
    monkeypatch.setattr(train_run, "evaluate", fail_on_call(2, train_run.evaluate))
    cfg = compose_config("train", TRAIN)
    run_dir = tmp_path / "eval"
    late(lambda: train_run.run(cfg, str(run_dir)), "after 3 record(s)", run_dir / "training_log.jsonl")
    assert len(kept.read_records(str(run_dir / "training_log.jsonl"))) == 3 and not (run_dir / "final.json").exists()


def fake_train_run(cfg, run_dir, command=""):
    """A grid job's training in seconds: the shipped checkpoint as the trained head, and the
    final.json a training writes."""
    import shutil

    from glm_mtp.experiments.targets.checkpoint import shipped_checkpoint

    shutil.copytree(shipped_checkpoint(), cfg.out)
    final = {"steps": 0, "mtp1_loss": 1.0}
    os.makedirs(run_dir)
    kept.write_json(os.path.join(run_dir, "final.json"), final)
    return final


def test_grid_keeps_its_head_and_evaluations(tmp_path, monkeypatch):
    common = ",".join(f"'{o}'" for o in ("model=shipped", "logger=none", "num_drafts=2", "run.num_prompts=1",
                                         "run.prompt_tokens=8", "run.max_new_tokens=3", "speedup.costs=glm5"))
    cfg = compose_config("grid", [*TRAIN, f"eval.common=[{common}]", "eval.feed_prompts=1"])
    check_grid(cfg)
    monkeypatch.setattr(grid, "run_training", fake_train_run)
    monkeypatch.setattr(grid, "feed_agreement", fail)  # after both evaluations
    job = tmp_path / "job"
    late(lambda: grid.run(cfg, str(job)), job / "checkpoint", job / "train" / "final.json",
         job / "acceptance-speculative" / "summary.json", job / "acceptance-teacher_forced" / "summary.json")
    assert json.loads((job / "acceptance-speculative" / "summary.json").read_text())["prompts"] == 1
    assert not (job / "grid.json").exists()  # grid_report takes the job for a failed one
    no_partials(job)


def grid_job():
    """A grid.json as a job writes it, with the fields the report reads."""
    ev = {"mode": "teacher_forced", "num_drafts": 2, "acceptance_per_position": [0.5, 0.25],
          "alpha_ci": [[0.4, 0.6], [0.2, 0.3]], "mean_accepted_length": 1.6, "tau_ci": [1.5, 1.7], "prompts": 2,
          "prompts_sha256": "x", "counts_per_prompt": {"reached": [[2, 1], [2, 1]], "accepted": [[1, 0], [1, 0]],
                                                       "steps": [2, 2]}}
    return {"mtp_depth": 1, "mtp_distill": 0.0, "base": "shipped", "steps": 2, "batch_size": 2, "seq_len": 16,
            "final": {"mtp1_loss": 3.0}, "evals": {"teacher_forced": ev}, "train_minutes": 0.1, "eval_minutes": 0.1,
            "feed_agreement": {"num_drafts": 2, "same_per_position": [1.0, 0.5], "all_same": 0.5, "positions": 4}}


def test_grid_report_keeps_its_table(tmp_path, monkeypatch, capsys):
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "grid.json").write_text(json.dumps(grid_job()))
    monkeypatch.setattr(grid_report, "plot", fail)
    with pytest.raises(SystemExit) as e:
        grid_report.main([str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and "injected" in err[0] and "grid_report.md" in err[0], err
    assert (tmp_path / "grid_report.md").read_text().startswith("# MTP training grid")
    assert not (tmp_path / "grid_report.png").exists()
    no_partials(tmp_path)


def test_finetune_keeps_its_losses_and_head(tmp_path, monkeypatch):
    from glm_mtp.experiments.training.finetune_run import run_keeping
    from glm_mtp.experiments.training import finetune_judge
    from glm_mtp.experiments.training.finetune_checks import check_finetune

    import importlib.util

    spec = importlib.util.spec_from_file_location("walk", os.path.join(os.path.dirname(__file__), "test_every_key.py"))
    walk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(walk)
    cfg = compose_config("finetune", [*walk.finetune_inputs(tmp_path, "none"), f"finetune.out={tmp_path / 'out'}"])
    checked = check_finetune(cfg)
    monkeypatch.setattr(finetune_judge, "judge_counts", fail)  # the final judging, after the training
    run_dir = tmp_path / "run"
    late(lambda: run_keeping(cfg, str(run_dir), checked, "test"), run_dir / "finetune_loss.json", tmp_path / "out")
    losses = json.loads((run_dir / "finetune_loss.json").read_text())
    assert losses["steps"] == 2 and [r["step"] for r in losses["loss"]] == [0, 1]
    assert (tmp_path / "out" / "config.json").exists() and not (tmp_path / "out" / "summary.json").exists()


BENCH = ["--backends", "reference", "--drafts", "1", "--repeats", "1", "--warmup", "0", "--copy-mib", "1",
         "--counters", "--context", "8", "--max-seq-len", "32"]


def test_bench_keeps_its_records(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device, nbytes: 1e9)
    # the second preset fails: the first one's records are kept
    monkeypatch.setattr(bench, "bench_preset", fail_on_call(2, bench.bench_preset))
    out = tmp_path / "preset"
    bc = bench.parse_args(["--presets", "tiny", "glm5next_tiny", *BENCH, "--out", str(out)])
    late(lambda: bench.run(bc), "after 1 record(s)", out / "records.jsonl")
    assert [r["preset"] for r in kept.read_records(str(out / "records.jsonl"))] == ["tiny"]
    assert not (out / "bench.json").exists()
    # the plot fails, through the command: one line, exit 1, bench.json whole
    monkeypatch.setattr(bench, "plot", fail)
    out = tmp_path / "plot"
    with pytest.raises(SystemExit) as e:
        bench.main(["--presets", "tiny", *BENCH, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and err[-1].startswith("python -m glm_mtp.experiments.bench: error: ") \
        and "injected" in err[-1] and "bench.json" in err[-1], err
    assert len(json.loads((out / "bench.json").read_text())["records"]) == 1 and not (out / "bench.png").exists()
    no_partials(out)


def test_bench_batch_keeps_its_timings(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_batch, "batch_counters", fail)  # after every batch size was timed
    out = tmp_path / "bb"
    with pytest.raises(SystemExit) as e:
        bench_batch.main(["--preset", "tiny", "--batch-sizes", "1", "2", "--repeats", "1", "--warmup", "0",
                          "--context", "8", "--max-seq-len", "32", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and "after 2 batch size(s)" in err[-1] and "records.jsonl" in err[-1], err
    assert [r["batch"] for r in kept.read_records(str(out / "records.jsonl"))] == [1, 2]
    assert not (out / "bench_batch.json").exists()
