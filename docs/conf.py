"""Sphinx settings for tandem's documentation site: Markdown pages (MyST), the furo theme, the Python API from the
docstrings (autodoc). It builds offline: no inventories fetched, no math or fonts from a CDN.

    pip install -e '.[docs]' && sphinx-build -W -b html docs docs/_build/html
"""

import tandem

project = "tandem"
release = version = tandem.__version__
copyright = "the tandem authors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links reach headings
myst_enable_extensions = ["deflist"]
suppress_warnings = ["myst.header"]  # pages moved from the README keep their heading levels

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True}

html_theme = "furo"
html_title = f"tandem {version}"
html_static_path = []
