"""Read a Hugging Face model folder (``config.json`` + safetensors + tokenizer files).

Files used (all read here, nothing downloaded). Every one, shards included, is resolved
inside the model folder (or its Hugging Face cache repository) and must be a regular file
before it is opened (:func:`edgeinfer.readers.files.folder_file`); every JSON file is
parsed with duplicate-key, size and nesting limits (:func:`~edgeinfer.readers.files.read_json`).

* ``config.json``: required. Classic ``rope_theta`` and transformers-5 ``rope_parameters``
  both work (handled by :meth:`ModelConfig.from_hf_dict`).
* ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``:
  each header is checked first (:mod:`edgeinfer.readers.safetensors_header`), then tensors
  are opened with :func:`safetensors.safe_open` (framework ``"numpy"``) and read lazily, one
  tensor per access, each checked for NaN/inf as it is read. F32/F16/F64 come through ``get_tensor``; BF16 (which
  numpy lacks) is read raw from the file at the header's offsets and widened to float32
  exactly (bf16 is the top half of an fp32).
* ``tokenizer.json``: required (the fast-tokenizer file is the tokenizer edgeinfer runs).
* ``tokenizer_config.json``: bos/eos token strings (plain or AddedToken-dict form),
  ``add_bos_token``, and the chat template. The template is taken from
  ``chat_template.jinja``, else ``chat_template.json``, else ``tokenizer_config.json``
  (transformers' own precedence); a list of named templates yields the ``default`` one.
* ``generation_config.json``: optional; its ``eos_token_id`` (int or list) is merged
  into ``config.eos_token_ids``; the dict is kept as ``ModelSource.generation``.

``add_bos_token`` when ``tokenizer_config.json`` does not say: inferred from the
``tokenizer.json`` post-processor. A ``TemplateProcessing`` (alone or inside a
``Sequence``) whose single-sequence template starts with a special token before ``$A``
adds a BOS on every encode, so the runtime must treat BOS as added; otherwise False.

Quantized checkpoints (a ``quantization_config`` in ``config.json``, or AutoGPTQ's
``quantize_config.json``) are refused here with a pointer to ``edgeinfer convert``. The
converter reads them through the same function with ``packed=`` a :class:`PackedLinears`
(its GPTQ / AutoAWQ layouts, :mod:`edgeinfer.quant.packed_formats`): every group of
tensors ``P.qweight``, ``P.qzeros``, ``P.scales`` ... becomes one canonical ``P.weight``
whose loader returns a :class:`~edgeinfer.backends.quantized.QuantizedTensor`; everything
else (config, tokenizer, tied head, strict tensor names and shapes) is checked as for a
float checkpoint.

Tied embeddings (https://github.com/ml-explore/mlx-examples/issues/564): ``tie_word_embeddings`` true (or absent: the HF default)
-> any ``lm_head.weight`` in the checkpoint is ignored (a warning is logged if it
differs from the embedding); false and no ``lm_head.weight`` -> ModelFormatError, never
a silent fall-back to the embedding.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import ModelFormatError, UnsupportedModelError
from ..source import LazyTensors, ModelSource, check_layer_count, expected_specs, finite_loader
from . import config_from_dict
from .files import (MAX_TOKENIZER_JSON_BYTES, check_template, folder_file, model_root,
                    parse_json, read_json, read_text)
from .fused import split_fused
from .safetensors_header import TensorEntry, read_header
from .tokenizer_files import check_tokenizer_json, token_id, token_text

log = logging.getLogger(__name__)

__all__ = ["PackedLinears", "quantization_config", "read_hf_folder"]

#: Checkpoint tensors that carry no weights the runtime needs (buffers saved by old
#: transformers versions); dropped silently.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".num_batches_tracked")
#: Multimodal checkpoints: the text decoder is read, the vision parts are skipped.
_SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.", "vision_model.")
#: Renames of wrapped text decoders onto the canonical ``model.`` prefix.
_PREFIX_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                   ("language_model.lm_head.", "lm_head."))

_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
#: dtypes :meth:`_SafetensorsFile.load_native` returns as stored (packed codes, fp16 scales).
_NATIVE_DTYPES = ("I32", "U32", "I64", "F16")


class PackedLinears(Protocol):
    """How a quantized checkpoint stores one linear ``P`` (implemented by the converter:
    :mod:`edgeinfer.quant.packed_formats`). ``metas`` / ``arrays`` map each suffix of
    :attr:`parts` present for ``P`` to its ``(dtype, shape)`` / a loader of its array in
    the stored dtype; ``where`` is the file, for messages."""

    #: tensor-name suffixes of one packed linear, e.g. ``(".qweight", ".qzeros", ...)``
    parts: tuple[str, ...]

    def shape(self, prefix: str, metas: dict[str, tuple[str, tuple[int, ...]]],
              where: str) -> tuple[int, int]:
        """The logical ``(out, in)`` of ``prefix.weight``; raises ModelFormatError."""
        ...

    def load(self, prefix: str, arrays: dict[str, Callable[[], np.ndarray]],
             where: str) -> Any:
        """``prefix.weight`` as a QuantizedTensor; raises ModelFormatError."""
        ...


def _token_str(v: Any, where: str) -> str | None:
    """A special-token entry of tokenizer_config: a string or an AddedToken dict."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    raise ModelFormatError(f"{where} must be a string or {{\"content\": ...}}, got {str(v)[:80]}")


def _pick_template(v: Any, where: str) -> str | None:
    """``chat_template`` as a string, or the ``default`` entry of a named list."""
    if isinstance(v, list):
        named = {t.get("name"): t.get("template") for t in v if isinstance(t, dict)}
        v = named.get("default") or next(iter(named.values()), None)
    if v is None or isinstance(v, str):
        return v
    raise ModelFormatError(f"{where}: a chat template must be a string or a list of "
                           f"{{\"name\", \"template\"}} entries, got {type(v).__name__}")


def _id_list(v: Any, where: str) -> list[int]:
    """An ``eos_token_id`` value: one token id or a list of them."""
    ids = v if isinstance(v, list) else [v]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelFormatError(f"{where} must be a token id or a list of token ids (integers "
                               f">= 0), got {str(v)[:80]}")
    return list(ids)


class _SafetensorsFile:
    """One safetensors file: names, dtypes and shapes up front; data on request."""

    def __init__(self, path: Path, shown: Path):
        from safetensors import SafetensorError, safe_open

        self.path = path  # resolved (a blob in the HF cache)
        self.shown = shown  # as named in the folder, for messages
        # Our own check first (duplicate names, offsets tiling the file, bounded header):
        # nothing below reads data the header does not describe.
        self.header = read_header(path, shown=shown)
        self.meta = {n: (t.dtype, t.shape) for n, t in self.header.tensors.items()}
        try:
            # safe_open checks the same layout again (defence in depth) before any read.
            with safe_open(str(path), framework="numpy"):
                pass
        except SafetensorError as e:
            raise ModelFormatError(f"{shown}: unreadable safetensors file ({e}); the file is "
                                   f"truncated or corrupt, download it again") from e
        except OSError as e:
            raise ModelFormatError(f"{shown}: cannot read ({e})") from e

    def load_native(self, name: str) -> np.ndarray:
        """Tensor ``name`` in its stored dtype for integer and F16 tensors (packed codes,
        fp16 scales), else as :meth:`load` (float32)."""
        if self.header.tensors[name].dtype in _NATIVE_DTYPES:
            from safetensors import safe_open

            with safe_open(str(self.path), framework="numpy") as f:
                return np.asarray(f.get_tensor(name))
        return self.load(name)

    def load(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a fresh float32 array in checkpoint orientation."""
        t: TensorEntry = self.header.tensors[name]
        if t.dtype in _NUMPY_DTYPES:
            from safetensors import safe_open

            with safe_open(str(self.path), framework="numpy") as f:
                return np.asarray(f.get_tensor(name), dtype=np.float32)
        if t.dtype == "BF16":
            n = (t.end - t.begin) // 2  # the header check made this prod(shape)
            raw = np.fromfile(self.path, dtype="<u2", count=n, offset=t.begin)
            if raw.size != n:
                raise ModelFormatError(f"{self.shown}: tensor {name!r} is cut short; download "
                                       f"it again")
            # bf16 is the high 16 bits of an IEEE fp32: widening is exact.
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(t.shape)
        raise UnsupportedModelError(
            f"{self.shown}: tensor {name!r} has dtype {t.dtype}; edgeinfer reads F32, F16, BF16 "
            f"and F64 checkpoints (quantized HF checkpoints go through edgeinfer.quant)"
        )


def _open_shards(folder: Path, root: Path) -> dict[str, _SafetensorsFile]:
    """Map checkpoint tensor name -> the file that holds it.

    Every shard named by the index is confined to the model folder (``folder_file``)
    before it is opened.
    """
    index = folder_file(folder, "model.safetensors.index.json", root=root)
    if index is not None:
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFormatError(f"{index}: no 'weight_map' object (tensor name -> shard "
                                   f"file); re-download the model")
        shard_of: dict[str, Path] = {}
        for name, fname in weight_map.items():  # every path is checked before any is opened
            if not isinstance(fname, str) or fname not in shard_of:
                shard_of[fname] = folder_file(folder, fname, root=root, required=True,
                                              field=f"{index.name} weight_map[{name!r}]")
        files: dict[str, _SafetensorsFile] = {}
        out: dict[str, _SafetensorsFile] = {}
        for name, fname in weight_map.items():
            if fname not in files:
                files[fname] = _SafetensorsFile(shard_of[fname], folder / fname)
            if name not in files[fname].meta:
                raise ModelFormatError(f"{folder / fname}: tensor {name!r} listed in {index.name} "
                                       f"is not in the shard")
            out[name] = files[fname]
        return out
    single = folder_file(folder, "model.safetensors", root=root)
    if single is not None:
        f = _SafetensorsFile(single, folder / "model.safetensors")
        return {n: f for n in f.meta}
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    hint = f" (found {', '.join(others)} but no index)" if others else ""
    if (folder / "pytorch_model.bin").exists():
        hint += "; pytorch_model.bin is not read (pickle): convert the checkpoint to safetensors"
    raise ModelFormatError(f"{folder}: no model.safetensors or model.safetensors.index.json{hint}")


def _infer_add_bos(tok: dict, bos: str | None) -> bool:
    """Whether tokenizer.json's post-processor prepends a BOS token to single sequences."""
    pp = tok.get("post_processor") or {}
    if not isinstance(pp, dict):
        return False
    procs = pp.get("processors", []) if pp.get("type") == "Sequence" else [pp]
    for proc in procs if isinstance(procs, list) else []:
        if not isinstance(proc, dict) or proc.get("type") != "TemplateProcessing":
            continue
        single = proc.get("single") or []
        first = single[0] if isinstance(single, list) and single else None
        if isinstance(first, dict) and isinstance(first.get("SpecialToken"), dict):
            tid = first["SpecialToken"].get("id")
            return bos is None or tid == bos
    return False


def _canonical(name: str) -> str | None:
    """Canonical HF name of a checkpoint tensor, or None to skip it."""
    if name.endswith(_IGNORED_SUFFIXES) or name.startswith(_SKIPPED_PREFIXES):
        return None
    for old, new in _PREFIX_RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _arrays_differ(a: Callable[[], np.ndarray], b: Callable[[], np.ndarray]) -> bool:
    return not np.array_equal(a(), b())


def quantization_config(folder: str | os.PathLike) -> tuple[dict, str] | None:
    """The checkpoint's quantization settings and the file they came from: ``config.json``'s
    ``quantization_config``, else AutoGPTQ's ``quantize_config.json``; None when neither is
    there (a float checkpoint, or no ``config.json``).

    Raises:
        ModelFormatError: an unreadable JSON file, or settings that are not an object.
    """
    folder = Path(folder).expanduser()
    root = model_root(folder)
    cfg_path = folder_file(folder, "config.json", root=root)
    if cfg_path is None:
        return None
    qc, where = read_json(cfg_path).get("quantization_config"), cfg_path
    if not qc:
        where = folder_file(folder, "quantize_config.json", root=root)
        qc = read_json(where) if where is not None else None
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ModelFormatError(f"{where}: quantization_config must be an object, got "
                               f"{type(qc).__name__}")
    return qc, str(where)


def _group_packed(where: dict[str, _SafetensorsFile], packed: PackedLinears,
                  loaders: dict[str, Callable[[], Any]], shapes: dict[str, tuple[int, ...]],
                  origin: dict[str, str]) -> set[str]:
    """Add one ``P.weight`` loader (a QuantizedTensor) per packed linear ``P``; returns the
    checkpoint names consumed."""
    groups: dict[str, dict[str, tuple[_SafetensorsFile, str]]] = {}
    for name, f in where.items():
        canon = _canonical(name)
        part = next((p for p in packed.parts if canon and canon.endswith(p)), None)
        if part is not None:
            groups.setdefault(canon[: -len(part)], {})[part] = (f, name)
    used: set[str] = set()
    for prefix, parts in groups.items():
        shown = str(next(iter(parts.values()))[0].shown)
        metas = {p: f.meta[n] for p, (f, n) in parts.items()}
        canon = prefix + ".weight"
        shapes[canon] = tuple(packed.shape(prefix, metas, shown))
        arrays = {p: (lambda f=f, n=n: f.load_native(n)) for p, (f, n) in parts.items()}
        loaders[canon] = (lambda pr=prefix, a=arrays, w=shown: packed.load(pr, a, w))
        origin[canon] = prefix + next(iter(parts))
        used.update(n for _f, n in parts.values())
    return used


def read_hf_folder(path: str | os.PathLike, *, packed: PackedLinears | None = None) -> ModelSource:
    """Read a HF model folder into a validated, lazily loaded :class:`ModelSource`.

    Args:
        path: folder with ``config.json``, ``model.safetensors`` (or sharded with
            ``model.safetensors.index.json``), ``tokenizer.json`` and optionally
            ``tokenizer_config.json``, ``generation_config.json``, ``chat_template.jinja``
            / ``chat_template.json``.
        packed: the layout of a quantized checkpoint's linears (the converter's import,
            module docstring); None: a quantized checkpoint is refused.

    Returns:
        ModelSource with ``format="hf"``; ``tensors`` maps canonical names to loaders
        yielding float32 arrays ``[out, in]`` (vectors ``[n]``; each checked for NaN/inf
        when loaded); ``shapes`` is known without loading.

    Raises:
        ModelFormatError: missing/invalid files, a file resolving outside the folder,
            truncated safetensors, a missing tensor, a wrong shape, an unexpected tensor in
            the decoder, a tokenizer that does not fit the config, or an untied config
            without ``lm_head.weight`` (the message names the file and the tensor/field).
        UnsupportedModelError: unknown ``model_type``, quantized checkpoints (without
            ``packed``), or dtypes other than F32/F16/BF16/F64.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelFormatError(f"{folder}: not a folder (expected a HF model folder)")
    root = model_root(folder)

    def file(name: str) -> Path | None:
        return folder_file(folder, name, root=root)

    cfg_path = file("config.json")
    if cfg_path is None:
        raise ModelFormatError(f"{folder}: no config.json (expected a HF model folder)")
    cfg_dict = read_json(cfg_path)
    qc = quantization_config(folder) if packed is None else None
    if qc:
        qm = qc[0].get("quant_method", "?")
        raise UnsupportedModelError(
            f"{qc[1]}: a {qm}-quantized checkpoint; import it first (GPTQ and AutoAWQ GEMM, "
            f"lossless): edgeinfer convert {folder} -o MODEL.eif, then run MODEL.eif"
        )

    # ---- tokenizer files ---------------------------------------------------------------
    tok_path = file("tokenizer.json")
    if tok_path is None:
        raise ModelFormatError(f"{folder}: no tokenizer.json (edgeinfer needs the fast-"
                               f"tokenizer file; a SentencePiece tokenizer.model alone is "
                               f"not read)")
    tokenizer_json = read_text(tok_path, MAX_TOKENIZER_JSON_BYTES)
    tok = parse_json(tokenizer_json, str(tok_path))
    tcfg_path = file("tokenizer_config.json")
    tcfg = read_json(tcfg_path) if tcfg_path else {}
    chat_template = None
    jinja_path, ct_json_path = file("chat_template.jinja"), file("chat_template.json")
    if jinja_path is not None:
        chat_template = read_text(jinja_path)
    elif ct_json_path is not None:
        chat_template = _pick_template(read_json(ct_json_path).get("chat_template"),
                                       str(ct_json_path))
    if chat_template is None:
        chat_template = _pick_template(tcfg.get("chat_template"), f"{tcfg_path}")
    chat_template = check_template(chat_template, str(jinja_path or ct_json_path or tcfg_path))
    bos_token = _token_str(tcfg.get("bos_token"), f"{tcfg_path}: bos_token")
    eos_token = _token_str(tcfg.get("eos_token"), f"{tcfg_path}: eos_token")
    add_bos_cfg = tcfg.get("add_bos_token")
    if add_bos_cfg is not None and not isinstance(add_bos_cfg, bool):
        raise ModelFormatError(f"{tcfg_path}: add_bos_token must be true or false, got "
                               f"{add_bos_cfg!r}")

    # ---- generation config + EOS union (vllm#4180) ---------------------------------------
    gen_path = file("generation_config.json")
    generation: dict = read_json(gen_path) if gen_path else {}
    extra_eos: list[int] = []
    if generation.get("eos_token_id") is not None:
        extra_eos = _id_list(generation["eos_token_id"], f"{gen_path}: eos_token_id")
        generation["eos_token_id"] = list(extra_eos)
    config = config_from_dict(cfg_dict, str(cfg_path), extra_eos=extra_eos)

    # ---- the tokenizer against the config -----------------------------------------------
    check_tokenizer_json(tok, str(tok_path), config.vocab_size,
                         {"tokenizer_config.json bos_token": bos_token,
                          "tokenizer_config.json eos_token": eos_token})
    if bos_token is None:
        bos_token = token_text(tok, config.bos_token_id)
    if eos_token is None and config.eos_token_ids:
        eos_token = token_text(tok, config.eos_token_ids[0])
    add_bos = add_bos_cfg if add_bos_cfg is not None else _infer_add_bos(tok, bos_token)
    tid = token_id(tok, eos_token)
    if tid is not None and tid not in config.eos_token_ids:
        config.eos_token_ids.append(tid)

    # ---- tensors -------------------------------------------------------------------------
    where = _open_shards(folder, root)
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    origin: dict[str, str] = {}
    used = _group_packed(where, packed, loaders, shapes, origin) if packed is not None else set()
    for name, f in where.items():
        canon = _canonical(name)
        if canon is None or name in used:
            continue
        if canon in loaders:
            raise ModelFormatError(f"{f.shown}: tensor {canon!r} appears twice (also as "
                                   f"{origin[canon]!r})")
        loaders[canon] = finite_loader(lambda f=f, n=name: f.load(n), canon, str(f.shown))
        shapes[canon] = f.meta[name][1]
        origin[canon] = name
    dtypes: dict[str, int] = {}
    for name, f in where.items():
        dtypes[f.meta[name][0]] = dtypes.get(f.meta[name][0], 0) + 1
    check_layer_count(config.num_hidden_layers, shapes, str(folder), "num_hidden_layers")
    split_fused(config, loaders, shapes, str(folder))  # e.g. Phi-3's qkv_proj, gate_up_proj

    if config.tie_word_embeddings:
        if "lm_head.weight" in loaders:
            # Tied: the checkpoint's lm_head is redundant (mlx-lm#1298); warn if it is not
            # the embedding, since the runtime will use the embedding.
            emb = loaders.get("model.embed_tokens.weight")
            if emb is not None and (shapes["lm_head.weight"] != shapes["model.embed_tokens.weight"]
                                    or _arrays_differ(loaders["lm_head.weight"], emb)):
                log.warning("%s: tie_word_embeddings is true but lm_head.weight differs from "
                            "model.embed_tokens.weight; using the embedding (as HF does)", folder)
            del loaders["lm_head.weight"], shapes["lm_head.weight"]
    elif "lm_head.weight" not in loaders:
        raise ModelFormatError(
            f"{folder}: config.json says tie_word_embeddings=false but the checkpoint has no "
            f"'lm_head.weight'; refusing to fall back to the embedding silently (set "
            f"tie_word_embeddings=true if the head is meant to be shared)"
        )

    expected = {s.name for s in expected_specs(config, shapes, str(folder))}
    unexpected = sorted(n for n in loaders if n not in expected)
    if unexpected:
        raise ModelFormatError(
            f"{folder}: tensor(s) {', '.join(unexpected[:5])}"
            f"{' …' if len(unexpected) > 5 else ''} are not used by a {config.model_type} model "
            f"with this config.json (e.g. biases or layers the config does not declare); "
            f"the config and the weights disagree"
        )

    src = ModelSource(
        path=str(folder),
        format="hf",
        config=config,
        tensors=LazyTensors(loaders),
        shapes=shapes,
        tokenizer_json=tokenizer_json,
        chat_template=chat_template,
        bos_token=bos_token,
        eos_token=eos_token,
        add_bos_token=add_bos,
        generation=generation,
        provenance={"files": sorted({str(f.shown.name) for f in where.values()}),
                    "dtypes": dtypes},
    )
    src.validate()
    return src
