"""End to end: convert -> .eif -> reference backend. stories260K with RTN / AWQ / GPTQ still
tells its story; tied / untied heads (C15); input errors; perplexity (llama.cpp's method);
slow: SmolLM2 AWQ answers "Paris"."""
from __future__ import annotations

from conftest import SHARED  # the shared folder (models, data) beside the checkout
import importlib.util
import json
import logging
import os

import numpy as np
import pytest

from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.container import describe_eif, read_eif
from edgeinfer.errors import ModelFormatError
from edgeinfer.models.arch import tensor_specs
from edgeinfer.models.config import ModelConfig
from edgeinfer.models.transformer import Transformer
from edgeinfer.perplexity import perplexity
from edgeinfer.quant.convert import convert
from edgeinfer.source import LazyTensors, ModelSource

STORIES = str(SHARED / "models" / "stories260K")
WIKI = str(SHARED / "data" / "wikitext-2")
STORY = (", there was a little girl named Lily. She loved to play outside in the park. One day, "
         "she saw a big, red ball. She wanted to play with it, but it was too high.")


def stories_source() -> ModelSource:
    """stories260K as a lazy ModelSource built directly from its HF folder."""
    from safetensors import safe_open

    cfg = ModelConfig.from_hf_dict(json.load(open(os.path.join(STORIES, "config.json"))))
    f = safe_open(os.path.join(STORIES, "model.safetensors"), "np")
    names = list(f.keys())
    return ModelSource(STORIES, "hf", cfg, LazyTensors({n: (lambda n=n: f.get_tensor(n)) for n in names}),
                       {n: tuple(f.get_slice(n).get_shape()) for n in names},
                       open(os.path.join(STORIES, "tokenizer.json")).read(),
                       bos_token="<s>", eos_token="</s>", add_bos_token=True)


def greedy(src: ModelSource, prompt_ids: list[int], n: int) -> list[int]:
    m = Transformer(src.config, src.tensors, ReferenceBackend(), max_positions=256)
    cache = m.new_cache(256)
    logits = m.forward(np.array(prompt_ids), cache)
    out = []
    for _ in range(n):
        t = int(logits[0].argmax())
        out.append(t)
        logits = m.forward(np.array([t]), cache)
    return out


@pytest.fixture(scope="module")
def stories():
    from tokenizers import Tokenizer

    src = stories_source()
    tok = Tokenizer.from_str(src.tokenizer_json)
    return src, tok, [1] + tok.encode("Once upon a time", add_special_tokens=False).ids


@pytest.mark.parametrize("method", ["rtn", "awq", "gptq", "mse"])
def test_stories_converted_tells_the_story(method, stories, tmp_path):
    src, tok, prompt = stories
    calib = tmp_path / "calib.txt"
    calib.write_text(open(os.path.join(WIKI, "valid.txt")).read()[:40000])
    out = tmp_path / f"s.{method}.eif"
    rep = convert(src, str(out), method=method, group_size=32, calib_path=str(calib), n_calib=8,
                  calib_len=128, progress=False)
    assert rep["file_size"] == os.path.getsize(out) and rep["method"] == method
    q = read_eif(out)
    down = q.tensors["model.layers.0.mlp.down_proj.weight"]
    assert (down.in_features, down.in_padded, down.group_size) == (172, 192, 32)  # padding rule
    assert q.tensors["model.layers.0.self_attn.q_proj.weight"].method == method
    assert q.tensors["lm_head.weight"].bits == 8  # untied head: INT8 per row
    text = tok.decode(greedy(q, prompt, 12))
    print(method, repr(text))
    assert text.startswith(", there was a little girl")
    d = describe_eif(out)
    assert d["provenance"]["method"] == method and d["provenance"]["source"] == STORIES
    assert 4.5 < d["bits_per_weight_by_kind"]["attention"] < 5.0  # 4 + 16/32 + 4/32


def test_stories_mse_data_free_uses_random_ids(stories, tmp_path):
    """--method mse without a calibration file: input scales from seeded random token ids
    (recorded), deterministic, and the story survives."""
    src, tok, prompt = stories
    for k in range(2):
        rep = convert(src, str(tmp_path / f"m{k}.eif"), method="mse", group_size=32,
                      progress=False)
        assert "random token ids" in rep["calibration"]
    q, q1 = read_eif(tmp_path / "m0.eif"), read_eif(tmp_path / "m1.eif")
    name = "model.layers.1.mlp.up_proj.weight"
    assert q.tensors[name].method == "mse"
    assert np.array_equal(q.tensors[name].qweight, q1.tensors[name].qweight)
    assert np.array_equal(q.tensors[name].scales, q1.tensors[name].scales)
    assert tok.decode(greedy(q, prompt, 12)).startswith(", there was a little girl")


