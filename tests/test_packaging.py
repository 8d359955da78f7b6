"""What the extras install: `.[opencl]` alone must find a device on a machine without a
GPU driver (PoCL, a CPU OpenCL driver, comes with it); constrained output is a core
dependency; the test extra has what the tests import; a built wheel ships the command."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def _project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def test_the_opencl_extra_brings_pocl():
    assert any(r.replace(" ", "").startswith("pyopencl[pocl]")
               for r in _project()["optional-dependencies"]["opencl"])


def test_constrained_output_and_the_desktop_example_are_installed():
    deps = [r.split(">")[0].split("=")[0].strip().lower() for r in _project()["dependencies"]]
    assert "llguidance" in deps
    test = [r.split(">")[0].split("[")[0].strip().lower()
            for r in _project()["optional-dependencies"]["test"]]
    assert {"jsonschema", "pyside6-essentials", "openai"} <= set(test)


@pytest.mark.slow
def test_the_wheel_ships_every_cli_module_and_the_console_script(tmp_path):
    """A non-editable build (what ``pip install .`` installs): every module of cli/ and
    the ``edgeinfer = cli:main`` entry point are in the wheel."""
    src = tmp_path / "src"  # a copy: building in place would leave build/ in the checkout
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("edgeinfer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    cli = {f"cli/{p.name}" for p in (ROOT / "cli").glob("*.py")}
    assert {"cli/__init__.py", "cli/__main__.py"} <= cli and cli <= names, cli - names
    assert "edgeinfer/api.py" in names and "edgeinfer/quant/convert.py" in names
    (ep,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "edgeinfer = cli:main" in zipfile.ZipFile(wheel).read(ep).decode()
