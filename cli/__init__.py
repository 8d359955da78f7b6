"""The ``edgeinfer`` command: argument parsing and user-facing output only.

Subcommands: pull, info, generate, chat, convert, export, perplexity, bench, serve,
devices, list, rm, ps. Errors that
edgeinfer raises on purpose print as one line (``error: ...``) with exit status 1.
This module holds the parser and the dispatch; the subcommands live by group in
:mod:`.run_cmds`, :mod:`.model_cmds` and :mod:`.serve_cmds`, what they share in
:mod:`.shared`.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from edgeinfer.errors import EdgeInferError
from edgeinfer.sampling import DEFAULTS
from edgeinfer.speculative import SPECULATE_MODES

from .model_cmds import cmd_convert, cmd_export, cmd_info, cmd_list, cmd_pull, cmd_rm
from .run_cmds import cmd_bench, cmd_chat, cmd_devices, cmd_generate, cmd_perplexity
from .serve_cmds import cmd_ps, cmd_serve
from .shared import (  # noqa: F401  (re-exported: the names the one-file cli had)
    _SAMPLING_FLAGS,
    CHAT_BASE,
    _age,
    _compile_notice,
    _constraint,
    _first_run_convert,
    _load,
    _parallel,
    _print_stats,
    _sampling,
    _say,
    _table,
    _warm_up,
)

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

    s = sub.add_parser("convert", help="quantize a checkpoint into one .eif file (or import a "
                                       "GPTQ / AutoAWQ checkpoint losslessly)")
    s.add_argument("model", help="HF folder (float, GPTQ or AutoAWQ GEMM), .gguf file or "
                                 "catalog name")
    s.add_argument("--output", "-o", default=None,
                   help="the .eif to write (default for a catalog name: the models cache, "
                        "as NAME:METHOD, e.g. smollm2-135m-instruct:gptq); an existing file only "
                        "with --force; never the input")
    s.add_argument("--force", "-f", action="store_true",
                   help="replace an existing --output file")
    s.add_argument("--method", choices=["signmax", "grid", "rtn", "awq", "gptq", "gptaq", "mse"],
                   default=None,
                   help="default: signmax (data-free, seconds; symmetric groups of 32, each "
                        "group's largest weight exact) without --calib, gptq with it; grid: "
                        "searched scales; rtn: the plain round-to-nearest baseline; mse: the clip "
                        "minimising the error weighted by mean x² per input; gptaq: "
                        "GPTQ fitting each layer to the float model's outputs (best quality, "
                        "about twice GPTQ's time)")
    s.add_argument("--bits", type=int, default=4)
    s.add_argument("--group-size", type=int, default=None,
                   help="default: the method's (signmax, grid 32, others 128); -1 = "
                        "per-channel; a row "
                        "it does not divide takes the largest multiple of 32 that does "
                        "(SmolLM2's 576-wide rows at 128: 96), recorded per tensor")
    s.add_argument("--symmetric", action=argparse.BooleanOptionalAction, default=None,
                   help="INT4 without zero points (default: the method's; signmax, grid: "
                        "symmetric)")
    s.add_argument("--embed-bits", type=int, default=None,
                   help="embedding and untied head: 8 (INT8 per row; the default), 16 or 32; "
                        "a GPTQ/AWQ import keeps them as stored unless given")
    s.add_argument("--calib", default=None, help="plain-text calibration file (default: self-generated)")
    s.add_argument("--n-calib", type=int, default=None, help="calibration sequences")
    s.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True,
                   help="GPTQ, GPTAQ: quantize columns in order of activation size (default on; "
                        "no run-time cost: the order is undone at convert time)")
    s.add_argument("--true-sequential", action=argparse.BooleanOptionalAction, default=True,
                   help="GPTQ: one forward per layer, each linear's Hessian from its inputs "
                        "with the layer's earlier linears quantized (default on; off: every "
                        "Hessian from the float layer, two forwards per layer, slower; gptaq "
                        "needs it on)")
    s.add_argument("--rotate", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ, GPTAQ: rotate the residual stream and value heads first (same "
                        "function, fewer outliers per group; a tied head is stored apart). "
                        "Default on for gptq and gptaq where the architecture allows it "
                        "(not Gemma)")
    s.add_argument("--gptq-grid", choices=["mse", "minmax"], default=None,
                   help="GPTQ's (and GPTAQ's) group scales and zero points: mse (default: the "
                        "clip minimising the diag(H)-weighted error) or minmax (the group's "
                        "range)")
    s.add_argument("--seed", type=int, default=0,
                   help="calibration windows and the rotation's draw")
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
