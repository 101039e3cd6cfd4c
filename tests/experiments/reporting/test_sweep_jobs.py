"""A report over a sweep says which jobs failed or never ran instead of printing a table of the
survivors (experiments/reporting/sweep_jobs.py, used by report and grid_report)."""


import pytest

from glm_mtp.experiments import grid_report, report
from glm_mtp.experiments.reporting.sweep_jobs import sweep_jobs


def make_sweep(root, task, params=None, jobs=()):
    """A sweep folder: ``multirun.yaml`` with the command line's ``task`` overrides (and
    ``hydra.sweeper.params``), and job folders ``(name, has_result)``."""
    root.mkdir(parents=True, exist_ok=True)
    lines = ["hydra:", "  overrides:", "    task:"] + [f"    - {t}" for t in task]
    if params:
        lines += ["  sweeper:", "    params:"] + [f"      {k}: {v}" for k, v in params.items()]
    (root / "multirun.yaml").write_text("\n".join(lines) + "\n")
    for name, done in jobs:
        (root / name / ".hydra").mkdir(parents=True)
        if done:
            (root / name / "summary.json").write_text("{}")
    return root


def test_a_sweep_with_a_failed_and_a_missing_job(tmp_path):
    root = make_sweep(tmp_path / "s", ["num_drafts=1,2,3", "policy=refeed,trim_all", "logger=none"],
                      jobs=[("0_num_drafts=1,policy=refeed", True), ("1_num_drafts=1,policy=trim_all", False),
                            ("2_num_drafts=2,policy=refeed", True), ("4_x", True), ("5_y", True)])
    jobs = sweep_jobs(str(root), "summary.json")
    assert jobs.expected == 6 and jobs.failed == ["1_num_drafts=1,policy=trim_all"] and jobs.missing == [3]
    assert jobs.problem() == ("4 of 6 jobs finished; 1 job(s) without a result (failed or unfinished): "
                              "1_num_drafts=1,policy=trim_all; 1 job(s) never ran: number(s) 3")


def test_sweeper_params_count_and_the_command_line_wins(tmp_path):
    root = make_sweep(tmp_path / "s", ["num_drafts=1,2"], params={"num_drafts": "1,2,3,4", "policy": "refeed,trim_all"})
    assert sweep_jobs(str(root), "summary.json").expected == 4  # 2 (command line) x 2 (params)


def test_a_complete_sweep_and_a_plain_folder_have_no_problem(tmp_path):
    root = make_sweep(tmp_path / "s", ["num_drafts=1,2"], jobs=[("0_a", True), ("1_b", True)])
    assert sweep_jobs(str(root), "summary.json").complete
    plain = tmp_path / "plain"
    (plain / "run").mkdir(parents=True)
    assert sweep_jobs(str(plain), "summary.json").problem() == ""


@pytest.mark.parametrize("module, result", [(report, "summary.json"), (grid_report, "grid.json")])
def test_reports_refuse_an_incomplete_sweep_with_one_line_and_exit_2(tmp_path, capsys, module, result):
    root = make_sweep(tmp_path / "s", ["num_drafts=1,2,3"], jobs=[("0_a", True), ("2_c", False)])
    if result != "summary.json":
        (root / "0_a" / "summary.json").rename(root / "0_a" / result)
    with pytest.raises(SystemExit) as e:
        module.main([str(root)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "1 of 3 jobs finished" in err and "2_c" in err and "number(s) 1" in err and "--partial" in err
    assert not (root / "report.md").exists() and not (root / "grid_report.md").exists()


def test_report_checks_its_arguments_before_reading(tmp_path, capsys):
    for argv, match in (([str(tmp_path / "none")], "is not a directory"),
                        ([str(tmp_path), "--pair", "colour"], "--pair: 'colour' is not a setting"),
                        ([str(tmp_path)], "no summary.json under")):
        with pytest.raises(SystemExit) as e:
            report.main(argv)
        assert e.value.code == 2 and match in capsys.readouterr().err
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SystemExit):
        report.main([str(tmp_path), "--out", str(f / "sub")])
    assert "--out:" in capsys.readouterr().err
