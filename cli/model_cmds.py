"""Subcommands on model files and the models cache: pull, info, convert, export, list, rm."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

from .shared import _age, _table


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


def cmd_convert(args) -> int:
    from edgeinfer.catalog import CATALOG, catalog_source, resolve_model
    from edgeinfer.model_store import parse_ref, variant_path
    from edgeinfer.quant.convert import convert

    if os.path.isdir(args.model):
        from edgeinfer.quant.import_packed import is_packed_checkpoint

        if is_packed_checkpoint(args.model):
            return _import_packed(args)
    if args.method is None:  # calibrated with a text file, else the data-free default
        args.method = "gptq" if args.calib else "signmax"
    gptq_only = [f for f, v in (("--rotate", args.rotate or None),
                                ("--gptq-grid", args.gptq_grid)) if v is not None]
    if args.method not in ("gptq", "gptaq") and gptq_only:
        verb = "apply" if len(gptq_only) > 1 else "applies"
        print(f"error: {' and '.join(gptq_only)} {verb} to --method gptq or gptaq only; use "
              f"--method gptq, or drop {' and '.join(gptq_only)}", file=sys.stderr)
        return 2
    if args.method == "gptaq" and not args.true_sequential:
        print("error: --method gptaq needs --true-sequential (the float and quantized inputs "
              "of each linear, row for row); drop --no-true-sequential, or use --method gptq",
              file=sys.stderr)
        return 2
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
                     overwrite=args.force, true_sequential=args.true_sequential,
                     rotate=args.rotate, gptq_grid=args.gptq_grid)
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
        prov = d["provenance"]
        if args.method in ("gptq", "gptaq"):  # what its GPTQ ran on (also in `info --json`)
            g += (", rotated" if prov.get("rotation") else ", not rotated") + \
                f", {prov.get('gptq_grid')} grid"
        lin = [v for k, v in d["bits_per_weight_by_kind"].items() if k in ("attention", "mlp")]
        lin_s = f", linear layers {min(lin):.2f}-{max(lin):.2f}" if lin else ""
        as_name = f" (run it as -m {report['model']})" if "model" in report else ""
        print(f"wrote {report['out_path']}{as_name}: {report['file_size'] / 2**20:.1f} MiB, "
              f"{report['bits_per_weight']:.2f} bits/weight in all{lin_s} "
              f"({report['method']}, group {g}) in {report['convert_seconds']:.1f} s, "
              f"peak RSS {report['peak_rss_mib']:.0f} MiB")
    return 0


def _import_packed(args) -> int:
    """``convert`` of a GPTQ / AutoAWQ folder: a lossless import (no quantization options)."""
    from edgeinfer.quant.import_packed import import_packed

    given = [f for f, v in (("--method", args.method), ("--group-size", args.group_size),
                            ("--symmetric", args.symmetric), ("--calib", args.calib),
                            ("--n-calib", args.n_calib), ("--bits", args.bits != 4 or None))
             if v is not None]
    if given:
        print(f"error: {args.model} is a quantized checkpoint: convert imports its weights as "
              f"they are (lossless); {', '.join(given)} do not apply (drop them, or convert "
              f"the float model)", file=sys.stderr)
        return 2
    if args.output is None:
        print("error: --output is required to import a GPTQ/AWQ checkpoint", file=sys.stderr)
        return 2
    report = import_packed(args.model, args.output, embed_bits=args.embed_bits,
                           overwrite=args.force)
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print(f"wrote {report['out_path']}: {report['file_size'] / 2**20:.1f} MiB, "
              f"{report['bits_per_weight']:.2f} bits/weight in all; imported {report['imported']} "
              f"(group {report['group_size']}, {report['n_packed']} linears re-laid, nothing "
              f"re-quantized) in {report['convert_seconds']:.1f} s")
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
