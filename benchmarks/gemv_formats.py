"""GEMV time and GB/s of named tensors of the catalog Qwen GGUF, re-laid natively, against
INT4 g128 (``quantize_rtn``) of the same dequantized weight; best of 5 x 400 calls, 2 threads.

Usage: ``python benchmarks/gemv_formats.py blk.11.ffn_down.weight blk.0.ffn_gate.weight``
(``EDGEINFER_HOME`` holding ``models/qwen2.5-coder-0.5b-instruct.gguf``)."""
import os
import sys
import time

import gguf
import numpy as np

from edgeinfer.readers.gguf_file import GGUFFile
from edgeinfer.readers.gguf_blocks import relayout
from edgeinfer.quant.rtn import quantize_rtn
from edgeinfer.backends.cpu import CpuBackend
from edgeinfer.backends.cpu.gemv import gemv_quant
NAMES = sys.argv[1:]
g = GGUFFile(os.path.join(os.environ.get("EDGEINFER_HOME", os.path.expanduser("~/.cache/edgeinfer")),
                          "models", "qwen2.5-coder-0.5b-instruct.gguf"))
CPU = CpuBackend(threads=2)
x0 = np.random.default_rng(0).standard_normal(8192).astype(np.float32)
def bench(label, w):
    h = CPU.upload_weight(w)
    x = x0[:w.in_features].copy(); y = np.zeros(w.out_features, np.float32)
    for _ in range(50): gemv_quant(y, x, h, None, CPU.act_scratch)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(400): gemv_quant(y, x, h, None, CPU.act_scratch)
        best = min(best, (time.perf_counter() - t) / 400)
    print(f"{label:28s} {h.nbytes/1e6:6.2f} MB  {best*1e6:7.1f} us  {h.nbytes/best/1e9:5.2f} GB/s")
for name in NAMES:
    info = g.tensors[name]; qt = gguf.GGMLQuantizationType(info.qtype).name
    raw = g.raw(info)
    bench(f"{name} {qt}", relayout(raw, qt, name, "x"))
    deq = gguf.quants.dequantize(raw, info.qtype).reshape(info.shape[::-1] if raw.ndim == 1 else raw.shape[:1] + (-1,))
    bench(f"{name} INT4 g128", quantize_rtn(np.asarray(deq, np.float32), 4, 128, name=name))
