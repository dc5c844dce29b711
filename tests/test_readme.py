"""The README's Python snippets run as pasted.

Every ```` ```python ```` block of README.md is a complete program and is run here, each in a
fresh namespace; a block fenced ```` ```python fragment ```` (still highlighted as Python) is
an excerpt that needs context (a GPU, a module of your own) and is skipped.
"""

import re
import runpy
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python( fragment)?\n(.*?)^```$", re.S | re.M)


def _blocks():
    blocks = BLOCK.findall(README.read_text())
    return [(i, code) for i, (fragment, code) in enumerate(blocks) if not fragment]


def test_first_snippet_is_a_complete_program():
    first = BLOCK.search(README.read_text())
    assert first and not first.group(1), "the README's first Python snippet must run as pasted"


@pytest.mark.parametrize("index,code", _blocks(), ids=[f"block{i}" for i, _ in _blocks()])
def test_snippet_runs(index, code, monkeypatch, tmp_path):
    """Run as a file (TVMScript reads the source of ``@I.ir_module`` classes)."""
    if "import torch" in code:
        pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    path = tmp_path / f"readme_block{index}.py"
    path.write_text(code)
    runpy.run_path(str(path), run_name="__readme__")
