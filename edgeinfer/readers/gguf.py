"""Read a llama.cpp GGUF file into a :class:`~edgeinfer.source.ModelSource`.

Metadata becomes an HF-style config dict, tensor names become the canonical HF names,
and the tokenizer is rebuilt as a ``tokenizer.json`` (:mod:`edgeinfer.readers.gguf_tokenizer`).
Weights of the block types in :data:`~edgeinfer.readers.gguf_blocks.NATIVE_TYPES` (Q4_0,
Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) come back as :class:`QuantizedTensor` re-laid losslessly
from the file's blocks (:mod:`edgeinfer.readers.gguf_blocks`), so the model runs at its
own quality with no float32 copy; every other tensor is dequantized to float32 on access
(``gguf.quants.dequantize``: F32, F16, BF16, Q2_K, Q3_K, Q8_K, IQ*), a quantized one with
a log line naming it and its type. ``native=False`` dequantizes everything (what the
converter starts from).

The file header is parsed by :mod:`edgeinfer.readers.gguf_file`; dequantization comes
from the ``gguf`` package.

Conventions undone so tensors match the HF checkpoint exactly (which family needs which
is data in :mod:`edgeinfer.models.families`):

* **Orientation.** GGUF lists dimensions fastest-first (``ne0`` = the input dimension
  of a matmul), so a GGUF ``[in, out]`` tensor is a row-major HF ``[out, in]`` array.
* **Llama Q/K row permutation.** llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.
  permute``) reorders the rows of ``q_proj`` / ``k_proj`` (weights and biases) of
  llama-architecture models from HF's rotate-half RoPE layout to the interleaved
  (GPT-J) layout its kernels use: ``w.reshape(n_head, 2, hd/2, in).swapaxes(1, 2)``.
  We apply the inverse, ``w.reshape(n_head, hd/2, 2, in).swapaxes(1, 2)``, with
  ``n_head`` = head_count for Q and head_count_kv for K. qwen2 and gemma3 GGUFs are
  written unpermuted (their llama.cpp graphs use NeoX RoPE) and are left alone.
  stories260K's HF folder vs its GGUF proves this bit for bit (tests).
* **Gemma norm weights.** HF's ``Gemma3RMSNorm`` computes ``x̂ · (1 + w)``; the converter
  (``Gemma3Model.modify_tensors``: ``if name.endswith("norm.weight"): data + 1``) stores
  ``1 + w`` so llama.cpp can use a plain RMSNorm. We subtract 1 from every ``*norm.weight``
  of a gemma3 GGUF (attn/ffn/post norms, q/k norms, final norm) to get the HF
  convention back (``ModelConfig.norm_unit_offset`` then adds it in the forward).
  Norms are stored F32, so ``(1 + w) - 1`` returns bf16-origin ``w`` exactly.
* **Fused tensors.** phi3's ``attn_qkv`` and ``ffn_up`` (gate then up rows) are split
  into the canonical q/k/v and gate/up (:mod:`edgeinfer.readers.fused`).

Config facts the GGUF does not store, and those it stores in its own way (gemma3's
sliding-window pattern, phi3's LongRoPE factor tensors), are filled by the family's
``gguf_fixup`` (:mod:`edgeinfer.models.family_fixups`).

EOS ids: ``tokenizer.ggml.eos_token_id`` plus ``eot`` / ``eom`` ids plus llama.cpp's
end-of-generation tokens recognised by text
(``<|im_end|>``, ``<|endoftext|>``, ``<end_of_turn>``, ``<|eot_id|>`` …, see
:data:`EOG_TOKEN_TEXTS`) when they are control tokens of the vocabulary. Token ids
outside the vocabulary (stories260K's ``padding_token_id`` = 0xFFFFFFFF) are treated
as absent.
"""
from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..backends.quantized import QuantizedTensor
from ..errors import ModelFormatError, UnsupportedModelError
from ..models.config import ModelConfig
from ..models.families import BY_GGUF_ARCH, BY_MODEL_TYPE, GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES
from ..source import LazyTensors, ModelSource, check_layer_count, expected_specs, finite_loader
from . import config_from_dict
from .files import check_template
from .fused import split_fused
from .gguf_blocks import NATIVE_TYPES, native_bits_per_weight, relayout
from .gguf_file import GGUFFile, GGUFTensorInfo

