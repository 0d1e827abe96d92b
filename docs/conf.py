"""Sphinx configuration of the teaching site. Built by docs/build_site.py from nbdev's processed notebooks."""
import configparser
from pathlib import Path

_settings = configparser.ConfigParser(delimiters=["="])
_settings.read(Path(__file__).resolve().parent.parent / "settings.ini", encoding="utf-8")
_cfg = _settings["DEFAULT"]

project = _cfg["lib_name"]
author = _cfg["author"]
copyright = _cfg["copyright"]
release = _cfg["version"]

extensions = ["myst_nb", "sphinx_external_toc", "sphinx-mathjax-offline"]
external_toc_path = "_toc.yml"
external_toc_exclude_missing = False

nb_execution_mode = "off"  # outputs (plots included) come from the executed notebooks in nbs/
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
suppress_warnings = ["mystnb.unknown_mime_type"]

html_theme = "sphinx_book_theme"
html_title = "torchtune_lit"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
}
html_static_path = ["_static"]
html_css_files = ["code-width.css"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
