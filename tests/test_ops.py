"""The op-parity matrix: every op of the backend contract (``backends/base.py``), on every
backend, against the numpy reference backend (the oracle), case by case, in the manner
of llama.cpp's test-backend-ops.

One error metric: ``NMSE = ||y - y_ref||² / ||y_ref||²`` (float64, over one op call; an
attention sequence takes the worst call; a zero reference requires an exactly zero
output). One threshold per dtype class (:data:`THRESHOLD`):

* ``f32``: float32 math on both sides (norms, RoPE, GLU, add, embeddings, dense and
  dequantized-tile linears, attention over float32 / f16 / the backend's own stored
  quantized K/V): 1e-10, i.e. a relative error norm of 1e-5;
* ``act8``: the CPU backend's integer linears on quantized weights (decode GEMV and
  prefill GEMM alike), whose activations are rounded per 32-block (to 15-bit integers;
  int8, llama.cpp's Q8_0 recipe, before): 5e-4, the bound test-backend-ops uses for
  quantized matmuls (relative error norm 2.2e-2);
* ``kvq``: OpenCL attention over a quantized cache against the reference's own cache of
  that format: 1e-6. A device may store a different code where a rotated K value lies
  within float32 rounding of a boundary (``tests/kv_admissible.py``), which moves the
  output by ~1e-4 relative; so the same call is also checked at ``f32`` against the
  reference attending over the backend's own stored K/V (dequantized). The CPU backend
  writes the reference's bytes (``test_cpu_kernels.py``): its quantized caches are ``f32``.

Backends (``tests/parity.py``): ``cpu`` (Numba, default options), ``cpu-exact``
(``exact_decode=True``: float activations; linears and heads), ``opencl-fused`` /
``opencl-unfused`` (the default device, PoCL here, with its row kernels and fused paths
forced on / off; attention once, as it does not depend on them), ``opencl-splitkv`` (the
split-KV attention forced, 16-key chunks; f32 / f16 attention).
OpenCL cases skip, naming why, only when pyopencl or an OpenCL device is missing.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest

from edgeinfer.backends.quantized import QuantizedTensor, pack_nibbles
from edgeinfer.backends.reference import ReferenceBackend
from parity import backend, nmse

THRESHOLD = {"f32": 1e-10, "act8": 5e-4, "kvq": 1e-6}

REF = ReferenceBackend()
OPENCL = ("opencl-fused", "opencl-unfused")
ALL = ("cpu",) + OPENCL
LINEAR = ("cpu", "cpu-exact") + OPENCL
ATTENTION = ("cpu", "opencl-fused")
ATTENTION_SPLIT = ATTENTION + ("opencl-splitkv",)
KV_DTYPES = ("f32", "f16", "int8", "int4", "k8v4")
KV_QUANT = ("int8", "int4", "k8v4")


# ---- weights ----------------------------------------------------------------------------
def rand_q4(rng, out, n_in, g, symmetric, scale_dtype=np.float16, scale=0.1):
    """int4 codes random everywhere, padding included (padded columns dequantize to
    nonzero values, so a kernel that reads past ``in_features`` is caught). g = -1:
    per-channel (one group per row)."""
    g = n_in + n_in % 2 if g == -1 else g
    in_pad = -(-n_in // g) * g
    ng = in_pad // g
    codes = rng.integers(0, 16, (out, in_pad))
    scales = (rng.random((out, ng)) * scale + scale / 10).astype(scale_dtype)
    zeros = None if symmetric else pack_nibbles(rng.integers(0, 16, (out, ng)))
    return QuantizedTensor(pack_nibbles(codes), scales, zeros, 4, g, n_in)


def rand_q8(rng, out, n_in, g, scale_dtype=np.float16):
    """int8 codes over the full range, -128 included."""
    g = n_in if g == -1 else g
    in_pad = -(-n_in // g) * g
    codes = rng.integers(-128, 128, (out, in_pad)).astype(np.int8)
    scales = (rng.random((out, in_pad // g)) * 0.01 + 0.001).astype(scale_dtype)
    return QuantizedTensor(codes, scales, None, 8, g, n_in)


def _weight(rng, fmt, out, n_in, g=32, sym=False):
    if fmt == "dense":
        return rng.standard_normal((out, n_in)).astype(np.float32)
    if fmt == "q4":
        return rand_q4(rng, out, n_in, g, sym)
    return rand_q8(rng, out, n_in, g)


# ---- the case table ---------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """``run(be, name)`` returns ``(outputs, class, *extra)``: the host outputs (one array
    or a list, one per call), compared with ``run(REF, "reference")``'s at ``class``;
    each extra ``(outputs, reference outputs, class)`` is a further comparison the run
    computed from the backend's own state."""

    op: str
    name: str
    backends: tuple
    run: Callable = field(repr=False)

    @property
    def id(self) -> str:
        return f"{self.op}-{self.name}"