log = logging.getLogger(__name__)

__all__ = [
    "EOG_TOKEN_TEXTS",
    "GGUFFile",
    "GGUFTensorInfo",
    "gguf_config_dict",
    "gguf_tensors",
    "hf_tensor_name",
    "native_loader",
    "read_gguf",
]

#: End-of-generation tokens llama.cpp recognises by their text (llama-vocab.cpp, the
#: ``special_eog_ids`` list; ggml-org/llama.cpp#9606), used as extra EOS ids.
EOG_TOKEN_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
)

# ---- metadata -> config ------------------------------------------------------------------
def _scalar(v: Any, key: str, where: Path) -> Any:
    """Per-layer arrays (some GGUFs) must be uniform: this runtime has one value per model."""
    if isinstance(v, list):
        if v and all(x == v[0] for x in v):
            return v[0]
        raise UnsupportedModelError(f"{where}: {key} varies per layer ({v[:8]}…); not supported")
    return v


def _valid_id(v: Any, n_vocab: int) -> int | None:
    """A token id, or None when absent or outside the vocabulary (0xFFFFFFFF = unset)."""
    if isinstance(v, bool) or not isinstance(v, int):
        return None
    return v if 0 <= v < n_vocab else None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _str_list(md: dict, key: str, where: Path) -> list[str]:
    """A metadata array of strings (empty when absent)."""
    v = md.get(key)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        raise ModelFormatError(f"{where}: GGUF metadata {key} must be an array of strings; the "
                               f"file is corrupt")
    return v


_REQUIRED = object()


