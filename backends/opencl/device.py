"""OpenCL device discovery, selection, capability probing and the program cache.

pyopencl is imported here and only here (lazily guarded), so ``import edgeinfer`` and
``import edgeinfer.backends`` never pull it in; a missing pyopencl or a machine without
an OpenCL platform becomes :class:`OpenCLUnavailableError` with the fix in the message.

Device specs accepted by :func:`select_device` (and the ``EDGEINFER_OPENCL_DEVICE``
environment variable read by the backend): ``"N"`` (index into :func:`list_devices`),
``"P:D"`` (platform P, its device D), or a case-insensitive substring of
"platform name / device name". ``None`` picks the first GPU, else accelerator, else CPU.

Kernel objects are built once per (file, name, build options) and carry declared scalar
argument dtypes (:func:`scalar_arg_dtypes`), so launches pass plain Python numbers through
pyopencl's fast path. ``EDGEINFER_OPENCL_FUSED=0/1`` turns the fused decode path (CPU
devices' default, see ``backend.py``) off or on.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import quantized as _q

try:  # the backend-neutral error class, once the lead adds backends/errors.py
    from ..errors import BackendUnavailableError as _UnavailableBase  # type: ignore
except ImportError:  # pragma: no cover - depends on the tree
    _UnavailableBase = RuntimeError

try:
    import pyopencl as cl
    _IMPORT_ERROR: ImportError | None = None
except ImportError as e:  # pragma: no cover - depends on the environment
    cl = None
    _IMPORT_ERROR = e

ENV_DEVICE = "EDGEINFER_OPENCL_DEVICE"
ENV_FUSED = "EDGEINFER_OPENCL_FUSED"
KERNEL_DIR = Path(__file__).resolve().parent


class OpenCLUnavailableError(_UnavailableBase):
    """OpenCL cannot be used here: no pyopencl, no platform, bad device spec, missing fp16."""


def _require_pyopencl():
    if cl is None:
        raise OpenCLUnavailableError(
            f"the OpenCL backend needs pyopencl ({_IMPORT_ERROR}); install it with "
            "`pip install 'edgeinfer[opencl]'` (pyopencl with PoCL, a CPU OpenCL device)")
    return cl


def _platforms():
    _require_pyopencl()
    try:
        plats = cl.get_platforms()
    except cl.Error as e:  # PLATFORM_NOT_FOUND_KHR when the ICD loader finds nothing
        plats = []
        err = e
    else:
        err = None
    if not plats:
        raise OpenCLUnavailableError(
            "no OpenCL platform found"
            + (f" ({err})" if err else "")
            + "; install your GPU vendor's OpenCL driver (ICD), or the PoCL CPU runtime with "
              "`pip install 'edgeinfer[opencl]'` (or `pip install pocl-binary-distribution`), "
              "or use --backend cpu")
    return plats



def _type_name(t: int) -> str:
    names = []
    for attr in ("GPU", "CPU", "ACCELERATOR", "CUSTOM"):
        if t & getattr(cl.device_type, attr, 0):
            names.append(attr.lower())
    return "+".join(names) or "other"


@dataclass(frozen=True)
class DeviceCaps:
    """What the kernels may rely on; derived once per device.

    Attributes:
        fp16: ``cl_khr_fp16`` (half arithmetic). Not needed for fp16 *storage*:
            vload_half / vstore_half are core OpenCL and are what the kernels use.
        subgroups: ``cl_khr_subgroups`` or ``cl_intel_subgroups`` is present (reported;
            the reductions use local memory, which every device has).
        lws: work-group size of the reduction kernels (GEMV, RMSNorm, attention).
        rows: output rows per GEMV work-group.
        ts: GEMM tile edge (work-group ts x ts); rt: tokens per GEMM work-item.
        max_hd: largest head dim the attention kernel accepts.
        max_wg: the device's largest work-group.
        split_kv_chunk: keys per work-group of the split-KV attention (0 = never split);
            used when at most ``split_kv_max_t`` queries see more than two chunks.
        fused: decode (T = 1) defers ops and runs the fused row-per-item kernels of
            ``fused.cl`` (CPU devices; ``EDGEINFER_OPENCL_FUSED=0/1`` overrides).
        rlws: work-group size of the row kernels (rows per group).
        kmax: most input features the row kernels stage in local memory.
    """

    fp16: bool
    subgroups: bool
    lws: int
    rows: int
    ts: int
    rt: int
    max_hd: int
    max_wg: int
    split_kv_chunk: int = 0
    split_kv_max_t: int = 4
    fused: bool = False
    rlws: int = 16
    kmax: int = 8192


def _pow2_floor(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def probe_caps(dev) -> DeviceCaps:
    """Choose kernel variants and launch shapes from the device's reported limits."""
    ext = dev.extensions.split()
    max_wg = int(dev.max_work_group_size)
    local = int(dev.local_mem_size)
    is_cpu = bool(dev.type & cl.device_type.CPU)
    # GPUs: 64 items (two NVIDIA warps, one AMD wavefront) per reduction group: enough to
    # hide latency yet few idle items on short rows (576 INT4 columns = 72 words).
    # CPUs (PoCL) run a work-group as a loop on one core; 16 items x 4 rows was the best
    # of 8/16/32/64 x 1/4/8 in one (noisy, shared-machine) sweep. GPU values are untested.
    lws = min(_pow2_floor(max_wg), 16 if is_cpu else 64)
    rows = 4
    # GEMM tile: 16x16 items with RT=4 tokens each needs (64*17 + 16*17) * 4 B = 5.4 KB.
    ts = 16 if max_wg >= 256 and local >= 8 * 1024 else 8
    return DeviceCaps(
        fp16="cl_khr_fp16" in ext,
        subgroups=("cl_khr_subgroups" in ext or "cl_intel_subgroups" in ext),
        lws=max(lws, 2), rows=rows, ts=ts, rt=4, max_hd=256, max_wg=_pow2_floor(max_wg),
        # GPUs need many work-groups in flight: decode has only Hq of them unless the keys
        # are split. A CPU has 2-16 cores, which Hq groups already fill.
        split_kv_chunk=0 if is_cpu else 256,
        # One output row per work-item suits a CPU (a group is a loop on one core) and is
        # what the fused decode kernels do; GPUs keep the cooperative per-op kernels
        # (a row per item would not coalesce), so they run unfused.
        fused=_env_flag(ENV_FUSED, is_cpu), rlws=min(16, _pow2_floor(max_wg)),
        kmax=max(8, min(8192, (local // 4 - 64) // 8 * 8)))


def _env_flag(name: str, default: bool) -> bool:
    v = os.environ.get(name, "").strip().lower()
    if v in ("0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    return default


def _describe(pi: int, di: int, plat, dev, index: int) -> dict:
    ext = dev.extensions.split()
    return {
        "index": index,
        "id": f"{pi}:{di}",
        "platform": plat.name.strip(),
        "name": dev.name.strip(),
        "type": _type_name(dev.type),
        "version": dev.version.strip(),
        "global_mem_bytes": int(dev.global_mem_size),
        "local_mem_bytes": int(dev.local_mem_size),
        "max_work_group_size": int(dev.max_work_group_size),
        "compute_units": int(dev.max_compute_units),
        "fp16": "cl_khr_fp16" in ext,
        "subgroups": "cl_khr_subgroups" in ext or "cl_intel_subgroups" in ext,
    }


def _enumerate():
    """[(platform_index, device_index, platform, device)] over every platform."""
    out = []
    for pi, plat in enumerate(_platforms()):
        try:
            devs = plat.get_devices()
        except cl.Error:  # a platform with no devices raises DEVICE_NOT_FOUND
            devs = []
        out.extend((pi, di, plat, d) for di, d in enumerate(devs))
    return out


def list_devices() -> list[dict]:
    """Every OpenCL device, for ``edgeinfer devices``.

    Returns:
        One dict per device: ``index`` (flat, usable as a device spec), ``id`` ("P:D"),
        ``platform``, ``name``, ``type`` ("gpu"/"cpu"/...), ``version``,
        ``global_mem_bytes``, ``local_mem_bytes``, ``max_work_group_size``,
        ``compute_units``, ``fp16`` (cl_khr_fp16), ``subgroups``.

    Raises:
        OpenCLUnavailableError: pyopencl missing or no platform.
    """
    return [_describe(pi, di, p, d, i) for i, (pi, di, p, d) in enumerate(_enumerate())]


def select_device(spec: str | int | None = None):
    """Resolve a device spec to a ``pyopencl.Device``.

    Args:
        spec: ``None`` (first GPU, else accelerator, else CPU), an int or ``"N"`` (index
            into :func:`list_devices`), ``"P:D"`` (platform:device), or a name substring.

    Returns:
        (device, description dict as in :func:`list_devices`).

    Raises:
        OpenCLUnavailableError: no platform/device, index out of range, no name match.
    """
    devs = _enumerate()
    if not devs:
        raise OpenCLUnavailableError("OpenCL platforms exist but expose no device")

    def avail() -> str:
        return "; ".join(f"{i} ({pi}:{di}) {p.name.strip()} / {d.name.strip()}"
                         for i, (pi, di, p, d) in enumerate(devs))

    def pick(i: int):
        pi, di, p, d = devs[i]
        return d, _describe(pi, di, p, d, i)

    if spec is None or (isinstance(spec, str) and not spec.strip()):
        for kind in ("GPU", "ACCELERATOR", "CPU"):
            for i, (_, _, _, d) in enumerate(devs):
                if d.type & getattr(cl.device_type, kind):
                    return pick(i)
        return pick(0)
    if isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit()):
        i = int(spec)
        if not 0 <= i < len(devs):
            raise OpenCLUnavailableError(
                f"OpenCL device index {i} is out of range: {len(devs)} device(s) available: {avail()}")
        return pick(i)
    s = str(spec).strip()
    if ":" in s and all(part.strip().isdigit() for part in s.split(":", 1)):
        pi, di = (int(x) for x in s.split(":", 1))
        for i, (p_i, d_i, _, _) in enumerate(devs):
            if (p_i, d_i) == (pi, di):
                return pick(i)
        raise OpenCLUnavailableError(
            f"OpenCL device {pi}:{di} (platform:device) does not exist; available: {avail()}")
    low = s.lower()
    for i, (_, _, p, d) in enumerate(devs):
        if low in f"{p.name.strip()} / {d.name.strip()}".lower():
            return pick(i)
    raise OpenCLUnavailableError(
        f"no OpenCL device name matches {s!r}; available: {avail()} "
        f"(pass an index, 'platform:device', or a substring of a name)")


def layout_defines() -> dict[str, str]:
    """Build-option constants taken from :mod:`edgeinfer.backends.quantized`."""
    return {
        "NIBBLES_PER_BYTE": str(_q.NIBBLES_PER_BYTE),
        "SYMMETRIC_ZERO_4BIT": str(_q.SYMMETRIC_ZERO_4BIT),
        "FP16_MAX": f"{_q.FP16_MAX:.1f}f",
    }


_SCALAR_DTYPES = {"int": np.int32, "uint": np.uint32, "float": np.float32}


def scalar_arg_dtypes(src: str, name: str) -> list:
    """Per argument of kernel ``name`` in ``src``: the numpy dtype of a scalar, None for a
    pointer (for ``Kernel.set_scalar_arg_dtypes``).

    Why: pyopencl sets an untyped numpy-scalar argument through a slow generic path; with
    declared dtypes it packs plain Python numbers with ``struct``.

    Raises:
        ValueError: no ``__kernel`` named ``name``, or an argument type not handled.
    """
    m = re.search(r"__kernel\b[^;{]*?\bvoid\s+" + re.escape(name) + r"\s*\(([^)]*)\)", src)
    if m is None:
        raise ValueError(f"kernel {name!r} not found in its source")
    out = []
    for arg in m.group(1).split(","):
        if "*" in arg:
            out.append(None)
            continue
        words = [w for w in arg.split() if w not in ("const", "__private")]
        if len(words) != 2 or words[0] not in _SCALAR_DTYPES:
            raise ValueError(f"kernel {name!r}: unsupported scalar argument {arg.strip()!r}")
        out.append(_SCALAR_DTYPES[words[0]])
    return out


# Extra compiler flags per kernel file. The quantized KV cache computes codes as
# rint(y / s): a correctly rounded division makes them equal numpy's bit for bit (the
# K rotation's sums may still round differently at a boundary: see kvformat).
_FILE_FLAGS = {"attention_q.cl": ["-cl-fp32-correctly-rounded-divide-sqrt"]}


class DeviceContext:
    """One context + in-order queue per device, shared by backend instances, with a
    program cache keyed by (file, build options): each program is built once."""

    def __init__(self, dev):
        self.device = dev
        self.context = cl.Context([dev])
        self.queue = cl.CommandQueue(self.context)
        self.caps = probe_caps(dev)
        self._programs: dict[tuple, object] = {}
        self._kernels: dict[tuple, object] = {}
        self._sources: dict[str, str] = {}
        self.builds = 0  # number of programs compiled (tests check the cache works)

    def options(self, **variant) -> list[str]:
        c = self.caps
        d = dict(layout_defines(), LWS=c.lws, ROWS=c.rows, TS=c.ts, RT=c.rt, MAX_HD=c.max_hd,
                 RLWS=c.rlws, KMAX=c.kmax)
        d.update(variant)
        return [f"-D{k}={v}" for k, v in sorted(d.items())]

    def kernel(self, file: str, name: str, **variant):
        """The kernel ``name`` of ``file`` built with this device's options + ``variant``."""
        key = (file, name, tuple(sorted(variant.items())))
        k = self._kernels.get(key)
        if k is None:
            opts = self.options(**variant)
            pkey = (file, tuple(opts))
            prog = self._programs.get(pkey)
            src = self._source(file)
            if prog is None:
                try:
                    prog = cl.Program(self.context, src).build(
                        options=opts + _FILE_FLAGS.get(file, []))
                except cl.RuntimeError as e:
                    raise OpenCLUnavailableError(
                        f"building {file} with {' '.join(opts)} failed on "
                        f"{self.device.name.strip()}: {e}") from e
                self._programs[pkey] = prog
                self.builds += 1
            k = cl.Kernel(prog, name)
            k.set_scalar_arg_dtypes(scalar_arg_dtypes(src, name))
            self._kernels[key] = k
        return k

    def _source(self, file: str) -> str:
        src = self._sources.get(file)
        if src is None:
            src = (KERNEL_DIR / "common.cl").read_text() + "\n" + (KERNEL_DIR / file).read_text()
            self._sources[file] = src
        return src


_CONTEXTS: dict[int, DeviceContext] = {}


def device_context(dev) -> DeviceContext:
    """The shared :class:`DeviceContext` of ``dev`` (created on first use)."""
    key = int(dev.int_ptr)
    ctx = _CONTEXTS.get(key)
    if ctx is None:
        ctx = _CONTEXTS[key] = DeviceContext(dev)
    return ctx


def env_device_spec() -> str | None:
    """The ``EDGEINFER_OPENCL_DEVICE`` value, if set (apps select a device without code)."""
    v = os.environ.get(ENV_DEVICE)
    return v if v else None
