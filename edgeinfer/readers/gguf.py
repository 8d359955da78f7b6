"""Read a llama.cpp GGUF file into a :class:`~edgeinfer.source.ModelSource`.

Metadata becomes an HF-style config dict, tensor names become the canonical HF names,
every tensor is dequantized to float32 on access (``gguf.quants.dequantize``: F32,
F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K…Q8_K, IQ*), and the tokenizer is rebuilt
as a ``tokenizer.json`` (:mod:`edgeinfer.readers.gguf_tokenizer`).

The file header is parsed here rather than with ``gguf.GGUFReader``: the reader builds
one numpy view per array element, which took 5 s (SmolLM2, 49k vocab) to 20 s (Gemma 3,
262k vocab) per open on this 2-core machine; the same metadata parses here in 0.1-0.9 s.
Layout constants (value types, block sizes) and dequantization come from the ``gguf``
package.

Conventions undone so tensors match the HF checkpoint exactly:

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

Config facts the GGUF does not store are filled from llama.cpp's own defaults
(``llama-model.cpp``): gemma3 uses a 6-layer sliding-window pattern (every 6th layer
global), local RoPE base 10000, and attention scale ``1/sqrt(head_dim)`` (27B:
``1/sqrt(hidden/heads)``). EOS ids: ``tokenizer.ggml.eos_token_id`` plus ``eot`` /
``eom`` ids plus llama.cpp's end-of-generation tokens recognised by text
(``<|im_end|>``, ``<|endoftext|>``, ``<end_of_turn>``, ``<|eot_id|>`` …, see
:data:`EOG_TOKEN_TEXTS`) when they are control tokens of the vocabulary. Token ids
outside the vocabulary (stories260K's ``padding_token_id`` = 0xFFFFFFFF) are treated
as absent.
"""
from __future__ import annotations

import logging
import math
import mmap
import os
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFormatError, UnsupportedModelError
from ..models.arch import tensor_specs
from ..models.config import ModelConfig
from ..source import LazyTensors, ModelSource
from . import config_from_dict

log = logging.getLogger(__name__)

__all__ = [
    "EOG_TOKEN_TEXTS",
    "GGUFFile",
    "GGUFTensorInfo",
    "gguf_config_dict",
    "gguf_tensors",
    "hf_tensor_name",
    "read_gguf",
]

#: general.architecture -> HF model_type.
ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}

#: End-of-generation tokens llama.cpp recognises by their text (llama-vocab.cpp, the
#: ``special_eog_ids`` list; ggml-org/llama.cpp#9606), used as extra EOS ids.
EOG_TOKEN_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
)

