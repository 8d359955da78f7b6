"""edgeinfer: quantized on-device LLM inference.

Importing this package is cheap: it imports neither numba nor pyopencl (backends are
imported when first used).
"""
from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that `import edgeinfer` stays cheap: the API pulls in the readers.
    if name in ("load", "Model", "ChatSession"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'edgeinfer' has no attribute {name!r}")
