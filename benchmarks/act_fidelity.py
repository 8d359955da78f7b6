"""Fidelity of the CPU backend's integer-dot linears against exact float activations.

usage:
  python benchmarks/act_fidelity.py [--model smollm2-135m-instruct|PATH] [--chunks 4]
        [--no-decode]

Both sides run the same weights (a path; a catalog name runs as its ``NAME:int4``
``.eif``, made on first use) on WikiText-2 test, llama.cpp's perplexity method
(512-token chunks, second half scored). The baseline is ``CpuBackend(exact_decode=True)``: dequantized weights, float32
activations, BLAS. Measured:

* ``prefill``: the default backend, each chunk as one prefill (the integer GEMM);
* ``decode``: the default backend, each chunk token by token (teacher-forced decode
  steps through the compiled plan), and whether its log-probabilities equal the prefill
  path's bit for bit (``decode_equals_prefill``).

Prints one JSON line: PPL of each path, KL (mean over scored positions, nats, as
:func:`edgeinfer.perplexity.divergence`) and top-1 agreement against the baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

WIKI = Path(os.environ.get("EDGEINFER_SHARED", "/work/shared")) / "data" / "wikitext-2"


def _source(name: str):
    from edgeinfer.catalog import resolve_model
    from edgeinfer.quant.convert import convert
    from edgeinfer.readers import read_model

    if ":" not in name and not Path(name).exists():
        name += ":int4"  # a bare catalog name: its INT4 .eif, made on first use
    return read_model(str(resolve_model(name, progress=False, converter=convert)))


def _logprobs(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    mx = x.max(axis=1, keepdims=True)
    return x - (np.log(np.exp(x - mx).sum(axis=1, keepdims=True)) + mx)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--no-decode", action="store_true", help="skip the decode path")
    a = ap.parse_args(argv)

    from edgeinfer.api import tokenizer_for
    from edgeinfer.backends.cpu import CpuBackend, kernel_paths
    from edgeinfer.models.transformer import Transformer
    from edgeinfer.perplexity import divergence

    src = _source(a.model)
    tok = tokenizer_for(src)
    text = (WIKI / "test.txt").read_text(encoding="utf-8")
    ids = np.asarray(tok.encode(text, add_special=False, parse_special=False), np.int64)
    bos = src.config.bos_token_id if src.add_bos_token else None
    if bos is not None:
        ids = np.concatenate([[bos], ids])
    n, first = a.n_ctx, a.n_ctx // 2
    base_m = Transformer(src.config, src.tensors, CpuBackend(exact_decode=True), n)
    fast_m = Transformer(src.config, src.tensors, CpuBackend(), n)
    acc = {k: [0.0, 0, 0, 0.0] for k in ("exact", "prefill", "decode")}  # kl, same, n, nll
    decode_equal = True
    t0 = time.perf_counter()
    for i in range(a.chunks):
        chunk = ids[i * n:(i + 1) * n].astype(np.int32).copy()
        if bos is not None:
            chunk[0] = bos
        target = chunk[first + 1:n]
        rows = np.arange(len(target))
        lp_base = _logprobs(base_m.forward(chunk, base_m.new_cache(n), all_logits=True)
                            [first:n - 1])
        lps = {"exact": lp_base,
               "prefill": _logprobs(fast_m.forward(chunk, fast_m.new_cache(n),
                                                   all_logits=True)[first:n - 1])}
        if not a.no_decode:
            cache = fast_m.new_cache(n)
            out = []
            for p in range(n - 1):
                lg = fast_m.forward(chunk[p:p + 1], cache)
                if p >= first:
                    out.append(np.array(lg[-1], np.float32))
            lps["decode"] = _logprobs(np.stack(out))
            decode_equal &= bool(np.array_equal(lps["decode"], lps["prefill"]))
        for k, lp in lps.items():
            kl, same, cnt = divergence(lp_base, lp)
            acc[k][0] += kl
            acc[k][1] += same
            acc[k][2] += cnt
            acc[k][3] += float(-lp[rows, target].sum())
        print(f"chunk {i + 1}/{a.chunks} {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    res = {"model": a.model, "chunks": a.chunks, "isa": kernel_paths()}
    for k, (kl, same, cnt, nll) in acc.items():
        if cnt:
            res[k] = {"ppl": round(float(np.exp(nll / cnt)), 4), "kl": kl / cnt,
                      "top1": round(same / cnt, 4)}
    if not a.no_decode:
        res["decode_equals_prefill"] = decode_equal
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