#: GGUF per-layer tensor suffix -> HF per-layer suffix (``blk.N.`` -> ``model.layers.N.``).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",  # gemma3: pre_feedforward_layernorm (below)
    "post_attention_norm": "post_attention_layernorm",  # gemma3 sandwich norms
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: Per-architecture overrides of :data:`_LAYER_NAMES` (gguf-py tensor_mapping.py:
#: FFN_PRE_NORM and FFN_NORM share the name ``ffn_norm``; ATTN_POST_NORM is
#: ``post_attention_norm``).
_ARCH_LAYER_NAMES = {"gemma3": {"ffn_norm": "pre_feedforward_layernorm"}}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# GGUF metadata value types (gguf-py constants.GGUFValueType).
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_NP_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
             10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class _Truncated(Exception):
    pass


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file.

    Attributes:
        name: GGUF name (``blk.0.attn_q.weight``).
        dims: GGUF dimensions, fastest-varying first (``ne0`` = row length).
        qtype: ``gguf.GGMLQuantizationType`` value.
        offset: absolute byte offset of the data in the file.
        nbytes: byte size of the data.
    """

    name: str
    dims: tuple[int, ...]
    qtype: int
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (HF) shape: the GGUF dims reversed, e.g. ``(out, in)``."""
        return tuple(reversed(self.dims))


class GGUFFile:
    """Parsed GGUF header (metadata + tensor table) over a read-only memory map.

    Attributes:
        path: the file.
        version: GGUF version (2 or 3).
        metadata: key -> value (ints, floats, bools, str, lists; numeric arrays as
            Python lists).
        tensors: GGUF name -> :class:`GGUFTensorInfo`, in file order.

    Raises:
        ModelFormatError: not GGUF, unsupported version or endianness, truncated or
            corrupt header, or tensor data reaching past the end of the file.
    """

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except OSError as e:
            raise ModelFormatError(f"{self.path}: cannot read ({e})") from e
        if size < 24:
            raise ModelFormatError(f"{self.path}: {size} bytes, too short for a GGUF header "
                                   f"(truncated file?)")
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = size
        mm = self._mm
        if mm[:4] != b"GGUF":
            raise ModelFormatError(f"{self.path}: not a GGUF file (magic {mm[:4]!r})")
        (version,) = struct.unpack_from("<I", mm, 4)
        if version not in (2, 3):
            swapped = struct.unpack_from(">I", mm, 4)[0]
            if swapped in (2, 3):
                raise ModelFormatError(f"{self.path}: big-endian GGUF is not supported")
            raise ModelFormatError(f"{self.path}: GGUF version {version} is not supported "
                                   f"(edgeinfer reads versions 2 and 3)")
        self.version = version
        try:
            n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
            off = 24
            self.metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key, off = self._str(off)
                (vtype,) = self._unpack("<I", off)
                off += 4
                self.metadata[key], off = self._value(vtype, off)
            infos = []
            for _ in range(n_tensors):
                name, off = self._str(off)
                (nd,) = self._unpack("<I", off)
                off += 4
                if nd > 8:
                    raise ModelFormatError(f"{self.path}: tensor {name!r} has {nd} dimensions "
                                           f"(corrupt header)")
                dims = self._unpack(f"<{nd}Q", off)
                off += 8 * nd
                qtype, toff = self._unpack("<IQ", off)
                off += 12
                infos.append((name, tuple(int(d) for d in dims), qtype, toff))
        except _Truncated:
            raise ModelFormatError(
                f"{self.path}: truncated GGUF file: the header ends past the end of the file "
                f"({size} bytes); download it again"
            ) from None
        except (UnicodeDecodeError, ValueError, struct.error) as e:
            raise ModelFormatError(f"{self.path}: corrupt GGUF header ({e})") from e
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (off + align - 1) // align * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, qtype, toff in infos:
            try:
                qt = gguf.GGMLQuantizationType(qtype)
            except ValueError:
                raise ModelFormatError(f"{self.path}: tensor {name!r} has unknown ggml type "
                                       f"{qtype}") from None
            if qt not in gguf.GGML_QUANT_SIZES:
                raise UnsupportedModelError(f"{self.path}: tensor {name!r} has ggml type {qt.name}, "
                                            f"which has no known block layout")
            block, tsize = gguf.GGML_QUANT_SIZES[qt]
            n = math.prod(dims)
            if dims and dims[0] % block:
                raise ModelFormatError(f"{self.path}: tensor {name!r} row of {dims[0]} is not a "
                                       f"multiple of the {qt.name} block ({block})")
            nbytes = n // block * tsize
            start = data_start + toff
            if start + nbytes > size:
                raise ModelFormatError(
                    f"{self.path}: truncated GGUF file: tensor {name!r} needs bytes "
                    f"{start}..{start + nbytes} but the file has {size}; download it again"
                )
            if name in self.tensors:
                raise ModelFormatError(f"{self.path}: tensor {name!r} appears twice")
            self.tensors[name] = GGUFTensorInfo(name, dims, int(qt), start, nbytes)

    # ---- header parsing ----------------------------------------------------------------
    def _unpack(self, fmt: str, off: int) -> tuple:
        if off + struct.calcsize(fmt) > self.size:
            raise _Truncated
        return struct.unpack_from(fmt, self._mm, off)

    def _str(self, off: int) -> tuple[str, int]:
        (n,) = self._unpack("<Q", off)
        off += 8
        if off + n > self.size:
            raise _Truncated
        return self._mm[off:off + n].decode("utf-8", errors="replace"), off + n

    def _value(self, vtype: int, off: int) -> tuple[Any, int]:
        if vtype in _SCALAR_FMT:
            fmt = _SCALAR_FMT[vtype]
            (v,) = self._unpack(fmt, off)
            return v, off + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._str(off)
        if vtype == _ARRAY:
            etype, n = self._unpack("<IQ", off)
            off += 12
            if etype in _NP_DTYPE:
                dt = np.dtype(_NP_DTYPE[etype])
                if off + n * dt.itemsize > self.size:
                    raise _Truncated
                arr = np.frombuffer(self._mm, dtype=dt, count=n, offset=off)
                vals = arr.astype(bool).tolist() if etype == 7 else arr.tolist()
                return vals, off + n * dt.itemsize
            if etype == _STRING:
                out = []
                mm, size, unpack = self._mm, self.size, struct.unpack_from
                for _ in range(n):
                    if off + 8 > size:
                        raise _Truncated
                    (ln,) = unpack("<Q", mm, off)
                    off += 8
                    if off + ln > size:
                        raise _Truncated
                    out.append(mm[off:off + ln].decode("utf-8", errors="replace"))
                    off += ln
                return out, off
            if etype == _ARRAY:
                out = []
                for _ in range(n):
                    v, off = self._value(_ARRAY, off)
                    out.append(v)
                return out, off
            raise ValueError(f"unknown array element type {etype}")
        raise ValueError(f"unknown metadata value type {vtype}")

    # ---- data ----------------------------------------------------------------------------
    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view ``[rows, row_bytes]`` (no copy)."""
        import gguf

        block, tsize = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.qtype)]
        row_bytes = (info.dims[0] // block) * tsize if info.dims else tsize
        buf = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return buf.reshape(-1, row_bytes)

    def dequantize(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor as a new float32 array in HF (row-major) shape.

        Raises:
            UnsupportedModelError: the ``gguf`` package cannot dequantize its type.
        """
        import gguf

        qt = gguf.GGMLQuantizationType(info.qtype)
        raw = self.raw(info)
        if qt == gguf.GGMLQuantizationType.F32:
            out = raw.view(np.float32).copy()
        elif qt == gguf.GGMLQuantizationType.F16:
            out = raw.view(np.float16).astype(np.float32)
        else:
            try:
                out = gguf.quants.dequantize(raw, qt)
            except NotImplementedError as e:
                raise UnsupportedModelError(f"{self.path}: tensor {info.name!r} is {qt.name}, "
                                            f"which the gguf package cannot dequantize") from e
            out = np.asarray(out, dtype=np.float32)
        return out.reshape(info.shape)


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


def gguf_config_dict(g: GGUFFile) -> dict[str, Any]:
    """HF-style ``config.json`` dict built from a GGUF's metadata and tensor table.

    Raises:
        UnsupportedModelError: architecture other than llama / qwen2 / gemma3, or
            per-layer varying sizes, or llama3 RoPE factors that match no HF rule.
        ModelFormatError: a required key (``{arch}.embedding_length`` …) is missing.
    """
    md = g.metadata
    arch = md.get("general.architecture")
    if arch not in ARCH_TO_MODEL_TYPE:
        raise UnsupportedModelError(
            f"{g.path}: GGUF architecture {arch!r} is not supported; edgeinfer reads "
            f"{', '.join(sorted(ARCH_TO_MODEL_TYPE))} GGUFs"
        )

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in md:
            raise ModelFormatError(f"{g.path}: GGUF metadata key {full!r} is missing")
        return _scalar(md[full], full, g.path)

    def opt(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        return _scalar(md[full], full, g.path) if full in md else default

    n_tokens = len(md.get("tokenizer.ggml.tokens") or [])
    emb = g.tensors.get("token_embd.weight")
    # the embedding's rows are the model's vocabulary (may exceed the token list if padded)
    n_vocab = (emb.shape[0] if emb is not None else 0) or n_tokens or int(opt("vocab_size", 0))
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(opt("attention.head_count_kv", heads))
    head_dim = opt("attention.key_length")
    rope_dims = opt("rope.dimension_count")
    if head_dim is None:
        head_dim = hidden // heads
    d: dict[str, Any] = {
        "model_type": ARCH_TO_MODEL_TYPE[arch],
        "vocab_size": n_vocab,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(head_dim),
        "rms_norm_eps": float(opt("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(opt("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(opt("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "hidden_act": "gelu_pytorch_tanh" if arch == "gemma3" else "silu",
    }
    if rope_dims is not None and int(rope_dims) != int(head_dim):
        d["partial_rotary_factor"] = int(rope_dims) / int(head_dim)
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        v = _valid_id(md.get(f"tokenizer.ggml.{key}"), n_tokens or n_vocab)
        d["pad_token_id" if key == "padding_token_id" else key] = v

    scaling = opt("rope.scaling.type")
    factor = opt("rope.scaling.factor")
    if scaling in ("linear", "yarn") and factor and float(factor) != 1.0:
        rs: dict[str, Any] = {"rope_type": scaling, "factor": float(factor)}
        orig = opt("rope.scaling.original_context_length")
        if orig:
            rs["original_max_position_embeddings"] = int(orig)
        if scaling == "yarn":
            for k_gguf, k_hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                 ("yarn_ext_factor", "extrapolation_factor"),
                                 ("yarn_attn_factor", "attention_factor")):
                v = opt(f"rope.scaling.{k_gguf}")
                if v is not None:
                    rs[k_hf] = float(v)
        d["rope_scaling"] = rs
    elif scaling not in (None, "none", "linear", "yarn"):
        raise UnsupportedModelError(f"{g.path}: rope scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in g.tensors:
        d["rope_scaling"] = _llama3_scaling(g, d, opt("rope.scaling.original_context_length"))

    if arch == "gemma3":
        n_layers = d["num_hidden_layers"]
        window = opt("attention.sliding_window")
        pattern = md.get(f"{arch}.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # newer converters: one bool per layer (True = SWA)
            types = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:  # llama.cpp set_swa_pattern(6): every 6th layer is global
            types = ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
                     for i in range(n_layers)]
        if window:
            d["sliding_window"] = int(window)
            d["layer_types"] = types
        d["rope_local_base_freq"] = float(opt("rope.freq_base_swa", 10000.0))
        # llama.cpp (llama-model.cpp, LLM_ARCH_GEMMA3): 1/sqrt(head_dim), except 27B
        # (62 layers) which uses 1/sqrt(hidden/heads) -- gemma_pytorch config.py. An int, as
        # HF's Gemma3TextConfig declares it (its strict config rejects 256.0).
        d["query_pre_attn_scalar"] = (hidden // heads if n_layers == 62 else int(head_dim))
        for k_gguf, k_hf in (("final_logit_softcapping", "final_logit_softcapping"),
                             ("attn_logit_softcapping", "attn_logit_softcapping")):
            v = opt(k_gguf)
            if v:
                d[k_hf] = float(v)
    return d


def _llama3_scaling(g: GGUFFile, d: dict, orig_ctx: Any) -> dict:
    """Recover HF ``rope_scaling`` (llama3 type) from a ``rope_freqs.weight`` tensor.

    llama.cpp's converter bakes Llama-3.1's frequency rule into per-pair divisors
    (``LlamaModel.generate_extra_tensors``); we find the HF parameters that reproduce
    them exactly (factor = the largest divisor; low/high freq factors 1 and 4 and
    original context 8192, the values every Llama 3.x release uses).
    """
    freqs = g.dequantize(g.tensors["rope_freqs.weight"]).reshape(-1).astype(np.float64)
    dim = int(d["head_dim"] * d.get("partial_rotary_factor", 1.0))
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
    """Canonical HF name of a GGUF tensor name, or None if it has no HF counterpart."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] in ("weight", "bias"):
        table = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
        hf = table.get(parts[2])
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


def gguf_tensors(g: GGUFFile, config: ModelConfig) -> tuple[dict[str, Callable[[], np.ndarray]], dict[str, tuple[int, ...]]]:
    """Canonical HF name -> float32 loader, and -> shape, for every tensor of a GGUF.

    Loaders dequantize on each call and undo the converter's conventions (llama Q/K
    row permutation, gemma ``1 + w`` norms); see the module docstring.

    Raises:
        UnsupportedModelError: a tensor with no HF counterpart (never dropped silently).
        ModelFormatError: a tensor this config does not use (metadata/weights disagree).
    """
    arch = g.metadata["general.architecture"]
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    unknown: list[str] = []
    permute_heads: dict[str, int] = {}
    if arch == "llama":
        permute_heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, info in g.tensors.items():
        if name == "rope_freqs.weight":
            continue  # folded into config.rope_scaling
        hf = hf_tensor_name(name, arch)
        if hf is None:
            unknown.append(name)
            continue
        post: list[Callable[[np.ndarray], np.ndarray]] = []
        proj = hf.split(".")[-2]
        if proj in permute_heads:
            post.append(lambda w, h=permute_heads[proj]: _unpermute_rows(w, h))
        if arch == "gemma3" and hf.endswith("norm.weight"):
            post.append(lambda w: w - np.float32(1.0))

        def load(info=info, post=post):
            w = g.dequantize(info)
            for f in post:
                w = f(w)
            return w

        loaders[hf] = load
        shapes[hf] = info.shape
    if unknown:
        raise UnsupportedModelError(
            f"{g.path}: tensor(s) {', '.join(unknown[:5])}{' …' if len(unknown) > 5 else ''} have "
            f"no counterpart in edgeinfer's {arch} architecture; refusing to drop weights silently"
        )
    expected = {s.name for s in tensor_specs(config)}
    extra = sorted(n for n in loaders if n not in expected)
    if extra:
        raise ModelFormatError(f"{g.path}: tensor(s) {', '.join(extra[:5])} are not used by a "
                               f"{config.model_type} model with this metadata")
    return loaders, shapes



def read_gguf(path: str | os.PathLike) -> ModelSource:
    """Read a GGUF file into a validated, lazily dequantized :class:`ModelSource`.

    Args:
        path: a ``.gguf`` file (llama, qwen2 or gemma3 architecture).

    Returns:
        ModelSource with ``format="gguf"``: canonical HF tensor names, float32 arrays in HF
        orientation and conventions (see the module docstring), a rebuilt
        ``tokenizer.json``, the chat template of ``tokenizer.chat_template``, BOS/EOS from
        ``tokenizer.ggml.*``. ``provenance`` records the GGUF version, file type and the
        count of each tensor type.

    Raises:
        ModelFormatError: not GGUF, truncated (the message names the file, and the
            tensor when the data section is cut), missing metadata or tensors, wrong shapes.
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

    tokens: list[str] = md.get("tokenizer.ggml.tokens") or []
    types: list[int] = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
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

    bos_id, eos_id = cfg.get("bos_token_id"), cfg.get("eos_token_id")
    loaders, shapes = gguf_tensors(g, config)

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
        chat_template=md.get("tokenizer.chat_template"),
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
        },
    )
    src.validate()  # tensors first: a broken file fails before the (slower) tokenizer build
    src.tokenizer_json, src.add_bos_token = tokenizer_json_from_gguf(md, where=str(p))
    return src


def _qname(qtype: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(qtype).name
