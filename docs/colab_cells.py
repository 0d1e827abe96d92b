"""Give every chapter its Colab badge and its Colab install cell, derived from what the chapter imports.

    python docs/colab_cells.py           # rewrite the two cells where they differ
    python docs/colab_cells.py --check   # exit 1 if a notebook's cells are missing or out of date

Each notebook in nbs/ gets, right after its title cell:
1. a markdown cell with an "Open in Colab" badge for that notebook (from `git_url` and `branch` in settings.ini);
2. a hidden code cell that, in Colab only, pip-installs the package and the libraries the chapter's own cells
   import beyond the package's dependencies (transformers, peft, matplotlib, ...), so every check runs there.
"""
from __future__ import annotations

import ast
import json
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_site import CFG, COLAB, ROOT, _text  # noqa: E402

NBS = ROOT / "nbs"
# import name -> what pip installs in Colab: the versions this book's checks were last run with, pinned, so a chapter
# opened in Colab a year from now runs against the same APIs (transformers 5's rope_parameters, TRL's loss functions
# that chapter 64 reads, lm_eval's task registry). numpy and matplotlib come with Colab; pinning them would replace the
# builds Colab's own packages were compiled against, so they are left to Colab unless missing.
EXTRA_PACKAGES = {
    "transformers": "transformers==5.24.0",
    "peft": "peft==0.21.2",
    "matplotlib": "matplotlib",
    "lm_eval": "lm_eval==0.4.13",
    "trl": "trl==1.16.0",
    "sklearn": "scikit-learn==1.9.1",
    "tensorboard": "tensorboard==2.21.0",
    "mlflow": "mlflow-skinny==3.18.0",
    "gguf": "gguf==0.19.0",
    "numpy": "numpy",
}
# installed with the package (settings.ini `requirements`) or with Python: nothing to add
PROVIDED = {"torch", "torchao", "safetensors", "datasets", "sentencepiece", "tokenizers", "tiktoken",
            "huggingface_hub", "omegaconf", "yaml", "tqdm", CFG["lib_name"]}
BADGE_PREFIX = "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
INSTALL_MARKER = 'if "google.colab" in sys.modules:'


def imported_modules(notebook: dict) -> set[str]:
    "Top-level names of the modules a notebook's code cells import (shell and magic lines skipped)."
    found = set()
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = [l for l in _text(cell["source"]).splitlines() if not l.lstrip().startswith(("!", "%"))]
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def needed_packages(notebook: dict) -> list[str]:
    "The pip requirements (beyond the package) a chapter's cells need, sorted."
    extra = imported_modules(notebook) - PROVIDED - set(sys.stdlib_module_names)
    return sorted(EXTRA_PACKAGES[m] for m in extra if m in EXTRA_PACKAGES)


def badge_cell(name: str) -> dict:
    return {"cell_type": "markdown", "metadata": {},
            "source": f"{BADGE_PREFIX}({COLAB.format(name=name)})"}


def install_cell(packages: list[str]) -> dict:
    url = CFG["git_url"]
    specs = [f"{CFG['lib_name']} @ git+{url}"] + packages
    lines = ["#| hide",
             "# In Colab only: install the package and what this chapter's checks import.",
             "import subprocess",
             "import sys",
             "",
             INSTALL_MARKER,
             "    packages = ["]
    lines += [f'        "{spec}",' for spec in specs]
    lines += ["    ]",
              "    subprocess.run(",
              '        [sys.executable, "-m", "pip", "install", "-q", *packages], check=True',
              "    )"]
    return {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
            "source": "\n".join(lines)}


def updated(notebook: dict, name: str) -> dict:
    "The notebook with its badge as cell 1 and the install cell right after `#| default_exp` (or the badge)."
    cells = [c for c in notebook["cells"]
             if not (c["cell_type"] == "markdown" and _text(c["source"]).startswith(BADGE_PREFIX))
             and not (c["cell_type"] == "code" and INSTALL_MARKER in _text(c["source"]))]
    cells.insert(1, badge_cell(name))
    at = 2
    if len(cells) > 2 and cells[2]["cell_type"] == "code" and "#| default_exp" in _text(cells[2]["source"]):
        at = 3
    cells.insert(at, install_cell(needed_packages(notebook)))
    return {**notebook, "cells": cells}


def _same(a: dict, b: dict) -> bool:
    return a["cell_type"] == b["cell_type"] and _text(a["source"]) == _text(b["source"])


def main(check: bool) -> int:
    stale = []
    for path in sorted(NBS.glob("*.ipynb")):
        notebook = json.loads(path.read_text(encoding="utf-8"))
        new = updated(notebook, path.name)
        if len(new["cells"]) == len(notebook["cells"]) and all(
                _same(a, b) for a, b in zip(new["cells"], notebook["cells"])):
            continue
        stale.append(path.name)
        if not check:
            for cell in new["cells"]:
                if isinstance(cell["source"], str):
                    cell["source"] = cell["source"].splitlines(keepends=True)
                if notebook.get("nbformat_minor", 0) >= 5:  # nbformat 4.5 cells carry an id
                    cell.setdefault("id", uuid.uuid4().hex[:8])
            path.write_text(json.dumps(new, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if check and stale:
        print(f"Colab badge or install cell out of date in {stale}: run python docs/colab_cells.py")
        return 1
    print("Colab cells up to date" if check else f"updated {len(stale)} notebooks")
    return 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv[1:]))
