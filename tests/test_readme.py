"""The Python snippets of the README and of the documentation pages run as pasted.

Every ```` ```python ```` block of README.md and of the Markdown pages under docs/ is a complete
program and is run here, each in a fresh namespace; a block fenced ```` ```python fragment ````
(still highlighted as Python) is an excerpt that needs context (a GPU, a module of your own) and
is skipped. A block that appears verbatim on several pages runs once.
"""

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]
BLOCK = re.compile(r"^```python( fragment)?\n(.*?)^```$", re.S | re.M)


def _page_id(page: Path) -> str:
    if page == README:
        return "README"
    return page.relative_to(ROOT / "docs").with_suffix("").as_posix()


def _blocks():
    seen, blocks = set(), []
    for page in PAGES:
        for i, (fragment, code) in enumerate(BLOCK.findall(page.read_text())):
            if not fragment and code not in seen:
                seen.add(code)
                blocks.append((f"{_page_id(page)}-block{i}", code))
    return blocks


def test_first_snippet_is_a_complete_program():
    first = BLOCK.search(README.read_text())
    assert first and not first.group(1), "the README's first Python snippet must run as pasted"


def test_docs_pages_have_snippets():
    """The page list is not empty (a moved docs folder would silently test nothing)."""
    ids = [name for name, _ in _blocks()]
    assert any(n.startswith("README-") for n in ids)
    assert any(n.startswith("guide/") for n in ids)


@pytest.mark.parametrize("name,code", _blocks(), ids=[name for name, _ in _blocks()])
def test_snippet_runs(name, code, monkeypatch, tmp_path):
    """Run as a file (TVMScript reads the source of ``@I.ir_module`` classes)."""
    if "import torch" in code:
        pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    path = tmp_path / f"{name.replace('/', '_').replace('-', '_')}.py"
    path.write_text(code)
    runpy.run_path(str(path), run_name="__readme__")
