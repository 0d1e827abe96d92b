"""Run notebooks in place and save their outputs (plots included), as the site shows them.

    python docs/execute_notebooks.py [nbs/NAME.ipynb ...]      (default: every notebook in nbs/)

Uses the same executor as `nbdev_test` (execnb), so cells marked `#| eval: false` are skipped here too. Run it after
editing a chapter, then `nbdev_clean`, so the committed notebook shows what its code computes.
"""
import sys
import time
from pathlib import Path

from execnb.nbio import read_nb, write_nb
from execnb.shell import CaptureShell

ROOT = Path(__file__).resolve().parent.parent


def _skip(cell) -> bool:
    "execnb preprocessor: True for cells not to run (markdown, and code marked `#| eval: false`), as nbdev_test."
    if cell.cell_type != "code":
        return True
    directives = [line.replace(" ", "") for line in cell.source.splitlines() if line.startswith("#|")]
    return "#|eval:false" in directives


def execute(path: Path) -> float:
    "Execute the notebook at `path` in its own folder, write the outputs back; return the seconds it took."
    nb = read_nb(path)
    start = time.perf_counter()
    shell = CaptureShell(path.parent)
    shell.run_all(nb, exc_stop=True, preproc=_skip)
    write_nb(nb, path)
    return time.perf_counter() - start


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted((ROOT / "nbs").glob("*.ipynb"))
    for path in paths:
        print(f"{path.name:<45}{execute(path.resolve()):6.1f} s", flush=True)
