"""The attention summation (spherepde/summation) is layered: every module imports only from layers
below its own (fastmath ← kernels ← the sums ← field ← __init__), the sums never import each
other, and the rest of spherepde may be imported only where the summation needs its geometry.
The checker parses the import statements (module-level and inside functions) with ast."""

import ast
import importlib
from pathlib import Path

import pytest

import spherepde

PACKAGE = Path(spherepde.__file__).parent
SUMMATION = PACKAGE / "summation"
# layer of every module of spherepde/summation: a module may import only strictly lower layers
LAYERS = {"fastmath": 0, "kernels": 1, "direct": 2, "tree": 2, "harmonic": 2, "near_field": 2, "points": 2, "clustered": 2,
          "field": 3,
          "__init__": 4}
# what the summation may import from the rest of spherepde (geometry and the model, not the solvers)
OUTSIDE = {"spherepde.mesh", "spherepde.model"}
# the former flat modules, now re-exports of spherepde.summation (solvers must not use them)
SHIMS = {"attention": "field", "harmonic_sum": "harmonic", "tree_sum": "tree", "near_field": "near_field",
         "fastmath": "fastmath"}


def imported_modules(path, package):
    """The absolute names of the modules that the file imports (at any depth of its code); package:
    the dotted name of the package that holds it (its folder), for the relative imports.
    `from P import name` counts as importing P.name where that is a module, else P."""
    path = Path(path)
    root = path.parents[len(package.split("."))]  # the folder that holds the top-level package
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            folder = root.joinpath(*module.split("."))
            for alias in node.names:
                is_module = (folder / f"{alias.name}.py").is_file() or (folder / alias.name).is_dir()
                found.add(f"{module}.{alias.name}" if is_module else module)
    return found


def layering_violations(folder, package, layers, outside):
    """Messages for every import of the modules in folder (package: their dotted package name) that
    breaks the layering: a module missing from layers, an import of the same or a higher layer, two
    modules importing each other, an import from package's parent other than `outside`."""
    parent = package.rsplit(".", 1)[0]
    graph = {}
    problems = []
    for path in sorted(Path(folder).glob("*.py")):
        name = path.stem
        if name not in layers:
            problems.append(f"{name}: no layer assigned")
            continue
        graph[name] = set()
        for module in imported_modules(path, package):
            if module == package:
                graph[name].add("__init__")
            elif module.startswith(package + "."):
                graph[name].add(module[len(package) + 1:].split(".")[0])
            elif module.startswith(parent + ".") and module not in outside:
                problems.append(f"{name} imports {module} (outside the summation: only {sorted(outside)})")
    for name, deps in sorted(graph.items()):
        for dep in sorted(deps - {name}):
            if name < dep and name in graph.get(dep, ()):
                problems.append(f"{name} and {dep} import each other")
            if dep in layers and layers[dep] >= layers[name]:
                problems.append(f"{name} (layer {layers[name]}) imports {dep} (layer {layers[dep]})")
    return problems


def test_summation_is_layered():
    assert layering_violations(SUMMATION, "spherepde.summation", LAYERS, OUTSIDE) == []


def test_every_summation_module_has_a_docstring():
    for path in SUMMATION.glob("*.py"):
        assert ast.get_docstring(ast.parse(path.read_text())), path.name


def write_package(folder, files):
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / f"{name}.py").write_text(text)
    return folder


@pytest.mark.parametrize("bad, expected", [
    ({"low": "from .high import f\n"}, "low (layer 0) imports high (layer 2)"),
    ({"low": "def g():\n    from . import high\n"}, "low (layer 0) imports high (layer 2)"),
    ({"mid": "from .other import f\n"}, "mid (layer 1) imports other (layer 1)"),
    ({"low": "from pkg.sub import high\n"}, "low (layer 0) imports high (layer 2)"),
    ({"low": "import pkg.solver\n"}, "low imports pkg.solver (outside the summation"),
    ({"low": "from .high import f\n", "high": "from .low import g\n"}, "high and low import each other"),
    ({"extra": "x = 1\n"}, "extra: no layer assigned"),
])
def test_the_checker_finds_bad_imports(tmp_path, bad, expected):
    """The checker on a synthetic package pkg.sub (low ← mid, other ← high): clean as written,
    and each deliberately bad import is reported."""
    files = {"__init__": '"""pkg.sub"""\nfrom .high import f\n',
             "low": "import math\nfrom pkg.geometry import h\n",
             "mid": "from .low import g\n", "other": "from . import low\n", "high": "from .mid import f\n"}
    layers = {"__init__": 3, "low": 0, "mid": 1, "other": 1, "high": 2}
    clean = write_package(tmp_path / "clean" / "pkg" / "sub", files)
    assert layering_violations(clean, "pkg.sub", layers, {"pkg.geometry"}) == []
    broken = {name: files.get(name, "") + text for name, text in bad.items()}
    broken = write_package(tmp_path / "broken" / "pkg" / "sub", {**files, **broken})
    problems = layering_violations(broken, "pkg.sub", layers, {"pkg.geometry"})
    assert any(p.startswith(expected) for p in problems), problems


def test_the_real_package_fails_with_an_upward_import(tmp_path):
    """A copy of spherepde/summation whose kernels import the dispatcher is reported."""
    copy = tmp_path / "spherepde" / "summation"
    copy.mkdir(parents=True)
    for path in SUMMATION.glob("*.py"):
        (copy / path.name).write_text(path.read_text())
    with (copy / "kernels.py").open("a") as f:
        f.write("\n\ndef late():\n    from .field import attention_field\n    return attention_field\n")
    problems = layering_violations(copy, "spherepde.summation", LAYERS, OUTSIDE)
    assert problems == ["field and kernels import each other", "kernels (layer 1) imports field (layer 3)"]


@pytest.mark.parametrize("shim, home", sorted(SHIMS.items()))
def test_former_modules_reexport_the_summation(shim, home):
    """spherepde.attention etc. hold no code: every public name is the object of spherepde.summation."""
    old = importlib.import_module(f"spherepde.{shim}")
    new = importlib.import_module(f"spherepde.summation.{home}")
    summation = importlib.import_module("spherepde.summation")
    for name in old.__all__:
        assert getattr(old, name) is getattr(new, name, getattr(summation, name, None)), name
    tree = ast.parse((PACKAGE / f"{shim}.py").read_text())
    assert all(isinstance(n, (ast.Expr, ast.ImportFrom, ast.Assign)) for n in tree.body), shim


def test_the_rest_of_spherepde_imports_the_summation_not_the_shims():
    for path in PACKAGE.rglob("*.py"):
        if path.parent == PACKAGE and path.stem in SHIMS:
            continue
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        package = ".".join(rel.parts[:-1])
        used = {m for m in imported_modules(path, package)
                for shim in SHIMS if m == f"spherepde.{shim}"}
        assert not used, (path, used)
