"""spherepde is layered: each subpackage imports only from those below it, siblings of one layer
never import each other, and inside the summation the modules are layered too (fastmath ←
kernels ← the sums ← field and heads ← __init__). The checker parses every import statement
(module-level and inside functions) with ast. No module imports another module's private names.
"""

import ast
import re
from pathlib import Path

import pytest

import spherepde

PACKAGE = Path(spherepde.__file__).parent
# rank of every top-level module and subpackage of spherepde: a module may import only from
# strictly lower ranks and from its own subpackage (equal ranks: siblings that must not meet)
PACKAGES = {"version": 0, "geometry": 1, "models": 2, "summation": 3, "transport": 3, "storage": 4,
            "solvers": 5, "analysis": 6, "visualization": 7, "runner": 8, "validation": 9, "cli": 10,
            "__main__": 11, "__init__": 11}
# inside spherepde/summation: the same rule between its modules
SUMMATION = {"fastmath": 0, "kernels": 1, "direct": 2, "batched": 2, "cuda": 3, "tree": 2, "harmonic": 2, "near_field": 2, "points": 2,
             "clustered": 2, "field": 3, "heads": 4, "__init__": 5}


def imported_modules(path, package):
    """The absolute names of the modules that the file imports (at any depth of its code) with the
    names taken from each: {module: {name, ...}} (an empty set for `import module`). package: the
    dotted name of the package that holds the file, for the relative imports. `from P import
    name` counts as importing the module P.name where that is a module, else P."""
    path = Path(path)
    root = path.parents[len(package.split("."))]  # the folder that holds the top-level package
    found = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name, set())
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            folder = root.joinpath(*module.split("."))
            for alias in node.names:
                if (folder / f"{alias.name}.py").is_file() or (folder / alias.name).is_dir():
                    found.setdefault(f"{module}.{alias.name}", set())
                else:
                    found.setdefault(module, set()).add(alias.name)
    return found


def package_violations(root, top, packages, inner=None):
    """Messages for every import inside the package folder `root` (dotted name `top`) that breaks
    the layering `packages` (rank of each subpackage or top-level module), the inner layering of
    subpackages (inner: {subpackage: {module: rank}}), or imports a private name of another module."""
    inner = inner or {}
    problems = []
    root = Path(root)
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        unit = rel.parts[0]
        if unit not in packages:
            problems.append(f"{'/'.join(rel.parts)}: {unit} has no layer")
            continue
        package = ".".join((top, *rel.parts[:-1]))
        here = ".".join((top, *rel.parts)).removesuffix(".__init__")
        for module, names in sorted(imported_modules(path, package).items()):
            if module != top and not module.startswith(top + "."):
                continue
            parts = module.split(".")[1:] or ["__init__"]
            target = parts[0]
            private = sorted(n for n in names if n.startswith("_") and not n.startswith("__"))
            if private and module != here:
                problems.append(f"{here} imports private {', '.join(private)} from {module}")
            if target not in packages:
                continue
            if target != unit:
                if packages[target] >= packages[unit]:
                    problems.append(f"{here} (layer {unit}) imports {module} (layer {target})")
                continue
            ranks = inner.get(unit)
            if ranks is None or len(rel.parts) < 2:
                continue
            mine = rel.parts[1] if len(rel.parts) > 1 else "__init__"
            theirs = parts[1] if len(parts) > 1 else "__init__"
            if mine not in ranks:
                problems.append(f"{here}: no layer inside {unit}")
            elif theirs in ranks and theirs != mine and ranks[theirs] >= ranks[mine]:
                problems.append(f"{here} (layer {ranks[mine]}) imports {module} (layer {ranks[theirs]})")
    return problems


def test_spherepde_is_layered():
    assert package_violations(PACKAGE, "spherepde", PACKAGES, {"summation": SUMMATION}) == []


def test_every_module_has_a_docstring():
    for path in PACKAGE.rglob("*.py"):
        assert ast.get_docstring(ast.parse(path.read_text())), path.relative_to(PACKAGE)


