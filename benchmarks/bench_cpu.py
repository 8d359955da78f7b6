"""CPU backend vs llama.cpp, side by side in one run, plus kernel GB/s and start-up time.

usage:
  python benchmarks/bench_cpu.py [--model smollm2|qwen|PATH.gguf ...] [--runs 3]
        [--prompt 256] [--gen 128] [--threads 2] [--group 128] [--head-bits 8]
        [--kv int8|f16|int4|k8v4|f32] [--kernels] [--profile] [--startup] [--no-peer]
        [--compose]

Our side: the GGUF is dequantized to float32 and RTN-quantized in-process to INT4
(asymmetric, ``--group``), embeddings / output head to ``--head-bits`` (8: per-row
int8), KV cache ``--kv`` (default int8, the engine default; llama.cpp uses f16). llama.cpp's side: ``/work/shared/peer/peer_bench.py`` on the same GGUF in a
subprocess (its own quantization, e.g. Q4_1 / Q4_K_M). Same threads, same random
prompt, median of ``--runs`` interleaved runs; prints one JSON line per model with
tokens/s, the ratios, and our decode's achieved GB/s of weights streamed per token.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODELS = {
    "smollm2": "smollm2-135m-instruct",
    "qwen": "qwen2.5-coder-0.5b-instruct",
}
PEER = Path("/work/shared/peer/peer_bench.py")
BANDWIDTH_GBPS = 16.0  # sustained 2-thread read bandwidth on this machine kind (PERF-NOTES)


def gguf_path(name: str) -> Path:
    """A catalog name (``smollm2``/``qwen``) or a path -> local GGUF file."""
    if name in MODELS:
        try:
            from edgeinfer.catalog import model_path
            p = Path(model_path(MODELS[name]))
        except (ImportError, AttributeError, KeyError, ValueError, TypeError):
            # catalog API in flux: fall back to its cache folder
            p = Path.home() / ".cache" / "edgeinfer" / "models" / f"{MODELS[name]}.gguf"
        if not p.exists():
            from edgeinfer.catalog import pull
            p = Path(pull(MODELS[name]))
        return p
    return Path(name)


def load_gguf_f32(path: Path):
    """(ModelConfig, {canonical name: float32 array}) from a GGUF, fully dequantized."""
    from edgeinfer.models.config import ModelConfig

    from edgeinfer.readers.gguf import (
        GGUFFile,
        _unpermute_rows,
        gguf_config_dict,
        hf_tensor_name,
    )
    g = GGUFFile(path)
    cfg = ModelConfig.from_hf_dict(gguf_config_dict(g))
    arch = g.metadata["general.architecture"]
    perm = ({"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
            if arch == "llama" else {})
    tensors = {}
    for name, info in g.tensors.items():
        hf = hf_tensor_name(name, arch)
        if hf is None:
            continue
        w = np.asarray(g.dequantize(info), np.float32)
        proj = hf.split(".")[-2]
        if proj in perm:
            w = _unpermute_rows(w, perm[proj])
        tensors[hf] = w
    return cfg, tensors


def rtn(w: np.ndarray, bits: int, group: int):
    """RTN through edgeinfer.quant when present, else a local asymmetric/per-row version."""
    try:
        from edgeinfer.quant.rtn import quantize_rtn
        return quantize_rtn(w, bits=bits, group_size=group)
    except ImportError:
        from edgeinfer.backends.quantized import QuantizedTensor, pack_nibbles
        out, n = w.shape
        if bits == 8:
            s = np.maximum(np.abs(w).max(1, keepdims=True) / 127, 1e-8).astype(np.float16)
            q = np.clip(np.round(w / s.astype(np.float32)), -127, 127).astype(np.int8)
            return QuantizedTensor(q, s, None, 8, n, n)
        kp = -(-n // group) * group
        wg = np.pad(w, ((0, 0), (0, kp - n))).reshape(out, -1, group)
        lo, hi = np.minimum(wg.min(-1), 0), np.maximum(wg.max(-1), 0)
        s = np.maximum((hi - lo) / 15, 1e-8).astype(np.float16)
        z = np.clip(np.round(-lo / s.astype(np.float32)), 0, 15)
        q = np.clip(np.round(wg / s.astype(np.float32)[..., None]) + z[..., None], 0, 15)
        return QuantizedTensor(pack_nibbles(q.astype(np.uint8).reshape(out, kp)), s,
                               pack_nibbles(z.astype(np.uint8)), 4, group, n)


def quantize_model(tensors: dict, group: int, head_bits: int) -> dict:
    out = {}
    for k, v in tensors.items():
        if k in ("model.embed_tokens.weight", "lm_head.weight"):
            out[k] = (rtn(v, 8, -1) if head_bits == 8 else
                      rtn(v, 4, group) if head_bits == 4 else v)
        elif v.ndim == 2:
            out[k] = rtn(v, 4, group)
        else:
            out[k] = v
    return out


def prompt_ids(vocab: int, n: int) -> np.ndarray:
    """The same pseudo-random prompt as peer_bench.py."""
    rng = np.random.default_rng(0)
    return rng.integers(100, min(vocab, 30000), n).astype(np.int32)


def run_ours(model, n_prompt: int, n_gen: int, kv: str = "f16") -> dict:
    ids = prompt_ids(model.cfg.vocab_size, n_prompt)
    cache = model.new_cache(n_prompt + n_gen + 8, kv)
    model.forward(ids[:16], cache)  # warm-up (as the peer does)
    cache.reset()
    t0 = time.perf_counter()
    logits = model.forward(ids, cache)
    t1 = time.perf_counter()
    tok = int(logits[-1].argmax())
    t2 = time.perf_counter()
    ids1 = np.zeros(1, np.int32)
    out = np.empty((1, model.cfg.vocab_size), np.float32)  # reused, as the engine does
    for _ in range(n_gen):
        ids1[0] = tok
        logits = model.forward(ids1, cache, out=out)
        tok = int(logits[-1].argmax())
    t3 = time.perf_counter()
    return {"prefill_tok_s": n_prompt / (t1 - t0), "decode_tok_s": n_gen / (t3 - t2)}


def run_peer(path: Path, n_prompt: int, n_gen: int, threads: int) -> dict | None:
    """llama.cpp's numbers from peer_bench.py, or None (printed reason) if it cannot run,
    e.g. SIGILL: the shared wheel was built with -march=native for another CPU."""
    r = subprocess.run([sys.executable, str(PEER), str(path), str(n_prompt), str(n_gen),
                        str(threads)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        print(json.dumps({"peer_failed": r.returncode, "stderr": r.stderr[-300:]}))
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def weight_bytes(model) -> int:
    """Bytes a decode step streams: every linear weight plus the output head."""
    from edgeinfer.backends.cpu import CpuQuantWeight
    from edgeinfer.models.transformer import LINEAR_KEYS

    def nb(w):
        return w.nbytes if isinstance(w, (CpuQuantWeight, np.ndarray)) else 0
    return sum(nb(lw[k]) for lw in model.layers for k in LINEAR_KEYS if k in lw) + nb(model.lm_head)


def profile_step(model, n_ctx: int, steps: int = 20, kv: str = "int8") -> dict:
    """Per-op wall time of decode steps (wrapping the backend's methods) vs the step time."""
    be = model.backend
    ids = prompt_ids(model.cfg.vocab_size, n_ctx)
    cache = model.new_cache(n_ctx + 2 * steps + 4, kv)
    model.forward(ids, cache)
    ops = ["embed", "rmsnorm", "linear", "linear_many", "rope", "attention", "glu", "add",
           "logits", "attention_input", "attention_output_mlp", "decoder_block", "embed_step",
           "norm_logits"]
    acc = {o: 0.0 for o in ops}
    orig = {o: getattr(be, o) for o in ops}
    depth = [0]

    def wrap(o, f):  # outermost op only (logits / linear_many call linear)
        def g(*a, **k):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    acc[o] += time.perf_counter() - t
        return g
    t0 = time.perf_counter()
    for _ in range(steps):
        model.forward(np.array([5], np.int32), cache)
    plain = (time.perf_counter() - t0) / steps
    for o in ops:
        setattr(be, o, wrap(o, orig[o]))
    try:
        for _ in range(steps):
            model.forward(np.array([5], np.int32), cache)
    finally:
        for o in ops:
            delattr(be, o)
    per = {o: acc[o] / steps * 1e3 for o in ops}
    # floor: the same linear kernels called back to back without the model's Python
    from edgeinfer.backends.cpu import CpuQuantWeight
    from edgeinfer.backends.cpu.gemv import gemv_quant
    from edgeinfer.models.transformer import LINEAR_KEYS
    ws = [lw[k] for lw in model.layers for k in LINEAR_KEYS if k in lw] + [model.lm_head]
    xs = [np.random.default_rng(0).standard_normal(w.shape[1]).astype(np.float32) for w in ws]
    ys = [np.empty(w.shape[0], np.float32) for w in ws]
    t0 = time.perf_counter()
    for _ in range(steps):
        for w, x, y in zip(ws, xs, ys):
            if isinstance(w, CpuQuantWeight):
                gemv_quant(y, x, w, None, be._act)
            else:
                np.dot(w, x, out=y)
    floor = (time.perf_counter() - t0) / steps * 1e3
    return {"step_ms": plain * 1e3, "ops_ms": {k: round(v, 3) for k, v in per.items()},
            "linear_kernels_back_to_back_ms": round(floor, 3),
            "python_outside_ops_ms": round(plain * 1e3 - sum(per.values()), 3)}


def python_overhead(model, n_ctx: int, steps: int = 40, kv: str = "int8") -> dict:
    """Python's share of a decode step: step time minus the same compiled-kernel calls
    replayed back to back.

    Every call from Python into a Numba dispatcher during ``steps`` decode steps is
    recorded (dispatcher + arguments, by patching ``Dispatcher.__call__``), then
    replayed in a tight loop with the same arrays. The replay is the kernels' own time
    plus the unavoidable C-level dispatch; everything else in the step (the model's
    and the backend's Python, numpy temporaries, ufunc ops) counts as overhead.
    """
    from numba.core.dispatcher import Dispatcher, _DispatcherBase
    ids = prompt_ids(model.cfg.vocab_size, n_ctx)
    cache = model.new_cache(n_ctx + 3 * steps + 4, kv)
    model.forward(ids, cache)
    tok = np.array([5], np.int32)
    out = np.empty((1, model.cfg.vocab_size), np.float32)
    for _ in range(3):
        model.forward(tok, cache, out=out)
    rec = []
    orig = Dispatcher.__dict__.get("__call__")

    def call(self, *a, **k):
        rec.append((self, a, k))
        return _DispatcherBase.__call__(self, *a, **k)

    Dispatcher.__call__ = call
    try:
        model.forward(tok, cache, out=out)
    finally:
        if orig is None:
            del Dispatcher.__call__
        else:
            Dispatcher.__call__ = orig
    cache.length -= 1
    # steps and replays interleaved, so that a burst of other load hits both alike
    ts, cs, rs, rcs = [], [], [], []
    for _ in range(steps):
        n0 = cache.length
        t0, c0 = time.perf_counter(), time.process_time()
        model.forward(tok, cache, out=out)
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
        cache.length = n0  # the same position each time, as the replay
        t0, c0 = time.perf_counter(), time.process_time()
        for d, a, k in rec:
            d(*a, **k)
        rs.append(time.perf_counter() - t0)
        rcs.append(time.process_time() - c0)
    step, kern = statistics.median(ts), statistics.median(rs)
    cstep, ckern = statistics.median(cs), statistics.median(rcs)
    # CPU time (both threads) is far less sensitive than wall time to other processes
    # taking the cores: on a loaded machine read python_pct_cpu; the minima (least
    # disturbed step vs least disturbed replay) are the most load-robust wall figure
    return {"step_ms": round(step * 1e3, 3), "kernels_replayed_ms": round(kern * 1e3, 3),
            "kernel_calls": len(rec), "python_ms": round((step - kern) * 1e3, 3),
            "python_pct": round(100 * (step - kern) / step, 1),
            "step_cpu_ms": round(cstep * 1e3, 3), "kernels_replayed_cpu_ms": round(ckern * 1e3, 3),
            "python_pct_cpu": round(100 * (cstep - ckern) / cstep, 1),
            "step_min_ms": round(min(ts) * 1e3, 3), "kernels_replayed_min_ms": round(min(rs) * 1e3, 3),
            "python_pct_min": round(100 * (min(ts) - min(rs)) / min(ts), 1)}


def bench_kernels(threads: int) -> list[dict]:
    """GB/s of packed weights for the decode GEMV on Qwen- and SmolLM2-sized matrices."""
    from edgeinfer.backends.cpu import CpuBackend
    be = CpuBackend(threads=threads)
    rng = np.random.default_rng(0)
    rows = []
    for (o, i, bits) in [(4864, 896, 4), (896, 4864, 4), (151936, 896, 4), (1536, 576, 4),
                         (576, 1536, 4), (49152, 576, 8)]:
        w = rng.standard_normal((o, i)).astype(np.float32) * 0.02
        h = be.upload_weight(rtn(w, bits, 128 if bits == 4 else -1))
        x = rng.standard_normal((1, i)).astype(np.float32)
        be.linear(x, h)
        n = max(5, min(200, int(3e9 / h.nbytes / 20)))
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            be.linear(x, h)
            ts.append(time.perf_counter() - t)
        t = statistics.median(ts)
        xs = rng.standard_normal((256, i)).astype(np.float32)
        be.linear(xs, h)
        t0 = time.perf_counter()
        be.linear(xs, h)
        tp = time.perf_counter() - t0
        rows.append({"shape": f"{o}x{i}", "bits": bits, "bytes": h.nbytes,
                     "gemv_us": round(t * 1e6, 1), "gemv_GBps": round(h.nbytes / t / 1e9, 2),
                     "gemm256_GFLOPs": round(2 * o * i * 256 / tp / 1e9, 1)})
    return rows


STARTUP_CODE = """
import time, numpy as np
t0 = time.perf_counter()
from edgeinfer.backends.cpu import CpuBackend
from edgeinfer.backends.quantized import QuantizedTensor, pack_nibbles
be = CpuBackend()
t1 = time.perf_counter()
rng = np.random.default_rng(0)
for bits in (4, 8):
    q = (pack_nibbles(rng.integers(0, 16, (8, 64))) if bits == 4
         else rng.integers(-127, 127, (8, 64)).astype(np.int8))
    w = be.upload_weight(QuantizedTensor(q, np.ones((8, 2), np.float16), None, bits, 32, 64))
    for t in (1, 4):
        be.linear(np.ones((t, 64), np.float32), w)
    be.embed(w, np.array([1], np.int32))
x = np.ones((4, 2, 8), np.float32)
for t in (1, 4):
    for dt in ("f32", "f16"):
        be.attention(x[:t], x[:t], x[:t], be.new_kv_cache(1, 2, 8, 8, dt), 0, 0, 0.3)
    be.rmsnorm(x[:t], np.ones(8, np.float32), 1e-5)
    be.rope(x[:t], np.ones((8, 4), np.float32), np.zeros((8, 4), np.float32), np.arange(t))
    be.glu(x[:t], x[:t]); be.glu(x[:t], x[:t], "gelu_tanh")
t2 = time.perf_counter()
print(round(t1 - t0, 2), round(t2 - t1, 2))
"""


def bench_startup() -> dict:
    """First-run compile time (empty Numba cache) and cached start-up, in subprocesses."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d)
        res = []
        for _ in range(2):
            t = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", STARTUP_CODE], env=env, capture_output=True,
                               text=True, check=True)
            wall = time.perf_counter() - t
            imp, first = map(float, r.stdout.split())
            res.append({"process_s": round(wall, 2), "import_s": imp, "first_calls_s": first})
    return {"cold_compile": res[0], "cached": res[1]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="*", default=["smollm2"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--head-bits", type=int, default=8, choices=(4, 8, 32))
    ap.add_argument("--kv", default="int8",
                    help="our KV cache dtype (the engine's default int8; llama.cpp's is f16)")
    ap.add_argument("--kernels", action="store_true", help="GEMV GB/s and GEMM GFLOP/s table")
    ap.add_argument("--profile", action="store_true", help="per-op decode-step breakdown")
    ap.add_argument("--startup", action="store_true", help="compile / cached start-up time")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--compose", action="store_true",
                    help="A/B: decode through the contract's compositions of ops (the path "
                         "before the fused decoder_block / embed_step / norm_logits)")
    a = ap.parse_args(argv)
    if a.startup:
        print(json.dumps({"startup": bench_startup()}))
    if a.kernels:
        for row in bench_kernels(a.threads):
            print(json.dumps(row))
    from edgeinfer.backends.cpu import CpuBackend
    from edgeinfer.models.transformer import Transformer
    if a.compose:
        from edgeinfer.backends.base import Backend
        for op in ("decoder_block", "embed_step", "norm_logits"):
            setattr(CpuBackend, op, getattr(Backend, op))
    for name in a.model:
        path = gguf_path(name)
        cfg, dense = load_gguf_f32(path)
        tensors = quantize_model(dense, a.group, a.head_bits)
        del dense
        model = Transformer(cfg, tensors, CpuBackend(threads=a.threads), a.prompt + a.gen + 16)
        ours, peer = [], []
        for _ in range(a.runs):
            if not a.no_peer:
                p = run_peer(path, a.prompt, a.gen, a.threads)
                if p is None:
                    a.no_peer = True
                else:
                    peer.append(p)
            ours.append(run_ours(model, a.prompt, a.gen, a.kv))
        med = {k: statistics.median(r[k] for r in ours) for k in ours[0]}
        wb = weight_bytes(model)
        row = {"model": path.name, "threads": a.threads, "prompt": a.prompt, "gen": a.gen,
               "ours_quant": f"int4 g{a.group} asym, head/embed {a.head_bits}-bit, kv {a.kv}",
               "ours_prefill_tok_s": round(med["prefill_tok_s"], 1),
               "ours_decode_tok_s": round(med["decode_tok_s"], 1),
               "ours_runs": [{k: round(v, 1) for k, v in r.items()} for r in ours],
               "ours_weight_MB_per_token": round(wb / 1e6, 1),
               "ours_decode_GBps": round(wb * med["decode_tok_s"] / 1e9, 2),
               "ours_decode_frac_of_16GBps": round(wb * med["decode_tok_s"] / 1e9 / BANDWIDTH_GBPS, 2),
               "loadavg_1min": round(os.getloadavg()[0], 1)}
        if peer:
            pm = {k: statistics.median(r[k] for r in peer) for k in ("prefill_tok_s", "decode_tok_s")}
            row.update({"llamacpp_prefill_tok_s": pm["prefill_tok_s"],
                        "llamacpp_decode_tok_s": pm["decode_tok_s"],
                        "llamacpp_runs": [{k: r[k] for k in ("prefill_tok_s", "decode_tok_s")}
                                          for r in peer],
                        "ratio_prefill": round(med["prefill_tok_s"] / pm["prefill_tok_s"], 2),
                        "ratio_decode": round(med["decode_tok_s"] / pm["decode_tok_s"], 2)})
            # each run pairs one peer run with the ours run right after it: on a loaded
            # machine the median of the per-pair ratios drifts less than the ratio of medians
            for k in ("prefill", "decode"):
                row[f"ratio_{k}_paired_median"] = round(statistics.median(
                    o[f"{k}_tok_s"] / p[f"{k}_tok_s"] for o, p in zip(ours, peer)), 2)
        print(json.dumps(row))
        if a.profile:
            print(json.dumps({"model": path.name, "profile_ctx": a.prompt,
                              **profile_step(model, a.prompt, kv=a.kv)}))
            print(json.dumps({"model": path.name, "python_overhead_ctx": a.prompt,
                              **python_overhead(model, a.prompt, kv=a.kv)}))


if __name__ == "__main__":
    main()
