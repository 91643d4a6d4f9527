"""Sphinx configuration of stabljax's documentation (``sphinx-build -W docs docs/_build``).

Markdown pages through myst-parser, the API reference from the docstrings through autodoc and
napoleon (Google style). No extension fetches anything: the build runs offline, as CI does.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's stabljax, installed or not

project = "stabljax"
author = "stabljax authors"
copyright = "2026, stabljax authors"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_autodoc_typehints",
    "sphinx.ext.mathjax",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_default_options = {"members": False}
autodoc_typehints = "description"
typehints_fully_qualified = False
always_document_param_types = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "stabljax"

# optax's type aliases (``optax.OptState``, ``optax.Params``) are chex's ``ArrayTree``, a
# forward reference sphinx-autodoc-typehints cannot evaluate; the signatures still show them.
suppress_warnings = ["sphinx_autodoc_typehints.forward_reference"]