def test_every_folder_is_a_package_with_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert folders | modules == set(PACKAGES)
    for folder in folders:
        assert (PACKAGE / folder / "__init__.py").is_file(), folder


def write_tree(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


CLEAN = {"__init__.py": '"""pkg"""\nfrom .high.api import f\n',
         "low/__init__.py": "", "low/a.py": "import math\n", "low/b.py": "from .a import x\n",
         "mid/__init__.py": "", "mid/m.py": "from ..low.a import x\nfrom pkg.low import b\n",
         "side/__init__.py": "", "side/s.py": "from ..low.b import y\n",
         "high/__init__.py": "", "high/api.py": "from ..mid.m import g\nfrom ..side import s\n"}
RANKS = {"low": 0, "mid": 1, "side": 1, "high": 2, "__init__": 3}


@pytest.mark.parametrize("bad, expected", [
    ({"low/a.py": "from ..high.api import f\n"}, "pkg.low.a (layer low) imports pkg.high.api (layer high)"),
    ({"low/a.py": "def g():\n    from ..mid import m\n"}, "pkg.low.a (layer low) imports pkg.mid.m (layer mid)"),
    ({"mid/m.py": "from pkg.side.s import y\n"}, "pkg.mid.m (layer mid) imports pkg.side.s (layer side)"),
    ({"low/a.py": "import pkg\n"}, "pkg.low.a (layer low) imports pkg (layer __init__)"),
    ({"mid/m.py": "from ..low.a import _hidden\n"}, "pkg.mid.m imports private _hidden from pkg.low.a"),
    ({"extra/__init__.py": ""}, "extra/__init__: extra has no layer"),
])
def test_the_checker_finds_bad_imports(tmp_path, bad, expected):
    """The checker on a synthetic package pkg (low ← mid, side ← high): clean as written, and each
    deliberately bad import is reported."""
    clean = write_tree(tmp_path / "clean" / "pkg", CLEAN)
    assert package_violations(clean, "pkg", RANKS) == []
    broken = write_tree(tmp_path / "broken" / "pkg", {**CLEAN, **bad})
    problems = package_violations(broken, "pkg", RANKS)
    assert expected in problems, problems


def test_the_real_package_fails_with_a_planted_upward_import(tmp_path):
    """A copy of spherepde whose mesh imports the Eulerian solver, and whose kernels import the
    summation's dispatcher, is reported twice: once between packages, once inside one."""
    copy = tmp_path / "spherepde"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    with (copy / "geometry" / "mesh.py").open("a") as f:
        f.write("\n\ndef late():\n    from ..solvers.eulerian import EulerianSolver\n    return EulerianSolver\n")
    with (copy / "summation" / "kernels.py").open("a") as f:
        f.write("\n\ndef late():\n    from .field import attention_field\n    return attention_field\n")
    problems = package_violations(copy, "spherepde", PACKAGES, {"summation": SUMMATION})
    assert problems == ["spherepde.geometry.mesh (layer geometry) imports spherepde.solvers.eulerian (layer solvers)",
                        "spherepde.summation.kernels (layer 1) imports spherepde.summation.field (layer 3)"]


def unused_private_definitions(folder):
    """Module-level private functions and classes (`_name`) that nothing in their module uses:
    dead code, since no other module may import them."""
    dead = []
    for path in sorted(Path(folder).rglob("*.py")):
        text = path.read_text()
        for node in ast.parse(text).body:
            if (isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith("_")
                    and not node.name.startswith("__")
                    and len(re.findall(rf"\b{re.escape(node.name)}\b", text)) < 2):
                dead.append(f"{path.relative_to(folder)}:{node.name}")
    return dead


def test_no_private_definition_is_unused():
    assert unused_private_definitions(PACKAGE) == []


def test_the_dead_code_check_finds_an_unused_helper(tmp_path):
    write_tree(tmp_path, {"a.py": "def _used():\n    return 1\n\n\ndef f():\n    return _used()\n\n\n"
                                  "def _padded(n):\n    return n\n"})
    assert unused_private_definitions(tmp_path) == ["a.py:_padded"]
