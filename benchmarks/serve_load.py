"""Load test of ``edgeinfer serve`` with the official ``openai`` client: aggregate decode
tok/s at 1/4/8 concurrent streams, per-stream inter-token latency, and the TTFT of a
request that arrives while 3 others stream (against its TTFT alone).

Starts ``edgeinfer serve --parallel P`` on a free port (or uses ``--url``), warms it, then
for each concurrency N sends N streamed chat requests at once (greedy, ``max_tokens``
each; the prompts ask for long answers, and the counts are the text chunks actually
streamed, about one per token).

    python benchmarks/serve_load.py -m smollm2-135m-instruct --parallel 8 --threads 2

Prints one JSON object per phase and a summary; numbers from a shared or loaded machine
are indicative only.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np

PROMPTS = ["Write a long story about a lighthouse keeper and a storm.",
           "Explain in detail how a bicycle works, part by part.",
           "Describe a journey across a desert, day by day.",
           "Tell the history of bread baking at length.",
           "Write a long letter from a sailor to his family.",
           "Describe a city market in the morning, in detail.",
           "Explain how rain forms, step by step, at length.",
           "Write a long fairy tale about a clever fox."]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def one_stream(client, model: str, prompt: str, max_tokens: int) -> dict:
    """Stream one chat completion; returns t0, ttft, the chunk times and the count."""
    t0 = time.perf_counter()
    times = []
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True)
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            times.append(time.perf_counter())
    return {"t0": t0, "times": times}


def run_concurrent(client, model: str, n: int, max_tokens: int, delays=None) -> list[dict]:
    out: list = [None] * n

    def work(i):
        if delays:
            time.sleep(delays[i])
        out[i] = one_stream(client, model, PROMPTS[i % len(PROMPTS)], max_tokens)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def summarize(results: list[dict]) -> dict:
    starts = [r["times"][0] for r in results if r["times"]]
    ends = [r["times"][-1] for r in results if r["times"]]
    decoded = sum(max(0, len(r["times"]) - 1) for r in results)
    span = max(ends) - min(starts) if starts else float("nan")
    itl = [float(np.median(np.diff(r["times"]))) for r in results if len(r["times"]) > 2]
    return {"streams": len(results), "tokens": sum(len(r["times"]) for r in results),
            "aggregate_decode_tok_s": decoded / span if span > 0 else float("nan"),
            "itl_median_s": float(np.median(itl)) if itl else float("nan"),
            "ttft_s": [round(r["times"][0] - r["t0"], 4) for r in results if r["times"]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--url", default=None, help="an already running server's base URL (/v1)")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--streams", default="1,4,8")
    args = ap.parse_args(argv)
    import openai

    proc = None
    url = args.url
    if url is None:
        port = free_port()
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "-m", args.model,
             "--port", str(port), "--parallel", str(args.parallel), "--threads",
             str(args.threads), "--ctx", str(args.ctx), "--quiet"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=here)
        url = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                name = client.models.list().data[0].id
                break
            except Exception:  # not listening yet (connection refused)
                if proc is not None and proc.poll() is not None:
                    raise SystemExit(f"server exited: {proc.stderr.read()[-2000:]}")
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        for n in sorted({1, 2, min(4, args.parallel), args.parallel}):
            run_concurrent(client, name, n, 8)  # warm: the kernels of every batch size
        report = {"model": args.model, "parallel": args.parallel, "threads": args.threads}
        for n in [int(s) for s in args.streams.split(",")]:
            report[f"streams_{n}"] = s = summarize(run_concurrent(client, name, n,
                                                                 args.max_tokens))
            print(json.dumps({f"streams_{n}": s}), flush=True)
        alone = summarize(run_concurrent(client, name, 1, 8))["ttft_s"][0]
        # a 4th request arriving while 3 stream (after their first tokens)
        mixed = run_concurrent(client, name, 4, args.max_tokens, delays=[0, 0, 0, 1.0])
        report["ttft_alone_s"] = alone
        report["ttft_while_3_stream_s"] = round(mixed[3]["times"][0] - mixed[3]["t0"], 4)
        one = report.get("streams_1", {}).get("aggregate_decode_tok_s")
        for n in (4, 8):
            s = report.get(f"streams_{n}")
            if s and one:
                s["speedup_vs_1"] = round(s["aggregate_decode_tok_s"] / one, 2)
                s["itl_vs_1"] = round(s["itl_median_s"] / report["streams_1"]["itl_median_s"], 2)
        print(json.dumps(report, indent=2))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