CASES: list[Case] = []


def case(op, name, backends=ALL):
    def deco(fn):
        CASES.append(Case(op, name, backends, fn))
        return fn
    return deco


def _seed(*parts) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


# linear -----------------------------------------------------------------------------------
def _linear_class(be, name, w, h, t):
    from edgeinfer.backends.cpu import CpuQuantWeight

    if name == "cpu" and isinstance(h, CpuQuantWeight):  # any T: one integer numerics
        return "act8"
    return "f32"


def _add_linear(label, make_w, t, bias=False, x_fn=None, backends=LINEAR):
    def run(be, name, make_w=make_w, t=t, bias=bias, x_fn=x_fn, label=label):
        rng = _seed("linear", label, t)
        w = make_w(rng)
        n_out, n_in = w.shape
        x = (x_fn or (lambda r, s: r.standard_normal(s).astype(np.float32)))(rng, (t, n_in))
        b = rng.standard_normal(n_out).astype(np.float32) if bias else None
        h = be.upload_weight(w)
        y = be.linear(be.upload(x), h, None if b is None else be.upload(b))
        return be.to_host(y), _linear_class(be, name, w, h, t)
    CASES.append(Case("linear", f"{label}-t{t}", backends, run))


for _t in (1, 3, 37):  # dense: odd sizes, one element, padded widths
    for _o, _i in [(1, 1), (7, 13), (33, 64), (33, 70), (130, 257)]:
        _add_linear(f"dense-{_o}x{_i}", lambda r, o=_o, i=_i: _weight(r, "dense", o, i), _t,
                    bias=_o % 2 == 1)
_add_linear("dense-large-magnitudes", lambda r: _weight(r, "dense", 16, 128) * 1e3, 1,
            x_fn=lambda r, s: (r.standard_normal(s) * 1e3).astype(np.float32))

# int4: group sizes 16 (groups straddle 32-blocks), 32, 64, 128, per-channel; sym / asym;
# odd row counts, in_features padded to the group, one column past a block
_INT4 = [(19, 200), (64, 256), (5, 37)]
for _t in (1, 2, 5):
    for _o, _i in _INT4:
        for _g in (32, 64, 128, -1):
            for _sym in (True, False):
                _add_linear(f"q4-{_o}x{_i}-g{_g}-{'sym' if _sym else 'asym'}",
                            lambda r, o=_o, i=_i, g=_g, s=_sym: rand_q4(r, o, i, g, s), _t,
                            bias=_sym)
    for _o, _i, _g, _sym in [(37, 172, 32, False), (13, 896, 128, False), (6, 100, -1, True),
                             (7, 64, 16, False), (5, 33, 32, True),
                             (302, 576, 64, False)]:  # 302 rows: the CPU's parallel GEMV
        _add_linear(f"q4-{_o}x{_i}-g{_g}-{'sym' if _sym else 'asym'}",
                    lambda r, o=_o, i=_i, g=_g, s=_sym: rand_q4(r, o, i, g, s), _t, bias=True)
    # int8: per-row (lm_head style), groups 13 / 32 / 50 / 64 / 101, parallel rows
    for _o, _i, _g in [(9, 576, -1), (13, 200, 32), (3, 70, 64), (131, 576, -1),
                       (23, 96, 32), (23, 100, 64), (23, 39, 13), (23, 101, 101)]:
        _add_linear(f"q8-{_o}x{_i}-g{_g}", lambda r, o=_o, i=_i, g=_g: rand_q8(r, o, i, g), _t,
                    bias=True)


def _q4_f32_scales(r):  # float32 scales beyond the fp16 range
    w = rand_q4(r, 9, 70, 32, False, np.float32)
    w.scales[:] *= 1e5
    return w


