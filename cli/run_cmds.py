"""Subcommands that run a model: generate, chat, perplexity, bench, devices."""
from __future__ import annotations

import json
import os
import sys

from .shared import _compile_notice, _constraint, _load, _print_stats, _sampling, _say


def cmd_generate(args) -> int:
    constrained = _constraint(args)
    model = _load(args)
    final = None
    for ev in model.stream(args.prompt, parse_special=args.parse_special,
                           max_tokens=args.max_tokens, stop=args.stop,
                           speculate=args.speculate, **constrained, **_sampling(args)):
        if ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        final = ev
    sys.stdout.write("\n")
    if args.verbose and final is not None:
        print(f"[finish: {final.finish_reason}]", file=sys.stderr)
        _print_stats(final.stats)
    return 0


def cmd_chat(args) -> int:
    from edgeinfer.chat_repl import run_chat

    _say(f"loading {args.model} ...")
    model = _load(args)
    _say(f"edgeinfer chat: {args.model} ({model.backend.name} backend, context "
         f"{model.n_ctx} tokens). /help for commands, Ctrl-C stops an answer, Ctrl-D quits.")
    return run_chat(model, system=args.system, max_tokens=args.max_tokens, stop=args.stop,
                    sampling={**_sampling(args, model), "speculate": args.speculate},
                    print_stats=_print_stats,
                    compile_notice=_compile_notice)


def cmd_perplexity(args) -> int:
    from edgeinfer.perplexity import perplexity

    model = _load(args)
    if not args.quiet:
        _compile_notice(model)
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        print(f"error: {args.text} is not UTF-8 text ({e.reason} at byte {e.start})",
              file=sys.stderr)
        return 1
    # special-token strings in the text ("<unk>" in WikiText) are text, as in llama.cpp
    ids = model.tokenizer.encode(text, add_special=False, parse_special=False)
    res = perplexity(model.transformer, ids, n_ctx=args.chunk, n_chunks=args.chunks,
                     bos_id=model.tokenizer.bos_id if model.tokenizer.add_bos_token else None,
                     progress=not args.quiet, kv_dtype=model.engine.kv_dtype)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"perplexity {res['ppl']:.4f} over {res['n_tokens']} scored tokens "
              f"({res['chunks']} chunks of {args.chunk})")
    return 0


def cmd_bench(args) -> int:
    import time

    import numpy as np
    from tqdm import tqdm

    from edgeinfer.engine import peak_rss_mb, reset_peak_rss, window_peak_rss_mb

    t0 = time.perf_counter()
    model = _load(args)
    load_s = time.perf_counter() - t0
    reset_peak_rss()  # run_peak_rss_mb: prefill + decode only, not the load's transients
    rng = np.random.default_rng(0)
    v = model.config.vocab_size
    results = []
    for _ in tqdm(range(args.repeat), desc="bench", unit="run", file=sys.stderr,
                  disable=args.quiet):
        ids = rng.integers(100, min(v, 30000), size=args.prompt_tokens).tolist()
        model.engine.reset()
        final = None
        for ev in model.engine.stream(ids, max_tokens=args.gen_tokens, stop=()):
            final = ev
        # random prompts may hit EOS early: only count full runs' stats
        results.append(final.stats)
    med = lambda xs: float(np.median(xs))
    out = {
        "model": args.model, "backend": model.backend.name,
        "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
        "load_s": load_s,
        "prefill_tok_s": med([s.prefill_tok_s for s in results]),
        "ttft_s": med([s.ttft_s for s in results]),
        "decode_tok_s": med([s.decode_tok_s for s in results]),
        "itl_s": med([s.itl_mean_s for s in results]),
        "generated": [s.generated_tokens for s in results],
        "peak_rss_mb": peak_rss_mb(),
        "run_peak_rss_mb": window_peak_rss_mb(),
    }
    # the memory target: the file (weights as stored) + the KV cache + 150 MB (MiB here)
    path = getattr(model.source, "path", None)
    if path and os.path.isfile(path):
        out["file_mb"] = os.path.getsize(path) / 2**20
        out["kv_mb"] = model.engine.cache.nbytes / 2**20
        out["rss_target_mb"] = out["file_mb"] + out["kv_mb"] + 150e6 / 2**20
    if args.json:
        print(json.dumps(out))
    else:
        for k, val in out.items():
            print(f"{k:16s} {val:.4g}" if isinstance(val, float) else f"{k:16s} {val}")
    return 0


def cmd_devices(args) -> int:
    from edgeinfer.backends.errors import BackendUnavailableError

    try:
        from edgeinfer.backends.opencl import list_devices
        devices = list_devices()
    except ImportError:
        print("error: OpenCL needs pyopencl: pip install 'edgeinfer[opencl]'", file=sys.stderr)
        return 1
    except BackendUnavailableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json or not devices:
        print(json.dumps(devices, indent=2, default=str) if args.json else "no OpenCL devices "
              "found: install your GPU's OpenCL driver (ICD), or PoCL, a CPU device: "
              "pip install 'edgeinfer[opencl]' (pyopencl[pocl])")
        return 0
    for d in devices:
        print(f"[{d.get('id', d.get('index'))}] {d.get('name')} ({d.get('platform')}, {d.get('type')}): "
              f"{int(d.get('global_mem_bytes', 0)) / 2**30:.1f} GiB, fp16 {'yes' if d.get('fp16') else 'no'}, "
              f"max work-group {d.get('max_work_group_size')}")
    return 0
