"""KV cache dtype quality and capacity on a real model (SmolLM2-135M-Instruct, WikiText-2).

For each KV dtype (f32, f16, int8, int4): perplexity by llama.cpp's method (chunks of
``--ctx`` tokens, no BOS (SmolLM2 adds none), the second half of each chunk scored:
logits at positions ctx/2 .. ctx-2 predict the next token), its change against the
f32 cache (ΔPPL), KL divergence and top-1 agreement of the scored next-token
distributions against f32, KV bytes per token, and the longest context that fits in
``--budget-mb`` MiB with :func:`edgeinfer.memory.plan_memory`.

The reference (numpy) backend runs the model: weights are the GGUF's, dequantized to
float32 (the full-precision baseline of MODELS.md, PPL 18.979 over 40 chunks with
llama.cpp's tokenizer). If ``edgeinfer.readers.read_model`` is not available yet, the
GGUF is read here with the ``gguf`` package (Q/K rows un-permuted back to the HF
layout) and the tokenizer is rebuilt from its vocab and merges.

Usage::

    python benchmarks/kv_quality.py --chunks 8 [--model PATH.gguf] [--data test.txt]
    python benchmarks/kv_quality.py --chunks 8 --dtypes f32,k8v4,int4-norot,kivi4
    python benchmarks/kv_quality.py --chunks 8 --budget-mb 4096 \\
        --model ~/.cache/edgeinfer/models/qwen2.5-coder-0.5b-instruct.gguf

Design experiments (fake-quantized on read over an f32 cache, not runtime formats):
``int4-norot`` int4 without the Hadamard rotation of K; ``int4-nostats`` int4 without
its K channel statistics (the previous int4); ``int4-offonly`` the offset m alone;
``int4-mc`` offset and a power-of-two scale ``c ~ sqrt(rms(k - m))`` in every head;
``int4-adapt`` that scale only in heads whose channel RMS spread (max / median) exceeds
8 (== the runtime int4); ``kivi4`` KIVI's K (Liu et al. 2024: per channel
over blocks of 32 tokens, asymmetric 4-bit, the last ``end % 32`` tokens in full
precision) with our int4 V. Design numbers: :mod:`edgeinfer.backends.kvformat`.

Results, 2026-11-29 (8 chunks, 2040 scored tokens, 2 shared cores). SmolLM2-135M: f32
PPL 21.5485; 1024 MiB budget with the GGUF's 93.8 MiB of weights; the model caps
context at 8192 (f16/int8/k8v4 rows measured before the int4 change, same formats):

============ ======== ======== ======== ====== ===============================
KV           B/token  ΔPPL     KL       top-1  context in 1 GiB (uncapped)
============ ======== ======== ======== ====== ===============================
f32          46080    0        0        100%   8192 (14805)
f16          23040    +0.002%  4e-7     100%   8192
int8         12060    -0.041%  0.00013  99.5%  8192
k8v4          9720    +0.114%  0.0045   95.9%  8192
int4          7200    +1.17%   0.0229   90.3%  8192 (94755)
int4-nostats (sim)    +2.22%   0.027    90.3%  the previous int4
int4-offonly (sim)    +0.86%   0.0226   90.3%
int4-mc      (sim)    +3.25%   0.0264   91.3%
int4-norot   (sim)    +3.39%   0.041    88.3%  (previous int4 without rotation)
kivi4        (sim)    +0.74%   0.013    93.4%
============ ======== ======== ======== ====== ===============================

Qwen2.5-Coder-0.5B-Instruct (``--budget-mb 4096``; 24 layers, 2 KV heads, hd 64; f32
PPL 29.1806; int4 == int4-adapt, bit for bit):

============ ======== ======== ======== ====== ===============================
KV           B/token  ΔPPL     KL       top-1  note
============ ======== ======== ======== ====== ===============================
f32          24576    0        0        100%
int8          6432    +0.419%  0.0053   95.8%
int4          3840    +2.48%   0.039    89.7%  the previous int4: +195%
int4-offonly (sim)    +4.51%   0.069    85.4%
int4-mc      (sim)    +1.73%   0.044    88.9%
kivi4        (sim)    +0.68%                   2 chunks only
============ ======== ======== ======== ====== ===============================
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from edgeinfer.backends.kvcache import (
    ALL_KV_DTYPES,
    HostKVCache,
    kv_bytes_per_token_layer,
)
from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.models.config import ModelConfig
from edgeinfer.models.transformer import Transformer

from edgeinfer.errors import MemoryBudgetError
from edgeinfer.memory import format_plan, plan_memory

WIKI = Path("/work/shared/data/wikitext-2/test.txt")

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert permute of Q/K rows (interleaved -> rotate-half pairs)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_llama(path: str):
    """(ModelConfig, float32 tensors by HF name, tokenizers.Tokenizer) of a llama GGUF."""
    import gguf
    from gguf.quants import dequantize
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    r = gguf.GGUFReader(path)
    f = {k: v.contents() for k, v in r.fields.items()
         if not k.startswith("tokenizer.ggml.") or k.endswith("_id")}
    a = f["general.architecture"]
    hq, hkv = f[f"{a}.attention.head_count"], f[f"{a}.attention.head_count_kv"]
    cfg = ModelConfig.from_hf_dict({
        "model_type": "llama", "vocab_size": f[f"{a}.vocab_size"],
        "hidden_size": f[f"{a}.embedding_length"], "intermediate_size": f[f"{a}.feed_forward_length"],
        "num_hidden_layers": f[f"{a}.block_count"], "num_attention_heads": hq,
        "num_key_value_heads": hkv, "rms_norm_eps": f[f"{a}.attention.layer_norm_rms_epsilon"],
        "rope_theta": f[f"{a}.rope.freq_base"], "max_position_embeddings": f[f"{a}.context_length"],
        "tie_word_embeddings": True, "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f.get("tokenizer.ggml.eos_token_id"),
    })
    tensors, raw_bytes = {}, 0
    for t in r.tensors:
        raw_bytes += int(t.n_bytes)
        if t.name in _GGUF_NAMES:
            name = _GGUF_NAMES[t.name]
        else:
            _, i, short, kind = t.name.split(".")
            name = f"model.layers.{i}.{_GGUF_LAYER[short]}.{kind}"
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, hq)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, hkv)
        tensors[name] = np.ascontiguousarray(w)
    toks = [bytes(r.fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8")
            for i in r.fields["tokenizer.ggml.tokens"].data]
    merges = [tuple(bytes(r.fields["tokenizer.ggml.merges"].parts[i]).decode("utf-8").split(" ", 1))
              for i in r.fields["tokenizer.ggml.merges"].data]
    tok = Tokenizer(models.BPE({s: i for i, s in enumerate(toks)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    return cfg, tensors, tok, raw_bytes


def load_model(path: str):
    """(cfg, tensors, encode(text) -> ids, weight bytes as stored in the file)."""
    try:
        from edgeinfer.api import tokenizer_for
        from edgeinfer.readers import read_model  # the runtime reader, once it lands
        src = read_model(path)
        tok = tokenizer_for(src)
        return src.config, src.tensors, (lambda s: tok.encode(s, add_special=False, parse_special=False)), os.path.getsize(path)
    except ImportError:
        cfg, tensors, tok, raw = load_gguf_llama(path)
        return cfg, tensors, (lambda s: tok.encode(s, add_special_tokens=False).ids), raw


# ---- design experiments (not runtime formats): fake-quantize on read over an f32 cache ----
class _SimCache(HostKVCache):
    """f32 storage; ``read`` returns K/V through a simulated format (quality only)."""

    def __init__(self, *args, kind: str, **kw):
        super().__init__(*args, **kw)
        self.kind = kind

    def read(self, layer, end):
        from edgeinfer.backends import kvcache as kc

        k, v = super().read(layer, end)
        g = self.group_size
        v4 = kc.dequant_asym4(*kc.quant_asym4(v, g))
        if self.kind == "int4-norot":  # the int4 format without the Hadamard rotation of K
            return kc.dequant_asym4(*kc.quant_asym4(k, g)), v4
        if self.kind in ("int4-nostats", "int4-offonly"):
            # int4 K without its channel statistics (m = 0, c = 1: the previous format), or
            # with the offset m alone; the benchmark writes each chunk at position 0
            h = kc.hadamard(g)
            m = kc.k_channel_stats(k[:kc.KSTAT_POSITIONS])[0] if self.kind == "int4-offonly" else 0
            y = kc.dequant_asym4(*kc.quant_asym4(kc._rotate(k - m, h), g))
            return kc._rotate(y, h) + m, v4
        if self.kind in ("int4-mc", "int4-adapt"):
            # offset m and a power-of-two c ~ sqrt(rms(k - m)) per channel ("mc"), or that c
            # only in heads whose channel RMS spread (max / median) exceeds 8 ("adapt")
            h = kc.hadamard(g)
            k0 = k[:kc.KSTAT_POSITIONS]
            m = kc.k_channel_stats(k0)[0]
            r = np.sqrt(((k0.astype(np.float64) - m) ** 2).mean(0))  # [H, hd]
            c = np.exp2(np.rint(np.log2(np.maximum(r, 1e-30)) / 2)).astype(np.float32)
            if self.kind == "int4-adapt":
                spread = r.max(-1) / np.maximum(np.median(r, -1), 1e-30)
                c = np.where((spread > 8)[:, None], c, np.float32(1))
            y = kc.dequant_asym4(*kc.quant_asym4(kc._rotate((k - m) / c, h), g))
            return kc._rotate(y, h) * c + m, v4
        if self.kind == "kivi4":
            # KIVI (Liu et al. 2024): K per channel over blocks of 32 tokens (asym 4-bit),
            # the last end % 32 tokens kept in full precision (the residual window);
            # V per token, groups of 32 (as our int4). Quantized at read: all complete
            # blocks are quantized, as after KIVI's prefill.
            nb = end // 32
            kq = k.copy()
            if nb:
                blk = k[:nb * 32].reshape(nb, 32, *k.shape[1:]).transpose(0, 2, 3, 1)  # [nb, H, hd, 32]
                deq = kc.dequant_asym4(*kc.quant_asym4(np.ascontiguousarray(blk), 32))
                kq[:nb * 32] = deq.transpose(0, 3, 1, 2).reshape(nb * 32, *k.shape[1:])
            return kq, v4
        raise ValueError(self.kind)


EXPERIMENTS = ("int4-norot", "kivi4", "int4-nostats", "int4-offonly", "int4-mc",
               "int4-adapt")


def new_cache(model, n_ctx: int, kind: str):
    """A runtime cache of dtype ``kind`` or a simulated experimental format."""
    if kind in EXPERIMENTS:
        c = model.cfg
        return _SimCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, n_ctx, "f32", kind=kind)
    return model.new_cache(n_ctx, kind)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: catalog smollm2-135m-instruct)")
    ap.add_argument("--data", default=str(WIKI))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--dtypes", default=",".join(ALL_KV_DTYPES),
                    help=f"first is the baseline; also the simulated {EXPERIMENTS}")
    ap.add_argument("--budget-mb", type=float, default=1024.0)
    ap.add_argument("--skip", type=int, default=0, help="start at this chunk index")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    path = args.model
    if path is None:
        from edgeinfer.catalog import pull
        path = str(pull("smollm2-135m-instruct"))
    t0 = time.perf_counter()
    cfg, tensors, encode, file_bytes = load_model(path)
    ids = np.asarray(encode(Path(args.data).read_text(encoding="utf-8")), np.int32)
    model = Transformer(cfg, tensors, ReferenceBackend(), max_positions=args.ctx)
    f32_weight_bytes = sum(int(t.nbytes) for t in tensors.values())
    del tensors
    print(f"loaded {path} in {time.perf_counter() - t0:.1f}s; {len(ids)} tokens of text",
          flush=True)

    n_ctx, first = args.ctx, args.ctx // 2
    n_chunks = min(args.chunks, len(ids) // n_ctx - args.skip)
    dtypes = args.dtypes.split(",")
    nll = {d: [] for d in dtypes}
    kl = {d: [] for d in dtypes}
    top1 = {d: [] for d in dtypes}
    times = {d: 0.0 for d in dtypes}
    for c in range(n_chunks):
        chunk = ids[(args.skip + c) * n_ctx:(args.skip + c + 1) * n_ctx]
        target = chunk[first + 1:]
        base = None
        for d in dtypes:
            cache = new_cache(model, n_ctx, d)
            t1 = time.perf_counter()
            lp = log_softmax(model.forward(chunk, cache, all_logits=True)[first:n_ctx - 1])
            times[d] += time.perf_counter() - t1
            nll[d].extend(-lp[np.arange(len(target)), target])
            if base is None:
                base = lp  # the first dtype listed (f32) is the baseline
            kl[d].extend((np.exp(base) * (base - lp)).sum(-1))
            top1[d].extend(base.argmax(-1) == lp.argmax(-1))
        ppl = {d: float(np.exp(np.mean(nll[d]))) for d in dtypes}
        print(f"chunk {c + 1}/{n_chunks}: " + "  ".join(f"{d} {ppl[d]:.4f}" for d in dtypes), flush=True)

    L, hkv, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    results = {"model": path, "chunks": n_chunks, "ctx": n_ctx, "scored_tokens": len(nll[dtypes[0]]),
               "weights_file_bytes": file_bytes, "weights_f32_bytes": f32_weight_bytes, "dtypes": {}}
    ppl0 = float(np.exp(np.mean(nll[dtypes[0]])))
    print(f"\n{'kv':10} {'PPL':>9} {'dPPL%':>7} {'KL':>8} {'top1%':>6} {'B/token':>8} "
          f"{f'ctx@{args.budget_mb:g}MiB(file w)':>18} {'uncapped':>9} {'ctx@(f32 w)':>12} {'s/chunk':>8}")
    for d in dtypes:
        ppl = float(np.exp(np.mean(nll[d])))
        if d in EXPERIMENTS:
            print(f"{d:10} {float(np.exp(np.mean(nll[d]))):9.4f} "
                  f"{100 * (np.exp(np.mean(nll[d])) / ppl0 - 1):+7.3f} {np.mean(kl[d]):8.5f} "
                  f"{100 * np.mean(top1[d]):6.2f}   (simulated experiment)")
            results["dtypes"][d] = {"ppl": float(np.exp(np.mean(nll[d]))), "kl": float(np.mean(kl[d])),
                                    "top1_pct": 100 * float(np.mean(top1[d]))}
            continue
        per_tok = L * kv_bytes_per_token_layer(hkv, hd, d)
        p_file = plan_memory(cfg, file_bytes, args.budget_mb, d, n_ctx)
        try:
            p_f32 = plan_memory(cfg, f32_weight_bytes, args.budget_mb, d, n_ctx)
        except MemoryBudgetError:  # f32 weights alone exceed the budget (Qwen at 1 GiB)
            p_f32 = argparse.Namespace(max_context=0)
        # the planned cache really allocates what the plan says
        probe = HostKVCache(L, hkv, hd, min(p_file.max_context, 4096), d)
        assert probe.nbytes == min(p_file.max_context, 4096) * p_file.kv_bytes_per_token
        del probe
        row = {"ppl": ppl, "dppl_pct": 100 * (ppl / ppl0 - 1), "kl": float(np.mean(kl[d])),
               "top1_pct": 100 * float(np.mean(top1[d])), "kv_bytes_per_token": per_tok,
               "max_ctx_file_weights": p_file.max_context, "max_ctx_f32_weights": p_f32.max_context,
               "s_per_chunk": times[d] / max(n_chunks, 1),
               # the budget formula without the model's position cap
               "uncapped_ctx_file_weights": (p_file.budget_bytes - file_bytes - p_file.scratch_bytes) // per_tok}
        results["dtypes"][d] = row
        print(f"{d:10} {ppl:9.4f} {row['dppl_pct']:+7.3f} {row['kl']:8.5f} {row['top1_pct']:6.2f} "
              f"{per_tok:8d} {p_file.max_context:18d} {row['uncapped_ctx_file_weights']:9d} {p_f32.max_context:12d} {row['s_per_chunk']:8.2f}")
    print("\nplan (int8, file-size weights):")
    print(format_plan(plan_memory(cfg, file_bytes, args.budget_mb, "int8", n_ctx, n_ctx=8192)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
