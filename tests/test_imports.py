"""The package's import rules, checked on the source of every module (no import is executed):

- no import cycle between modules (module-level and function-level imports both count: a cycle hidden inside a
  function is still two modules that need each other);
- no module imports another package's private module: `torchtune_lit.data._messages` is the `data` package's own,
  used by `data` and packages inside it; everyone else imports `torchtune_lit.data`; likewise a `_name` is imported
  only inside the package that defines it;
- the lower layers never import the higher ones (`modules` <- `data` <- `tokenizers` <- the rest; nothing in the
  library imports a recipe; `training` never imports `rlhf`, `datasets` never imports `models`);
- imports of the package sit at the top of a module, where a reader sees them (the command line's lazy imports,
  which keep PyTorch out of the commands that do not need it, are the one exception).
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "torchtune_lit"


def module_files() -> dict[str, Path]:
    "Dotted module name -> file, for every module of the package (a package is its __init__)."
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_modidx.py":  # nbdev's index of names, not code
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = module_files()


def _package(module: str) -> str:
    "The package a module belongs to: itself for a package, its parent for a plain module."
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _known(name: str) -> str:
    "The most specific module of the package that `name` (a module or a module's attribute) lives in."
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else ""


def imported_modules(module: str) -> list[tuple[str, int]]:
    "(module imported, line) for every import of a torchtune_lit module in `module`'s file, at any depth."
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package upwards
                anchor = _package(module).split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _known(name) if name.startswith("torchtune_lit") else ""
            if target and target != module:
                found.append((target, node.lineno))
    return found


GRAPH = {module: imported_modules(module) for module in MODULES}


def _owner_of_private(module: str) -> str:
    "For a private module (a `_name` part below the top package), the package that owns it; else ''."
    parts = module.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and part != "__init__":
            return ".".join(parts[:i])
    return ""


def test_no_module_imports_another_packages_private_module():
    offences = []
    for module, imports in GRAPH.items():
        for target, line in imports:
            owner = _owner_of_private(target)
            if owner and not (module == owner or module.startswith(owner + ".")):
                offences.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not offences, "import the package, not its private module:\n" + "\n".join(sorted(offences))


def private_names_imported(module: str) -> list[tuple[str, str, int]]:
    "(module, private name, line) for each `from torchtune_lit.X import _name` in `module`'s file."
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            anchor = _package(module).split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        source = _known(base) if base.startswith("torchtune_lit") else ""
        found += [(source, alias.name, node.lineno) for alias in node.names
                  if source and alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def _private_name_offences() -> list[str]:
    offences = []
    for module in MODULES:
        for source, name, line in private_names_imported(module):
            owner = _package(source)
            if not (module == owner or module.startswith(owner + ".")):
                offences.append(f"{module}:{line} imports {name} from {source}")
    return offences


def test_no_module_imports_another_packages_private_name():
    """A `_name` is its package's own: `rlhf` reading `training.checkpointing._read_tensors` would tie it to a
    detail `training` may change; such a name is made public (and documented) instead."""
    offences = _private_name_offences()
    assert not offences, "make the name public, or keep it in its package:\n" + "\n".join(sorted(offences))


def test_the_private_name_check_can_fail(tmp_path):
    "The check above finds a private name imported across packages when there is one."
    saved = MODULES.get("torchtune_lit.rlhf._probe")
    probe = tmp_path / "_probe.py"
    probe.write_text("from torchtune_lit.training.checkpointing import _resolve_files\n")
    MODULES["torchtune_lit.rlhf._probe"] = probe
    try:
        assert any("_resolve_files from torchtune_lit.training.checkpointing" in o for o in _private_name_offences())
    finally:
        del MODULES["torchtune_lit.rlhf._probe"]
        if saved is not None:
            MODULES["torchtune_lit.rlhf._probe"] = saved


def _cycles() -> list[list[str]]:
    "The strongly connected components of more than one module (Tarjan's algorithm, iterative)."
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], 0
    for root in GRAPH:
        if root in index:
            continue
        work = [(root, iter(sorted({t for t, _ in GRAPH[root]})))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted({t for t, _ in GRAPH[child]}))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def test_no_import_cycle():
    cycles = _cycles()
    assert not cycles, "modules that import each other (directly or through others):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_check_can_fail():
    "The check above finds a cycle when there is one: two modules of a made-up graph that import each other."
    saved = dict(GRAPH)
    try:
        GRAPH["torchtune_lit.config"] = [*GRAPH["torchtune_lit.config"], ("torchtune_lit._cli.tunelit", 1)]
        assert any({"torchtune_lit.config", "torchtune_lit._cli.tunelit"} <= set(c) for c in _cycles())
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


def test_layers():
    """The lower layers never import the higher ones: `modules` (the network's pieces) and `data` (messages and
    collation) import no other part of the library that builds on them, `tokenizers` none but those two, and no
    library package imports a recipe (recipes sit on top; only the CLI finds them); `training` never imports `rlhf`
    and `datasets` never imports `models`."""
    library = ("torchtune_lit.data", "torchtune_lit.datasets", "torchtune_lit.generation", "torchtune_lit.models",
               "torchtune_lit.rlhf", "torchtune_lit.tokenizers", "torchtune_lit.training", "torchtune_lit.tabular",
               "torchtune_lit.config")
    higher = ("torchtune_lit.datasets", "torchtune_lit.generation", "torchtune_lit.models", "torchtune_lit.rlhf",
              "torchtune_lit.training", "torchtune_lit.recipes", "torchtune_lit.tabular", "torchtune_lit._cli")
    forbidden = {
        "torchtune_lit.modules": (*higher, "torchtune_lit.data", "torchtune_lit.tokenizers"),
        "torchtune_lit.data": (*higher, "torchtune_lit.tokenizers"),
        "torchtune_lit.tokenizers": higher,
        **{package: ("torchtune_lit.recipes", "torchtune_lit._cli") for package in library},
    }
    # the parts of one algorithm live with it: `training` holds what every recipe shares and never imports `rlhf`
    # (preference and GRPO parts are `rlhf.preference_parts`, `rlhf.grpo_parts`); data never needs a model
    forbidden["torchtune_lit.training"] = (*forbidden["torchtune_lit.training"], "torchtune_lit.rlhf")
    forbidden["torchtune_lit.datasets"] = (*forbidden["torchtune_lit.datasets"], "torchtune_lit.models")
    offences = []
    for module, imports in GRAPH.items():
        for layer, banned in forbidden.items():
            if module == layer or module.startswith(layer + "."):
                offences += [f"{module}:{line} imports {target}" for target, line in imports
                             if any(target == b or target.startswith(b + ".") for b in banned)]
    assert not offences, "\n".join(offences)


# Where an import of the package may sit inside a function, and why: the command line imports the training package
# only in the commands that need it, so `tunelit ls`, `cp`, `cat` and `validate` start without loading PyTorch.
LAZY_IMPORTS_ALLOWED_IN = ("torchtune_lit._cli",)


def function_level_imports(module: str) -> list[tuple[str, int]]:
    "(module imported, line) for each import of a torchtune_lit module that sits inside a function of `module`."
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.Import):
                names = [alias.name for alias in inner.names]
            elif isinstance(inner, ast.ImportFrom):
                names = ["." * inner.level + (inner.module or "")]
            else:
                continue
            found += [(name, inner.lineno) for name in names if name.startswith(("torchtune_lit", "."))]
    return found


def test_no_import_hides_inside_a_function():
    """An import of the package inside a function hides a dependency (often a cycle dodged): imports sit at the top
    of the module, except the command line's lazy ones."""
    offences = [f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {name} inside a function"
                for module in MODULES if not module.startswith(LAZY_IMPORTS_ALLOWED_IN)
                for name, line in function_level_imports(module)]
    assert not offences, "\n".join(offences)


def test_the_hidden_import_check_can_fail(tmp_path):
    "The check above finds an import inside a function when there is one."
    source = "import torch\n\ndef f():\n    from torchtune_lit.training import runs\n    return runs\n"
    MODULES["torchtune_lit._made_up"] = tmp_path / "made_up.py"
    try:
        MODULES["torchtune_lit._made_up"].write_text(source)
        assert function_level_imports("torchtune_lit._made_up") == [("torchtune_lit.training", 4)]
    finally:
        del MODULES["torchtune_lit._made_up"]
