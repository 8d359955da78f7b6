"""OpenCL backend (pyopencl + ``.cl`` kernels in this folder).

Public API:
    :class:`OpenCLBackend` - the backend contract on an OpenCL device.
    :func:`list_devices` - every device with its capabilities (``edgeinfer devices``).
    :class:`OpenCLUnavailableError` - raised when OpenCL cannot be used here.

Kernels (output first, shapes in comments; layout constants arrive as ``-D`` options
from :mod:`edgeinfer.backends.quantized`): ``common.cl`` (reductions, dequant helpers,
prepended to every program), ``dense.cl`` (f32 GEMV, RMSNorm, RoPE, GLU, add, embedding),
``quant.cl`` (INT4 / INT8 GEMV and embeddings), ``gemm.cl`` (tiled GEMM for prefill, every
weight format), ``attention.cl`` (f32/f16 KV write, fused rope + KV write, online-softmax
GQA attention), ``attention_q.cl`` (int8 / int4 / k8v4 KV quantize-on-write + attention
over the codes; launched from :mod:`.attention_q`), ``fused.cl`` (CPU devices: row-per-item GEMV with fused norm / q-k-v / GLU /
residual for decode, and its token-loop form for prefill).

Importing this package does not fail without pyopencl; constructing the backend or
listing devices then raises :class:`OpenCLUnavailableError` naming the fix.
"""
from __future__ import annotations

from .backend import OpenCLBackend
from .device import ENV_DEVICE, OpenCLUnavailableError, list_devices, select_device
from .kvcache import DeviceKVCache
from .memory import DeviceTensor, DeviceWeight

# The start-up self-check (a tiny model on the device vs. the reference backend) lives in
# edgeinfer.selfcheck: it runs the real transformer, which backends may not import.

__all__ = ["ENV_DEVICE", "DeviceKVCache", "DeviceTensor", "DeviceWeight", "OpenCLBackend",
           "OpenCLUnavailableError", "list_devices", "select_device"]