def test_stories_data_free_awq_records_its_text(stories, tmp_path):
    src, tok, prompt = stories
    out = tmp_path / "df.eif"
    rep = convert(src, str(out), method="awq", group_size=32, n_calib=2, calib_len=48,
                  progress=False)
    assert rep["calibration"].startswith("data-free")
    prov = describe_eif(out)["provenance"]
    ids = np.array(prov["calibration_ids"])
    assert ids.shape == (2, 48) and np.all(ids[:, 0] == 1)
    assert tok.decode(greedy(read_eif(out), prompt, 6)).startswith(", there was")


# ------------------------------------------------------------------ C15: tied embeddings
#: A 32-token word-level tokenizer (the tiny models' vocabulary).
_TINY_TOKENIZER = json.dumps({"model": {"type": "WordLevel", "unk_token": "t0",
                                        "vocab": {f"t{i}": i for i in range(32)}}})


def _tiny(tie, head: str, seed=0) -> ModelSource:
    """2-layer llama, vocab 32, hidden 16; tie in {True, False, None (key absent)};
    head in {"present", "absent", "different"}."""
    d = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2}
    if tie is not None:
        d["tie_word_embeddings"] = tie
    cfg = ModelConfig.from_hf_dict(d)
    rng = np.random.default_rng(seed)
    t = {s.name: (rng.standard_normal(s.shape(cfg)) * (0.1 if "norm" not in s.name else 0.1) +
                  (1.0 if "norm" in s.name else 0.0)).astype(np.float32)
         for s in tensor_specs(cfg) if s.name != "lm_head.weight"}
    t["model.embed_tokens.weight"] *= 10.0  # embeddings ~N(0, 1), layers small: a stable net
    e = t["model.embed_tokens.weight"]
    if head == "present":
        t["lm_head.weight"] = e.copy() if cfg.tie_word_embeddings else \
            rng.standard_normal(e.shape).astype(np.float32)
    elif head == "different":
        t["lm_head.weight"] = rng.standard_normal(e.shape).astype(np.float32)
    return ModelSource("tiny", "hf", cfg, t, {k: v.shape for k, v in t.items()}, _TINY_TOKENIZER)


def _logits(tensors, cfg, ids):
    m = Transformer(cfg, tensors, ReferenceBackend(), max_positions=16)
    return m.forward(np.array(ids), m.new_cache(16), all_logits=True)


@pytest.mark.parametrize("tie,head", [(True, "present"), (True, "absent"), (False, "present"),
                                      (None, "absent"), (True, "different")])
def test_c15_tied_untied(tie, head, tmp_path, caplog):
    src = _tiny(tie, head)
    cfg = src.config
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    expect_head = (src.tensors["model.embed_tokens.weight"] if cfg.tie_word_embeddings
                   else src.tensors["lm_head.weight"])
    ref = _logits({**src.tensors, "lm_head.weight": expect_head}, cfg, ids)
    out = tmp_path / "t.eif"
    with caplog.at_level(logging.WARNING):
        convert(src, str(out), method="rtn", group_size=16, embed_bits=8, progress=False)
    q = read_eif(out)
    stored = describe_eif(out)["quantization"]
    assert ("lm_head.weight" in stored) == (not cfg.tie_word_embeddings)  # tied: stored once
    got = _logits(q.tensors, q.config, ids)
    err = np.abs(got - ref).max() / ref.std()
    assert err < 0.1, err  # INT4 layers + INT8 head
    if head == "different":  # the redundant head is ignored, with a warning
        assert "differs from the embedding" in caplog.text
        wrong = _logits({**src.tensors, "lm_head.weight": src.tensors["lm_head.weight"]},
                        _untied(cfg), ids)
        assert np.abs(wrong - ref).max() / ref.std() > 1.0


def _untied(cfg):
    d = cfg.to_hf_dict()
    d["tie_word_embeddings"] = False
    return ModelConfig.from_hf_dict(d)


def test_c15_untied_without_head_is_a_clear_error(tmp_path):
    src = _tiny(False, "absent")
    with pytest.raises(ModelFormatError, match="lm_head.weight is missing"):
        convert(src, str(tmp_path / "x.eif"), method="rtn", progress=False)
    assert not os.listdir(tmp_path)


