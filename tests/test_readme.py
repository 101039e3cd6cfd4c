"""README.md's Python blocks run as written: each ```python block is executed on its own, in a
fresh namespace (so a block may not lean on names an earlier one defined), on the CPU."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python blocks of a Markdown text, in order."""
    return FENCE.findall(text)


def readme_blocks() -> list[str]:
    with open(os.path.join(REPO, "README.md")) as f:
        return python_blocks(f.read())


def test_the_readme_has_its_python_blocks():
    # the reference drafter, either family, fp8, the engine loop, many sequences
    assert len(readme_blocks()) >= 5


def test_the_extractor_sees_every_block_and_nothing_else():
    text = "prose\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = 2\nz = 3\n"]


@pytest.mark.parametrize("index", range(len(readme_blocks())))
def test_a_readme_python_block_runs_as_written(index, monkeypatch):
    # on a CPU-only machine, even where CUDA exists: the blocks choose their device from this
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    block = readme_blocks()[index]
    assert '"cuda"' not in block.replace('"cuda" if torch.cuda.is_available() else', ""), \
        "a README block hard-codes CUDA: choose the device from torch.cuda.is_available()"
    exec(compile(block, f"README.md python block {index + 1}", "exec"), {"__name__": f"readme_block_{index + 1}"})
