"""edgeinfer: quantized on-device LLM inference.

Importing this package is cheap: it imports neither numba nor pyopencl (backends are
imported when first used).
"""
from __future__ import annotations

__version__ = "0.1.0"
