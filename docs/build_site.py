"""Build the teaching site offline: nbdev's processed notebooks -> plain notebooks -> Sphinx + myst-nb HTML.

    python docs/build_site.py            # writes docs/_build/html (warnings are errors)

1. `nbdev.serve.proc_nbs` processes nbs/ into _proc/ exactly as for quarto (hidden cells dropped, `show_doc`
   rendered, doc links added).
2. `adapt_notebook` removes what only quarto understands: the raw YAML front-matter cell becomes a title, a
   description and an "Open in Colab" link; `#| echo: false` becomes Sphinx's `remove-input` tag and other `#|`
   lines are dropped; pandoc link attributes (`{target="_blank" ...}`) are removed; links to the quarto site
   become relative links; cell metadata that is not plain JSON text is dropped.
3. The table of contents follows nbs/sidebar.yml, the one list of the book's parts (quarto reads it too); a
   notebook missing from it is an error.
4. `sphinx-build -W` renders the site with execution off, so plots come from the saved outputs.
"""
from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SRC = DOCS / "_build" / "src"
OUT = DOCS / "_build" / "html"

_settings = configparser.ConfigParser(delimiters=["="])
_settings.read(ROOT / "settings.ini", encoding="utf-8")
CFG = _settings["DEFAULT"]
SITE_URL = f"{CFG['doc_host']}{CFG['doc_baseurl']}/"
REPO_PATH = CFG["git_url"].removeprefix("https://github.com/")
COLAB = f"https://colab.research.google.com/github/{REPO_PATH}/blob/{CFG['branch']}/nbs/{{name}}"
PANDOC_ATTRS = re.compile(r"\{(?:target|style|\.)[^}\n]*\}")


def _text(source) -> str:
    return "".join(source) if isinstance(source, list) else source


SITE_LINK = re.compile(r"\]\(" + re.escape(SITE_URL) + r"([\w./-]+?)\.html(?:#[^)]*)?\)")


# nbdev links a `name` in backticks to its page even inside a link the prose already
# wrote ([`KVCache`](13_kv_cache.ipynb)), which would show as "[KVCache](13_kv_cache.ipynb)":
# inside a link's text, each such doc link goes back to the plain `name`
DOC_LINK = r"\[`[^`\]]+`\]\([^)\s]*\)"
LINK_WITH_DOC_LINKS = re.compile(
    rf"\[((?:[^\[\]]|{DOC_LINK})*{DOC_LINK}(?:[^\[\]]|{DOC_LINK})*)\]\("
)


def _unnest_links(text: str) -> str:
    def plain(match: re.Match) -> str:
        return "[" + re.sub(r"\[(`[^`\]]+`)\]\([^)\s]*\)", r"\1", match.group(1)) + "]("

    return LINK_WITH_DOC_LINKS.sub(plain, text)


def _clean_markdown(text: str) -> str:
    """Remove pandoc link attributes and the doc links nbdev nests inside links; links to
    pages of the quarto site become links to the page's notebook."""
    text = _unnest_links(PANDOC_ATTRS.sub("", text))
    return SITE_LINK.sub(r"](\1.ipynb)", text)


def _title_cells(front_matter: dict, notebook_name: str) -> list[dict]:
    title = front_matter.get("title", notebook_name)
    lines = [f"# {title}", ""]
    if front_matter.get("description"):
        lines += [f"*{front_matter['description']}*", ""]
    return [{"cell_type": "markdown", "metadata": {}, "source": "\n".join(lines)}]


def adapt_code_cell(cell: dict) -> dict | None:
    "Translate quarto's `#|` display options into Sphinx tags; None when the cell is not to be shown."
    lines = _text(cell["source"]).splitlines()
    options = {}
    for line in lines:
        if line.startswith("#|") and ":" in line:
            key, value = line[2:].split(":", 1)
            options[key.strip()] = value.strip()
    if options.get("include") == "false":
        return None
    tags = ["remove-input"] if options.get("echo") == "false" else []
    if options.get("output") == "false":
        tags.append("remove-output")
    cell["source"] = "\n".join(l for l in lines if not l.startswith("#|")).strip("\n")
    cell["metadata"] = {"tags": tags} if tags else {}
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        if "text/markdown" in data:
            # show_doc output opens with a '---' rule, which docutils does not allow inside a cell's output
            markdown = re.sub(r"\A\s*---\s*\n", "", _text(data["text/markdown"]))
            data["text/markdown"] = _clean_markdown(markdown)
            data.pop("text/plain", None)  # the markdown is the rendering; do not show both
    return cell


def _directives(source: str) -> dict[str, str]:
    "A cell's `#| key value` lines as {key: value}."
    found = {}
    for line in source.splitlines():
        if line.startswith("#|"):
            key, _, value = line[2:].strip().partition(" ")
            found[key.rstrip(":")] = value.strip()
    return found


def _strip_directives(source: str) -> str:
    return "\n".join(l for l in source.splitlines() if not l.startswith("#|")).strip("\n")


def exported_cells(notebook: Path) -> dict[str, str]:
    "{cell source without `#|` lines: module it is exported to} for a source notebook's export cells."
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    code = [_text(c["source"]) for c in cells if c["cell_type"] == "code"]
    default = next((_directives(c)["default_exp"] for c in code if "default_exp" in _directives(c)), None)
    exported = {}
    for source in code:
        directives = _directives(source)
        kind = next((k for k in ("export", "exports", "exporti") if k in directives), None)
        if kind:
            exported[_strip_directives(source)] = directives[kind] or default
    return exported


def public_names(source: str) -> list[str]:
    "Top-level public functions, classes and assigned names of a code cell, in source order."
    import ast

    names = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_")]


