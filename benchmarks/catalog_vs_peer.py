"""The catalog GGUFs as they are, ours against llama.cpp on the same file.

    python benchmarks/catalog_vs_peer.py smollm2-135m-instruct qwen2.5-coder-0.5b-instruct \
        gemma-3-270m --runs 2

Per run and model, alternating: ours in its own process (the prompts of
``edgeinfer bench NAME --prompt-tokens 256 --gen-tokens 128``: rng-0 random ids;
``engine.stream`` with ``speculate="auto"``, the bench default, then ``"off"``, twice
each after one warm-up stream), then llama.cpp's ``peer_bench.py FILE 256 128 THREADS``
in its own process with the environment this script started with. Prints one JSON line
per process and a summary line per model: medians, ours / llama.cpp.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

USER_ENV = dict(os.environ)  # before edgeinfer or numpy: what each process gets

sys.path.insert(0, str(Path(__file__).resolve().parent))


def ours(name: str, threads: int, prompt: int, gen: int) -> dict:
    """One process's figures: prefill and decode tok/s per stream, by speculation mode."""
    import numpy as np

    from edgeinfer import api

    m = api.load(name, threads=threads)
    v = m.config.vocab_size
    out: dict = {"side": "ours", "model": name, "load": os.getloadavg()[0]}
    for spec in ("warm-up", "auto", "off", "auto", "off"):
        ids = np.random.default_rng(0).integers(100, min(v, 30000), size=prompt).tolist()
        m.engine.reset()
        final = None
        for ev in m.engine.stream(ids, max_tokens=gen, stop=(),
                                  speculate="auto" if spec == "warm-up" else spec):
            final = ev
        s = final.stats
        if spec != "warm-up":
            out.setdefault(spec, []).append({"prefill": s.prefill_tok_s, "decode": s.decode_tok_s,
                                             "tokens": s.generated_tokens})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--_ours", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._ours:
        print(json.dumps(ours(a.models[0], a.threads, a.prompt, a.gen)))
        return 0
    import statistics

    import llamacpp_peer as peer
    from edgeinfer.catalog import pull

    for name in a.models:
        path = pull(name, progress=False)  # the cached file (verified), else the download
        rows = []
        for _ in range(a.runs):
            r = subprocess.run([sys.executable, __file__, name, "--_ours", "--threads",
                                str(a.threads), "--prompt", str(a.prompt), "--gen", str(a.gen)],
                               env=USER_ENV, capture_output=True, text=True, check=True)
            o = json.loads(r.stdout.strip().splitlines()[-1])
            print(json.dumps(o), flush=True)
            p = peer.run_peer(Path(path), a.prompt, a.gen, a.threads, USER_ENV)
            p["load"] = os.getloadavg()[0]
            print(json.dumps({"side": "llama.cpp", **p}), flush=True)
            pre = statistics.median([s["prefill"] for k in ("auto", "off") for s in o[k]])
            off = statistics.median([s["decode"] for s in o["off"]])
            auto = statistics.median([s["decode"] for s in o["auto"]])
            rows.append((pre, p["prefill_tok_s"], off, p["decode_tok_s"], auto))
        print(json.dumps({"model": name, "runs": [
            {"prefill": f"{r[0]:.0f} / {r[1]:.0f} = {r[0] / r[1]:.2f}x",
             "decode_off": f"{r[2]:.1f} / {r[3]:.1f} = {r[2] / r[3]:.2f}x",
             "decode_auto": round(r[4], 1)} for r in rows]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