for _t in (1, 4):
    _add_linear("q4-f32-scales-1e5", _q4_f32_scales, _t)
    _add_linear("q4-g10", lambda r: rand_q4(r, 9, 70, 10, False), _t)  # group not a multiple of 8
    for _g, _sym in ((128, False), (32, True), (-1, False)):  # the converter's quantizer
        def _rtn(r, g=_g, sym=_sym):
            from edgeinfer.quant.rtn import quantize_rtn
            return quantize_rtn(r.standard_normal((48, 172)).astype(np.float32), 4, g, sym)
        _add_linear(f"q4-rtn-g{_g}-{'sym' if _sym else 'asym'}", _rtn, _t)
for _fmt, _g in (("dense", 32), ("q4", 32), ("q8", 50)):  # T = 130: many GEMM tiles
    _add_linear(f"{_fmt}-many-tiles", lambda r, f=_fmt, g=_g: _weight(r, f, 70, 100, g), 130,
                bias=True)


def _outlier(r, s):  # one activation of 40 (CPU decode: the provable bound, test_cpu_kernels.py)
    x = r.standard_normal(s).astype(np.float32)
    x[0, s[1] // 2] = 40.0
    return x


for _t in (1, 2, 5):
    for _bits, _o, _i, _g in [(4, 37, 172, 32), (4, 64, 256, 64), (4, 13, 896, 128),
                              (4, 6, 100, -1), (4, 7, 64, 16), (4, 5, 33, 32), (4, 302, 576, 64),
                              (8, 9, 576, -1), (8, 13, 200, 32), (8, 3, 70, 64),
                              (8, 131, 576, -1)]:
        _add_linear(f"q{_bits}-{_o}x{_i}-g{_g}-outlier",
                    lambda r, b=_bits, o=_o, i=_i, g=_g: (rand_q4(r, o, i, g, False) if b == 4
                                                          else rand_q8(r, o, i, g)),
                    _t, bias=True, x_fn=_outlier,
                    backends=LINEAR if _t > 2 else ("cpu-exact",) + OPENCL)
_add_linear("q4-large-magnitudes", lambda r: rand_q4(r, 40, 256, 32, False, scale=300.0), 1,
            x_fn=lambda r, s: (r.standard_normal(s) * 1e4).astype(np.float32))
_add_linear("q4-zero-activations", lambda r: rand_q4(r, 40, 256, 32, False), 1,
            x_fn=lambda r, s: np.zeros(s, np.float32))
for _fmt in ("dense", "q4", "q8"):
    _add_linear(f"{_fmt}-zero-activations", lambda r, f=_fmt: _weight(r, f, 24, 64), 2,
                x_fn=lambda r, s: np.zeros(s, np.float32))


def _stale_x(fmt):
    """Pooled device buffers are larger than the tensor and hold stale data (NaN here): a
    GEMV that reads x past in_features turns its row into NaN."""
    def run(be, name):
        rng = _seed("stale", fmt)
        w = _weight(rng, fmt, 130, 257)
        x = rng.standard_normal((1, 257)).astype(np.float32)
        h = be.upload_weight(w)
        if name == "reference":
            return be.linear(x, h), "f32"
        from edgeinfer.backends.opencl.memory import DeviceTensor

        padded = be.upload(np.concatenate([x[0], np.full(64, np.nan, np.float32)]))
        return be.to_host(be.linear(DeviceTensor(padded._block, (1, 257)), h)), "f32"
    return run


for _fmt in ("dense", "q4", "q8"):
    CASES.append(Case("linear", f"{_fmt}-stale-values-past-x", OPENCL, _stale_x(_fmt)))


# linear_many (LinearGroup: q/k/v, gate/up) -----------------------------------------------
def _linear_many(members, t):
    def run(be, name):
        rng = _seed("linear_many", members, t)
        ws = [_weight(rng, fmt, o, 256, g) for fmt, o, g in members]
        bs = [rng.standard_normal(o).astype(np.float32) if i != 1 else None
              for i, (_, o, _) in enumerate(members)]
        x = rng.standard_normal((t, 256)).astype(np.float32)
        hs = [be.upload_weight(w) for w in ws]
        grp = be.group_linears(hs, [None if b is None else be.upload(b) for b in bs])
        ys = be.linear_many(be.upload(x), grp)
        cls = max((_linear_class(be, name, w, h, t) for w, h in zip(ws, hs)),
                  key=lambda c: THRESHOLD[c])
        return [be.to_host(y) for y in ys], cls
    return run


for _t in (1, 2, 7):
    for _label, _members in [("q4-g32", (("q4", 96, 32), ("q4", 32, 32), ("q4", 32, 32))),
                             ("q4-g128", (("q4", 96, 128), ("q4", 32, 128), ("q4", 32, 128))),
                             ("q8-pc", (("q8", 96, -1), ("q8", 32, -1), ("q8", 32, -1))),
                             ("dense", (("dense", 96, 0), ("dense", 32, 0), ("dense", 32, 0))),
                             ("mixed", (("q4", 16, 32), ("q8", 8, -1), ("dense", 4, 0)))]:
        CASES.append(Case("linear_many", f"{_label}-t{_t}", LINEAR, _linear_many(_members, _t)))


# embed and the output head ----------------------------------------------------------------
def _table(rng, kind, v=50, d=72):
    if kind == "dense":
        return rng.standard_normal((v, d)).astype(np.float32)
    if kind == "q8":
        return rand_q8(rng, v, d, 32)
    return rand_q4(rng, v, d, 32, kind == "q4sym")


for _kind in ("dense", "q4", "q4sym", "q8"):
    for _d in (40, 72):
        def _embed(be, name, kind=_kind, d=_d):
            rng = _seed("embed", kind, d)
            tab = be.upload_embedding(_table(rng, kind, 50, d))
            ids = np.array([0, 49, 7, 7, 1], np.int32)
            return [be.to_host(be.embed(tab, ids, s)) for s in (1.0, 1.5, 6.5)], "f32"
        CASES.append(Case("embed", f"{_kind}-d{_d}", ALL, _embed))

for _kind in ("dense", "q4", "q4sym", "q8"):
    for _variant in ("plain", "softcap", "norm", "norm-unit-offset-softcap"):
        for _t in (1, 3):
            def _logits(be, name, kind=_kind, variant=_variant, t=_t):
                """The tied head: the embedding handle used as the output projection."""
                rng = _seed("logits", kind, variant, t)
                tab = be.upload_embedding(_table(rng, kind))
                x = (rng.standard_normal((t, 72)) * 3).astype(np.float32)
                w = rng.standard_normal(72).astype(np.float32)
                norm = None
                if variant.startswith("norm"):
                    norm = (be.upload(w), 1e-6, "unit-offset" in variant)
                softcap = 5.0 if "softcap" in variant else None
                return be.logits(be.upload(x), tab, softcap, norm), \
                    _linear_class(be, name, None, tab, t)
            CASES.append(Case("logits", f"tied-{_kind}-{_variant}-t{_t}", LINEAR, _logits))
for _fmt, _g in (("dense", 0), ("q4", 128), ("q8", -1)):
    def _head(be, name, fmt=_fmt, g=_g):
        """An untied head [V, D] uploaded as a linear weight, with the final norm."""
        rng = _seed("head", fmt)
        head = be.upload_weight(_weight(rng, fmt, 300, 256, g))
        x = rng.standard_normal((1, 256)).astype(np.float32)
        w = rng.standard_normal(256).astype(np.float32)
        return be.logits(be.upload(x), head, None, (be.upload(w), 1e-5, False)), \
            _linear_class(be, name, None, head, 1)
    CASES.append(Case("logits", f"head-{_fmt}-norm", LINEAR, _head))


# rmsnorm ----------------------------------------------------------------------------------
for _shape in [(1, 1), (3, 17), (1, 64), (5, 576), (70, 1000), (2, 4, 64), (5, 3, 7), (3, 4, 8)]:
    for _uo in (False, True):
        def _rmsnorm(be, name, shape=_shape, uo=_uo):
            rng = _seed("rmsnorm", shape, uo)
            x = (rng.standard_normal(shape) * 1e3).astype(np.float32)
            w = rng.standard_normal(shape[-1]).astype(np.float32)
            return be.to_host(be.rmsnorm(be.upload(x), be.upload(w), 1e-6, uo)), "f32"
        CASES.append(Case("rmsnorm", f"{'x'.join(map(str, _shape))}-"
                          f"{'unit-offset' if _uo else 'plain'}", ALL, _rmsnorm))


@case("rmsnorm", "large-magnitudes")
def _rmsnorm_large(be, name):
    x = np.full((2, 256), 3e4, np.float32)
    x[1, ::2] = -1e15
    return be.to_host(be.rmsnorm(be.upload(x), be.upload(np.ones(256, np.float32)), 1e-5)), "f32"


# rope -------------------------------------------------------------------------------------
_ROPE = [(1, 9, 64, 64, "random"), (7, 2, 8, 8, "random"), (300, 3, 16, 8, "random")] + [
    (5, 3, hd, rot, pos) for hd, rot in ((8, 8), (64, 64), (32, 16), (10, 6))
    for pos in ("contig", "scatter")]
for _t, _h, _hd, _rot, _pos in _ROPE:
    def _rope(be, name, t=_t, h=_h, hd=_hd, rot=_rot, pos=_pos):
        """Partial rotary (rot < hd passes dims >= rot through), scattered and repeated
        positions, random angles (any table, not only RoPE's)."""
        rng = _seed("rope", t, h, hd, rot, pos)
        x = rng.standard_normal((t, h, hd)).astype(np.float32)
        if pos == "random":
            ang = rng.random((512, rot // 2)).astype(np.float32) * 6
            p = rng.integers(0, 512, t).astype(np.int32)
        else:
            inv = 1.0 / (10000 ** (np.arange(0, rot, 2) / rot))
            ang = np.arange(64)[:, None] * inv[None, :]
            p = np.arange(7, 7 + t) if pos == "contig" else np.array([0, 63, 5, 5, 20])
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        return be.to_host(be.rope(be.upload(x), be.upload(cos), be.upload(sin),
                                  p.astype(np.int32))), "f32"
    CASES.append(Case("rope", f"t{_t}-h{_h}-hd{_hd}-rot{_rot}-{_pos}", ALL, _rope))


# glu, add ---------------------------------------------------------------------------------
for _act in ("silu", "gelu_tanh"):
    for _shape in [(1, 1536), (40, 1536), (3, 101)]:
        def _glu(be, name, act=_act, shape=_shape):
            """Including extremes where exp overflows or the tanh saturates."""
            rng = _seed("glu", act, shape)
            g = (rng.standard_normal(shape) * 8).astype(np.float32)
            g[0, :7] = [-1e4, -100.0, 0.0, 100.0, 1e4, -88.8, -30.0]
            u = rng.standard_normal(shape).astype(np.float32)
            with np.errstate(over="ignore"):
                return be.to_host(be.glu(be.upload(g), be.upload(u), act)), "f32"
        CASES.append(Case("glu", f"{_act}-{_shape[0]}x{_shape[1]}", ALL, _glu))

for _shape in [(2, 3), (4, 6), (7, 576)]:
    def _add(be, name, shape=_shape):
        rng = _seed("add", shape)
        a, b = ((rng.standard_normal(shape) * 1e3).astype(np.float32) for _ in range(2))
        return be.to_host(be.add(be.upload(a), be.upload(b))), "f32"
    CASES.append(Case("add", "x".join(map(str, _shape)), ALL, _add))


# attention --------------------------------------------------------------------------------
def _kv(rng, t, h, hd, kind, mag=1.0):
    k = (rng.standard_normal((t, h, hd)) * 2 * mag).astype(np.float32)
    v = rng.standard_normal((t, h, hd)).astype(np.float32)
    if kind == "outlier":  # one K channel x50, one token's V far beyond the f16 range
        k[:, :, 3] *= 50
        v[0] *= 1e6
    elif kind == "zeros":  # zero rows: zero scale, all-zero codes, no NaN
        k[0], v[0] = 0, 0
    elif kind == "ties":  # values on rounding boundaries
        k = (np.round(k * 4) / 4).astype(np.float32)
        v = (np.round(v * 2) / 2).astype(np.float32)
    elif kind == "saturate":  # beyond f16: stored saturated, never inf
        k[:] = 1e6
        k[-1] = -3e5
    return k, v


def _attention(heads, steps, dtype, window=None, softcap=None, ring=None, max_tokens=64,
               mag=1.0, k_shift=None, scale=None, q_mag=2.0):
    """``steps``: (T, kind) per call, the first a prefill. With ``ring`` = (window,
    max_chunk), layer 0 is a sliding-window ring and layer 1 global, both called per step;
    otherwise layer 1 of two. For OpenCL's quantized caches also the reference over the
    backend's own stored K/V (f32 class; the same-format comparison is then ``kvq``)."""
    hq, hkv, hd = heads
    sc = scale if scale is not None else hd ** -0.5

    def run(be, name):
        rng = _seed("attention", heads, steps, dtype, window, softcap, ring, mag)
        kw = {"window_sizes": [ring[0], None], "max_chunk": ring[1]} if ring else {}
        cache = be.new_kv_cache(2, hkv, hd, max_tokens, dtype, **kw)
        own = REF.new_kv_cache(2, hkv, hd, max_tokens, "f32")
        layers = [(0, ring[0]), (1, None)] if ring else [(1, window)]
        outs, refs, pos = [], [], 0
        for t, kind in steps:
            q = (rng.standard_normal((t, hq, hd)) * q_mag * mag).astype(np.float32)
            k, v = _kv(rng, t, hkv, hd, kind, mag)
            if k_shift is not None:
                k = k + k_shift
            for layer, win in layers:
                y = be.attention(be.upload(q), be.upload(k), be.upload(v), cache, layer, pos,
                                 sc, win, softcap)
                outs.append(be.to_host(y))
                if dtype in KV_QUANT and name.startswith("opencl"):
                    kk, vv = cache.read(layer, pos + t)
                    refs.append(REF.attention(q, kk[pos:], vv[pos:], own, layer, pos, sc, win,
                                              softcap))
            pos += t
        if not refs:  # float caches; the CPU backend writes the reference's bytes
            return outs, "f32"
        return outs, "kvq", (outs, refs, "f32")
    return run


_PREFILL_DECODE = ((20, "plain"), (7, "plain"), (1, "plain"), (1, "plain"), (25, "plain"),
                   (4, "plain"), (1, "plain"))
for _heads in [(8, 2, 8), (9, 3, 64), (4, 4, 16), (8, 4, 8), (4, 4, 64), (6, 2, 80),
               (3, 1, 256), (14, 2, 64)]:  # GQA 4:1 / 3:1 / MHA / MQA; head_dim 256
    for _dt in KV_DTYPES:
        CASES.append(Case("attention", f"{_dt}-{'-'.join(map(str, _heads))}",
                          ATTENTION_SPLIT if _dt in ("f32", "f16") else ATTENTION,
                          _attention(_heads, _PREFILL_DECODE, _dt)))
for _dt in KV_DTYPES:
    _bes = ATTENTION_SPLIT if _dt in ("f32", "f16") else ATTENTION
    for _w, _cap in [(1, None), (5, None), (16, None), (None, 30.0), (4, 20.0), (21, 3.0)]:
        CASES.append(Case("attention", f"{_dt}-window{_w}-softcap{_cap}", _bes,
                          _attention((6, 2, 40), ((9, "plain"), (1, "plain"), (1, "plain"),
                                                  (30, "plain"), (6, "plain"), (1, "plain")),
                                     _dt, _w, _cap)))
    CASES.append(Case("attention", f"{_dt}-long-prefill", _bes,
                      _attention((4, 2, 16), ((50, "plain"), (1, "plain"), (13, "plain")), _dt,
                                 max_tokens=80)))
    CASES.append(Case("attention", f"{_dt}-large-scores", _bes,
                      _attention((4, 2, 64), ((6, "plain"), (1, "plain"), (1, "plain")), _dt,
                                 mag=15.0)))
    for _heads in [(9, 3, 64), (14, 2, 64), (4, 4, 16), (6, 2, 80)]:
        CASES.append(Case("attention", f"{_dt}-outliers-zeros-ties-{'-'.join(map(str, _heads))}",
                          ATTENTION, _attention(_heads, ((17, "plain"), (1, "outlier"),
                                                         (9, "ties"), (1, "plain"),
                                                         (1, "zeros")), _dt)))
    CASES.append(Case("attention", f"{_dt}-saturate-f16", ATTENTION,
                      _attention((1, 1, 8), ((2, "saturate"),), _dt, max_tokens=4, scale=1e-6)))
    CASES.append(Case("attention", f"{_dt}-ring-window4", ATTENTION,
                      _attention((4, 2, 16), ((8, "plain"), (8, "plain"), (1, "plain"),
                                              (1, "plain"), (5, "plain"), (1, "plain"),
                                              (16, "plain")), _dt, ring=(4, 16), max_tokens=48)))
    CASES.append(Case("attention", f"{_dt}-ring-window5-softcap", ATTENTION,
                      _attention((4, 2, 32), ((8, "plain"), (1, "plain"), (1, "plain"),
                                              (7, "plain"), (1, "plain"), (8, "plain"),
                                              (1, "plain"), (1, "plain"), (1, "plain")), _dt,
                                 softcap=20.0, ring=(5, 8))))
_K_OFFSET = np.zeros(64, np.float32)
_K_OFFSET[[30, 31, 62, 63]] = [120, -150, 90, 140]
for _dt in KV_QUANT:  # Qwen-like K: large constant per-channel offsets, an outlier channel
    CASES.append(Case("attention", f"{_dt}-large-k-offset", ATTENTION,
                      _attention((14, 2, 64), ((20, "plain"), (1, "plain"), (7, "outlier"),
                                               (1, "plain")), _dt, k_shift=_K_OFFSET, q_mag=1.0)))


# ---- the matrix -------------------------------------------------------------------------
def _params():
    for c in CASES:
        for b in c.backends:
            yield pytest.param(b, c, id=f"{b}-{c.id}")


def _as_list(y):
    return y if isinstance(y, list) else [y]


def _worst(ys, refs) -> float:
    ys, refs = _as_list(ys), _as_list(refs)
    assert len(ys) == len(refs)
    return max(nmse(y, r) for y, r in zip(ys, refs))


@pytest.mark.parametrize("name,c", list(_params()))
def test_op(name, c):
    be = backend(name)
    want, _ = c.run(REF, "reference")[:2]
    got = c.run(be, name)
    ys, cls = got[:2]
    err = _worst(ys, want)
    assert err <= THRESHOLD[cls], f"NMSE {err:.3g} > {THRESHOLD[cls]:g} ({cls})"
    for extra_y, extra_ref, extra_cls in got[2:]:
        err = _worst(extra_y, extra_ref)
        assert err <= THRESHOLD[extra_cls], f"NMSE {err:.3g} > {THRESHOLD[extra_cls]:g} " \
            f"({extra_cls}, against the backend's own stored K/V)"


def test_every_contract_op_is_in_the_matrix():
    """Positive control on the table itself: each op of the contract has cases on every
    backend, and the metric sees a one-ulp-scale error in float32 but not in int8 terms."""
    ops = {"linear", "linear_many", "embed", "logits", "rmsnorm", "rope", "glu", "add",
           "attention"}
    assert {c.op for c in CASES} == ops
    for op in ops:
        bes = {b for c in CASES if c.op == op for b in c.backends}
        assert {"cpu", "opencl-fused"} <= bes, op
    y = np.ones(1000, np.float32)
    assert nmse(y * (1 + 2e-5), y) > THRESHOLD["f32"]
    assert nmse(y * (1 + 5e-6), y) < THRESHOLD["f32"]
    assert nmse(np.zeros(3), np.zeros(3)) == 0.0 and nmse(np.ones(3), np.zeros(3)) == np.inf


@pytest.mark.parametrize("name", ALL)
def test_glu_refuses_an_unknown_activation(name):
    be = backend(name)
    g = be.upload(np.ones((2, 8), np.float32))
    with pytest.raises(ValueError):
        be.glu(g, g, "relu")


class _Off:
    """A backend whose ``op`` returns its output scaled by 1 + 1e-4 (a negative control)."""

    def __init__(self, be, op):
        self._be, self._op = be, op

    def __getattr__(self, name):
        fn = getattr(self._be, name)
        if name != self._op:
            return fn
        be = self._be
        return lambda *a, **k: be.upload(be.to_host(fn(*a, **k)) * np.float32(1 + 1e-4))


@pytest.mark.parametrize("op", ["rmsnorm", "rope", "glu", "attention", "linear"])
@pytest.mark.parametrize("name", ["cpu", "opencl-fused"])
def test_matrix_sees_a_small_error(name, op):
    """Negative control on the pipeline: a 1e-4 relative error in one op fails its cases."""
    c = next(c for c in CASES if c.op == op and name in c.backends)
    want = c.run(REF, "reference")[0]
    ys, cls = c.run(_Off(backend(name), op), name)[:2]
    assert _worst(ys, want) > THRESHOLD[cls]
