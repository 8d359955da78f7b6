"""What the extras install: `.[opencl]` alone must find a device on a machine without a
GPU driver (PoCL, a CPU OpenCL driver, comes with it); constrained output is a core
dependency; the test extra has what the tests import."""
from __future__ import annotations

import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


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
