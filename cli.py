"""The ``edgeinfer`` command: argument parsing and user-facing output only.

Subcommands: pull, info, generate, chat, convert, export, perplexity, bench, serve,
devices, list, rm, ps. Errors that
edgeinfer raises on purpose print as one line (``error: ...``) with exit status 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

from edgeinfer.errors import EdgeInferError
from edgeinfer.sampling import DEFAULTS
from edgeinfer.speculative import SPECULATE_MODES

DEFAULT_MODEL = "smollm2-135m-instruct"
KV_DTYPE_CHOICES = ("int8", "f16", "f32", "int4", "k8v4")  # edgeinfer.backends.kvcache.ALL_KV_DTYPES


# ---- shared options --------------------------------------------------------------------
def _add_runtime_args(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    if model_required:
        p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                       help=f"path (HF folder, .gguf, .eif) or catalog name (default {DEFAULT_MODEL})")
    p.add_argument("--backend", choices=["cpu", "reference", "opencl"], default=None,
                   help="compute backend (default: cpu)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--device", default=None, help="OpenCL device index or name")
    p.add_argument("--ctx", type=int, default=None,
                   help="context length in tokens (default 4096, lowered to what --max-memory "
                        "allows; at most the model's positions)")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default=None,
                   help="KV cache dtype (default int8)")
    p.add_argument("--max-memory", type=float, default=None, metavar="MB",
                   help="total memory budget in MiB: sizes the context, refuses what cannot fit")
    p.add_argument("--prefill-chunk", type=int, default=512, help="tokens per prefill step")


#: chat's sampling under the model's generation config: DEFAULTS plus a mild repetition
#: penalty (at low temperatures a 135M model loops into nonsense).
CHAT_BASE = dataclasses.replace(DEFAULTS, repetition_penalty=1.1)
_SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")


def _add_sampling_args(p: argparse.ArgumentParser, chat: bool) -> None:
    # generate is greedy unless told (as the API); chat takes the model's own defaults
    # (its generation config, else CHAT_BASE), as the server does for omitted fields
    def default(field: str) -> str:
        if chat:
            return f"(default: the model's generation config, else {getattr(CHAT_BASE, field)})"
        return f"(default {0.0 if field == 'temperature' else getattr(DEFAULTS, field)})"

    p.add_argument("--max-tokens", "-n", type=int, default=256, help="most tokens to generate")
    p.add_argument("--temperature", "--temp", type=float, default=None,
                   help=f"0 = greedy {default('temperature')}")
    p.add_argument("--top-k", type=int, default=None, help=f"0 = off {default('top_k')}")
    p.add_argument("--top-p", type=float, default=None, help=f"1 = off {default('top_p')}")
    p.add_argument("--min-p", type=float, default=None, help=f"0 = off {default('min_p')}")
    p.add_argument("--repeat-penalty", dest="repetition_penalty", metavar="PENALTY",
                   type=float, default=None, help=f"1 = off {default('repetition_penalty')}")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    _add_speculate_arg(p)


def _add_speculate_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculate", choices=list(SPECULATE_MODES), default="auto",
                   help="prompt-lookup speculative decoding: n-gram drafts verified in one "
                        "forward, the same tokens as without (default auto: where exact and "
                        "while it pays; ngram: where exact)")


def _sampling(args, model=None) -> dict:
    """The sampling flags given on the command line; for chat (``model`` given) over the
    model's defaults. generate passes only the given ones: the API's defaults are
    greedy and :data:`edgeinfer.sampling.DEFAULTS`."""
    given = {f: getattr(args, f) for f in _SAMPLING_FLAGS if getattr(args, f) is not None}
    if model is None:
        return given
    return {**model.sampling_defaults(CHAT_BASE), **given}


def _constraint(args) -> dict:
    """``json_schema=`` / ``grammar=`` from --json-schema / --grammar FILE (read and
    compiled before the model loads, so a bad file costs no load).

    Raises:
        GrammarError: the file is not a valid JSON schema / grammar.
        FileNotFoundError: no such file.
    """
    from edgeinfer.constrained import Grammar

    if getattr(args, "json_schema", None):
        with open(args.json_schema, encoding="utf-8") as f:
            text = f.read()
        try:
            return {"grammar": Grammar.from_json_schema(text)}
        except EdgeInferError as e:
            raise type(e)(f"--json-schema {args.json_schema}: {e}") from None
    if getattr(args, "grammar", None):
        with open(args.grammar, encoding="utf-8") as f:
            text = f.read()
        try:
            return {"grammar": Grammar.from_lark(text)}
        except EdgeInferError as e:
            raise type(e)(f"--grammar {args.grammar}: {e}") from None
    return {}


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _first_run_convert(*args, **kw):
    """The converter, imported only when ``NAME:int4`` is made on first use."""
    from edgeinfer.quant.convert import convert

    return convert(*args, **kw)


def _load(args, warm: bool = False):
    """The ``--model``; a catalog name runs as its GGUF (natively, at its own quality);
    ``NAME:int4`` is made on first use.

    Kernels that are not compiled yet (a fresh install) are compiled here, before any
    prompt, with a progress line; ``warm`` also loads already-compiled ones (the server,
    whose first request should not pay for it)."""
    from edgeinfer import api
    from edgeinfer.catalog import read_resolved, resolve_model

    from edgeinfer.model_store import record_use

    quiet = getattr(args, "quiet", False)
    path = resolve_model(args.model, progress=not quiet, converter=_first_run_convert,
                         notify=None if quiet else _say)
    source = read_resolved(path)
    model = api.Model(source, backend=args.backend, n_ctx=args.ctx,
                      kv_dtype=args.kv_dtype, threads=args.threads, device=args.device,
                      prefill_chunk=args.prefill_chunk, max_memory=args.max_memory,
                      parallel=_parallel(args, source))
    record_use(path)
    if warm or model.kernels_cold:
        _warm_up(model, quiet)
    return model


def _parallel(args, source) -> int:
    """``--parallel`` (serve only; 1 elsewhere), or by default min(4, the sequences of
    the context that fit in --max-memory, else in the memory available now)."""
    if not hasattr(args, "parallel"):
        return 1
    if args.parallel is not None:
        return args.parallel
    from edgeinfer import api
    from edgeinfer.memory import default_parallel

    backend = args.backend or api.default_backend()
    return default_parallel(source.config, api.source_weight_bytes(source, backend),
                            args.kv_dtype or api.DEFAULT_KV_DTYPE, args.prefill_chunk,
                            args.ctx, args.max_memory)


def _warm_up(model, quiet: bool) -> None:
    """Compile (fresh install) or load the kernels before the first prompt, with a
    progress line on stderr: the first answer must not stall after its first word."""
    import time

    cold = model.kernels_cold
    t0 = time.perf_counter()
    if quiet:
        model.warm_up()
        return
    head = ("compiling CPU kernels (first run only, 15-60 s; cached for later runs):" if cold
            else "loading kernels:")
    sys.stderr.write(head)
    sys.stderr.flush()
    model.warm_up(progress=lambda stage: (sys.stderr.write(f" {stage}..."), sys.stderr.flush()))
    sys.stderr.write(f" done in {time.perf_counter() - t0:.1f} s\n")
    sys.stderr.flush()


def _compile_notice(model) -> None:
    """Say so before the first generation when the CPU kernels are not compiled yet."""
    if getattr(model, "kernels_cold", None):
        model.kernels_cold = False  # compiled by the generation about to run
        _say("compiling CPU kernels for the first answer (first run only, 15-60 s; "
             "cached for later runs)...")


def _print_stats(stats, stream=sys.stderr, interrupted: bool = False) -> None:
    if interrupted:
        print(f"[interrupted after {stats.generated_tokens} tokens]", file=stream)
    spec = (f" ({stats.accepted}/{stats.drafted} speculative drafts accepted)"
            if stats.drafted else "")
    print(f"[{stats.prompt_tokens} prompt tokens ({stats.reused_tokens} reused), "
          f"{stats.generated_tokens} generated; TTFT {stats.ttft_s * 1000:.0f} ms, "
          f"prefill {stats.prefill_tok_s:.1f} tok/s, decode {stats.decode_tok_s:.1f} tok/s"
          f"{spec}, ITL p90 {stats.itl_p90_s * 1000:.1f} ms, KV {stats.kv_bytes / 2**20:.1f} "
          f"MiB, peak RSS {stats.peak_rss_mb:.0f} MiB]", file=stream)


# ---- subcommands -----------------------------------------------------------------------
def cmd_pull(args) -> int:
    from edgeinfer.catalog import CATALOG, pull

    path = pull(args.name, progress=not args.quiet)
    if args.json:
        e = CATALOG[args.name]
        print(json.dumps({"name": args.name, "path": str(path), "bytes": path.stat().st_size,
                          "sha256": e.sha256, "description": e.description}))
    else:
        print(path)
    return 0


def cmd_info(args) -> int:
    from edgeinfer.catalog import resolve_model
    from edgeinfer.readers import read_model

    path = resolve_model(args.model, progress=True)
    src = read_model(str(path))  # read once: a large GGUF's tokenizer takes seconds to rebuild
    if str(path).endswith(".eif"):
        from edgeinfer.container import describe_eif
        info = describe_eif(str(path))
    else:
        c = src.config
        size = (sum(f.stat().st_size for f in path.iterdir()) if path.is_dir()
                else path.stat().st_size)
        info = {
            "path": str(path), "format": src.format, "architecture": c.model_type,
            "parameters": c.param_count(), "file_bytes": size,
            "context": c.max_position_embeddings, "layers": c.num_hidden_layers,
            "hidden": c.hidden_size, "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "vocab": c.vocab_size,
            "rope_theta": c.rope_theta, "tied_embeddings": c.tie_word_embeddings,
            "eos_token_ids": c.eos_token_ids, "chat_template": bool(src.chat_template),
            "kv_bytes_per_token_f32": c.kv_bytes_per_token_f32(),
        }
    plan = None
    from edgeinfer.memory import context_length

    if args.max_memory is not None:
        from edgeinfer.api import DEFAULT_KV_DTYPE, source_weight_bytes
        from edgeinfer.memory import format_plan, plan_memory

        plan = plan_memory(src.config, source_weight_bytes(src, args.backend or "cpu"),
                           args.max_memory, args.kv_dtype or DEFAULT_KV_DTYPE, args.prefill_chunk)
        info["memory_plan"] = dataclasses.asdict(plan)
    # the context chat/generate/serve would run with (one rule), and the model's limit
    model_max = src.config.max_position_embeddings
    info.pop("context", None)
    info = {"context": context_length(model_max, None, plan.max_context if plan else None),
            "model_context": model_max, **info}
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        if plan is not None:
            info.pop("memory_plan")
        for k, v in info.items():
            if isinstance(v, (dict, list)) and len(json.dumps(v, default=str)) > 100:
                v = json.dumps(v, default=str)[:100] + "..."
            print(f"{k:24s} {v}")
        if plan is not None:
            print(format_plan(plan))
    return 0


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


def cmd_convert(args) -> int:
    from edgeinfer.catalog import CATALOG, catalog_source, resolve_model
    from edgeinfer.model_store import parse_ref, variant_path
    from edgeinfer.quant.convert import convert

    if args.method is None:  # calibrated with a text file, else the data-free default
        args.method = "awq" if args.calib else "signmax"
    name, variant = (parse_ref(args.model) if not os.path.exists(args.model)
                     else (args.model, None))
    from_catalog = name in CATALOG and variant in (None, "gguf")
    out = args.output
    if out is None:
        if not from_catalog:
            print("error: --output is required unless MODEL is a catalog name (which is "
                  f"written into the models cache as NAME:{args.method})", file=sys.stderr)
            return 2
        out = variant_path(name, args.method)
        if out.exists() and not args.force:
            print(f"error: {name}:{args.method} exists ({out}); remove it first with "
                  f"`edgeinfer rm {name}:{args.method}`, or pass --force", file=sys.stderr)
            return 1
        out.parent.mkdir(parents=True, exist_ok=True)
    # a catalog GGUF carries no sampling settings: its entry's go into the file
    src = (catalog_source(name, progress=not args.quiet) if from_catalog
           else str(resolve_model(args.model, progress=not args.quiet)))
    report = convert(src, str(out), method=args.method, bits=args.bits,
                     group_size=args.group_size, symmetric=args.symmetric,
                     embed_bits=args.embed_bits, calib_path=args.calib, n_calib=args.n_calib,
                     seed=args.seed, act_order=args.act_order, progress=not args.quiet,
                     overwrite=args.force)
    if args.output is None:
        report["model"] = f"{name}:{args.method}"
    if args.json:
        print(json.dumps(report, default=str))
    else:
        from edgeinfer.container import describe_eif

        d = describe_eif(report["out_path"])
        groups = sorted({q["group_size"] for q in d["quantization"].values()
                         if q["bits"] == args.bits})
        asked = report["group_size"]
        g = "per-channel" if asked == -1 else str(asked)
        other = ", ".join(str(x) for x in groups if x != asked)
        if other:  # rows the requested group does not divide (the --group-size rule)
            g = (f"{g}, {other} where {asked} does not divide the row" if asked in groups
                 else f"{other} ({asked} divides no row)")
        lin = [v for k, v in d["bits_per_weight_by_kind"].items() if k in ("attention", "mlp")]
        lin_s = f", linear layers {min(lin):.2f}-{max(lin):.2f}" if lin else ""
        as_name = f" (run it as -m {report['model']})" if "model" in report else ""
        print(f"wrote {report['out_path']}{as_name}: {report['file_size'] / 2**20:.1f} MiB, "
              f"{report['bits_per_weight']:.2f} bits/weight in all{lin_s} "
              f"({report['method']}, group {g}) in {report['convert_seconds']:.1f} s, "
              f"peak RSS {report['peak_rss_mib']:.0f} MiB")
    return 0


def cmd_export(args) -> int:
    from edgeinfer.catalog import resolve_model
    from edgeinfer.quant.export_gptq import export_gptq

    path = args.model
    if not os.path.exists(path) and ":" in path:  # NAME:VARIANT of the models cache
        path = str(resolve_model(path, progress=not args.quiet))
    if not os.path.isfile(path) or not path.endswith(".eif"):
        print(f"error: {args.model} is not an .eif file; export takes a converted model "
              f"(edgeinfer convert MODEL --method gptq -o MODEL.eif, or NAME:gptq)",
              file=sys.stderr)
        return 2
    report = export_gptq(path, args.output, overwrite=args.force)
    if args.json:
        print(json.dumps(report))
    else:
        sym = "symmetric" if report["sym"] else "asymmetric"
        print(f"wrote {report['out_dir']}: HF GPTQ folder ({report['n_quantized']} 4-bit linears, "
              f"group {report['group_size']}, {sym}, v1 zero points; "
              f"{report['bytes'] / 2**20:.1f} MiB of tensors)")
    return 0


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


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return v


def _port(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {port}")
    return port


def _size(text: str) -> int:
    from edgeinfer.server_limits import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return v


def cmd_serve(args) -> int:
    try:
        from edgeinfer.server import ServerLimits, default_model_name, serve
    except ImportError as e:
        print(f"error: `edgeinfer serve` needs the serve extra: pip install 'edgeinfer[serve]' "
              f"({e.name} is missing)", file=sys.stderr)
        return 1
    import contextlib

    from edgeinfer.model_store import server_state

    limits = ServerLimits(max_body=args.max_body, header_timeout=args.header_timeout,
                          body_timeout=args.body_timeout)
    model = _load(args, warm=True)  # the first request pays no kernel loading
    # a catalog name (or NAME:VARIANT) is a nicer id than the cached file's name; a path
    # gives its stem
    name = args.model_name or (default_model_name(model) if os.path.exists(args.model)
                               else args.model)
    key_note = " (API key required)" if args.api_key else ""
    state = contextlib.ExitStack()

    def listening(url: str) -> None:
        state.enter_context(server_state(model, name, url))
        par = model.pool.n if model.pool is not None else 1
        print(f"serving model id '{name}' ({model.backend.name} backend, context "
              f"{model.n_ctx} tokens, {par} in parallel) at {url}{key_note}; clients send "
              f"model=\"{name}\"; Ctrl-C stops", file=sys.stderr)

    with state:
        serve(model, host=args.host, port=args.port, api_key=args.api_key, model_name=name,
              log_level=str(args.log_level).lower(), default_max_tokens=args.max_tokens,
              access_log=not args.quiet, limits=limits, on_listening=listening,
              queue_limit=args.queue_limit, speculate=args.speculate)
    return 0


def _age(seconds: float | None) -> str:
    """'3 minutes ago' style, or 'never'."""
    import time

    if seconds is None:
        return "never"
    d = max(0.0, time.time() - seconds)
    for unit, n in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if d >= n:
            k = int(d // n)
            return f"{k} {unit}{'s' if k > 1 else ''} ago"
    return "just now"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def cmd_list(args) -> int:
    from edgeinfer.model_store import list_models

    entries = list_models()
    if args.json:
        print(json.dumps([e.as_dict() for e in entries], indent=2))
        return 0
    if not entries:
        print("no models in the cache yet (`edgeinfer pull NAME` or `edgeinfer chat -m NAME`)")
        return 0
    rows = [["NAME", "SIZE", "FORMAT", "METHOD", "LAST USED", "PATH"]]
    rows += [[e.ref, f"{e.size / 2**20:.0f} MiB", e.format, e.method, _age(e.last_used),
              e.path] for e in entries]
    print(_table(rows))
    return 0


def cmd_rm(args) -> int:
    from edgeinfer.model_store import remove

    for ref in args.names:
        removed = remove(ref)
        print(f"removed {ref}: {', '.join(p.name for p in removed)}")
    return 0


def cmd_ps(args) -> int:
    from edgeinfer.model_store import running_servers

    servers = running_servers()
    if args.json:
        print(json.dumps([e.as_dict() for e in servers], indent=2))
        return 0
    if not servers:
        print("no edgeinfer server is running")
        return 0
    rows = [["MODEL", "PID", "URL", "BACKEND", "CONTEXT", "MEMORY", "WEIGHTS + KV", "UP"]]
    for e in servers:
        rss = "?" if e.rss_bytes is None else f"{e.rss_bytes / 2**20:.0f} MiB"
        up = _age(e.started).replace(" ago", "").replace("just now", "<1 minute")
        rows.append([e.model, str(e.pid), e.url, e.backend, f"{e.n_ctx} ({e.kv_dtype} KV)",
                     rss, f"{(e.weights_bytes + e.kv_bytes) / 2**20:.0f} MiB", up])
    print(_table(rows))
    return 0


# ---- parser ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgeinfer", description="Quantized on-device LLM inference.")
    p.add_argument("--log-level", default=os.environ.get("EDGEINFER_LOG", "WARNING"))
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("pull", help="fetch a catalog model into the cache")
    s.add_argument("name")
    s.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    s.add_argument("--json", action="store_true", help="one JSON object on stdout")
    s.set_defaults(func=cmd_pull)

    s = sub.add_parser("info", help="describe a model (architecture, size, quantization, memory plan)")
    s.add_argument("model")
    s.add_argument("--json", action="store_true")
    s.add_argument("--max-memory", type=float, default=None, metavar="MB",
                   help="print the memory plan for this budget (weights, KV per token, max context)")
    s.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default=None)
    s.add_argument("--backend", choices=["cpu", "reference", "opencl"], default=None)
    s.add_argument("--prefill-chunk", type=int, default=512)
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("generate", help="complete a prompt")
    _add_runtime_args(s)
    _add_sampling_args(s, chat=False)
    s.add_argument("--prompt", "-p", required=True)
    s.add_argument("--parse-special", action=argparse.BooleanOptionalAction, default=True,
                   help="special-token strings in the prompt (e.g. <|im_start|>) become control "
                        "tokens (default, as llama.cpp); --no-parse-special encodes them as "
                        "plain text")
    s.add_argument("--verbose", "-v", action="store_true", help="print timing stats to stderr")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", default=None,
                   help="constrain the output to one JSON value valid under the JSON schema "
                        "in FILE ('{\"type\": \"object\"}': any object)")
    g.add_argument("--grammar", metavar="FILE", default=None,
                   help="constrain the output to the Lark grammar in FILE (llguidance's dialect)")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("chat", help="chat in the terminal")
    _add_runtime_args(s)
    _add_sampling_args(s, chat=True)
    s.add_argument("--system", default=None, help="system prompt")
    s.set_defaults(func=cmd_chat)

    s = sub.add_parser("convert", help="quantize a checkpoint into one .eif file")
    s.add_argument("model", help="HF folder, .gguf file or catalog name")
    s.add_argument("--output", "-o", default=None,
                   help="the .eif to write (default for a catalog name: the models cache, "
                        "as NAME:METHOD, e.g. smollm2-135m-instruct:gptq); an existing file only "
                        "with --force; never the input")
    s.add_argument("--force", "-f", action="store_true",
                   help="replace an existing --output file")
    s.add_argument("--method", choices=["signmax", "grid", "rtn", "awq", "gptq", "mse"],
                   default=None,
                   help="default: signmax (data-free, seconds; symmetric groups of 32, each "
                        "group's largest weight exact) without --calib, awq with it; grid: "
                        "searched scales; rtn: the plain round-to-nearest baseline")
    s.add_argument("--bits", type=int, default=4)
    s.add_argument("--group-size", type=int, default=None,
                   help="default: the method's (signmax, grid 32, others 128); -1 = "
                        "per-channel; a row "
                        "it does not divide takes the largest multiple of 32 that does "
                        "(SmolLM2's 576-wide rows at 128: 96), recorded per tensor")
    s.add_argument("--symmetric", action=argparse.BooleanOptionalAction, default=None,
                   help="INT4 without zero points (default: the method's; signmax, grid: "
                        "symmetric)")
    s.add_argument("--embed-bits", type=int, default=8)
    s.add_argument("--calib", default=None, help="plain-text calibration file (default: self-generated)")
    s.add_argument("--n-calib", type=int, default=None, help="calibration sequences")
    s.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True,
                   help="GPTQ: quantize columns in order of activation size (default on; "
                        "no run-time cost: the order is undone at convert time)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--quiet", "-q", action="store_true")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_convert)

    s = sub.add_parser("export", help="write a converted .eif in another format (HF GPTQ)")
    s.add_argument("model", help=".eif file or NAME:VARIANT from the models cache")
    s.add_argument("--format", choices=["gptq"], required=True,
                   help="gptq: a Hugging Face GPTQ folder (v1 zero points, desc_act false) for "
                        "transformers, vLLM, SGLang")
    s.add_argument("--output", "-o", required=True, help="the folder to create")
    s.add_argument("--force", "-f", action="store_true",
                   help="replace a previous export in --output (other files are never deleted)")
    s.add_argument("--quiet", "-q", action="store_true")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("perplexity", help="perplexity on a text file (llama.cpp's method)")
    s.add_argument("model")
    _add_runtime_args(s, model_required=False)
    s.add_argument("--text", required=True)
    s.add_argument("--chunk", type=int, default=512)
    s.add_argument("--chunks", type=int, default=None, help="limit the number of chunks")
    s.add_argument("--quiet", "-q", action="store_true")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_perplexity)

    s = sub.add_parser("bench", help="measure load, prefill and decode speed")
    s.add_argument("model")
    _add_runtime_args(s, model_required=False)
    s.add_argument("--prompt-tokens", type=int, default=256)
    s.add_argument("--gen-tokens", type=int, default=128)
    s.add_argument("--repeat", type=int, default=3)
    s.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    s.add_argument("--json", action="store_true", help="one JSON object on stdout")
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("devices", help="list OpenCL platforms and devices")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_devices)

    s = sub.add_parser("list", aliases=["ls"], help="the models in the cache (name:variant, "
                       "size, format, method, last used, path)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_list)

    s = sub.add_parser("rm", help="remove a model (every variant) or one NAME:VARIANT "
                       "from the cache")
    s.add_argument("names", nargs="+", metavar="NAME[:VARIANT]")
    s.set_defaults(func=cmd_rm)

    s = sub.add_parser("ps", help="the running edgeinfer servers: model, URL, memory")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_ps)

    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_runtime_args(s)
    s.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=_port, default=8080, help="TCP port (default 8080)")
    s.add_argument("--api-key", default=os.environ.get("EDGEINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes "
                        "(default: $EDGEINFER_API_KEY, else no key)")
    s.add_argument("--model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: --model)")
    _add_speculate_arg(s)
    s.add_argument("--max-tokens", "-n", type=int, default=None, metavar="N",
                   help="most tokens to generate for a request that sets no max_tokens "
                        "(default: unlimited, i.e. up to the end of the context, as OpenAI; "
                        "a request's own max_tokens always applies)")
    s.add_argument("--quiet", "-q", action="store_true",
                   help="no log line per request on stderr (method, path, status, tokens, seconds)")
    s.add_argument("--max-body", type=_size, default="4M", metavar="SIZE",
                   help="largest request body accepted, e.g. 4M, 512K (default 4M); larger: 413")
    s.add_argument("--header-timeout", type=_seconds, default=10.0, metavar="S",
                   help="seconds a client has to send the request line and headers "
                        "(default 10); slower: 408")
    s.add_argument("--body-timeout", type=_seconds, default=30.0, metavar="S",
                   help="seconds a client has to send the request body after its headers "
                        "(default 30); slower: 408")
    s.add_argument("--parallel", type=_positive, default=None, metavar="N",
                   help="requests generated at once (continuous batching; one KV cache of "
                        "the context each); default: min(4, what fits in --max-memory, else "
                        "in the memory available)")
    s.add_argument("--queue-limit", type=int, default=16, metavar="N",
                   help="requests that may wait for a free slot (default 16); past it a new "
                        "request gets 503 with Retry-After")
    s.set_defaults(func=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(levelname)s %(name)s: %(message)s")
    if hasattr(args, "temperature"):
        try:  # checked before loading: a typo costs no model load
            dataclasses.replace(DEFAULTS, **_sampling(args))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if getattr(args, "max_tokens", None) is not None and args.max_tokens < 1:
        print(f"error: --max-tokens must be at least 1, got {args.max_tokens}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except EdgeInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"error: file not found: {e.filename or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
