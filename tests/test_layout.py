"""The package layout the design card promises: import rules and the installed names."""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# floor of each top-level folder: imports may only point to the same floor or below
FLOORS = {"backends": 1, "models": 2, "edgeinfer": 3, "quant": 4}
PKG_OF = {"backends": "edgeinfer.backends", "models": "edgeinfer.models",
          "quant": "edgeinfer.quant", "edgeinfer": "edgeinfer"}


def _floor_of_module(mod: str) -> int | None:
    if mod.startswith("edgeinfer.backends"):
        return 1
    if mod.startswith("edgeinfer.models"):
        return 2
    if mod.startswith("edgeinfer.quant"):
        return 4
    if mod == "edgeinfer" or mod.startswith("edgeinfer."):
        return 3
    return None


def _resolve(pkg: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = pkg.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def test_import_edgeinfer_pulls_in_neither_numba_nor_pyopencl():
    code = ("import sys, edgeinfer, edgeinfer.api, edgeinfer.backends, edgeinfer.models.transformer; "
            "bad = [m for m in ('numba', 'pyopencl', 'torch') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_folder_imports_a_floor_above_it():
    violations = []
    for top, floor in FLOORS.items():
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT / top).with_suffix("")
            pkg_parts = [PKG_OF[top]] + [p for p in rel.parts if p != "__init__"]
            pkg = ".".join(pkg_parts if path.name == "__init__.py" else pkg_parts[:-1])
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                mods = []
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    mods = [_resolve(pkg, node)]
                for m in mods:
                    f = _floor_of_module(m)
                    if f is not None and f > floor:
                        violations.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {m}")
    assert not violations, "\n".join(violations)


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = cfg["package-dir"]
    found = set()
    for pkg, d in {**dirs, "cli": "cli"}.items():  # cli/: the command, its own top-level name
        for init in (ROOT / d).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / d)
            found.add(".".join([pkg] + list(rel.parts)) if rel.parts else pkg)
    # edgeinfer's own dir also contains nothing mapped elsewhere
    missing = {p for p in found if p not in listed}
    assert not missing, f"packages missing from pyproject [tool.setuptools] packages: {missing}"


def test_installed_names_are_only_edgeinfer_and_cli():
    import edgeinfer.backends
    import edgeinfer.models
    import edgeinfer.quant

    assert Path(edgeinfer.backends.__file__).parent == ROOT / "backends"
    assert Path(edgeinfer.models.__file__).parent == ROOT / "models"
    assert Path(edgeinfer.quant.__file__).parent == ROOT / "quant"
