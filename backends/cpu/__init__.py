"""The Numba CPU backend: INT4/INT8 integer-dot GEMV for decode and an integer GEMM with
the same per-row numerics for prefill, blocked GQA attention over the host KV cache.

Tensors are host numpy float32 arrays. Quantized weights are repacked once at upload
(:mod:`.repack`); dense float32 weights are used as given (a float32 memmap stays a
memmap). Importing this module imports Numba; ``import edgeinfer.backends`` does not.

Kernel modules: :mod:`.gemv` (decode, T = 1), :mod:`.qgemm` (T > 1 on quantized weights:
prefill, batched decode, speculative verify), :mod:`.gemm` (dense weights, ``exact_decode``),
:mod:`.attention` (f32/f16 cache), :mod:`.kvquant` (int8/int4/k8v4 cache: bit-exact KV
write and attention over the codes), :mod:`.elementwise`, with the SIMD row kernels in
:mod:`._simd` (one token) and :mod:`._simd_tokens` (up to 4 tokens per weight load). :meth:`CpuBackend.group_linears` fuses q/k/v and gate/up into one weight
(one GEMV, one GEMM). Decode steps run as a compiled plan (:mod:`.plan`: one or two
Numba calls per layer for 4-bit plain blocks, :mod:`.stepwise` for the others), which
allocates nothing.

Threading: Numba's OpenMP pool for the integer kernels, started at import by
:func:`.threads.start_threads` (the OpenMP runtime's default wait policy: workers spin a
few ms after a region, so they stay awake while generating and sleep between requests;
a user's ``OMP_WAIT_POLICY`` applies as given; ``os.environ`` is left untouched); a small
Python thread pool with single-threaded OpenBLAS for the BLAS GEMMs (:mod:`.gemm`), so
two spinning pools never fight over the cores. :func:`kernel_paths` and
:func:`.threads.threading_info` say what this process chose.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from . import _numba_cache
from .threads import start_threads, threading_info

# before any kernel module is imported: its dispatchers pick their cache locator when
# decorated (see ._numba_cache: the cache key covers every kernel file)
_numba_cache.install()
# before any kernel can start the threading layer (see .threads: the wait policy is read
# once, when the OpenMP runtime loads)
start_threads()

import numba
import numpy as np

from ..base import Backend, LinearGroup
from ..blockrows import BlockRows
from ..kvcache import HostKVCache, _rotate
from ..osmemory import ForwardReleaser, private_file_view, release_mapped_pages
from ..quantized import QuantizedTensor
from . import _simd_ir
from . import plan as _plan
from .attention import ATTN_SERIAL_MAX, decode_scratch_shape
from .blockrows import dequant_block_rows
from .attention import attention as _attention
from .attention import attention_serial as _attention_serial
from .elementwise import (
    PAR_MIN_ELEMS,
    glu_into,
    is_gelu,
    rmsnorm_rows,
    rmsnorm_rows_par,
    rope_tokens,
    rope_tokens_par,
)
from .gemm import GemmPool, blas_core, gemm_dense, gemm_quant
from .gemv import ActScratch, gemv_quant
from .governor import ThreadGovernor
from ._amx import HAVE_AMX
from ._blockdot import BLOCKDOT
from .qgemm import gemm_int
from .qlane import gemm_lane, row_dequant
from .kvquant import (
    attention_q,
    attention_q_serial,
    decode_scratch_q_shape,
    kv_write_q,
    layer_arrays,
)
from .repack import CpuQuantWeight, repack, repack_q8_view, runs_on_integer_kernels

__all__ = ["CpuBackend", "CpuQuantWeight", "kernel_paths", "physical_cores", "threading_info"]

#: Dense float32 weights: token counts up to this run one BLAS call on the calling thread;
#: above, BLAS tiles on the workers. (Quantized weights: the GEMV for T = 1 only.)
GEMV_MAX_T = 2
_NO_POS = np.zeros(0, np.int64)  # f32 / f16 attention: positions = slots
_NO_SCR = np.zeros((0, 0), np.float32)  # attention scratch: none (items allocate their own)


@dataclass(frozen=True, eq=False)
class FusedLinears(LinearGroup):
    """A :class:`LinearGroup` of repacked weights of one format concatenated row-wise:
    ``weight`` (all members' rows) and ``bias`` (zeros where a member has none, or None);
    member ``i`` is rows ``splits[i]``, and ``weights`` view that storage."""

    weight: CpuQuantWeight = None
    bias: np.ndarray | None = None
    splits: tuple = ()


def physical_cores() -> int:
    """Physical cores available to this process (SMT siblings counted once)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, (os.cpu_count() or 2) // 2)
    seen = set()
    for c in cpus:
        path = f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list"
        try:
            with open(path) as f:
                seen.add(f.read().strip())
        except OSError:
            seen.add(str(c))
    return max(1, len(seen))


def kernel_paths() -> dict[str, str]:
    """The instruction path each kernel family took in this process, chosen at import.

    ``gemv`` (decode integer dots, :mod:`._simd`): ``"avx2"`` or ``"portable"``;
    ``qgemm`` (prefill on quantized weights, :mod:`.qgemm`: the same row kernels);
    on a CPU with AMX also ``gemv_qB`` / ``qgemm_qB`` for B = 4, 5, 8, those weights'
    paths in the block-dot numerics (:mod:`._blockdot`): ``"avx2-blockdot"`` rows,
    ``"amx"`` tiles (from 3-4 tokens: :mod:`._amx_few`, :mod:`._amx`);
    ``gemm`` (dense weights and ``exact_decode``, :mod:`.gemm`): the BLAS library and
    the core its dispatch picked, e.g. ``"openblas:Haswell"``; ``numba``: the CPU LLVM compiles the other kernels
    (attention, elementwise, fused halves) for, e.g. ``"znver3"``.
    """
    import llvmlite.binding as llb
    rows = "avx2" if _simd_ir.HAVE_AVX2 else "portable"
    q4 = {}
    if BLOCKDOT:  # 4-, 5-, 8-bit weights: block-dot numerics, their GEMMs on AMX tiles
        tiles = "amx" if HAVE_AMX else "avx2-blockdot"
        q4 = {k: v for b in (4, 5, 8)
              for k, v in ((f"gemv_q{b}", "avx2-blockdot"), (f"qgemm_q{b}", tiles))}
    return {"gemv": rows, "qgemm": rows, **q4, "gemm": blas_core(),
            "numba": numba.config.CPU_NAME or llb.get_host_cpu_name()}


class CpuBackend(Backend):
    """Numba CPU implementation of :class:`~edgeinfer.backends.base.Backend`.

    Args:
        threads: worker threads (default: physical cores, capped by
            ``numba.config.NUMBA_NUM_THREADS``): Numba's parallel kernels (set with
            ``numba.set_num_threads``, which is per calling thread: construct the backend
            on the thread that runs the model) and the prefill GEMM tile workers.
        exact_decode: compute every quantized linear (any T) on dequantized tiles + BLAS
            with float32 activations instead of the integer kernels, and compile no decode
            plan (the model composes the ops): slower, logits match the reference to
            ~1e-6. For parity tests and debugging.

    One instance runs one forward at a time (activation and decode scratch are shared);
    use one backend per concurrent session.

    Weight handles: float32 ndarray ``[out, in]`` (dense) or :class:`CpuQuantWeight`.
    Quantized weights whose scale groups straddle 32-column blocks (group size not a
    multiple of 32 with several groups) are dequantized to float32 at upload, except
    8-bit ones in groups of 16 (llama.cpp ``Q6_K``: :mod:`.qlane`'s lane-scaled kernels).
    """

    name = "cpu"
    #: upload_embedding takes a :class:`..blockrows.BlockRows` table as it is
    reads_block_rows = True

    def __init__(self, threads: int | None = None, exact_decode: bool = False, **_options):
        n = physical_cores() if threads is None else int(threads)
        if n < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = min(n, numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(self.threads)
        self.governor = ThreadGovernor(self.threads)  # fewer threads under contention
        self.exact_decode = bool(exact_decode)
        self.act_scratch = ActScratch()  # activation quantization buffers of the GEMVs
        self.releaser = ForwardReleaser()  # memory given back after forwards (see logits)
        self._pool = GemmPool(self.threads)
        self._scr: dict = {}  # decode scratch buffers by (name, shape)
        self._file_tables: list = []  # embeddings left in a file view (upload_embedding)
        self._row_tables: list = []  # embeddings left as a file's blocks (BlockRows)

    def govern(self) -> None:
        """Set the calling thread's Numba thread count to the governor's choice
        (:class:`.governor.ThreadGovernor`: fewer than :attr:`threads` while another
        process takes cores; ``EDGEINFER_CPU_ADAPT_THREADS=0``: always :attr:`threads`)."""
        self.governor.step()

    # ---- memory ----------------------------------------------------------------------
    def upload(self, a):
        """float32 C-contiguous view or copy of ``a`` (no copy when already so)."""
        return np.ascontiguousarray(a, dtype=np.float32)

    def upload_weight(self, w):
        """Repack a QuantizedTensor for the integer kernels; dense weights as float32.

        A quantized source that views a read-only file mapping (``.eif``) has its pages
        given back once copied (:func:`..osmemory.release_mapped_pages`), so loading never
        holds the file's pages and the repacked copy at once."""
        if isinstance(w, QuantizedTensor):
            if runs_on_integer_kernels(w):
                out = repack(w)
            else:
                out = np.ascontiguousarray(w.dequantize(), dtype=np.float32)
            release_mapped_pages(w.qweight, w.scales, w.zeros)
            return out
        return np.ascontiguousarray(w, dtype=np.float32)

    def upload_embedding(self, w):
        """The embedding table (also the tied output head): as :meth:`upload_weight`,
        except an 8-bit table read from an ``.eif`` (a read-only file mapping), whose codes
        already have the kernels' layout: its codes are then a copy-on-write view of the
        file (:func:`..osmemory.private_file_view`), not a copy: a lookup makes only its
        rows resident, so an untied table never becomes resident as a whole. Same values,
        same kernels. A :class:`..blockrows.BlockRows` table (an untied GGUF embedding)
        is kept as it is, its rows decoded on lookup (:mod:`.blockrows`)."""
        if isinstance(w, BlockRows):
            self._row_tables.append(w)
            return w
        if isinstance(w, QuantizedTensor) and w.bits == 8:
            codes = private_file_view(w.qweight)
            out = None if codes is None else repack_q8_view(w, codes)
            if out is not None:  # its looked-up rows are given back after each prefill
                self._file_tables.append(out)
                return out
        return self.upload_weight(w)

    def to_host(self, t):
        """The array itself (tensors already live on the host)."""
        return np.asarray(t)

    def new_kv_cache(self, n_layers, n_kv_heads, head_dim, max_tokens, dtype="f32",
                     window_sizes=None, max_chunk=512):
        """A :class:`~edgeinfer.backends.kvcache.HostKVCache` ``[L, S, Hkv, hd]`` (ring
        storage for the layers ``window_sizes`` marks as windowed)."""
        return HostKVCache(n_layers, n_kv_heads, head_dim, max_tokens, dtype,
                           window_sizes=window_sizes, max_chunk=max_chunk)

    # ---- ops -------------------------------------------------------------------------
    def embed(self, table, ids, scale=1.0):
        """x[T, D] = table[ids] * scale; quantized tables dequantize only the rows used.

        Also marks the start of a forward for the memory releases of :meth:`logits`."""
        ids = np.asarray(ids).reshape(-1)
        self.releaser.note_tokens(ids.shape[0])
        if isinstance(table, CpuQuantWeight):
            if ids.size and (ids.min() < 0 or ids.max() >= table.out_features):
                raise IndexError(f"token id out of range 0..{table.out_features - 1}")
            out = np.empty((ids.shape[0], table.in_features), np.float32)
            row_dequant(table)(out, table.wp, table.sc, table.sz, table.bmap, ids.astype(np.int64, copy=False),
               np.float32(scale))
            return out
        if isinstance(table, BlockRows):
            if ids.size and (ids.min() < 0 or ids.max() >= table.out_features):
                raise IndexError(f"token id out of range 0..{table.out_features - 1}")
            out = np.empty((ids.shape[0], table.in_features), np.float32)
            dequant_block_rows(out, table.raw, ids.astype(np.int64, copy=False), table.kind,
                               np.float32(scale))
            return out
        x = table[ids]
        return x * np.float32(scale) if scale != 1.0 else x

    def rmsnorm(self, x, w, eps, unit_offset=False):
        """y[..., N] = x / sqrt(mean(x**2) + eps) * (w | 1 + w) over the last axis, float32."""
        n = x.shape[-1]
        x2 = np.ascontiguousarray(x).reshape(-1, n)
        y = np.empty_like(x2)
        fn = rmsnorm_rows_par if x2.size >= PAR_MIN_ELEMS else rmsnorm_rows
        fn(y, x2, w, float(eps), bool(unit_offset))
        return y.reshape(x.shape)

    def logits(self, x, head, softcap=None, norm=None):
        """Final projection x[T, D] @ head[V, D].T -> float32 [T, V] (the contract's).

        Then gives memory back (:class:`..osmemory.ForwardReleaser`): after a
        multi-token forward (prefill chunk) the freed heap and the rows an untied
        file-viewed embedding mapped (:meth:`upload_embedding`; a lookup maps whole page
        cache folios); after the first forwards also the pages of the JIT compiler, idle
        once the kernels are loaded."""
        y = super().logits(x, head, softcap, norm)
        rel = self.releaser
        if rel.due:  # file-viewed tables not streamed as the head
            rel.after_forward(tuple(t.wp for t in self._file_tables if t is not head)
                              + tuple(t.raw for t in self._row_tables))
        return y

    def linear(self, x, w, bias=None):
        """y[T, out] = x[T, in] @ W[out, in].T (+ bias[out]).

        Quantized W: T = 1 the integer GEMV, larger T (prefill, a batched decode step,
        a speculative verify) the multi-token integer GEMM of :mod:`.qgemm`, whose rows
        are bit-identical to the GEMV's (so the output of a row never depends on T);
        ``exact_decode``: dequantized tiles + BLAS
        on the tile workers for every T. Dense W:
        numpy BLAS (tiled on the workers for T > ``GEMV_MAX_T``; one GEMV per row while
        :attr:`rows_alone`, a batched decode step, so each row equals its decode alone).

        Raises:
            ValueError: ``in`` does not match the weight.
        """
        if (w.__class__ is CpuQuantWeight and x.ndim == 2 and x.shape[0] == 1
                and x.shape[1] == w.in_features and not self.exact_decode):
            # one token: the least Python per call
            y = np.empty((1, w.out_features), np.float32)
            gemv_quant(y[0], x[0], w, bias, self.act_scratch)
            return y
        k = x.shape[-1]
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, k)
        t = x2.shape[0]
        if isinstance(w, CpuQuantWeight):
            if k != w.in_features:
                raise ValueError(f"linear: x has {k} features, weight expects {w.in_features}")
            if self.exact_decode:
                y = gemm_quant(x2, w, bias, self._pool)
            elif t == 1:
                y = np.empty((1, w.out_features), np.float32)
                gemv_quant(y[0], x2[0], w, bias, self.act_scratch)
            elif w.lane_scales:  # a scale per 16 columns (Q6_K): .qlane, each row its GEMV's
                y = gemm_lane(x2, w, bias)
            else:  # the multi-token kernels, each row bit-identical to its GEMV (.qgemm)
                y = gemm_int(x2, w, bias)
        elif t <= GEMV_MAX_T or self.rows_alone:
            if self.rows_alone and t > 1:  # a batched decode step: each row's GEMV alone
                y = np.empty((t, w.shape[0]), np.float32)
                for i in range(t):
                    np.matmul(x2[i:i + 1], w.T, out=y[i:i + 1])
            else:
                y = x2 @ w.T
            if bias is not None:
                y += bias
        else:
            y = gemm_dense(x2, w, bias, self._pool)
        rel = self.releaser
        if rel.first:  # first forward: release after each layer
            rel.after_op()
        return y.reshape(x.shape[:-1] + (y.shape[-1],))

    def group_linears(self, ws, biases):
        """q/k/v or gate/up as one weight when all are repacked of one format (bits,
        in_features, blocks, groups): their rows concatenated once, the members' handles
        returned as views into it (:class:`FusedLinears`; the given handles are not
        modified, and their own copies die with them), so :meth:`linear_many` quantizes
        ``x`` once and runs one GEMV (one parallel region) or one prefill GEMM. Other
        mixes: the handles as they are."""
        w0 = ws[0]
        if len(ws) < 2 or any(
                w.__class__ is not CpuQuantWeight or w.bits != w0.bits
                or w.in_features != w0.in_features or w.n_blocks != w0.n_blocks
                or w.group_size != w0.group_size or w.sc.shape[1] != w0.sc.shape[1]
                or w.sc.dtype != w0.sc.dtype or w.sz.dtype != w0.sz.dtype
                or w.lane_scales != w0.lane_scales or w.sz.shape[1] != w0.sz.shape[1]
                or w.zero_scale != w0.zero_scale
                or not np.array_equal(w.bmap, w0.bmap) for w in ws):
            return super().group_linears(ws, biases)
        sc = np.concatenate([w.sc for w in ws])
        cat = CpuQuantWeight(w0.bits, sum(w.out_features for w in ws), w0.in_features,
                             w0.group_size, w0.n_blocks,
                             np.concatenate([w.wp for w in ws]), sc,
                             sc if w0.zero_scale != 1.0 else np.concatenate([w.sz for w in ws]),
                             w0.bmap, w0.lane_scales, w0.zero_scale)
        splits, members, r = [], [], 0
        for w in ws:
            a, r = r, r + w.out_features
            members.append(replace(w, wp=cat.wp[a:r], sc=cat.sc[a:r], sz=cat.sz[a:r]))
            splits.append((a, r))
        bias = None
        if any(b is not None for b in biases):
            bias = np.concatenate([np.zeros(w.out_features, np.float32) if b is None
                                   else np.asarray(b, np.float32) for w, b in zip(ws, biases)])
        return FusedLinears(tuple(members), tuple(biases), cat, bias, tuple(splits))

    def linear_many(self, x, group):
        """[x @ W_i.T (+ b_i)] for the members of ``group``: one :meth:`linear` on a
        :class:`FusedLinears` weight (column views of its output), else one per member."""
        if group.__class__ is FusedLinears:
            y = self.linear(x, group.weight, group.bias)
            return [y[..., a:b] for a, b in group.splits]
        return [self.linear(x, w, b) for w, b in zip(group.weights, group.biases)]

    # ---- decode --------------------------------------------------------------------------
    def scratch(self, name: str, shape: tuple) -> np.ndarray:
        """A float32 scratch array of this backend, allocated once per (name, shape)."""
        key = (name, shape)
        a = self._scr.get(key)
        if a is None:
            a = self._scr[key] = np.zeros(shape, np.float32)
        return a

    def compile_decode(self, step, cache):
        """A :class:`.plan.CpuDecodePlan` of ``step`` over ``cache`` (see :mod:`.plan`), or
        None with ``exact_decode`` or a cache that is not a ``HostKVCache``."""
        return _plan.compile_decode(self, step, cache)

    def rope(self, x, cos, sin, positions):
        """Rotate x[T, H, hd] (NeoX pairing) by tables cos/sin [P, r/2] at positions [T]."""
        x = np.ascontiguousarray(x)
        y = np.empty_like(x)
        pos = positions if positions.dtype.kind == "i" else np.asarray(positions, np.int64)
        fn = rope_tokens_par if x.size >= PAR_MIN_ELEMS else rope_tokens
        fn(y, x, cos, sin, pos)
        return y

    def attention(self, q, k, v, cache, layer, start_pos, scale, window=None, softcap=None):
        """Append k, v [T, Hkv, hd] to ``cache`` and attend: returns out[T, Hq, hd] float32.

        See :meth:`Backend.attention`. f32/f16 caches are read in place by the kernel;
        int8/int4/k8v4 caches (linear or ring) are encoded and read in place by
        :mod:`.kvquant` (never dequantized to a float copy); f32/f16 rings use the
        cache's numpy ``write`` / ``read_positions``. Decode over fewer than
        ``ATTN_SERIAL_MAX`` key elements runs single-threaded.

        Raises:
            ValueError: the positions do not fit in the cache.
        """
        t, hq, hd = q.shape
        cache.check_room(start_pos, t)
        q = np.ascontiguousarray(q, dtype=np.float32)
        k = np.ascontiguousarray(k, dtype=np.float32)
        v = np.ascontiguousarray(v, dtype=np.float32)
        out = np.empty((t, hq, hd), np.float32)
        win, cap = int(window or 0), float(softcap or 0.0)
        raw = cache.raw(layer)
        ring = cache.positions(layer) is not None
        if "k_q" in raw and cache.rotate_k:
            return self._attention_q(out, q, k, v, cache, layer, int(start_pos), float(scale),
                                     win, cap, ring)
        kc = raw.get("k")
        if kc is not None and not ring and kc.dtype in (np.float32, np.float16):
            vc = raw["v"]
            if kc.dtype == np.float16:  # the kernel converts (and saturates) bits itself
                kc, vc = kc.view(np.uint16), vc.view(np.uint16)
            fn = (_attention_serial if t == 1 and (start_pos + 1) * hq * hd <= ATTN_SERIAL_MAX
                  else _attention)
            scr = (self.scratch("attn_items", decode_scratch_shape(cache, hq, hd)) if t == 1
                   else _NO_SCR)
            fn(out, q, k, v, kc, vc, _NO_POS, True, int(start_pos), float(scale), win, cap, scr)
            return out
        # quantized or ring storage: the cache encodes/decodes, the kernel masks by position
        cache.write(layer, start_pos, k, v)
        kk, vv, pos = cache.read_positions(layer, start_pos + t)
        _attention(out, q, k, v, np.ascontiguousarray(kk, np.float32),
                   np.ascontiguousarray(vv, np.float32), np.asarray(pos, np.int64), False,
                   int(start_pos), float(scale), win, cap, _NO_SCR)
        return out

    def _attention_q(self, out, q, k, v, cache, layer, start, scale, win, cap, ring):
        """Quantized cache (int8 / int4 / k8v4, linear or ring): encode in place, attend
        over the codes (:mod:`.kvquant`); nothing is dequantized to a float copy."""
        kq, ks, kmin, vq, vs, vmin, pos, hmat, koff, kcs = layer_arrays(cache, layer)
        g = cache.group_size
        t = k.shape[0]
        if ring and t > cache.slots[layer] - (cache.window_sizes[layer] - 1):
            raise ValueError(
                f"a chunk of {t} tokens is larger than the {cache.max_chunk} a windowed layer "
                f"(window {cache.window_sizes[layer]}) was sized for; prefill in smaller chunks "
                f"or build the cache with max_chunk >= {t}")
        # the cache's own rotation (same numpy call as cache.write): bit-identical codes
        kv_write_q(_rotate(cache.k_input(layer, start, k), hmat), v, kq, ks, kmin, vq, vs, vmin,
                   pos, start, g)
        n_keys = kq.shape[0] if ring else start + t
        fn = (attention_q_serial if t == 1 and n_keys * q.shape[1] * q.shape[2]
              <= ATTN_SERIAL_MAX else attention_q)
        scr = (self.scratch("attn_items_q", decode_scratch_q_shape(cache, q.shape[1],
                                                                    q.shape[2]))
               if t == 1 else _NO_SCR)
        fn(out, q, hmat, kq, ks, kmin, vq, vs, vmin, koff, kcs, pos, start, scale, win, cap, scr)
        return out

    def glu(self, gate, up, act="silu"):
        """y[T, F] = act(gate) * up, act "silu" or "gelu_tanh": numpy ufuncs
        (:func:`.elementwise.glu_into`, which also gives the reasons).

        Raises:
            ValueError: unknown activation.
        """
        g = np.asarray(gate, dtype=np.float32)
        return glu_into(np.empty_like(g), g, up, is_gelu(act))

    def add(self, a, b):
        """Elementwise a + b (numpy; one call, no Numba dispatch needed)."""
        return a + b
