"""Can this process use AMX-INT8 from llvmlite, and how fast are exact block dots on it?

usage:
  python benchmarks/amx_probe.py [--blocks 4096] [--reps 20]

Prints one JSON object: the CPU's AMX flags, whether Linux granted the tile data state
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), and, where it did, the
integer dot products of a prefill tile computed on AMX and checked against numpy:

* the shape the prefill issue needs: 16 tokens x 16 weight rows x one 32-column block,
  int32 exact, with 15-bit activations split as ``x = 128 h + l`` (``h``, ``l`` int8) so
  that two ``tdpbssd`` give ``128 C_h + C_l``, the exact int16 x code dot (the numerics
  of :mod:`edgeinfer.backends.cpu.qgemm`, where every block's dot is exact);
* ``gmac_s``: 15-bit x 4-bit multiply-adds per second on one thread (tile loads, the two
  ``tdpbssd`` and the stores of both int32 tiles per block; no float work), ``streamed``
  (every block's operands new: memory-bound) and ``cached`` (8 blocks' operands reused
  from L1, as a GEMM reuses its weight panel across token tiles);
* the same split with a full 64-byte K per tile (two blocks' columns summed together),
  the nearest this probe gets to the hardware's int8 peak.

The kernel is LLVM IR compiled by llvmlite's MCJIT with ``+amx-tile,+amx-int8`` (the
intrinsics with immediate tile numbers: ``llvm.x86.ldtilecfg``, ``tileloadd64``,
``tdpbssd``, ``tilestored64``), called through ctypes. Intel SDM vol. 1 ch. 18 (AMX);
Linux ``Documentation/arch/x86/xstate.rst`` (the permission).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import time

import numpy as np

def cpu_amx_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(x for x in line.split(":", 1)[1].split() if x.startswith("amx"))
    except OSError:
        pass
    return []


def _tile_config(k_bytes: int) -> np.ndarray:
    """64-byte palette-1 config: t0, t1 C (16 x 64 B); t2, t3 A (16 x K B); t4 B (K/4 x 64 B)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb = cfg[16:48].view(np.uint16)
    rows = cfg[48:64]
    for t, (r, c) in enumerate([(16, 64), (16, 64), (16, k_bytes), (16, k_bytes),
                                (k_bytes // 4, 64)]):
        colsb[t] = c
        rows[t] = r
    return cfg


_IR = r"""
declare void @llvm.x86.ldtilecfg(i8*)
declare void @llvm.x86.tilerelease()
declare void @llvm.x86.tilezero(i8)
declare void @llvm.x86.tileloadd64(i8, i8*, i64)
declare void @llvm.x86.tilestored64(i8, i8*, i64)
declare void @llvm.x86.tdpbssd(i8, i8, i8)

; per block b (operands of block b & mask): C_h = A_h[b] . B[b], C_l = A_l[b] . B[b]
; (tdpbssd), stored at c_h / c_l [b]
define void @dots(i8* %cfg, i8* %ah, i8* %al, i8* %b, i8* %ch, i8* %cl, i64 %nb,
                  i64 %abytes, i64 %bbytes, i64 %astride, i64 %mask) {
entry:
  call void @llvm.x86.ldtilecfg(i8* %cfg)
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %loop]
  %j = and i64 %i, %mask
  %ao = mul i64 %j, %abytes
  %bo = mul i64 %j, %bbytes
  %co = mul i64 %j, 1024
  %pah = getelementptr i8, i8* %ah, i64 %ao
  %pal = getelementptr i8, i8* %al, i64 %ao
  %pb = getelementptr i8, i8* %b, i64 %bo
  %pch = getelementptr i8, i8* %ch, i64 %co
  %pcl = getelementptr i8, i8* %cl, i64 %co
  call void @llvm.x86.tilezero(i8 0)
  call void @llvm.x86.tilezero(i8 1)
  call void @llvm.x86.tileloadd64(i8 2, i8* %pah, i64 %astride)
  call void @llvm.x86.tileloadd64(i8 3, i8* %pal, i64 %astride)
  call void @llvm.x86.tileloadd64(i8 4, i8* %pb, i64 64)
  call void @llvm.x86.tdpbssd(i8 0, i8 2, i8 4)
  call void @llvm.x86.tdpbssd(i8 1, i8 3, i8 4)
  call void @llvm.x86.tilestored64(i8 0, i8* %pch, i64 64)
  call void @llvm.x86.tilestored64(i8 1, i8* %pcl, i64 64)
  %next = add i64 %i, 1
  %done = icmp eq i64 %next, %nb
  br i1 %done, label %exit, label %loop
exit:
  call void @llvm.x86.tilerelease()
  ret void
}
"""


def compile_dots():
    """ctypes function of the IR above, compiled for the host with AMX enabled."""
    import llvmlite.binding as llb
    llb.initialize_native_target()
    llb.initialize_native_asmprinter()
    mod = llb.parse_assembly(_IR)
    mod.verify()
    target = llb.Target.from_default_triple()
    features = llb.get_host_cpu_features().flatten() + ",+amx-tile,+amx-int8"
    tm = target.create_target_machine(cpu=llb.get_host_cpu_name(), features=features, opt=3,
                                      codemodel="jitdefault")
    engine = llb.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    asm = tm.emit_assembly(llb.parse_assembly(_IR))
    addr = engine.get_function_address("dots")
    p = ctypes.c_void_p
    fn = ctypes.CFUNCTYPE(None, p, p, p, p, p, p, ctypes.c_int64, ctypes.c_int64,
                          ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)(addr)
    return fn, engine, asm


def _vnni_b(codes: np.ndarray) -> np.ndarray:
    """Weight codes [16 rows, K] int8 -> the B tile [K/4, 64]: B[k4, 4 n + i] = w[n, 4 k4 + i]."""
    n, k = codes.shape
    b = codes.reshape(n, k // 4, 4).transpose(1, 0, 2).reshape(k // 4, 4 * n)
    return np.ascontiguousarray(b)


def run(blocks: int, reps: int, k_bytes: int, fn, rng) -> dict:
    x = rng.integers(-16256, 16257, (blocks, 16, k_bytes)).astype(np.int32)  # 15-bit activations
    h = np.rint(x / 128).astype(np.int32)
    lo = x - 128 * h
    assert np.abs(h).max() <= 127 and np.abs(lo).max() <= 64
    ah = np.ascontiguousarray(h.astype(np.int8))
    al = np.ascontiguousarray(lo.astype(np.int8))
    w = rng.integers(0, 16, (blocks, 16, k_bytes)).astype(np.int8)  # 4-bit codes, 16 rows
    b = np.ascontiguousarray(np.stack([_vnni_b(w[i]) for i in range(blocks)]))
    ch = np.zeros((blocks, 16, 16), np.int32)
    cl = np.zeros((blocks, 16, 16), np.int32)
    cfg = _tile_config(k_bytes)
    args = [a.ctypes.data for a in (cfg, ah, al, b, ch, cl)]
    fn(*args, blocks, 16 * k_bytes, k_bytes * 16, k_bytes, -1)
    got = 128 * ch.astype(np.int64) + cl
    want = np.einsum("btk,bnk->btn", x.astype(np.int64), w.astype(np.int64))
    exact = bool(np.array_equal(got, want))
    res = {"k_bytes": k_bytes, "exact": exact}
    for name, mask in (("streamed", -1), ("cached", 7)):  # every block new / 8 blocks in L1
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn(*args, blocks, 16 * k_bytes, k_bytes * 16, k_bytes, mask)
            ts.append(time.perf_counter() - t)
        t = min(ts)
        res[name] = {"ns_per_block": round(t / blocks * 1e9, 1),
                     "gmac_s": round(blocks * 16 * 16 * k_bytes / t / 1e9, 1)}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    out: dict = {"amx_flags": cpu_amx_flags()}
    if "amx_int8" not in out["amx_flags"]:
        out["granted"] = False
        print(json.dumps(out))
        return 0
    from edgeinfer.backends.cpu._amx import HAVE_AMX  # asks the OS at import
    out["granted"] = HAVE_AMX
    if out["granted"]:
        fn, engine, asm = compile_dots()
        out["tdpbssd_in_asm"] = asm.count("tdpbssd")
        rng = np.random.default_rng(0)
        out["runs"] = [run(a.blocks, a.reps, k, fn, rng) for k in (32, 64)]
        del engine
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