def gguf_config_dict(g: GGUFFile) -> dict[str, Any]:
    """HF-style ``config.json`` dict built from a GGUF's metadata and tensor table.

    Every metadata value read here is type- and range-checked (sizes positive integers,
    frequencies and epsilons positive finite numbers), and ``block_count`` is checked
    against the ``blk.N`` tensors present before anything per layer is built.

    Raises:
        UnsupportedModelError: an architecture no family reads (``BY_GGUF_ARCH``), or
            per-layer varying sizes, or llama3 RoPE factors that match no HF rule.
        ModelFormatError: a required key (``{arch}.embedding_length`` …) is missing, or a
            value has the wrong type or range (the message names the key).
    """
    md = g.metadata
    arch = md.get("general.architecture")
    fam = BY_GGUF_ARCH.get(arch) if isinstance(arch, str) else None
    if fam is None:
        raise UnsupportedModelError(
            f"{g.path}: GGUF architecture {arch!r} is not supported; edgeinfer reads "
            f"{', '.join(sorted(BY_GGUF_ARCH))} GGUFs"
        )

    def opt(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        return _scalar(md[full], full, g.path) if full in md else default

    def get(key: str, default: Any, kind: str, lo: int = 1) -> Any:
        """``{arch}.{key}``: kind "int" (an integer >= lo), "pos" (a finite number > 0) or
        "num" (any finite number)."""
        full = f"{arch}.{key}"
        if full not in md:
            if default is _REQUIRED:
                raise ModelFormatError(f"{g.path}: GGUF metadata key {full!r} is missing")
            return default
        v = _scalar(md[full], full, g.path)
        if kind == "int":
            ok, want = _is_int(v) and v >= lo, f"an integer >= {lo}"
        elif kind == "pos":
            ok, want = _is_num(v) and v > 0, "a finite number > 0"
        else:
            ok, want = _is_num(v), "a finite number"
        if not ok:
            raise ModelFormatError(f"{g.path}: GGUF metadata {full} = {v!r}; expected {want}; "
                                   f"the file is corrupt")
        return v

    def need(key: str) -> int:
        return get(key, _REQUIRED, "int")

    def opt_int(key: str, default: Any = None, lo: int = 1) -> Any:
        return get(key, default, "int", lo)

    def opt_pos(key: str, default: Any = None) -> Any:
        return get(key, default, "pos")

    n_tokens = len(_str_list(md, "tokenizer.ggml.tokens", g.path))
    emb = g.tensors.get("token_embd.weight")
    # the embedding's rows are the model's vocabulary (may exceed the token list if padded)
    n_vocab = (emb.shape[0] if emb is not None else 0) or n_tokens or opt_int("vocab_size", 0)
    hidden = need("embedding_length")
    heads = need("attention.head_count")
    kv_heads = opt_int("attention.head_count_kv", heads)
    head_dim = opt_int("attention.key_length")
    rope_dims = opt_int("rope.dimension_count")
    n_layers = need("block_count")
    check_layer_count(n_layers, g.tensors, str(g.path), f"{arch}.block_count", prefix="blk.")
    if head_dim is None:
        if hidden % heads:
            raise ModelFormatError(f"{g.path}: {arch}.embedding_length {hidden} is not a multiple "
                                   f"of {arch}.attention.head_count {heads} and "
                                   f"{arch}.attention.key_length is absent; the file is corrupt")
        head_dim = hidden // heads
    d: dict[str, Any] = {
        "model_type": fam.gguf_model_type,
        "vocab_size": n_vocab,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(opt_pos("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(opt_pos("rope.freq_base", 10000.0)),
        "max_position_embeddings": opt_int("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
    }
    if rope_dims is not None and rope_dims != head_dim:
        d["partial_rotary_factor"] = rope_dims / head_dim
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        v = _valid_id(md.get(f"tokenizer.ggml.{key}"), n_tokens or n_vocab)
        d["pad_token_id" if key == "padding_token_id" else key] = v

    scaling = opt("rope.scaling.type")
    factor = opt("rope.scaling.factor")
    if scaling is not None and not isinstance(scaling, str):
        raise ModelFormatError(f"{g.path}: GGUF metadata {arch}.rope.scaling.type = {scaling!r} "
                               f"is not a string")
    if scaling in ("linear", "yarn") and factor is not None and factor != 1.0:
        rs: dict[str, Any] = {"rope_type": scaling, "factor": float(opt_pos("rope.scaling.factor"))}
        orig = opt_int("rope.scaling.original_context_length", None, 0)
        if orig:
            rs["original_max_position_embeddings"] = orig
        if scaling == "yarn":
            for k_gguf, k_hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                 ("yarn_ext_factor", "extrapolation_factor"),
                                 ("yarn_attn_factor", "attention_factor")):
                v = get(f"rope.scaling.{k_gguf}", None, "num")
                if v is not None:
                    rs[k_hf] = float(v)
        d["rope_scaling"] = rs
    elif scaling not in (None, "none", "linear", "yarn", "longrope"):  # longrope: fixups
        raise UnsupportedModelError(f"{g.path}: rope scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in g.tensors:
        d["rope_scaling"] = _llama3_scaling(g, d, opt_int("rope.scaling.original_context_length",
                                                          None, 0))

    if fam.gguf_fixup is not None:
        try:
            fam.gguf_fixup(_Meta(g, arch, opt), d)
        except (ValueError, TypeError, ArithmeticError) as e:
            raise ModelFormatError(f"{g.path}: {e}; the file is corrupt") from None
    return d


class _Meta:
    """What a family's ``gguf_fixup`` reads: ``opt`` (``{arch}.key``, uniform per layer),
    ``raw`` (``{arch}.key`` as stored) and ``tensor`` (float32 array or None)."""

    def __init__(self, g: GGUFFile, arch: str, opt: Callable[..., Any]):
        self._g, self._arch, self.opt = g, arch, opt

    def raw(self, key: str, default: Any = None) -> Any:
        return self._g.metadata.get(f"{self._arch}.{key}", default)

    def tensor(self, name: str) -> np.ndarray | None:
        info = self._g.tensors.get(name)
        return None if info is None else self._g.dequantize(info)


def _llama3_scaling(g: GGUFFile, d: dict, orig_ctx: Any) -> dict:
    """Recover HF ``rope_scaling`` (llama3 type) from a ``rope_freqs.weight`` tensor.

    llama.cpp's converter bakes Llama-3.1's frequency rule into per-pair divisors
    (``LlamaModel.generate_extra_tensors``); we find the HF parameters that reproduce
    them exactly (factor = the largest divisor; low/high freq factors 1 and 4 and
    original context 8192, the values every Llama 3.x release uses).
    """
    freqs = g.dequantize(g.tensors["rope_freqs.weight"]).reshape(-1).astype(np.float64)
    dim = int(d["head_dim"] * d.get("partial_rotary_factor", 1.0))
    if freqs.shape != (dim // 2,) or not np.isfinite(freqs).all() or not (freqs > 0).all():
        raise ModelFormatError(f"{g.path}: rope_freqs.weight has {freqs.size} values (expected "
                               f"{dim // 2} positive finite divisors, one per rotary pair)")
    factor = float(freqs.max())
    for low, high, old in ((1.0, 4.0, int(orig_ctx or 8192)), (1.0, 4.0, 8192)):
        inv = 1.0 / (d["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        want = np.where(wavelen < old / high, 1.0,
                        np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
        if want.shape == freqs.shape and np.allclose(want, freqs, rtol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": old}
    raise UnsupportedModelError(f"{g.path}: rope_freqs.weight matches no llama3 RoPE scaling "
                                f"rule edgeinfer knows")


def hf_tensor_name(name: str, arch: str) -> str | None:
    """Canonical HF name of a GGUF tensor name, or None if it has no HF counterpart (fused
    tensors get their HF fused name, split later)."""
    if name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] in ("weight", "bias"):
        fam = BY_GGUF_ARCH.get(arch)
        hf = (fam.gguf_layer_names.get(parts[2]) if fam else None) or GGUF_LAYER_NAMES.get(parts[2])
        if hf is not None:
            return f"model.layers.{parts[1]}.{hf}.{parts[3]}"
    return None


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``LlamaModel.permute`` (interleaved -> rotate-half rows).

    ``w``: ``[n_head * head_dim, ...]`` (weight ``[out, in]`` or bias ``[out]``).
    GGUF row ``h*hd + 2*j + a`` holds HF row ``h*hd + a*hd/2 + j``.
    """
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _unpermute_quantized(w: QuantizedTensor, n_head: int) -> QuantizedTensor:
    """:func:`_unpermute_rows` on a quantized weight (its codes, scales and mins move with
    their rows)."""
    f = lambda a: None if a is None else _unpermute_rows(a, n_head)  # noqa: E731
    return QuantizedTensor(f(w.qweight), f(w.scales), f(w.zeros), w.bits, w.group_size,
                           w.in_features, w.method, dict(w.meta), f(w.mins))


def native_loader(g: GGUFFile, info: GGUFTensorInfo) -> Callable[[], QuantizedTensor] | None:
    """A loader re-laying ``info``'s blocks into a :class:`QuantizedTensor`, or None when
    its type has no native layout or it is not a 2-D weight."""
    qn = _qname(info.qtype)
    if qn not in NATIVE_TYPES or len(info.dims) != 2:
        return None

    def load() -> QuantizedTensor:
        raw = g.raw(info)
        return relayout_by_rows(raw, lambda part: relayout(part, qn, info.name, str(g.path)))
    return load


#: File bytes re-laid per step of :func:`relayout_by_rows`.
RELAYOUT_CHUNK_BYTES = 16 << 20


def relayout_by_rows(raw: np.ndarray, relay: Callable[[np.ndarray], QuantizedTensor],
                     chunk_bytes: int = RELAYOUT_CHUNK_BYTES) -> QuantizedTensor:
    """``relay(raw)`` (a row-wise relayout of the file bytes ``raw [rows, row_bytes]``) done
    ``chunk_bytes`` of rows at a time, each chunk's file pages released once read
    (:func:`..backends.osmemory.release_mapped_pages`), into arrays made once: loading
    holds the result and one chunk of the file, not the whole tensor's pages beside it."""
    from ..backends.osmemory import release_mapped_pages

    step = max(1, chunk_bytes // max(1, raw.shape[1]))

    def relay_rows(r0: int) -> QuantizedTensor:
        part = raw[r0:r0 + step]
        try:
            return relay(part)
        finally:
            release_mapped_pages(part)

    first = relay_rows(0)
    if raw.shape[0] <= step:
        return first
    names = [f for f in ("qweight", "scales", "zeros", "mins") if getattr(first, f) is not None]
    full = {f: np.empty((raw.shape[0],) + getattr(first, f).shape[1:], getattr(first, f).dtype)
            for f in names}
    for r0 in range(0, raw.shape[0], step):
        w = first if r0 == 0 else relay_rows(r0)
        for f in names:
            full[f][r0:r0 + step] = getattr(w, f)
    return QuantizedTensor(full["qweight"], full["scales"], full.get("zeros"), first.bits,
                           first.group_size, first.in_features, first.method, dict(first.meta),
                           full.get("mins"))


def _finite_quantized(w: QuantizedTensor, name: str, where: str) -> QuantizedTensor:
    """``w`` after its scales and mins were found finite (an fp16 NaN/inf there would
    make whole groups non-finite)."""
    from ..source import check_finite

    check_finite(w.scales, f"{name} scales", where)
    if w.mins is not None:
        check_finite(w.mins, f"{name} mins", where)
    return w


def gguf_tensors(g: GGUFFile, config: ModelConfig, native: bool = True) -> tuple[dict[str, Callable[[], Any]], dict[str, tuple[int, ...]]]:
    """Canonical HF name -> loader, and -> shape, for every tensor of a GGUF.

    Loaders undo the converter's conventions (llama Q/K row permutation, gemma ``1 + w``
    norms; see the module docstring) on each call. With ``native`` a weight of a type in
    :data:`NATIVE_TYPES` loads as a :class:`QuantizedTensor` (scales and mins checked
    finite), every other tensor as float32 (a quantized one logged, by type).

    Raises:
        UnsupportedModelError: a tensor with no HF counterpart (never dropped silently).
        ModelFormatError: a tensor this config does not use (metadata/weights disagree).
    """
    arch = g.metadata["general.architecture"]
    fam = BY_MODEL_TYPE[config.model_type]
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    unknown: list[str] = []
    float_kept: dict[str, list[str]] = {}  # ggml type -> tensors dequantized (native only)
    permute_heads: dict[str, int] = {}
    if fam.gguf_permute_qk:
        if config.head_dim % 2:
            raise ModelFormatError(f"{g.path}: head_dim {config.head_dim} is odd; llama.cpp's "
                                   f"Q/K row permutation pairs rows, so the file is corrupt")
        permute_heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, info in g.tensors.items():
        if name == "rope_freqs.weight" or name in fam.gguf_config_tensors:
            continue  # folded into config.rope_scaling
        hf = hf_tensor_name(name, arch)
        if hf is None:
            unknown.append(name)
            continue
        post: list[Callable[[Any], Any]] = []
        proj = hf.split(".")[-2]
        native_load = native_loader(g, info) if native else None
        if native_load is not None and not (fam.gguf_norm_plus_one and hf.endswith("norm.weight")):
            if proj in permute_heads:
                post.append(lambda w, h=permute_heads[proj]: _unpermute_quantized(w, h))

            def load_q(load=native_load, post=post, hf=hf, name=name):
                w = load()
                for f in post:
                    w = f(w)
                return _finite_quantized(w, f"{hf} ({name})", str(g.path))

            loaders[hf] = load_q
            shapes[hf] = info.shape
            continue
        if native and info.qtype not in _FLOAT_TYPES:
            float_kept.setdefault(_qname(info.qtype), []).append(name)
        if proj in permute_heads:
            post.append(lambda w, h=permute_heads[proj]: _unpermute_rows(w, h))
        if fam.gguf_norm_plus_one and hf.endswith("norm.weight"):
            post.append(lambda w: w - np.float32(1.0))

        def load(info=info, post=post):
            w = g.dequantize(info)
            for f in post:
                w = f(w)
            return w

        loaders[hf] = finite_loader(load, f"{hf} ({name})", str(g.path))
        shapes[hf] = info.shape
    for qn, names in float_kept.items():
        log.info("%s: %d %s tensor(s) run dequantized to float32 (no native layout for %s "
                 "yet): %s", g.path, len(names), qn, qn, ", ".join(names))
    if unknown:
        raise UnsupportedModelError(
            f"{g.path}: tensor(s) {', '.join(unknown[:5])}{' …' if len(unknown) > 5 else ''} have "
            f"no counterpart in edgeinfer's {arch} architecture; refusing to drop weights silently"
        )
    split_fused(config, loaders, shapes, str(g.path))  # e.g. phi3's attn_qkv, ffn_up
    expected = {s.name for s in expected_specs(config, shapes, str(g.path))}
    extra = sorted(n for n in loaders if n not in expected)
    if extra:
        raise ModelFormatError(f"{g.path}: tensor(s) {', '.join(extra[:5])} are not used by a "
                               f"{config.model_type} model with this metadata")
    return loaders, shapes



def gguf_row_tables(g: GGUFFile, loaders: dict[str, Callable[[], Any]]) -> dict[str, Callable[[], Any]]:
    """The untied embedding as its file's blocks: ``{"model.embed_tokens.weight": loader}``
    of a :class:`~edgeinfer.backends.blockrows.BlockRows` view (no copy; see
    :attr:`ModelSource.row_tables`), or ``{}`` (a tied table is also the output head,
    which needs the kernels' layout; a type with no row decoder).

    The loader checks every block's fp16 fields finite (reading the table once, then
    giving its pages back) and raises ModelFormatError naming the tensor otherwise."""
    from ..backends.blockrows import BLOCK_TYPES, BlockRows

    info = g.tensors.get("token_embd.weight")
    if info is None or "lm_head.weight" not in loaders or len(info.dims) != 2:
        return {}
    qn = _qname(info.qtype)
    if qn not in BLOCK_TYPES:
        return {}

    def load() -> BlockRows:
        from ..backends.osmemory import release_mapped_pages

        raw = g.raw(info)
        table = BlockRows(raw, qn, "token_embd.weight")
        b = raw.reshape(raw.shape[0], -1, table.block_bytes)
        fields = (0, 2) if qn in ("Q4_1", "Q5_1") else (0,)
        try:
            for at in fields:
                for r0 in range(0, b.shape[0], 8192):
                    h = np.ascontiguousarray(b[r0:r0 + 8192, :, at:at + 2]).view(np.uint16)
                    if ((h & 0x7C00) == 0x7C00).any():  # exponent all ones: inf or NaN
                        raise ModelFormatError(
                            f"{g.path}: tensor 'token_embd.weight' has non-finite {qn} block "
                            f"scales (inf/NaN); the file is corrupt: re-download it")
        finally:
            release_mapped_pages(raw)
        return table
    return {"model.embed_tokens.weight": load}


def read_gguf(path: str | os.PathLike, native: bool = True) -> ModelSource:
    """Read a GGUF file into a validated, lazily loaded :class:`ModelSource`.

    Args:
        path: a ``.gguf`` file of an architecture in :mod:`edgeinfer.models.families`.
        native: weights of the native block types as :class:`QuantizedTensor` (the
            file's own values, re-laid); False: every tensor dequantized to float32.

    Returns:
        ModelSource with ``format="gguf"``: canonical HF tensor names, QuantizedTensor or
        float32 arrays in HF orientation and conventions (see the module docstring), a
        rebuilt
        ``tokenizer.json``, the chat template of ``tokenizer.chat_template``, BOS/EOS from
        ``tokenizer.ggml.*``. ``provenance`` records the GGUF version, file type and the
        count of each tensor type.

    Raises:
        ModelFormatError: not GGUF, truncated (the message names the file, and the
            tensor when the data section is cut), missing or ill-typed metadata, missing
            tensors, wrong shapes, more tokens than embedding rows; NaN/inf in a tensor
            when it is loaded.
        UnsupportedModelError: other architectures, tokenizer kinds, unknown tensors
            (weights edgeinfer would otherwise silently drop), undequantizable types.
    """
    from .gguf_tokenizer import tokenizer_json_from_gguf

    p = Path(path).expanduser()
    if not p.is_file():
        raise ModelFormatError(f"{p}: no such file (expected a .gguf file)")
    g = GGUFFile(p)
    md = g.metadata
    cfg = gguf_config_dict(g)

    tokens = _str_list(md, "tokenizer.ggml.tokens", p)
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if (not isinstance(types, list) or len(types) != len(tokens)
            or not all(_is_int(t) for t in types)):
        raise ModelFormatError(f"{p}: GGUF metadata tokenizer.ggml.token_type must hold one integer "
                               f"per token ({len(tokens)}); the file is corrupt")
    n_vocab = len(tokens)
    extra_eos: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tid = _valid_id(md.get(f"tokenizer.ggml.{key}"), n_vocab)
        if tid is not None:
            extra_eos.append(tid)
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == 3 and t in EOG_TOKEN_TEXTS and i not in extra_eos:
            extra_eos.append(i)
    config = config_from_dict(cfg, str(p), extra_eos=extra_eos)
    if n_vocab > config.vocab_size:
        raise ModelFormatError(f"{p}: tokenizer.ggml.tokens has {n_vocab} tokens but the embedding "
                               f"has {config.vocab_size} rows; token ids past the embedding cannot "
                               f"run (the file is corrupt)")
    template = check_template(md.get("tokenizer.chat_template"),
                              f"{p}: GGUF metadata tokenizer.chat_template")

    bos_id, eos_id = cfg.get("bos_token_id"), cfg.get("eos_token_id")
    loaders, shapes = gguf_tensors(g, config, native=native)

    generation: dict[str, Any] = {"eos_token_id": list(config.eos_token_ids)}
    if bos_id is not None:
        generation["bos_token_id"] = bos_id
    src = ModelSource(
        path=str(p),
        format="gguf",
        config=config,
        tensors=LazyTensors(loaders),
        shapes=shapes,
        tokenizer_json="",
        chat_template=template,
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        generation=generation,
        provenance={
            "gguf_version": g.version,
            "general.name": md.get("general.name"),
            "general.file_type": md.get("general.file_type"),
            "tensor_types": dict(Counter(_qname(i.qtype) for i in g.tensors.values())),
            "tokenizer.ggml.model": md.get("tokenizer.ggml.model"),
            "tokenizer.ggml.pre": md.get("tokenizer.ggml.pre"),
            "native": native,
            "native_weight_bytes": _weight_bytes(g, native),
        },
        mapping=g._mm,  # dropped once a backend holds its copies (nothing keeps a view)
        row_tables=gguf_row_tables(g, loaders) if native else {},
    )
    src.validate()  # tensors first: a broken file fails before the (slower) tokenizer build
    src.tokenizer_json, src.add_bos_token = tokenizer_json_from_gguf(md, where=str(p),
                                                                     vocab_size=config.vocab_size)
    return src


def _weight_bytes(g: GGUFFile, native: bool) -> int:
    """Bytes the tensors take once loaded: the re-laid size of native types, float32
    for the rest."""
    total = 0
    for info in g.tensors.values():
        n = math.prod(info.dims)
        bpw = native_bits_per_weight(_qname(info.qtype)) if native and len(info.dims) == 2 else None
        total += int(n * bpw / 8) if bpw is not None else 4 * n
    return total


def _qname(qtype: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(qtype).name


_FLOAT_TYPES = (0, 1, 30)  # ggml F32, F16, BF16
