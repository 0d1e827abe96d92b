"""Run notebooks in place and save their outputs (plots included), as the site shows them.

    python docs/execute_notebooks.py [nbs/NAME.ipynb ...]      (default: every notebook in nbs/)

Uses the same executor as `nbdev_test` (execnb), so cells marked `#| eval: false` are skipped here too. Run it after
editing a chapter, then `nbdev_clean`, so the committed notebook shows what its code computes.
"""
import os
import sys
import time
from pathlib import Path

from execnb.nbio import read_nb, write_nb
from execnb.shell import CaptureShell

ROOT = Path(__file__).resolve().parent.parent
# Saved outputs are what a reader sees on the site: no progress bars (tqdm, and the Hugging Face libraries built on
# it, read these switches). A reader who runs a chapter sees the bars as usual.
os.environ.update(TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
# The saved outputs are the full runs: `make test-nbs` sets TUNELIT_BOOK_QUICK=1 to cut the long training runs of a few
# chapters to a few steps; it must never leak into what the site shows.
os.environ.pop("TUNELIT_BOOK_QUICK", None)


def _import_torchao_quietly() -> None:
    """torchao logs two harmless messages when first imported (optional compiled kernels of other formats, a pytree
    deprecation). torchtune_lit imports it quietly on first NF4 use, but `import transformers` in a chapter's checks
    imports it loudly; importing it quietly first keeps that noise out of the saved outputs."""
    from torchtune_lit.modules.low_precision.nf4 import _torchao_nf4

    _torchao_nf4()


def _skip(cell) -> bool:
    "execnb preprocessor: True for cells not to run (markdown, and code marked `#| eval: false`), as nbdev_test."
    if cell.cell_type != "code":
        return True
    directives = [line.replace(" ", "") for line in cell.source.splitlines() if line.startswith("#|")]
    return "#|eval:false" in directives


def execute(path: Path) -> float:
    "Execute the notebook at `path` in its own folder, write the outputs back; return the seconds it took."
    nb = read_nb(path)
    for cell in nb.cells:  # a cell that no longer prints must not keep what it printed before
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    start = time.perf_counter()
    shell = CaptureShell(path.parent)
    shell.run_all(nb, exc_stop=True, preproc=_skip)
    write_nb(nb, path)
    return time.perf_counter() - start


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted((ROOT / "nbs").glob("*.ipynb"))
    _import_torchao_quietly()
    for path in paths:
        print(f"{path.name:<45}{execute(path.resolve()):6.1f} s", flush=True)
