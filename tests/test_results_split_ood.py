"""results/finetune/domain/split_ood.py: the OOD source's files in two disjoint halves that
``source=text`` reads in ``source=ood``'s order (RESULTS.md's domain-adaptation measurement)."""

import importlib.util
import os

from glm_mtp.experiments.settings.prompts import read_text, text_files
from glm_mtp.experiments.training.corpus import ood_items, read_item

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script():
    spec = importlib.util.spec_from_file_location(
        "split_ood", os.path.join(REPO, "results", "finetune", "domain", "split_ood.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_halves_are_disjoint_cover_the_source_and_keep_its_order(tmp_path, capsys):
    out = tmp_path / "ood"
    assert load_script().main([str(out)]) == 0
    items = ood_items()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(items)
    for half, parity in (("tune", 0), ("judge", 1)):
        files = text_files(str(out / half))
        # the half's files, read as source=text reads them, are the source's files at alternate
        # indices, in the source's order, byte for byte
        assert [read_text(f) for f in files] == [read_item(n) for n in items[parity::2]]
        assert [line.split()[0] for line in lines[parity::2]] == [half] * len(files)


def test_a_non_empty_folder_is_refused_and_left_as_found(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    assert load_script().main([str(tmp_path)]) == 2
    assert "not an empty folder" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"]
