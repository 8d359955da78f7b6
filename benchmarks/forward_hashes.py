"""Hashes of greedy tokens and logits for every backend x KV dtype x model: a refactor of
the forward pass must leave every line unchanged (bit-identical outputs).

Per (model, backend, KV dtype), on one cache: a prompt in two prefill chunks, greedy
decode steps (logits into a reused buffer), prefix reuse (``trim`` then a 3-token chunk,
then a 1-token chunk, then decode), a one-token prompt at position 0 (the int4 cache
fixes its K statistics there) and a whole-sequence forward with ``all_logits``
(perplexity). Each line: model, backend, kv, case, the greedy tokens and the first 16 hex
digits of the sha256 of the float32 logits of that case.

Models: stories260K (HF float32, and RTN INT4 linears with an 8-bit head), SmolLM2-135M
and Gemma-3-270M (catalog GGUF, dequantized to float32, and their INT4 ``.eif`` made with
the catalog's RTN options into ``--cache``), tiny random Gemma-3 (tests/tiny_models.py;
also with 8-token chunks: ring layers), Qwen2 (QKV bias) and Mistral (sliding window,
ring layers; also with dense MLP weights beside 4-bit attention) models, tiny Phi-3
(fused q/k/v and gate/up split at load; LongRoPE with its switch at 16 positions).

    python benchmarks/forward_hashes.py [--backends cpu,reference,opencl] [--models ...]
        [--kv f32,f16,int8,int4,k8v4] > hashes.txt
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

STORIES = Path("/work/shared/models/stories260K")
KV_DTYPES = ("f32", "f16", "int8", "int4", "k8v4")
PROMPT = [1, 400, 35, 22, 7, 301, 13, 88, 5, 240, 17, 3]


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, np.float32).tobytes())
    return h.hexdigest()[:16]


def _rtn4(w, g):
    from test_cpu_model import rtn4
    return rtn4(w, g)


def _rtn8_rows(w):
    from test_cpu_model import rtn8_rows
    return rtn8_rows(w)


def _q4(tensors, g=32, head8=True, skip=()):
    out = {}
    for k, v in tensors.items():
        if head8 and k == "lm_head.weight":
            out[k] = _rtn8_rows(v)
        elif v.ndim == 2 and "embed" not in k and k != "lm_head.weight" and not any(
                s in k for s in skip):
            out[k] = _rtn4(v, g)
        else:
            out[k] = v
    return out


def _tiny(model_type: str, **over):
    from edgeinfer.models.arch import tensor_specs
    from edgeinfer.models.config import ModelConfig
    d = {"model_type": model_type, "vocab_size": 256, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rope_theta": 1e4, "tie_word_embeddings": False, **over}
    cfg = ModelConfig.from_hf_dict(d)
    rng = np.random.default_rng(7)
    tensors = {s.name: (rng.standard_normal(s.shape(cfg)) * 0.3).astype(np.float32)
               for s in tensor_specs(cfg)}
    return cfg, tensors


def _eif(name: str, cache: Path) -> Path:
    """The catalog GGUF converted with the catalog's RTN options into ``cache``."""
    from edgeinfer.catalog import PREPARE_OPTIONS, pull
    from edgeinfer.quant.convert import convert
    from edgeinfer.readers import read_model
    out = cache / f"{name}.int4.eif"
    if not out.exists():
        cache.mkdir(parents=True, exist_ok=True)
        convert(read_model(str(pull(name, progress=False))), str(out), **PREPARE_OPTIONS,
                progress=False)
    return out


def models(cache: Path):
    """name -> (loader () -> (cfg, tensors), max_chunk)."""
    from edgeinfer.readers import read_model
    from tiny_models import tiny_gemma

    def read(path):
        def load():
            s = read_model(str(path))
            return s.config, s.tensors
        return load

    def stories_q4():
        from safetensors.numpy import load_file
        from edgeinfer.models.config import ModelConfig
        cfg = ModelConfig.from_hf_dict(json.loads((STORIES / "config.json").read_text()))
        return cfg, _q4(load_file(str(STORIES / "model.safetensors")))

    def catalog(name):
        def load():
            from edgeinfer.catalog import pull
            s = read_model(str(pull(name, progress=False)))
            return s.config, s.tensors
        return load

    def tiny_gemma_q4():
        cfg, t = tiny_gemma(vocab_size=512, hidden_size=64, intermediate_size=96,
                            num_attention_heads=4)
        return cfg, _q4(t, head8=False)

    def tiny_gemma_f32():
        return tiny_gemma(vocab_size=512, hidden_size=64, intermediate_size=96,
                          num_attention_heads=4)

    def qwen(q4):
        def load():
            cfg, t = _tiny("qwen2", attention_bias=True)
            return cfg, (_q4(t) if q4 else t)
        return load

    def mistral(mode):
        def load():
            cfg, t = _tiny("mistral", sliding_window=5)
            if mode == "q4":
                t = _q4(t)
            elif mode == "mixed":
                t = _q4(t, skip=("mlp.",))
            return cfg, t
        return load

    def phi3(variant):
        def load():
            from tiny_models import tiny_phi3_folder
            d = cache / f"tiny-phi3-{variant}"
            if not (d / "config.json").exists():
                tiny_phi3_folder(d, variant)
            return read(d)()
        return load

    return {
        "stories-f32": (read(STORIES), 512),
        "stories-q4": (stories_q4, 512),
        "smollm2-gguf": (catalog("smollm2-135m-instruct"), 512),
        "smollm2-int4": (lambda: read(_eif("smollm2-135m-instruct", cache))(), 512),
        "gemma3-gguf": (catalog("gemma-3-270m"), 512),
        "gemma3-int4": (lambda: read(_eif("gemma-3-270m", cache))(), 512),
        "tiny-gemma-f32": (tiny_gemma_f32, 512),
        "tiny-gemma-f32-ring": (tiny_gemma_f32, 8),
        "tiny-gemma-q4": (tiny_gemma_q4, 512),
        "tiny-gemma-q4-ring": (tiny_gemma_q4, 8),
        "tiny-qwen2-f32": (qwen(False), 512),
        "tiny-qwen2-q4": (qwen(True), 512),
        "tiny-mistral-q4-ring": (mistral("q4"), 8),
        "tiny-mistral-mixed-ring": (mistral("mixed"), 8),
        "tiny-mistral-f32-ring": (mistral("f32"), 8),
        "tiny-phi3": (phi3("plain"), 512),
        "tiny-phi3-longrope": (phi3("longrope"), 8),
    }


