"""CPU backend vs llama.cpp, each side in its own clean process, plus kernel GB/s and
start-up time.

usage:
  python benchmarks/bench_cpu.py [--model smollm2|qwen|PATH.gguf ...] [--runs 3]
        [--prompt 256] [--gen 128] [--threads N] [--wait-policy PASSIVE|ACTIVE]
        [--peer q4_0 catalog] [--group 128] [--head-bits 8] [--kv int8|f16|int4|k8v4|f32]
        [--kernels] [--profile] [--startup] [--no-peer] [--compose]

Fairness:

* Every measured process (ours, llama.cpp's) gets exactly the environment this script was
  started with, captured before anything of edgeinfer is imported (:data:`USER_ENV`),
  plus only the tuning asked for both sides (``--wait-policy`` sets ``OMP_WAIT_POLICY``
  for both; ``--threads`` is both sides' thread count, default: our backend's default,
  the physical cores). Nothing edgeinfer sets reaches the peer.
* Same baseline weights: the catalog GGUF dequantized to float32. Ours: RTN INT4
  (asymmetric, ``--group``), embeddings / head at ``--head-bits`` (8: per-row int8), KV
  cache ``--kv`` (default int8, the engine's), cached as an ``.eif``. llama.cpp's:
  ``--peer q4_0``, its fastest 4-bit format, quantized by llama.cpp from an F32 GGUF of
  the same weights (:mod:`llamacpp_peer`), and ``catalog``, the GGUF as downloaded.
* Runs interleaved (ours, then each peer file, ``--runs`` times), each a fresh process
  (``peer_bench.py`` for llama.cpp); medians.

Prints one JSON line per model: the machine (``cpu``, ``cpu_flags``, ``isa``: the
instruction path each of our kernel families took, ``threads``, ``wait_policy``,
``load_before`` / ``load_after``, ``read_GBps``: read bandwidth measured in this run),
the first ``--peer`` file (``peer_gguf``, ``peer_format``, ``llamacpp_*_tok_s``), ours
(``ours_*_tok_s``), ``ratio_prefill`` / ``ratio_decode`` (ours / llama.cpp), the other
peer files under ``other_peers``. Exit status 2 when llama.cpp could not run.
"""
from __future__ import annotations

import os

#: This process's environment as started, before edgeinfer (or numpy) is imported: what
#: every measured process gets (see the module docstring).
USER_ENV = dict(os.environ)

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_peer as peer  # noqa: E402

MODELS = {
    "smollm2": "smollm2-135m-instruct",
    "qwen": "qwen2.5-coder-0.5b-instruct",
}
_SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
               "avx512_bf16", "amx_int8", "amx_bf16")


def gguf_path(name: str) -> Path:
    """A catalog name (``smollm2``/``qwen``) or a path -> local GGUF file (pulled if needed)."""
    if name in MODELS:
        from edgeinfer.catalog import model_path, pull
        p = Path(model_path(MODELS[name]))
        return p if p.exists() else Path(pull(MODELS[name]))
    return Path(name)


def cpu_model() -> tuple[str, list[str]]:
    """(model name, the SIMD flags of :data:`_SIMD_FLAGS` it has) from /proc/cpuinfo."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = val.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(val.split())
    except OSError:
        import platform
        name = platform.processor()
    return name or "unknown", [f for f in _SIMD_FLAGS if f in flags]


def rtn(w: np.ndarray, bits: int, group: int):
    """edgeinfer's RTN (asymmetric for 4 bits, symmetric per row for 8 with group -1)."""
    from edgeinfer.quant.rtn import quantize_rtn
    return quantize_rtn(w, bits=bits, group_size=group)


def quantize_model(tensors, group: int, head_bits: int) -> dict:
    """Canonical name -> QuantizedTensor (2-D weights) or the float array (norms, biases)."""
    out = {}
    for k in tensors:
        v = tensors[k]
        if k in ("model.embed_tokens.weight", "lm_head.weight"):
            out[k] = (rtn(v, 8, -1) if head_bits == 8 else
                      rtn(v, 4, group) if head_bits == 4 else v)
        elif v.ndim == 2:
            out[k] = rtn(v, 4, group)
        else:
            out[k] = v
    return out


