"""Quality of edgeinfer's INT4 converter: WikiText-2 perplexity of RTN / AWQ / GPTQ / signmax.

Usage::

    python benchmarks/quality.py [--model smollm2-135m-instruct] [--chunks 40]
        [--methods rtn,awq,gptq] [--n-calib 32] [--calib-len 512] [--act-order] [--out DIR]
    python benchmarks/quality.py --model M --llama [--llama-no-f32] --chunks N --out DIR
    python benchmarks/quality.py --model M --gguf-native [--native-ftypes Q4_0,Q6_K] --chunks N --out DIR

For each row (baseline = the dequantized GGUF in float32 through the reference backend,
then each converted ``.eif``) prints perplexity with llama.cpp's method (512-token chunks,
second half scored; :mod:`edgeinfer.perplexity`), ΔPPL vs baseline, bits per weight of
the linear+embedding tensors, file size, convert time and the converter's peak RSS, and
KL(baseline || row) and top-1 agreement with the baseline per scored position (llama.cpp's
``--kl-divergence`` figures; the baseline's log-probabilities are kept as float16 in
``OUT/MODEL.base-logprobs.CHUNKS.npy``, so ``--skip-baseline`` and ``--llama`` runs reuse
them). Each conversion runs in its own subprocess so its peak RSS is its own. GPTQ rows use
``convert``'s defaults (rotated where the architecture allows, the searched grid). Calibration: WikiText-2
``valid.txt``; evaluation: ``test.txt``. Anchors (MODELS.md): baseline 18.979, llama.cpp
Q4_0 +18.3% at 4.5 bpw.

``--llama`` instead gives llama.cpp's rows on the same weights, text and chunking: the GGUF
dequantized to an F32 GGUF (the baseline, scored by llama.cpp as a cross-check of ours),
then ``llama_model_quantize`` to Q4_0 from that F32 file (its default mix: Q4_0 linears at
4.5 bpw; the tied embedding / output head falls back from Q6_K to Q8_0, 8.5 bpw, because
the row width is not a multiple of 256), scored with llama-cpp-python (``logits_all``) on
our token ids (BOS written over each chunk's first token, second half scored).

``--gguf-native``: the GGUF with its block types re-laid (no float32 copy,
:mod:`edgeinfer.readers.gguf_blocks`) on the CPU backend, against the baseline; with
``--native-ftypes Q4_0,Q4_K_S,...`` instead llama.cpp's pure quantizations of the F32 GGUF
(``OUT/MODEL.FTYPE.pure.gguf``), each row with its bits per weight in the file
(:func:`gguf_bpw`) and as the CPU backend holds it (:func:`cpu_bpw`).

Reading the GGUF uses ``edgeinfer.readers.read_model`` when it exists; otherwise a small
lazy fallback below (gguf dequantize per tensor + llama.cpp Q/K row un-permutation; the
tokenizer.json is rebuilt once by transformers' GGUF converter and cached).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

WIKI = "/work/shared/data/wikitext-2"


# ---------------------------------------------------------------- fallback GGUF reading
def _tokenizer_json(gguf_path: str) -> str:
    cache = gguf_path + ".tokenizer.json"
    if not os.path.exists(cache):
        code = ("import sys; from transformers import AutoTokenizer; import os;"
                "t=AutoTokenizer.from_pretrained(os.path.dirname(sys.argv[1]),"
                "gguf_file=os.path.basename(sys.argv[1]));"
                "open(sys.argv[2],'w').write(t.backend_tokenizer.to_str())")
        subprocess.run([sys.executable, "-c", code, gguf_path, cache], check=True)
    return open(cache).read()


def _fallback_read(path: str):
    import gguf
    from edgeinfer.models.config import ModelConfig

    from edgeinfer.source import LazyTensors, ModelSource

    r = gguf.GGUFReader(path)

    def field(k, default=None):
        f = r.fields.get(k)
        if f is None:
            return default
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types and f.types[0] == gguf.GGUFValueType.STRING else v[0].item()

    a = field("general.architecture")
    nh, nkv = field(f"{a}.attention.head_count"), field(f"{a}.attention.head_count_kv")
    hf = {"model_type": "qwen2" if a == "qwen2" else "llama",
          "vocab_size": field(f"{a}.vocab_size") or len(r.fields["tokenizer.ggml.tokens"].data),
          "hidden_size": field(f"{a}.embedding_length"),
          "intermediate_size": field(f"{a}.feed_forward_length"),
          "num_hidden_layers": field(f"{a}.block_count"), "num_attention_heads": nh,
          "num_key_value_heads": nkv, "rms_norm_eps": field(f"{a}.attention.layer_norm_rms_epsilon"),
          "rope_theta": field(f"{a}.rope.freq_base"),
          "max_position_embeddings": field(f"{a}.context_length"),
          "bos_token_id": field("tokenizer.ggml.bos_token_id"),
          "eos_token_id": field("tokenizer.ggml.eos_token_id")}
    infos = {t.name: t for t in r.tensors}
    hf["tie_word_embeddings"] = "output.weight" not in infos
    cfg = ModelConfig.from_hf_dict(hf)
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    sub = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
           "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}
    for n in infos:
        if n.startswith("blk."):
            _, i, rest = n.split(".", 2)
            base, kind = rest.rsplit(".", 1)
            tgt = sub[base]
            names[n] = f"model.layers.{i}.{tgt}" if tgt.endswith(".weight") else f"model.layers.{i}.{tgt}.{kind}"

    def load(gname, canon):
        t = infos[gname]
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)])
        if a == "llama" and (canon.endswith("q_proj.weight") or canon.endswith("k_proj.weight")):
            heads = nh if "q_proj" in canon else nkv  # undo llama.cpp's interleaved Q/K rows
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        return np.ascontiguousarray(w)

    names = {g: c for g, c in names.items() if g in infos}
    loaders = {c: (lambda g=g, c=c: load(g, c)) for g, c in names.items()}
    shapes = {c: tuple(int(x) for x in reversed(infos[g].shape)) for g, c in names.items()}
    return ModelSource(path, "gguf", cfg, LazyTensors(loaders), shapes, _tokenizer_json(path),
                       chat_template=field("tokenizer.chat_template"),
                       add_bos_token=bool(field("tokenizer.ggml.add_bos_token", False)))


def read(path: str, native: bool = False):
    """A ModelSource for a GGUF / HF folder / .eif (the project's reader when available);
    a GGUF dequantized to float32 unless ``native`` (its block types re-laid)."""
    if path.endswith(".eif"):
        from edgeinfer.container import read_eif
        return read_eif(path)
    try:
        from edgeinfer.readers import read_model
        src = read_model(path)
    except ImportError:
        return _fallback_read(path)
    return src if native or src.format != "gguf" else src.float32()


# ---------------------------------------------------------------- llama.cpp rows
def f32_gguf(src: str, dst: str) -> str:
    """Write ``src`` (a GGUF) with every tensor dequantized to F32 (metadata copied as is,
    tensor layout unchanged): the full-precision baseline as llama.cpp sees it."""
    import gguf

    if os.path.exists(dst):
        return dst
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst + ".tmp", arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt,
                        sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, a.reshape([int(x) for x in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(dst + ".tmp", dst)
    return dst


def llama_quantize(src_f32: str, dst: str, ftype: str = "Q4_0", pure: bool = False) -> str:
    """llama.cpp's own quantizer (``llama_model_quantize``): the default mix for ``ftype``,
    or with ``pure`` its one type for every 2-D tensor (``llama-quantize --pure``; a row not
    a multiple of 256 still falls back: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0)."""
    import llama_cpp

    if not os.path.exists(dst):
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        p.nthread = 2
        p.pure = pure
        rc = llama_cpp.llama_model_quantize(src_f32.encode(), dst.encode(), p)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({src_f32} -> {ftype}) failed: {rc}")
    return dst


def gguf_bpw(path: str) -> dict:
    """Bits per weight of a GGUF's tensors by kind and type, as llama.cpp stores them."""
    import gguf

    by: dict = {}
    for t in gguf.GGUFReader(path).tensors:
        kind = ("embedding/head" if t.name in ("token_embd.weight", "output.weight") else
                "linear" if t.name.endswith(".weight") and len(t.shape) == 2 else "other")
        acc = by.setdefault(kind, [0, 0, set()])
        acc[0] += int(t.n_bytes)
        acc[1] += int(t.n_elements)
        acc[2].add(t.tensor_type.name)
    return {k: {"bpw": round(8 * b / n, 3), "types": sorted(ty)} for k, (b, n, ty) in by.items()}


def cpu_bpw(path: str) -> dict:
    """Bits per weight of a GGUF's 2-D tensors as the CPU backend holds them (each tensor
    re-laid and repacked as at load, one at a time), by kind (``linear``,
    ``embedding/head``)."""
    from edgeinfer.backends.cpu import CpuBackend
    from edgeinfer.readers import read_model

    src, be, acc = read_model(path), CpuBackend(), {}
    for name, shape in src.shapes.items():
        if len(shape) != 2:
            continue
        table = "embed_tokens" in name or "lm_head" in name
        w = (be.upload_embedding if table else be.upload_weight)(src.tensors[name])
        a = acc.setdefault("embedding/head" if table else "linear", [0, 0])
        a[0] += int(w.nbytes)
        a[1] += int(np.prod(shape))
    return {k: round(8 * b / n, 3) for k, (b, n) in acc.items()}


def llama_ppl(gguf_path: str, token_src: str, chunks: int, kl_base: str | None = None) -> dict:
    """llama.cpp perplexity of a GGUF on WikiText-2 test with *our* token ids and the same
    chunking as :func:`edgeinfer.perplexity.perplexity` (512-token chunks, BOS written over
    each chunk's first token when the model adds BOS, second half scored); with
    ``kl_base`` (the baseline's saved log-probabilities, :func:`ppl_of`) also ``kl`` and
    ``top1`` against it."""
    import math

    import llama_cpp
    from tokenizers import Tokenizer

    from edgeinfer.perplexity import divergence

    src = read(token_src)
    tok = Tokenizer.from_str(src.tokenizer_json)
    tok.encode_special_tokens = True  # "<unk>" in WikiText is text (llama.cpp: parse_special=false)
    text = open(os.path.join(WIKI, "test.txt"), encoding="utf-8").read()
    toks = np.asarray(tok.encode(text, add_special_tokens=False).ids, np.int64)
    bos = src.config.bos_token_id if src.add_bos_token else None
    if bos is not None:
        toks = np.concatenate([[bos], toks])
    n_ctx, first = 512, 256
    llm = llama_cpp.Llama(gguf_path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=2,
                          verbose=False)
    nll, count, t = 0.0, 0, time.perf_counter()
    base = np.load(kl_base, mmap_mode="r") if kl_base and os.path.exists(kl_base) else None
    kl_acc = [0.0, 0, 0]
    n = min(chunks, len(toks) // n_ctx)
    for i in range(n):
        chunk = toks[i * n_ctx:(i + 1) * n_ctx].copy()
        if bos is not None:
            chunk[0] = bos
        llm.reset()
        llm.eval(chunk.tolist())
        lg = np.asarray(llm.scores[first:n_ctx - 1], np.float64)
        tgt = chunk[first + 1:n_ctx]
        mx = lg.max(axis=1, keepdims=True)
        lse = np.log(np.exp(lg - mx).sum(axis=1)) + mx[:, 0]
        nll += float(np.sum(lse - lg[np.arange(len(tgt)), tgt]))
        count += len(tgt)
        if base is not None:
            for j, v in enumerate(divergence(base[i], lg - lse[:, None])):
                kl_acc[j] += v
        print(f"[{i + 1}] {math.exp(nll / count):.4f}", file=sys.stderr, flush=True)
    out = {"ppl": math.exp(nll / count), "nll": nll / count, "n_tokens": count, "chunks": n,
           "seconds": round(time.perf_counter() - t, 1)}
    if kl_acc[2]:
        out["kl"], out["top1"] = round(kl_acc[0] / kl_acc[2], 5), round(kl_acc[1] / kl_acc[2], 4)
    return out


def llama_rows(model: str, chunks: int, out_dir: str, ftypes=("Q4_0",),
               score_f32: bool = True, kl_base: str | None = None) -> list[dict]:
    """llama.cpp rows: its F32 baseline (scored unless ``score_f32`` is false) and each
    ``ftype`` quantized from that F32 file (KL / top-1 against ``kl_base`` when given)."""
    base = f32_gguf(model, os.path.join(out_dir, os.path.basename(model) + ".F32.gguf"))
    rows = [{"row": "llama.cpp F32 (same baseline)", "bpw_gguf": gguf_bpw(base),
             **(llama_ppl(base, model, chunks, kl_base) if score_f32 else {"ppl": None})}]
    print(json.dumps(rows[-1]), flush=True)
    for ft in ftypes:
        t = time.perf_counter()
        q = llama_quantize(base, os.path.join(out_dir, os.path.basename(model) + f".{ft}.gguf"))
        row = {"row": f"llama.cpp {ft}", "quantize_seconds": round(time.perf_counter() - t, 1),
               **llama_ppl(q, model, chunks, kl_base), "bpw_gguf": gguf_bpw(q),
               "file_size": os.path.getsize(q)}
        if rows[0]["ppl"]:
            row["dppl_pct"] = round(100 * (row["ppl"] / rows[0]["ppl"] - 1), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ---------------------------------------------------------------- measurements
def ppl_of(path: str, chunks: int, save_logprobs: str | None = None,
           kl_base: str | None = None, native_cpu: bool = False) -> dict:
    """Perplexity of a model file on WikiText-2 test through the reference backend
    (``native_cpu``: a GGUF's native block types on the CPU backend).

    ``save_logprobs``: write the scored positions' log-probabilities (float16
    ``[chunks, 255, V]``, a ``.npy`` file, via a temp file renamed at the end) for later
    rows; ``kl_base``: such a file of the baseline, adding ``kl`` (mean KL(base || this),
    nats) and ``top1`` (fraction of positions with the same most likely token).
    """
    from edgeinfer.backends.reference import ReferenceBackend
    from edgeinfer.models.transformer import Transformer
    from tokenizers import Tokenizer

    from edgeinfer.perplexity import divergence, perplexity

    src = read(path, native=native_cpu)
    tok = Tokenizer.from_str(src.tokenizer_json)
    tok.encode_special_tokens = True  # "<unk>" in WikiText is text (llama.cpp: parse_special=false)
    text = open(os.path.join(WIKI, "test.txt"), encoding="utf-8").read()
    ids = tok.encode(text, add_special_tokens=False).ids
    bos = src.config.bos_token_id if src.add_bos_token else None
    if native_cpu:
        from edgeinfer.backends.cpu import CpuBackend
        backend = CpuBackend()
    else:
        backend = ReferenceBackend()
    model = Transformer(src.config, src.tensors, backend, max_positions=512)
    sink, acc, store = None, [0.0, 0, 0], None
    if save_logprobs:
        tmp = save_logprobs + ".tmp.npy"
        store = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16,
                                          shape=(chunks, 255, src.config.vocab_size))

        def sink(i, lp):
            store[i] = lp
    elif kl_base:
        base = np.load(kl_base, mmap_mode="r")

        def sink(i, lp):
            kl, same, n = divergence(base[i], lp)
            acc[0] += kl
            acc[1] += same
            acc[2] += n
    t = time.perf_counter()
    res = perplexity(model, ids, n_ctx=512, n_chunks=chunks, bos_id=bos, progress=True,
                     on_logprobs=sink)
    res["seconds"] = round(time.perf_counter() - t, 1)
    res["chunk_ppl"] = [round(v, 4) for v in res["chunk_ppl"]]  # running estimate, as llama.cpp prints
    if store is not None:
        store.flush()
        del store
        os.replace(tmp, save_logprobs)
    if kl_base and acc[2]:
        res["kl"] = round(acc[0] / acc[2], 5)
        res["top1"] = round(acc[1] / acc[2], 4)
    return res


def convert_one(model: str, method: str, out: str, n_calib: int, calib_len: int,
                act_order: bool) -> dict:
    from edgeinfer.quant.convert import convert

    from edgeinfer.container import describe_eif

    src = read(model)
    # the data-free defaults keep their own layout (symmetric groups of 32); others: g128
    group = None if method in ("signmax", "grid") else 128
    rep = convert(src, out, method=method, group_size=group,
                  calib_path=os.path.join(WIKI, "valid.txt"), n_calib=n_calib,
                  calib_len=calib_len, act_order=act_order, progress=True,
                  overwrite=True)  # this benchmark's own output, remade on each run
    d = describe_eif(out)
    rep["bpw_linear"] = {k: round(v, 3) for k, v in d["bits_per_weight_by_kind"].items()}
    rep["bpw_all_weights"] = round(d["bits_per_weight"], 3)
    rep["awq_alpha"] = rep.get("awq_alpha")  # per layer and group: kept for diagnosis
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--methods", default="rtn,awq,gptq")
    ap.add_argument("--n-calib", type=int, default=32)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--out", default="/tmp/edgeinfer-quality")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--gguf-native", action="store_true",
                    help="only the GGUF run natively (its own blocks, CPU backend) vs the baseline")
    ap.add_argument("--native-ftypes",
                    help="with --gguf-native: instead of the model's own file, llama.cpp's pure "
                         "quantizations of its F32 GGUF (comma list of ftypes, e.g. "
                         "Q4_0,Q4_K_S,Q6_K), each run natively")
    ap.add_argument("--_convert", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_ppl", help=argparse.SUPPRESS)
    ap.add_argument("--_save-logprobs", dest="save_logprobs", help=argparse.SUPPRESS)
    ap.add_argument("--_kl-base", dest="kl_base", help=argparse.SUPPRESS)
    ap.add_argument("--_native-cpu", dest="native_cpu", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--llama", action="store_true",
                    help="only the llama.cpp rows: F32 baseline and Q4_0 from it")
    ap.add_argument("--llama-no-f32", action="store_true",
                    help="with --llama: do not score the F32 file (Q4_0 only)")
    args = ap.parse_args()
    model = args.model
    if not os.path.exists(model):
        from edgeinfer.catalog import resolve_model
        model = str(resolve_model(model))
    if args._convert:  # child process: one conversion, report on stdout
        print(json.dumps(convert_one(model, args._convert[0], args._convert[1], args.n_calib,
                                     args.calib_len, args.act_order)))
        return
    if args._ppl:
        print(json.dumps(ppl_of(args._ppl, args.chunks, args.save_logprobs, args.kl_base,
                                args.native_cpu)))
        return
    os.makedirs(args.out, exist_ok=True)
    base_lp = os.path.join(args.out, f"{os.path.basename(model)}.base-logprobs.{args.chunks}.npy")
    if args.llama:  # KL / top-1 against the baseline's log-probs when a run saved them
        llama_rows(model, args.chunks, args.out, score_f32=not args.llama_no_f32,
                   kl_base=base_lp)
        return

    def child(*extra) -> dict:
        cmd = [sys.executable, __file__, "--model", model, "--chunks", str(args.chunks),
               "--n-calib", str(args.n_calib), "--calib-len", str(args.calib_len), *extra]
        if args.act_order:
            cmd.append("--act-order")
        p = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
        return json.loads(p.stdout.strip().splitlines()[-1])

    rows = []
    base = None if args.skip_baseline else child("--_ppl", model, "--_save-logprobs", base_lp)
    if base:
        rows.append({"row": "baseline (dequantized GGUF, f32)", **base})
        print(json.dumps(rows[-1]), flush=True)
    files = [("GGUF native (CPU backend)", model)] if args.gguf_native else []
    if args.gguf_native and args.native_ftypes:
        stem = os.path.join(args.out, os.path.basename(model))
        f32 = f32_gguf(model, stem + ".F32.gguf")
        files = [(f"llama.cpp {ft} --pure, native (CPU backend)",
                  llama_quantize(f32, f"{stem}.{ft}.pure.gguf", ft, pure=True))
                 for ft in args.native_ftypes.split(",")]
    for label, path in files:
        res = child("--_ppl", path, "--_native-cpu",
                    *(["--_kl-base", base_lp] if os.path.exists(base_lp) else []))
        row = {"row": label, **res, "bpw_gguf": gguf_bpw(path), "bpw_ram": cpu_bpw(path),
               "file_size": os.path.getsize(path)}
        if base:
            row["dppl_pct"] = round(100 * (res["ppl"] / base["ppl"] - 1), 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for m in ([] if args.gguf_native else args.methods.split(",")):
        g = 32 if m in ("signmax", "grid") else 128
        out = os.path.join(args.out, f"{os.path.basename(model)}.{m}.g{g}.eif")
        rep = child("--_convert", m, out)
        res = child("--_ppl", out, *(["--_kl-base", base_lp] if os.path.exists(base_lp) else []))
        row = {"row": m, **res, **rep}
        if base:
            row["dppl_pct"] = round(100 * (res["ppl"] / base["ppl"] - 1), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| row | PPL | ΔPPL | KL | top-1 | bpw (linears / all; a native GGUF: linears file/RAM) | file MiB | convert s | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bpw = r.get("bpw_linear", {})
        lin = bpw.get("attention"), bpw.get("mlp")
        kl = f"{r['kl']:.4f} | {100 * r['top1']:.1f}%" if "kl" in r else "— | —"
        if "bpw_ram" in r:  # a native GGUF row: its linears in the file / in RAM
            lin = r["bpw_gguf"]["linear"]["bpw"], r["bpw_ram"]["linear"]
        print(f"| {r['row']} | {r['ppl']:.3f} | {('%+.2f%%' % r['dppl_pct']) if 'dppl_pct' in r else '—'} | {kl} "
              f"| {lin[0] and f'{lin[0]:.2f}/{lin[1]:.2f}'} / {r.get('bpw_all_weights', '—')} "
              f"| {r.get('file_size', 0) / 2**20:.1f} | {r.get('convert_seconds', '—')} "
              f"| {r.get('peak_rss_mib', '—')} |")


if __name__ == "__main__":
    main()