def run_cases(m, kv: str, max_chunk: int, vocab: int, cases=None):
    """[(case, tokens, digest)] of one model on one backend with one KV dtype (``cases``:
    the names to keep, default all); a case that raises gives its exception's name."""
    rows = []
    for name, fn in CASES.items():
        if cases is None or name in cases:
            try:
                rows += fn(m, kv, max_chunk, vocab)
            except Exception as e:  # noqa: BLE001 (the line records what was raised)
                rows.append((name, [], f"raised:{type(e).__name__}"))
    return rows


def _main_cases(m, kv, max_chunk, vocab):
    rows = []
    kw = {} if getattr(m, "rope_switch", None) is None else {"long_rope": False}
    prompt = np.array([t % vocab for t in PROMPT], np.int32)
    cache = m.new_cache(64, kv, max_chunk)
    out = np.empty((1, m.cfg.vocab_size), np.float32)

    def decode(logits, n):
        toks, logs = [], []
        for _ in range(n):
            tok = int(np.argmax(logits[-1]))
            toks.append(tok)
            logits = m.forward(np.array([tok], np.int32), cache, out=out, **kw)
            logs.append(logits.copy())
        return toks, logs, logits

    a = m.forward(prompt[:7], cache, **kw)
    b = m.forward(prompt[7:], cache, **kw)
    rows.append(("prefill", [int(np.argmax(b[-1]))], _digest([a, b])))
    toks, logs, last = decode(b, 6)
    rows.append(("decode", toks, _digest(logs)))
    cache.trim(len(prompt) - 2)  # prefix reuse: keep all but the last 2 prompt tokens
    keep = cache.length
    c = m.forward(np.array([9, 31, 2], np.int32) % vocab, cache, **kw)
    d = m.forward(np.array([44 % vocab], np.int32), cache, **kw)
    toks, logs, _ = decode(d, 3)
    rows.append((f"reuse@{keep}", toks, _digest([c, d] + logs)))
    cache.reset()
    e = m.forward(prompt[:1], cache, **kw)  # one token at position 0
    toks, logs, _ = decode(e, 3)
    rows.append(("one-token", toks, _digest([e] + logs)))
    c2 = m.new_cache(64, kv, max_chunk)
    f = [m.forward(prompt[:7], c2, all_logits=True, **kw),
         m.forward(prompt[7:], c2, all_logits=True, **kw)]
    rows.append(("all-logits", [int(x) for y in f for x in y.argmax(-1)], _digest(f)))
    return rows


def _long_prompt(m, kv, max_chunk, vocab):
    """20 prompt tokens in chunks of 8 then 3 greedy steps (past a LongRoPE switch at 16)."""
    ids = np.array([(t * 7 + 3) % vocab for t in PROMPT + PROMPT][:20], np.int32)
    kw = {} if getattr(m, "rope_switch", None) is None else {"long_rope": True}
    cache = m.new_cache(64, kv, max_chunk)
    logs = [m.forward(ids[i:i + 8], cache, **kw) for i in range(0, 20, 8)]
    out = np.empty((1, m.cfg.vocab_size), np.float32)
    toks = []
    for _ in range(3):
        toks.append(int(np.argmax(logs[-1][-1])))
        logs.append(m.forward(np.array(toks[-1:], np.int32), cache, out=out, **kw).copy())
    return [("long-prompt", toks, _digest(logs))]


CASES = {"main": _main_cases, "long-prompt": _long_prompt}


def backend(name: str):
    from edgeinfer.backends import get_backend
    if name == "opencl":
        return get_backend("opencl", device="0")
    return get_backend(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="reference,cpu,opencl")
    ap.add_argument("--models", default=",".join(models(Path("."))))
    ap.add_argument("--kv", default=",".join(KV_DTYPES))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "forward_hashes"))
    args = ap.parse_args(argv)
    from edgeinfer.models.transformer import Transformer
    table = models(Path(args.cache))
    for name in args.models.split(","):
        load, chunk = table[name]
        cfg, tensors = load()
        for bname in args.backends.split(","):
            m = Transformer(cfg, tensors, backend(bname), 256)
            for kv in args.kv.split(","):
                for case, toks, dig in run_cases(m, kv, chunk, cfg.vocab_size,
                                                  args.cases.split(",")):
                    print(f"{name} {bname} {kv} {case} {','.join(map(str, toks))} {dig}",
                          flush=True)
            del m
    return 0


if __name__ == "__main__":
    sys.exit(main())