def test_non_finite_weight_is_named(tmp_path):
    src = _tiny(True, "absent")
    src.tensors["model.layers.1.mlp.up_proj.weight"][2, 3] = np.nan
    with pytest.raises(ModelFormatError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*non-finite"):
        convert(src, str(tmp_path / "x.eif"), method="gptq", n_calib=1, calib_len=8, progress=False)
    with pytest.raises(ValueError, match="unknown method"):
        convert(src, str(tmp_path / "x.eif"), method="squeeze", progress=False)


# ------------------------------------------------------------------ perplexity
class _FakeModel:
    """forward returns uniform logits, or a one-hot on the true next token of ``text``."""

    def __init__(self, vocab, text=None):
        self.vocab, self.text, self.seen = vocab, text, []

    def new_cache(self, n, dtype="f32"):
        class C:
            length = 0

            def reset(self):
                self.length = 0
        return C()

    def forward(self, ids, cache, all_logits=False):
        self.seen.append(np.array(ids))
        out = np.zeros((len(ids), self.vocab), np.float32)
        if self.text is not None:
            start = self.starts.pop(0)
            nxt = self.text[start + 1:start + 1 + len(ids)]
            out[np.arange(len(nxt)), nxt] = 50.0
        return out


def test_perplexity_llama_cpp_method():
    ids = np.arange(100) % 7 + 3
    m = _FakeModel(16)
    r = perplexity(m, ids, n_ctx=16, bos_id=1)
    # 101 tokens with BOS -> 6 chunks of 16; 16 - 1 - 8 = 7 scored per chunk
    assert r["chunks"] == 6 and r["n_tokens"] == 42
    assert r["ppl"] == pytest.approx(16.0) and r["nll"] == pytest.approx(np.log(16))
    assert all(c[0] == 1 for c in m.seen)  # first token of each chunk replaced by BOS
    assert m.seen[1][1] == np.concatenate([[1], ids])[17]
    r2 = perplexity(_FakeModel(16), ids, n_ctx=16, n_chunks=2)
    assert r2["chunks"] == 2 and r2["n_tokens"] == 14
    perfect = _FakeModel(16, text=ids)
    perfect.starts = [i * 16 for i in range(6)]
    assert perplexity(perfect, ids, n_ctx=16)["ppl"] == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="2 \\* n_ctx"):
        perplexity(m, ids[:20], n_ctx=16)


def test_divergence_kl_and_top1():
    """KL(P || Q) and top-1 agreement on hand-made distributions (P = Q gives 0 and full
    agreement; a known pair gives its closed-form KL)."""
    from edgeinfer.perplexity import divergence

    p = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]))
    assert divergence(p, p)[0] == pytest.approx(0.0, abs=1e-12) and divergence(p, p)[1:] == (2, 2)
    q = np.log(np.array([[0.2, 0.7, 0.1], [0.1, 0.1, 0.8]]))
    kl, same, n = divergence(p.astype(np.float16), q)
    assert kl == pytest.approx(0.7 * np.log(0.7 / 0.2) + 0.2 * np.log(0.2 / 0.7), rel=2e-3)
    assert (same, n) == (1, 2)
    seen = []
    perplexity(_FakeModel(16), np.arange(100) % 7 + 3, n_ctx=16, n_chunks=2,
               on_logprobs=lambda i, lp: seen.append((i, lp.shape, np.exp(lp).sum(1))))
    assert [(i, sh) for i, sh, _ in seen] == [(0, (7, 16)), (1, (7, 16))]
    assert np.allclose(seen[0][2], 1.0)


def test_perplexity_stories_real_text(stories):
    src, tok, _ = stories
    m = Transformer(src.config, src.tensors, ReferenceBackend(), max_positions=128)
    ids = tok.encode((STORY + " ") * 12, add_special_tokens=False).ids
    good = perplexity(m, ids, n_ctx=128, bos_id=1)["ppl"]
    shuffled = np.random.default_rng(0).permutation(ids)
    bad = perplexity(m, shuffled, n_ctx=128, bos_id=1)["ppl"]
    assert good < 3.0 and bad > 5 * good


# ------------------------------------------------------------------ slow: a real model
def _smollm_source():
    from edgeinfer.catalog import model_path
    path = str(model_path("smollm2-135m-instruct"))
    if not os.path.exists(path):
        pytest.skip("SmolLM2 not pulled (edgeinfer pull smollm2-135m-instruct)")
    try:
        from edgeinfer.readers import read_model
        return read_model(path)
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "quality", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "quality.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.read(path)


@pytest.mark.slow
def test_smollm2_awq_answers_paris(tmp_path):
    from tokenizers import Tokenizer

    src = _smollm_source()
    out = tmp_path / "smol.awq.eif"
    convert(src, str(out), method="awq", group_size=128, calib_path=os.path.join(WIKI, "valid.txt"),
            n_calib=4, calib_len=128, progress=False)
    q = read_eif(out)
    tok = Tokenizer.from_str(q.tokenizer_json)
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    text = tok.decode(greedy(q, tok.encode(prompt, add_special_tokens=False).ids, 10))
    print(repr(text))
    assert "Paris" in text


def test_embedding_table_blocks_equal_one_shot():
    from edgeinfer.quant.convert import _table
    from edgeinfer.quant.rtn import quantize_rtn

    w = np.random.default_rng(5).standard_normal((1000, 24)).astype(np.float32)
    a, b = _table(w, 8, "e", rows=300), quantize_rtn(w, 8, -1, True)
    assert np.array_equal(a.qweight, b.qweight) and np.array_equal(a.scales, b.scales)
    assert _table(w, 16, "e").dtype == np.float16
    with pytest.raises(ValueError, match="embed_bits"):
        _table(w, 4, "e")