def _exported_note(source: str, module: str) -> dict | None:
    "A one-line note after an exported cell: where its public names live, in source order."
    names = public_names(source)
    if not names or not module:
        return None
    listed = ", ".join(f"`{n}`" for n in names)
    text = f"<small>Exported to `{CFG['lib_name']}.{module}`: {listed}</small>"
    return {"cell_type": "markdown", "metadata": {}, "source": text}


COLAB_BADGE = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\(([^)]*)\)")


def adapt_notebook(path: Path) -> tuple[str, dict]:
    "Read a processed notebook; return (page name from its output-file, plain notebook for myst-nb)."
    nb = json.loads(path.read_text(encoding="utf-8"))
    source_nb = ROOT / "nbs" / path.name
    exported = exported_cells(source_nb) if source_nb.exists() else {}
    cells, front_matter = [], {}
    for cell in nb["cells"]:
        source = _text(cell["source"])
        if cell["cell_type"] == "raw" and source.startswith("---"):
            front_matter = yaml.safe_load(source.strip().strip("-")) or {}
            continue
        if cell["cell_type"] == "markdown":
            if source.startswith("<!-- WARNING: THIS FILE WAS AUTOGENERATED"):
                continue
            # the notebook's Colab badge is an image on github.com; the offline site links in text
            source = COLAB_BADGE.sub(r"[Open in Colab](\1)", source)
            cells.append({"cell_type": "markdown", "metadata": {}, "source": _clean_markdown(source)})
        elif cell["cell_type"] == "code":
            adapted = adapt_code_cell(cell)
            if adapted is not None and (adapted["source"] or adapted.get("outputs")):
                adapted.pop("id", None)
                cells.append(adapted)
                module = exported.get(adapted["source"])
                note = _exported_note(adapted["source"], module) if module else None
                if note:
                    cells.append(note)
    page = Path(front_matter.get("output-file", path.stem + ".html")).stem
    nb["cells"] = _title_cells(front_matter, path.name) + cells
    nb["metadata"] = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                      "language_info": {"name": "python"}}
    nb["nbformat"], nb["nbformat_minor"] = 4, 4
    return page, nb


# `50_lora.ipynb` from a chapter, `nbs/50_lora.ipynb` from the home page (which is also the README at the root)
CHAPTER_LINK = re.compile(r"\]\((?:nbs/)?(\w+)\.ipynb(#[^)\s]*)?\)")


def link_chapters(nb: dict, pages: dict[str, str]) -> None:
    "Links between chapters name the notebook (`50_lora.ipynb`, as on GitHub and Colab); the site names its page."
    def to_page(match: re.Match) -> str:
        page = pages.get(match.group(1) + ".ipynb")
        if page is None and match.group(1) in pages.values():  # nbdev's own doc links name the page
            page = match.group(1)
        if page is None:
            raise SystemExit(f"a link to {match.group(0)[2:-1]}, which is not a notebook in nbs/")
        return f"]({page}.ipynb{match.group(2) or ''})"

    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            cell["source"] = CHAPTER_LINK.sub(to_page, _text(cell["source"]))


def sidebar_parts() -> list[dict]:
    "The book's parts from nbs/sidebar.yml: [{'caption': str | None, 'notebooks': [names]}]."
    contents = yaml.safe_load((ROOT / "nbs" / "sidebar.yml").read_text())["website"]["sidebar"]["contents"]
    parts, loose = [], []
    for entry in contents:
        if isinstance(entry, str):
            loose.append(entry)
        else:
            parts.append({"caption": entry["section"], "notebooks": list(entry["contents"])})
    return [{"caption": None, "notebooks": loose}] + parts


def write_toc(pages: dict[str, str]) -> None:
    "Write _toc.yml (sphinx-external-toc) from the sidebar; every notebook must be listed exactly once."
    parts = sidebar_parts()
    listed = [nb for part in parts for nb in part["notebooks"]]
    missing = sorted(set(pages) - set(listed))
    unknown = sorted(set(listed) - set(pages))
    if missing or unknown or len(listed) != len(set(listed)):
        raise SystemExit(f"nbs/sidebar.yml and nbs/ disagree: not listed {missing}, listed but absent {unknown}, "
                         f"duplicates {sorted({n for n in listed if listed.count(n) > 1})}. Edit nbs/sidebar.yml.")
    root = pages["index.ipynb"]
    toc = {"format": "jb-book", "root": root, "parts": []}
    for part in parts:
        chapters = [{"file": pages[nb]} for nb in part["notebooks"] if pages[nb] != root]
        if chapters:
            toc["parts"].append({"caption": part["caption"] or "Start here", "chapters": chapters})
    (SRC / "_toc.yml").write_text(yaml.safe_dump(toc, sort_keys=False))


def main() -> int:
    import warnings
    from nbdev.serve import proc_nbs
    # nbdev suggests splitting cells that mix imports and code (for show_doc's sake); not a site problem
    warnings.filterwarnings("ignore", message="Found cells containing imports and other code")
    proc = Path(proc_nbs(n_workers=0, force=True))
    shutil.rmtree(SRC, ignore_errors=True)
    SRC.mkdir(parents=True)
    pages, adapted = {}, {}
    for path in sorted(proc.glob("*.ipynb")):
        page, nb = adapt_notebook(path)
        pages[path.name], adapted[page] = page, nb
    for page, nb in adapted.items():
        link_chapters(nb, pages)
        (SRC / f"{page}.ipynb").write_text(json.dumps(nb, indent=1), encoding="utf-8")
    write_toc(pages)
    shutil.rmtree(OUT, ignore_errors=True)
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           "-c", str(DOCS), str(SRC), str(OUT)]).returncode


if __name__ == "__main__":
    sys.exit(main())
