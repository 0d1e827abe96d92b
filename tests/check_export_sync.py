"""Fail when the package under torchtune_lit/ is not exactly what `make export` makes from nbs/.

The notebooks are the source; a hand edit of an exported .py file, or a notebook edited without re-exporting,
would make the package and the book disagree. We snapshot every exported file, export again (`nbdev_export`, then
`ruff check --select I --fix`, which sorts the imports nbdev rewrote as relative ones), and compare.
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "torchtune_lit"


def snapshot() -> dict[str, bytes]:
    return {str(p.relative_to(ROOT)): p.read_bytes() for p in sorted(PACKAGE.rglob("*.py"))}


def main() -> int:
    before = snapshot()
    bin_dir = Path(sys.executable).parent
    subprocess.run([str(bin_dir / "nbdev_export")], cwd=ROOT, check=True)
    subprocess.run([str(bin_dir / "ruff"), "check", "--select", "I", "--fix", "--quiet", "torchtune_lit"],
                   cwd=ROOT, check=True)
    after = snapshot()
    changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
    added, removed = sorted(after.keys() - before.keys()), sorted(before.keys() - after.keys())
    if changed or added or removed:
        print("The package and the notebooks disagree: nbdev_export changed the package.", file=sys.stderr)
        for label, names in (("changed", changed), ("created", added), ("not produced", removed)):
            for name in names:
                print(f"  {label}: {name}", file=sys.stderr)
        print("Edit the notebook in nbs/ (never the .py), run `make export`, and commit both.", file=sys.stderr)
        return 1
    print(f"export sync: the {len(after)} files under torchtune_lit/ match nbs/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
