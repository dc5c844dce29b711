"""Sphinx configuration of relaxgrad's documentation.

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (warnings are errors;
``tests/test_docs.py`` runs exactly that).
"""

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # document this checkout, not another installed copy

import relaxgrad  # noqa: E402

project = "relaxgrad"
author = "relaxgrad authors"
copyright = "relaxgrad authors"  # noqa: A001 (Sphinx's name)
release = version = relaxgrad.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_nb",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
templates_path = ["_templates"]
exclude_patterns = ["_build", "_templates", "**.ipynb_checkpoints"]

# API reference: autosummary writes one page per public name into api/generated (not committed).
autosummary_generate = True
autodoc_default_options = {"members": False}
autodoc_typehints = "none"  # numpydoc's Parameters sections give the types
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False

# Markdown pages (MyST): anchors for headings, so [text](page.md#a-heading) links resolve.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# Notebooks: rendered with the outputs they are committed with. tests/test_notebooks.py
# executes them (and checks the committed outputs); executing them again here would take minutes.
nb_execution_mode = "off"

html_theme = "furo"
html_title = f"relaxgrad {release}"


def _copy_notebooks(app):
    """The notebooks live in notebooks/ at the repository root; Sphinx reads sources below
    docs/ only, so the build copies them to docs/notebooks (ignored by git)."""
    target = Path(app.srcdir) / "notebooks"
    target.mkdir(exist_ok=True)
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        dest = target / notebook.name
        if not dest.exists() or dest.read_bytes() != notebook.read_bytes():
            shutil.copyfile(notebook, dest)


def _clear_generated(app):
    """autosummary writes a page per documented name and never deletes one: a page left from
    a name since removed would fail the strict build (in no toctree), so start afresh."""
    shutil.rmtree(Path(app.srcdir) / "api" / "generated", ignore_errors=True)


def setup(app):
    # before autosummary's own builder-inited handler (priority 500) generates the pages
    app.connect("builder-inited", _clear_generated, priority=100)
    app.connect("builder-inited", _copy_notebooks, priority=100)
