"""``export --format gptq``: an ``.eif`` -> a Hugging Face GPTQ folder (serving engines).

The folder (what transformers' GPTQ integration, GPTQModel, vLLM and SGLang load):

* ``model.safetensors``: per quantized linear ``P`` (``P.weight`` in the ``.eif``):

  - ``P.qweight`` int32 ``[in / 8, out]``: eight 4-bit codes per word packed along the
    *input* dimension, code of input ``8r + k`` in bits ``4k .. 4k + 3`` of row ``r``;
  - ``P.qzeros`` int32 ``[in / group, out / 8]``: zero points packed the same way along
    the *output* dimension, stored as ``z - 1`` (the original AutoGPTQ "v1" convention,
    ``checkpoint_format: gptq``: loaders add 1 after unpacking); symmetric weights store
    ``8 - 1`` everywhere;
  - ``P.scales`` float16 ``[in / group, out]``;
  - ``P.g_idx`` int32 ``[in]``: ``i // group`` (``desc_act`` false: the act-order
    permutation was resolved at convert time, see :mod:`.gptq`);
  - dequantization ``W[o, i] = scales[g, o] * (code[i, o] - (stored_zero[g, o] + 1))``,
    ``g = g_idx[i]``.

  Every other tensor (embeddings, norms, biases, an untied head) dense float16: an INT8
  table is dequantized (``q * s`` in float32, then rounded to float16).
* ``config.json``: the model config with ``quantization_config`` {quant_method gptq, bits
  4, group_size, desc_act false, sym, checkpoint_format gptq}; ``generation_config.json``;
  ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat template),
  ``special_tokens_map.json``.

What cannot be exported is refused up front (:class:`UnsupportedModelError` naming the
tensor and the fix): a weight with float group mins (a GGUF's Q4_1/Q4_K layout), 8-bit
linears, float32 scales, padded rows, group sizes that differ between linears, a
``z = 0`` zero point in a group that uses code 15 (v1 cannot store ``z = 0``: ``0 - 1``
wraps; a group whose codes stay below 15 is re-expressed exactly as ``z = 1`` and codes
``+ 1``). The folder is written through
:func:`edgeinfer.safe_write.atomic_output_dir` (a temporary folder renamed at the end).

Format references: AutoGPTQ ``qlinear`` pack/dequant (https://github.com/AutoGPTQ/AutoGPTQ),
GPTQModel's v1/v2 zero-point notes (https://github.com/ModelCloud/GPTQModel).
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ..backends.quantized import SYMMETRIC_ZERO_4BIT, QuantizedTensor, unpack_nibbles
from ..errors import UnsupportedModelError
from ..models.families import BY_MODEL_TYPE
from ..safe_write import atomic_output_dir
from ..source import ModelSource

#: 4-bit codes per int32 word.
PACK = 8
BITS = 4
#: The files an export writes (``--force`` replaces a folder holding only these).
FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json")
#: ModelConfig fields that are edgeinfer's own switches, not HF config keys.
_OWN_FIELDS = ("norm_unit_offset", "qk_norm", "embed_scale", "sandwich_norms")


def pack_int32(codes: np.ndarray, axis: int) -> np.ndarray:
    """Pack 4-bit codes (integers 0..15) eight to an int32 along ``axis`` (0 or 1) of a 2-D
    array: word ``r`` holds codes ``8r .. 8r + 7``, code ``8r + k`` in bits ``4k .. 4k + 3``.

    Returns:
        int32, the packed axis divided by 8 (the bit pattern of a uint32).

    Raises:
        ValueError: a code outside 0..15, or the axis not a multiple of 8.
    """
    c = np.asarray(codes)
    if c.size and (c.min() < 0 or c.max() > 15):
        raise ValueError(f"4-bit codes must be in 0..15, got {c.min()}..{c.max()}")
    if c.shape[axis] % PACK:
        raise ValueError(f"axis {axis} of {c.shape} is not a multiple of {PACK}")
    c = np.moveaxis(c.astype(np.uint32), axis, -1)
    c = c.reshape(c.shape[:-1] + (-1, PACK))
    words = np.zeros(c.shape[:-1], np.uint32)
    for k in range(PACK):
        words |= c[..., k] << np.uint32(BITS * k)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis)).view(np.int32)


def unpack_int32(words: np.ndarray, axis: int) -> np.ndarray:
    """Inverse of :func:`pack_int32`: uint8 codes, the packed axis times 8."""
    w = np.moveaxis(np.asarray(words).view(np.uint32), axis, -1)
    out = np.stack([(w >> np.uint32(BITS * k)) & np.uint32(15) for k in range(PACK)], axis=-1)
    out = out.reshape(w.shape[:-1] + (-1,)).astype(np.uint8)
    return np.ascontiguousarray(np.moveaxis(out, -1, axis))


def _refuse(name: str, why: str, fix: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"cannot export {name!r} as GPTQ: {why}; {fix}")


def gptq_tensors(qt: QuantizedTensor, name: str) -> dict[str, np.ndarray]:
    """One 4-bit linear as GPTQ v1 arrays ``{qweight, qzeros, scales, g_idx}`` (module doc).

    Args:
        qt: the ``.eif`` weight ``[out, in]`` (4-bit, integer zero points or symmetric).
        name: its tensor name, for messages.

    Raises:
        UnsupportedModelError: a layout GPTQ cannot hold exactly (module docstring).
    """
    if qt.mins is not None:
        raise _refuse(name, "it has float group mins (a GGUF Q4_1/Q5_1/Q4_K layout), which "
                      "GPTQ's integer zero points cannot hold",
                      "convert the model from float weights first (edgeinfer convert SOURCE "
                      "--method gptq -o MODEL.eif)")
    if qt.bits != BITS:
        raise _refuse(name, f"it is {qt.bits}-bit (the export writes 4-bit linears)",
                      "convert it to 4 bits (edgeinfer convert)")
    if qt.in_features != qt.in_padded:
        raise _refuse(name, f"its {qt.in_features} input columns are zero-padded to "
                      f"{qt.in_padded} (group {qt.group_size} does not divide them)",
                      "convert with a --group-size that divides every row (e.g. 32)")
    out, n_in = qt.shape
    if n_in % PACK or out % PACK:
        raise _refuse(name, f"shape {qt.shape} is not a multiple of {PACK} in both dimensions",
                      "this model cannot be packed in GPTQ's int32 layout")
    if qt.scales.dtype != np.float16:
        raise _refuse(name, "some of its scales exceed the float16 range (stored as float32)",
                      "GPTQ stores float16 scales: this weight cannot be exported")
    codes = qt.codes()  # [out, in] uint8
    g = qt.group_size
    if qt.zeros is None:
        zeros = np.full((out, qt.n_groups), SYMMETRIC_ZERO_4BIT, np.uint8)
    else:
        zeros = unpack_nibbles(qt.zeros, qt.n_groups)  # [out, n_groups]
        z0 = zeros == 0
        if z0.any():
            top = codes.reshape(out, qt.n_groups, g).max(axis=2)  # [out, n_groups]
            bad = z0 & (top == 15)
            if bad.any():
                o, j = (int(v[0]) for v in np.nonzero(bad))
                raise _refuse(name, f"{int(bad.sum())} group(s) (first: row {o}, group {j}) "
                              f"have zero point 0 and use code 15; GPTQ v1 stores z - 1 and "
                              f"cannot hold z = 0", "re-convert with --symmetric")
            # z = 0 with codes <= 14: the same values as z = 1 with every code + 1
            codes = codes.copy().reshape(out, qt.n_groups, g)
            codes[z0] += 1
            codes = codes.reshape(out, n_in)
            zeros = np.where(z0, 1, zeros).astype(np.uint8)
    return {
        "qweight": pack_int32(codes.T, axis=0),  # [in / 8, out]
        "qzeros": pack_int32((zeros - 1).T, axis=1),  # [n_groups, out / 8], v1: z - 1
        "scales": np.ascontiguousarray(qt.scales.T),  # float16 [n_groups, out]
        "g_idx": (np.arange(n_in, dtype=np.int32) // np.int32(g)),
    }


def _dense_f16(name: str, t: Any) -> np.ndarray:
    a = t.dequantize() if isinstance(t, QuantizedTensor) else np.asarray(t, np.float32)
    with np.errstate(over="ignore"):
        h = np.asarray(a, np.float32).astype(np.float16)
    if not np.isfinite(h).all():
        raise _refuse(name, "its values exceed the float16 range", "this model cannot be "
                      "exported with float16 dense tensors")
    return h


def _linear_names(source: ModelSource) -> list[str]:
    """The decoder linears (4-bit in an edgeinfer conversion) by canonical name."""
    from ..models.families import LINEAR_KEYS, layer_tensor_names

    out = []
    for i in range(source.config.num_hidden_layers):
        names = layer_tensor_names(i)
        out += [names[k] for k in LINEAR_KEYS if names[k] in source.tensors]
    return out


def _group_size(source: ModelSource, linears: list[str]) -> int:
    groups: dict[int, list[str]] = {}
    for n in linears:
        t = source.tensors[n]
        if not isinstance(t, QuantizedTensor):
            raise _refuse(n, "it is not quantized (a float linear)",
                          "convert the model first (edgeinfer convert SOURCE --method gptq)")
        groups.setdefault(t.group_size, []).append(n)
    if len(groups) > 1:
        widths = sorted({source.tensors[n].in_features for n in linears})
        fit = [g for g in (128, 64, 32) if all(w % g == 0 for w in widths)]
        desc = ", ".join(f"{g} ({v[0]}{' …' if len(v) > 1 else ''})" for g, v in sorted(groups.items()))
        fix = (f"re-convert with --group-size {fit[0]}, which divides every row" if fit
               else "no group size of 32-128 divides every row of this model")
        raise UnsupportedModelError(f"cannot export as GPTQ: its linears use different group "
                                    f"sizes ({desc}) and GPTQ's config has one; {fix}")
    return next(iter(groups)) if groups else 128


def _hf_config(source: ModelSource, group: int, sym: bool) -> dict:
    cfg = source.config
    fam = BY_MODEL_TYPE[cfg.model_type]
    d = cfg.to_hf_dict()
    for k in _OWN_FIELDS:
        d.pop(k, None)
    d = {k: v for k, v in d.items() if v is not None}
    if cfg.arch == "gemma3":
        d["query_pre_attn_scalar"] = int(d["query_pre_attn_scalar"])
    arch = [a for a, mt in fam.architectures.items() if mt == cfg.model_type] or list(fam.architectures)
    d["architectures"] = arch[:1]
    d["torch_dtype"] = "float16"
    d["quantization_config"] = {
        "quant_method": "gptq", "bits": BITS, "group_size": group, "desc_act": False,
        "sym": sym, "checkpoint_format": "gptq", "lm_head": False,
    }
    return d


def export_gptq(src: str | os.PathLike | ModelSource, out_dir: str | os.PathLike, *,
                overwrite: bool = False) -> dict:
    """Write ``src`` (an ``.eif`` path or ModelSource of one) as a HF GPTQ folder.

    Args:
        src: the converted model.
        out_dir: the folder to create (refused if it exists, unless ``overwrite`` and it
            holds only a previous export's files).
        overwrite: the CLI's ``--force``.

    Returns:
        report dict: out_dir, group_size, sym, n_quantized, n_dense, bytes.

    Raises:
        UnsupportedModelError: a tensor GPTQ cannot hold (module docstring), or a family
            whose HF layout differs (Phi-3's fused projections).
        ModelFormatError: an unreadable ``.eif``. OutputError: see
            :func:`~edgeinfer.safe_write.atomic_output_dir`.
    """
    from safetensors.numpy import save_file

    if isinstance(src, ModelSource):
        source = src
    else:
        from ..container import read_eif

        source = read_eif(src)
    inputs = [str(source.path)]
    cfg = source.config
    fam = BY_MODEL_TYPE[cfg.model_type]
    if fam.fused:
        raise UnsupportedModelError(f"cannot export {cfg.model_type} as GPTQ yet: its HF "
                                    f"checkpoint fuses q/k/v and gate/up into one linear each")
    linears = _linear_names(source)
    group = _group_size(source, linears)
    syms = {source.tensors[n].symmetric for n in linears}
    if len(syms) > 1:
        raise UnsupportedModelError("cannot export as GPTQ: some linears are symmetric and some "
                                    "are not (GPTQ's config has one 'sym'); re-convert the model")
    sym = syms.pop() if syms else False
    arrays: dict[str, np.ndarray] = {}
    lin = set(linears)
    for name in source.tensors:
        if name in lin:
            prefix = name[: -len(".weight")]
            for k, a in gptq_tensors(source.tensors[name], name).items():
                arrays[f"{prefix}.{k}"] = a
        else:
            arrays[name] = _dense_f16(name, source.tensors[name])
    config = _hf_config(source, group, sym)
    gen = {k: v for k, v in (source.generation or {}).items() if v is not None}
    if cfg.bos_token_id is not None:
        gen.setdefault("bos_token_id", cfg.bos_token_id)
    if cfg.eos_token_ids:
        gen.setdefault("eos_token_id", cfg.eos_token_ids if len(cfg.eos_token_ids) > 1
                       else cfg.eos_token_ids[0])
    specials = {k: v for k, v in (("bos_token", source.bos_token),
                                  ("eos_token", source.eos_token)) if v}
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": source.add_bos_token,
               "add_eos_token": False, "model_max_length": cfg.max_position_embeddings,
               "clean_up_tokenization_spaces": False, **specials}
    if source.chat_template:
        tok_cfg["chat_template"] = source.chat_template
    files = {"config.json": config, "generation_config.json": gen,
             "tokenizer_config.json": tok_cfg, "special_tokens_map.json": specials}
    with atomic_output_dir(out_dir, overwrite=overwrite, inputs=inputs, replaceable=FILES) as tmp:
        save_file(arrays, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(source.tokenizer_json)
        for fn, obj in files.items():
            with open(os.path.join(tmp, fn), "w", encoding="utf-8") as f:
                json.dump(obj, f, indent=2, ensure_ascii=False)
                f.write("\n")
    return {"out_dir": str(out_dir), "format": "gptq", "group_size": group, "sym": sym,
            "n_quantized": len(linears), "n_dense": len(source.tensors) - len(linears),
            "bytes": int(sum(a.nbytes for a in arrays.values()))}
