"""OpenCL backend speed: decode / prefill tokens/s on whole models and each GEMV kernel's
achieved GB/s (weight bytes streamed per second).

usage:
  python benchmarks/bench_opencl.py [--device SPEC] [--models stories,smollm2-rand]
        [--prompt 64] [--gen 32] [--no-kernels] [--unfused] [--cpu] [--json out.json]

  --unfused  also time the model with the fused decode path off (the per-op kernels)
  --cpu      also time the Numba CPU backend on the same models, in the same process
             (side by side: the machine may be shared, compare within one run)

Models:
  stories      stories260K (/work/shared/models/stories260K), dense float32 and RTN INT4
               (group 32) with an INT8 head.
  smollm2-rand a SmolLM2-135M-shaped llama (576 hidden, 1536 FFN, 30 layers, 9/3 heads,
               49152 vocab) with *random* INT4 weights (group 128, asymmetric) and an INT8
               tied embedding/head: same bytes and kernels as the real converted model.
Kernels: y[1, out] = x[1, in] @ W.T for the SmolLM2 shapes in every weight format, timed
over repeated launches (queue drained once); GB/s counts the weight bytes read.

Numbers on PoCL (a CPU OpenCL device) measure the kernels' portability and per-launch
overhead, not GPU speed. OpenCL model rows report ``launches_per_token`` (kernels enqueued
per decode token) and whether the fused decode path was on. Kernel rows time
one ``linear`` (the row kernel of the fused path on CPU devices, the per-op GEMV
elsewhere) with its output read back on the device (pending outputs forced).
Prints one JSON line per measurement.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

STORIES = Path("/work/shared/models/stories260K")
SMOLLM2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "max_position_embeddings": 2048, "rope_theta": 100000.0,
           "tie_word_embeddings": True}


def rand_q4(rng, out: int, n_in: int, g: int = 128):
    """A random asymmetric INT4 QuantizedTensor [out, n_in] (scales ~ N(0,1)/sqrt(in) weights)."""
    from edgeinfer.backends.quantized import QuantizedTensor, pack_nibbles

    in_pad = -(-n_in // g) * g
    ng = in_pad // g
    s = (n_in ** -0.5) / 4.6
    return QuantizedTensor(pack_nibbles(rng.integers(0, 16, (out, in_pad), dtype=np.uint8)),
                           (s * (0.5 + rng.random((out, ng), dtype=np.float32))).astype(np.float16),
                           pack_nibbles(rng.integers(6, 10, (out, ng), dtype=np.uint8)), 4, g, n_in)


def rand_q8(rng, out: int, n_in: int):
    from edgeinfer.backends.quantized import QuantizedTensor

    return QuantizedTensor(rng.integers(-127, 128, (out, n_in), dtype=np.int8),
                           np.full((out, 1), 1.0 / 127, np.float16), None, 8, n_in, n_in)


def stories_models():
    from edgeinfer.models.config import ModelConfig
    from edgeinfer.models.transformer import LINEAR_KEYS
    from edgeinfer.quant.rtn import quantize_rtn
    from safetensors.numpy import load_file

    cfg = ModelConfig.from_hf_dict(json.loads((STORIES / "config.json").read_text()))
    dense = load_file(str(STORIES / "model.safetensors"))
    q = {}
    for name, t in dense.items():
        short = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if short in LINEAR_KEYS:
            q[name] = quantize_rtn(t, 4, 32)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            q[name] = quantize_rtn(t, 8, -1)
        else:
            q[name] = t
    return [("stories260K-f32", cfg, dense), ("stories260K-int4", cfg, q)]


def smollm2_random(seed: int = 0):
    from edgeinfer.models.arch import tensor_specs
    from edgeinfer.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(SMOLLM2)
    rng = np.random.default_rng(seed)
    tensors = {}
    for spec in tensor_specs(cfg):
        shape = spec.shape(cfg)
        if spec.name == "model.embed_tokens.weight":
            tensors[spec.name] = rand_q8(rng, *shape)
        elif len(shape) == 2:
            tensors[spec.name] = rand_q4(rng, *shape)
        else:
            tensors[spec.name] = np.ones(shape, np.float32)
    return [("smollm2-135m-rand-int4", cfg, tensors)]


def bench_model(be, name, cfg, tensors, prompt: int, gen: int) -> dict:
    from edgeinfer.models.transformer import Transformer

    t0 = time.perf_counter()
    model = Transformer(cfg, tensors, be, max_positions=prompt + gen + 8)
    upload_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    ids = rng.integers(3, cfg.vocab_size, prompt).astype(np.int32)
    cache = model.new_cache(prompt + gen + 4)
    model.forward(ids[:8], cache)  # warm-up: builds programs, fills the buffer pool
    model.forward(ids[:1], cache)
    cache.reset()
    t0 = time.perf_counter()
    logits = model.forward(ids, cache)
    prefill_s = time.perf_counter() - t0
    tok = int(np.argmax(logits[-1]))
    n0 = getattr(be, "launches", None)
    t0 = time.perf_counter()
    for _ in range(gen):
        tok = int(np.argmax(model.forward(np.array([tok], np.int32), cache)[-1]))
    decode_s = time.perf_counter() - t0
    device = getattr(be, "device_info", {}).get("name", "numpy")
    out = {"model": name, "backend": be.name, "device": device, "upload_s": round(upload_s, 3),
           "prompt": prompt, "prefill_tok_s": round(prompt / prefill_s, 2), "gen": gen,
           "decode_tok_s": round(gen / decode_s, 2), "ms_per_token": round(1e3 * decode_s / gen, 2)}
    if n0 is not None:
        out["fused"] = bool(be.caps.fused)
        out["launches_per_token"] = round((be.launches - n0) / gen, 1)
    return out


def bench_kernels(be, reps: int = 20) -> list[dict]:
    rng = np.random.default_rng(2)
    d, f, v = SMOLLM2["hidden_size"], SMOLLM2["intermediate_size"], SMOLLM2["vocab_size"]
    shapes = [("qkv/o", d, d), ("gate/up", f, d), ("down", d, f), ("head/4", v // 4, d)]
    out = []
    for label, n_out, n_in in shapes:
        weights = {"f32": rng.standard_normal((n_out, n_in)).astype(np.float32),
                   "int4-g128": rand_q4(rng, n_out, n_in, 128 if n_in % 128 == 0 else 64),
                   "int8": rand_q8(rng, n_out, n_in)}
        for fmt, w in weights.items():
            dw = be.upload_weight(w)
            x = be.upload(rng.standard_normal((1, n_in)).astype(np.float32))
            be.linear(x, dw).buf  # .buf enqueues a pending (fused-path) op
            be.queue.finish()
            t0 = time.perf_counter()
            for _ in range(reps):
                y = be.linear(x, dw)
                y.buf
            be.queue.finish()
            dt = (time.perf_counter() - t0) / reps
            del y
            out.append({"kernel": f"gemv {fmt}", "shape": f"{label} {n_out}x{n_in}",
                        "weight_bytes": dw.nbytes, "us": round(dt * 1e6, 1),
                        "gb_s": round(dw.nbytes / dt / 1e9, 3)})
    return out


def dispatch_overhead(be, reps: int = 200) -> dict:
    """Python-side cost of one op (enqueue only, tiny tensors) vs. its device completion."""
    a = be.upload(np.ones((1, 64), np.float32))
    be.add(a, a)
    be.queue.finish()
    t0 = time.perf_counter()
    for _ in range(reps):
        y = be.add(a, a)
    t1 = time.perf_counter()
    be.queue.finish()
    t2 = time.perf_counter()
    del y
    return {"op": "add[1,64]", "enqueue_us": round((t1 - t0) / reps * 1e6, 1),
            "total_us": round((t2 - t0) / reps * 1e6, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="OpenCL device spec (index, P:D, name)")
    ap.add_argument("--models", default="stories,smollm2-rand")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--reference", action="store_true", help="also time the numpy reference")
    ap.add_argument("--unfused", action="store_true",
                    help="also time the per-op (unfused) decode path on the same device")
    ap.add_argument("--cpu", action="store_true", help="also time the Numba CPU backend")
    ap.add_argument("--threads", type=int, default=None, help="CPU backend threads")
    ap.add_argument("--json", default=None, help="write all results to this file")
    args = ap.parse_args(argv)

    from edgeinfer.backends.opencl import OpenCLBackend, OpenCLUnavailableError
    from edgeinfer.backends.reference import ReferenceBackend

    try:
        be = OpenCLBackend(device=args.device)
    except OpenCLUnavailableError as e:
        print(f"OpenCL unavailable: {e}", file=sys.stderr)
        return 2
    print(f"device: {be.device_info['platform']} / {be.device_info['name']}  caps: {be.caps}")
    results = []
    results.append(dispatch_overhead(be))
    print(json.dumps(results[-1]))
    if not args.no_kernels:
        for r in bench_kernels(be):
            results.append(r)
            print(json.dumps(r))
    models = []
    for m in args.models.split(","):
        if m == "stories" and STORIES.exists():
            models += stories_models()
        elif m == "smollm2-rand":
            models += smollm2_random()
    extra = []
    if args.unfused:
        import dataclasses

        ub = OpenCLBackend(device=args.device)
        ub.caps = dataclasses.replace(ub.caps, fused=False)
        extra.append(ub)
    if args.cpu:
        from edgeinfer.backends import get_backend

        extra.append(get_backend("cpu", **({"threads": args.threads} if args.threads else {})))
    for name, cfg, tensors in models:
        backends = [be] + extra + ([ReferenceBackend()] if args.reference else [])
        for b in backends:
            r = bench_model(b, name, cfg, tensors, args.prompt, args.gen)
            results.append(r)
            print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