def _file_key(path: Path) -> str:
    """A short key of the file's identity (absolute path, size, mtime) for cache names."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:10]


def ours_eif(src: Path, group: int, head_bits: int) -> Path:
    """Our model from ``src``'s weights (dequantized to float32, then :func:`quantize_model`)
    as a cached ``.eif`` in :func:`llamacpp_peer.cache_dir` (written once)."""
    from edgeinfer.container import write_eif
    from edgeinfer.readers.gguf import read_gguf
    out = peer.cache_dir() / f"{src.stem}-{_file_key(src)}-rtn-g{group}-h{head_bits}.eif"
    if not out.exists():
        s = read_gguf(src, native=False)  # float32 arrays, not the blocks as codes
        write_eif(out, s.config, quantize_model(s.tensors, group, head_bits),
                  tokenizer_json=s.tokenizer_json, chat_template=s.chat_template,
                  bos_token=s.bos_token, eos_token=s.eos_token, add_bos_token=s.add_bos_token,
                  generation=s.generation,
                  provenance={"source": str(src), "method": f"rtn g{group}, head {head_bits}"})
    return out


def peer_files(src: Path, kinds: list[str], env: dict[str, str]) -> list[tuple[str, Path]]:
    """(kind, GGUF) for each of ``kinds``: ``q4_0`` (llama.cpp's Q4_0 of the F32 GGUF of
    ``src``, both cached) or ``catalog`` (``src`` itself).

    Raises:
        PeerError: llama.cpp could not quantize.
    """
    out = []
    for kind in kinds:
        if kind == "catalog":
            out.append((kind, src))
        else:
            stem = f"{src.stem}-{_file_key(src)}"
            f32 = peer.f32_gguf(src, peer.cache_dir() / f"{stem}-f32.gguf")
            out.append((kind, peer.q4_0_gguf(f32, peer.cache_dir() / f"{stem}-q4_0.gguf", env)))
    return out


def prompt_ids(vocab: int, n: int) -> np.ndarray:
    """The same pseudo-random prompt as peer_bench.py."""
    rng = np.random.default_rng(0)
    return rng.integers(100, min(vocab, 30000), n).astype(np.int32)


def run_ours(model, n_prompt: int, n_gen: int, kv: str = "f16") -> dict:
    """One timed prefill of ``n_prompt`` tokens and ``n_gen`` greedy decode steps (after
    a warm-up prefill and two decode steps, as llama.cpp's warm-up)."""
    ids = prompt_ids(model.cfg.vocab_size, n_prompt)
    cache = model.new_cache(n_prompt + n_gen + 8, kv)
    ids1 = np.zeros(1, np.int32)
    out = np.empty((1, model.cfg.vocab_size), np.float32)  # reused, as the engine does
    model.forward(ids[:16], cache)  # warm-up: loads the compiled kernels of both paths
    for _ in range(2):
        model.forward(ids1, cache, out=out)
    cache.reset()
    t0 = time.perf_counter()
    logits = model.forward(ids, cache)
    t1 = time.perf_counter()
    tok = int(logits[-1].argmax())
    t2 = time.perf_counter()
    for _ in range(n_gen):
        ids1[0] = tok
        logits = model.forward(ids1, cache, out=out)
        tok = int(logits[-1].argmax())
    t3 = time.perf_counter()
    return {"prefill_tok_s": n_prompt / (t1 - t0), "decode_tok_s": n_gen / (t3 - t2)}


def read_bandwidth(threads: int, nbytes: int | None = None, passes: int = 5) -> float:
    """Sustained read GB/s of this machine with ``threads`` threads: the best of
    ``passes`` parallel sums over a buffer of ``nbytes`` (default: 4x the L3 cache, at
    least 512 MiB), so that the caches cannot serve it."""
    import numba
    if nbytes is None:
        l3 = 32 << 20
        try:
            txt = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
            l3 = int(txt[:-1]) << {"K": 10, "M": 20}[txt[-1]] if txt[-1] in "KM" else int(txt)
        except (OSError, ValueError, KeyError, IndexError):
            pass
        nbytes = max(512 << 20, 4 * l3)

    @numba.njit(parallel=True)
    def total(a):  # int64 adds vectorize (a float sum would be bound by add latency)
        s = 0
        for i in numba.prange(a.shape[0]):
            s += a[i]
        return s

    a = np.ones(nbytes // 8, np.int64)
    numba.set_num_threads(threads)
    total(a[:1024])
    best = 0.0
    for _ in range(passes):
        t = time.perf_counter()
        total(a)
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def weight_bytes(model) -> int:
    """Bytes a decode step streams: every linear weight plus the output head."""
    from edgeinfer.backends.cpu import CpuQuantWeight
    from edgeinfer.models.transformer import LINEAR_KEYS

    def nb(w):
        return w.nbytes if isinstance(w, (CpuQuantWeight, np.ndarray)) else 0
    return sum(nb(lw[k]) for lw in model.layers for k in LINEAR_KEYS if k in lw) + nb(model.lm_head)


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


def bench_startup(env: dict[str, str]) -> dict:
    """First-run compile time (empty Numba cache) and cached start-up, in subprocesses
    with ``env`` plus an empty ``NUMBA_CACHE_DIR``."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(env, NUMBA_CACHE_DIR=d)
        res = []
        for _ in range(2):
            t = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", STARTUP_CODE], env=env, capture_output=True,
                               text=True, check=True)
            wall = time.perf_counter() - t
            imp, first = map(float, r.stdout.split())
            res.append({"process_s": round(wall, 2), "import_s": imp, "first_calls_s": first})
    return {"cold_compile": res[0], "cached": res[1]}


# ---- the measured processes ------------------------------------------------------------
def _worker(mode: str, args: list[str], env: dict[str, str]) -> list[dict]:
    """Run this script's ``--worker mode`` in a fresh process with exactly ``env``; its
    JSON lines."""
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", mode, *args],
                       env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"bench_cpu --worker {mode} failed ({r.returncode}):\n"
                           f"{r.stderr.strip()[-2000:]}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def worker(a) -> None:
    """One measured process of ours (``--worker probe|ours|kernels``): prints JSON lines."""
    from edgeinfer.backends.cpu import CpuBackend, kernel_paths, physical_cores, threading_info
    threads = a.threads or physical_cores()
    if a.worker == "probe":
        print(json.dumps({"threads_default": physical_cores(),
                          "threading": threading_info()._asdict(), "isa": kernel_paths(),
                          "read_GBps": round(read_bandwidth(threads), 2)}))
        return
    if a.worker == "kernels":
        for row in bench_kernels(threads):
            print(json.dumps(row))
        return
    from edgeinfer.container import read_eif
    from edgeinfer.models.transformer import Transformer
    if a.compose:
        from edgeinfer.backends.base import Backend
        CpuBackend.compile_decode = Backend.compile_decode
    src = read_eif(a.eif)
    # positions: the run's, or the profiles' (up to 3 x 40 steps after the prompt)
    table = a.prompt + max(a.gen, 130 if a.profile else 0) + 16
    model = Transformer(src.config, src.tensors, CpuBackend(threads=threads), table)
    r = run_ours(model, a.prompt, a.gen, a.kv)
    print(json.dumps({**r, "threads": model.backend.threads, "weight_bytes": weight_bytes(model),
                      "threading": threading_info()._asdict(), "isa": kernel_paths()}))
    if a.profile:
        from cpu_profile import profile_step, python_overhead
        print(json.dumps({"profile_ctx": a.prompt, **profile_step(model, a.prompt, kv=a.kv)}))
        print(json.dumps({"python_overhead_ctx": a.prompt,
                          **python_overhead(model, a.prompt, kv=a.kv)}))


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _peer_fields(kind: str, path: Path, runs: list[dict], ours: list[dict]) -> dict:
    """The JSON fields of one peer file: its medians and ours / its ratios."""
    pre, dec = _med(runs, "prefill_tok_s"), _med(runs, "decode_tok_s")
    row = {"peer_gguf": str(path), "peer_format": f"{kind}: {peer.gguf_format(path)}",
           "llamacpp_prefill_tok_s": pre, "llamacpp_decode_tok_s": dec,
           "llamacpp_runs": [{k: r[k] for k in ("prefill_tok_s", "decode_tok_s")} for r in runs],
           "ratio_prefill": round(_med(ours, "prefill_tok_s") / pre, 2),
           "ratio_decode": round(_med(ours, "decode_tok_s") / dec, 2)}
    # each of ours pairs with the peer run right after it: on a loaded machine the median
    # of the per-pair ratios drifts less than the ratio of medians
    for k in ("prefill", "decode"):
        row[f"ratio_{k}_paired_median"] = round(statistics.median(
            o[f"{k}_tok_s"] / p[f"{k}_tok_s"] for o, p in zip(ours, runs)), 2)
    return row


def bench_model(name: str, a, env: dict[str, str], threads: int,
                probe: dict) -> tuple[dict, bool, list[dict]]:
    """(the JSON row of one model, whether llama.cpp ran, the ``--profile`` rows)."""
    src = gguf_path(name)
    eif = ours_eif(src, a.group, a.head_bits)
    files, error = [], None
    if not a.no_peer:
        try:
            files = peer_files(src, a.peer, env)
        except peer.PeerError as e:
            error = str(e)
    ours, peers = [], {kind: [] for kind, _ in files}
    args = ["--eif", str(eif), "--prompt", str(a.prompt), "--gen", str(a.gen),
            "--threads", str(threads), "--kv", a.kv] + (["--compose"] if a.compose else [])
    extra: list[dict] = []
    load_before = [round(x, 2) for x in os.getloadavg()]
    for i in range(a.runs):
        last = i == a.runs - 1 and a.profile
        res = _worker("ours", args + (["--profile"] if last else []), env)
        ours.append(res[0])
        extra += res[1:]
        for kind, path in files if error is None else ():
            try:
                peers[kind].append(peer.run_peer(path, a.prompt, a.gen, threads, env,
                                                 a.peer_script))
            except peer.PeerError as e:
                error = str(e)
                break
    load_after = [round(x, 2) for x in os.getloadavg()]
    cpu, flags = cpu_model()
    o = ours[0]
    wb = o["weight_bytes"]
    dec = _med(ours, "decode_tok_s")
    row = {"model": src.name, "cpu": cpu, "cpu_flags": flags, "isa": o["isa"],
           "threads": threads,
           "wait_policy": {"ours": o["threading"]["wait_policy"],
                           "ours_source": o["threading"]["source"],
                           "llamacpp": env.get("OMP_WAIT_POLICY", "default")},
           "load_before": load_before, "load_after": load_after,
           "prompt": a.prompt, "gen": a.gen,
           "ours_quant": f"int4 g{a.group} asym, head/embed {a.head_bits}-bit, kv {a.kv}",
           "ours_eif": str(eif),
           "ours_prefill_tok_s": round(_med(ours, "prefill_tok_s"), 1),
           "ours_decode_tok_s": round(dec, 1),
           "ours_runs": [{k: round(r[k], 1) for k in ("prefill_tok_s", "decode_tok_s")}
                         for r in ours],
           "ours_weight_MB_per_token": round(wb / 1e6, 1),
           "ours_decode_GBps": round(wb * dec / 1e9, 2),
           "read_GBps": probe["read_GBps"],
           "ours_decode_frac_of_read": round(wb * dec / 1e9 / probe["read_GBps"], 2)}
    done = [(k, p) for k, p in files if peers[k]]
    if done:
        row.update(_peer_fields(done[0][0], done[0][1], peers[done[0][0]], ours))
        row["other_peers"] = [_peer_fields(k, p, peers[k], ours) for k, p in done[1:]]
    if error is not None:
        row["peer_error"] = error
        print(error, file=sys.stderr)
    return row, error is None, extra


def _peer_script_default() -> Path:
    """``peer_bench.py`` of ``shared/peer``: beside this clone, else /work/shared."""
    beside = Path(__file__).resolve().parents[2] / "shared" / "peer" / "peer_bench.py"
    return beside if beside.exists() else peer.PEER


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="*", default=["smollm2"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None,
                    help="both sides' threads (default: our backend's, the physical cores)")
    ap.add_argument("--wait-policy", choices=("PASSIVE", "ACTIVE"), default=None,
                    help="OMP_WAIT_POLICY for both sides (default: neither is told; ours "
                         "and llama.cpp then both run their OpenMP runtime's default)")
    ap.add_argument("--peer", nargs="*", default=["q4_0", "catalog"],
                    choices=("q4_0", "catalog"), help="llama.cpp's files; the first is the "
                    "top-level comparison")
    ap.add_argument("--peer-script", type=Path, default=_peer_script_default())
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--head-bits", type=int, default=8, choices=(4, 8, 32))
    ap.add_argument("--kv", default="int8",
                    help="our KV cache dtype (the engine's default int8; llama.cpp's is f16)")
    ap.add_argument("--kernels", action="store_true", help="GEMV GB/s and GEMM GFLOP/s table")
    ap.add_argument("--profile", action="store_true", help="per-op decode-step breakdown")
    ap.add_argument("--startup", action="store_true", help="compile / cached start-up time")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--compose", action="store_true",
                    help="A/B: decode through the model's composition of single ops (no "
                         "compiled decode plan)")
    ap.add_argument("--worker", choices=("probe", "ours", "kernels"), help=argparse.SUPPRESS)
    ap.add_argument("--eif", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.runs < 1:
        ap.error("--runs must be >= 1")
    if a.worker:
        worker(a)
        return 0
    env = peer.peer_env(USER_ENV, a.wait_policy)
    if a.startup:
        print(json.dumps({"startup": bench_startup(env)}))
    tune = ["--threads", str(a.threads)] if a.threads else []
    probe = _worker("probe", tune, env)[0]
    threads = a.threads or probe["threads_default"]
    if a.kernels:
        for row in _worker("kernels", ["--threads", str(threads)], env):
            print(json.dumps(row))
    status = 0
    for name in a.model:
        row, peer_ok, extra = bench_model(name, a, env, threads, probe)
        print(json.dumps(row), flush=True)
        for e in extra:
            print(json.dumps({"model": row["model"], **e}))
        if not peer_ok:
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
