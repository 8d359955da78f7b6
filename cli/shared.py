"""What the subcommands share: sampling and constraint flags, loading the ``--model``
(warm-up, progress lines) and printing stats and tables."""
from __future__ import annotations

import dataclasses
import sys

from edgeinfer.errors import EdgeInferError
from edgeinfer.sampling import DEFAULTS

#: chat's sampling under the model's generation config: DEFAULTS plus a mild repetition
#: penalty (at low temperatures a 135M model loops into nonsense).
CHAT_BASE = dataclasses.replace(DEFAULTS, repetition_penalty=1.1)
_SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")


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
    head = ("compiling CPU kernels (first run only, about 30-90 s on 2 cores; cached for "
            "later runs):" if cold else "loading kernels:")
    sys.stderr.write(head)
    sys.stderr.flush()
    model.warm_up(progress=lambda stage: (sys.stderr.write(f" {stage}..."), sys.stderr.flush()))
    sys.stderr.write(f" done in {time.perf_counter() - t0:.1f} s\n")
    sys.stderr.flush()


def _compile_notice(model) -> None:
    """Say so before the first generation when the CPU kernels are not compiled yet."""
    if getattr(model, "kernels_cold", None):
        model.kernels_cold = False  # compiled by the generation about to run
        _say("compiling CPU kernels for the first answer (first run only, about 30-90 s on 2 "
             "cores; cached for later runs)...")


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
