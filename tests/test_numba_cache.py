"""The kernels' Numba cache key covers every kernel source file (backends/cpu/_numba_cache)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from edgeinfer.backends.cpu import _numba_cache, elementwise, gemv, plan


def test_tree_stamp_changes_with_any_kernel_file(tmp_path):
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text(f"# {name}\n")
    (tmp_path / "notes.txt").write_text("x")
    s0 = _numba_cache.tree_stamp(str(tmp_path))
    assert s0 == _numba_cache.tree_stamp(str(tmp_path))  # stable
    (tmp_path / "notes.txt").write_text("changed")  # not a source file
    assert _numba_cache.tree_stamp(str(tmp_path)) == s0
    (tmp_path / "b.py").write_text("# b.py edited\n")
    s1 = _numba_cache.tree_stamp(str(tmp_path))
    assert s1 != s0
    (tmp_path / "c.py").write_text("")  # a new kernel file
    assert _numba_cache.tree_stamp(str(tmp_path)) not in (s0, s1)


def test_kernel_dispatchers_use_the_tree_stamp():
    assert _numba_cache.install()
    stamp = _numba_cache.tree_stamp()
    for fn in (gemv.gemv_q4, plan.block_q_post, elementwise.rmsnorm_rows):
        loc = fn._cache._impl.locator
        assert type(loc).__name__.startswith("KernelTree"), type(loc)
        own, tree = loc.get_source_stamp()
        assert tree == stamp
    # another package's functions keep Numba's own locators
    from numba import njit

    @njit(cache=True)
    def f(x):
        return x + 1
    assert not type(f._cache._impl.locator).__name__.startswith("KernelTree")


_PROBE = """
import json, numpy as np
from edgeinfer.backends.cpu import elementwise as e
x = np.ones((2, 8), np.float32); w = np.ones(8, np.float32); y = np.empty_like(x)
e.rmsnorm_rows(y, x, w, 1e-5, False)
print(json.dumps({"file": e.__file__, "hits": sum(e.rmsnorm_rows.stats.cache_hits.values()),
                  "misses": sum(e.rmsnorm_rows.stats.cache_misses.values())}))
"""


@pytest.mark.parametrize("edit", [False, True])
def test_cache_reused_across_processes_and_invalidated_by_an_edit(tmp_path, edit):
    """Copy the package, compile a kernel twice in fresh processes (the second loads it
    from the cache), then edit another kernel file: the next process recompiles."""
    import edgeinfer
    src_root = os.path.dirname(os.path.dirname(os.path.abspath(edgeinfer.__file__)))
    pkg = tmp_path / "src"
    shutil.copytree(src_root, pkg, ignore=shutil.ignore_patterns(
        ".venv", ".git", "tests", "__pycache__", "*.egg-info", "docs", "benchmarks"))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = str(tmp_path / "shim")
    # the copy is importable as edgeinfer (+ its package-dir mapping) through a .pth-like shim
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(_SHIM.format(root=str(pkg)))

    def run():
        r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = run()
    assert first["file"].startswith(str(pkg)), first  # the copy, not the installed tree
    assert first["misses"] >= 1 and first["hits"] == 0
    second = run()
    assert second["hits"] >= 1 and second["misses"] == 0
    if edit:  # a callee-side file, not elementwise.py itself
        target = pkg / "backends" / "cpu" / "gemv.py"
        target.write_text(target.read_text() + "\n# edited\n")
        third = run()
        assert third["misses"] >= 1 and third["hits"] == 0


_SHIM = """
import sys, types, importlib.util, os
root = {root!r}
sys.path.insert(0, root)
# edgeinfer.backends / .models / .quant live at the repository root (package-dir)
import edgeinfer
for sub in ("backends", "models", "quant"):
    spec = importlib.util.spec_from_file_location(
        "edgeinfer." + sub, os.path.join(root, sub, "__init__.py"),
        submodule_search_locations=[os.path.join(root, sub)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["edgeinfer." + sub] = mod
    spec.loader.exec_module(mod)
    setattr(edgeinfer, sub, mod)
"""
