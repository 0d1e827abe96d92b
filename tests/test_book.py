"""The book's conventions that every chapter must keep (NOTEBOOKS.md)."""
import json
from pathlib import Path

import pytest

NBS = sorted((Path(__file__).resolve().parent.parent / "nbs").glob("*.ipynb"))


@pytest.mark.parametrize("path", NBS, ids=[p.name for p in NBS])
def test_chapter_opens_with_title_description_and_colab_cell(path):
    cells = json.loads(path.read_text())["cells"]
    first = "".join(cells[0]["source"])
    assert first.startswith("# ") and "\n> " in first, "first cell: '# Title' then '> description'"
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    colab = [c for c in code if 'if "google.colab" in sys.modules:' in c]
    assert colab and colab[0].startswith("#| hide"), "a hidden cell that installs the package in Colab only"
    badge = "".join(cells[1]["source"])
    assert badge.startswith("[![Open In Colab]") and badge.endswith(f"/nbs/{path.name})"), \
        "the second cell is the chapter's own Colab badge"


def test_recipes_use_absolute_imports():
    "A recipe copied out with `tunelit cp` must run on its own, so it may not use relative imports."
    recipes = sorted((Path(__file__).resolve().parent.parent / "torchtune_lit" / "recipes").glob("[!_]*.py"))
    assert recipes
    for file in recipes:
        assert "from ." not in file.read_text(), f"{file.name} has a relative import"
