"""Write README.md from nbs/index.ipynb without quarto (nbdev_readme needs quarto; it still works where present).

    python docs/make_readme.py           # rewrite README.md
    python docs/make_readme.py --check   # exit 1 if README.md is not what index.ipynb gives

The notebook goes through the same adapter as the site (hidden cells dropped, quarto syntax removed), then
nbconvert's Markdown exporter. Outputs are kept, so the README shows what the home page computed.
"""
import json
import sys
import tempfile
import warnings
from pathlib import Path

import nbformat
from nbconvert import MarkdownExporter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_site import ROOT, adapt_notebook  # noqa: E402


def readme_text() -> str:
    from nbdev.serve import proc_nbs
    warnings.filterwarnings("ignore", message="Found cells containing imports and other code")
    proc = Path(proc_nbs(n_workers=0, file_glob="index.ipynb"))
    _, nb = adapt_notebook(proc / "index.ipynb")
    body, _ = MarkdownExporter().from_notebook_node(nbformat.reads(json.dumps(nb), as_version=4))
    return "<!-- Generated from nbs/index.ipynb by docs/make_readme.py: edit the notebook, not this file. -->\n\n" + body.strip() + "\n"


if __name__ == "__main__":
    text, readme = readme_text(), ROOT / "README.md"
    if "--check" in sys.argv[1:]:
        if not readme.exists() or readme.read_text(encoding="utf-8") != text:
            sys.exit("README.md is out of date with nbs/index.ipynb: run `make readme` (python docs/make_readme.py).")
        print("README.md matches nbs/index.ipynb")
    else:
        readme.write_text(text, encoding="utf-8")
        print(f"wrote {readme}")
