"""Read a Hugging Face model folder (``config.json`` + safetensors + tokenizer files).

Files used (all read here, nothing downloaded):

* ``config.json``: required. Classic ``rope_theta`` and transformers-5 ``rope_parameters``
  both work (handled by :meth:`ModelConfig.from_hf_dict`).
* ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``:
  tensors are opened with :func:`safetensors.safe_open` (framework ``"numpy"``) and read
  lazily, one tensor per access. F32/F16/F64 come through ``get_tensor``; BF16 (which
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

Tied embeddings (case C15): ``tie_word_embeddings`` true (or absent: the HF default)
-> any ``lm_head.weight`` in the checkpoint is ignored (a warning is logged if it
differs from the embedding); false and no ``lm_head.weight`` -> ModelFormatError, never
a silent fall-back to the embedding.
"""
from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFormatError, UnsupportedModelError
from ..models.arch import tensor_specs
from ..source import LazyTensors, ModelSource
from . import config_from_dict
from .fused import split_fused

log = logging.getLogger(__name__)

__all__ = ["read_hf_folder"]

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


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path}: invalid JSON ({e})") from e
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read ({e})") from e


def _token_str(v: Any) -> str | None:
    """A special-token entry of tokenizer_config: a string or an AddedToken dict."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _pick_template(v: Any) -> str | None:
    """``chat_template`` as a string, or the ``default`` entry of a named list."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list):
        named = {t.get("name"): t.get("template") for t in v if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def _safetensors_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset of the data section) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelFormatError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", raw)
        hdr = f.read(n)
    if len(hdr) < n:
        raise ModelFormatError(f"{path}: truncated safetensors header")
    try:
        return json.loads(hdr), 8 + n
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path}: corrupt safetensors header ({e})") from e


class _SafetensorsFile:
    """One safetensors file: names, dtypes and shapes up front; data on request."""

    def __init__(self, path: Path):
        from safetensors import SafetensorError, safe_open

        self.path = path
        try:
            # safe_open validates the whole header and that the data section covers every
            # tensor, so a truncated download fails here, naming the file.
            with safe_open(str(path), framework="numpy") as f:
                names = list(f.keys())
                self.meta = {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape()))
                             for n in names}
        except SafetensorError as e:
            raise ModelFormatError(f"{path}: unreadable safetensors file ({e}); the file is "
                                   f"truncated or corrupt, download it again") from e
        except OSError as e:
            raise ModelFormatError(f"{path}: cannot read ({e})") from e
        self._header: tuple[dict, int] | None = None

    def load(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a fresh float32 array in checkpoint orientation."""
        dtype, shape = self.meta[name]
        if dtype in _NUMPY_DTYPES:
            from safetensors import safe_open

            with safe_open(str(self.path), framework="numpy") as f:
                return np.asarray(f.get_tensor(name), dtype=np.float32)
        if dtype == "BF16":
            if self._header is None:
                self._header = _safetensors_header(self.path)
            hdr, base = self._header
            start, end = hdr[name]["data_offsets"]
            n = int(np.prod(shape, dtype=np.int64))
            if end - start != 2 * n:
                raise ModelFormatError(f"{self.path}: tensor {name!r} has {end - start} bytes "
                                       f"for {n} bf16 values")
            raw = np.fromfile(self.path, dtype="<u2", count=n, offset=base + start)
            # bf16 is the high 16 bits of an IEEE fp32: widening is exact.
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
        raise UnsupportedModelError(
            f"{self.path}: tensor {name!r} has dtype {dtype}; edgeinfer reads F32, F16, BF16 "
            f"and F64 checkpoints (quantized HF checkpoints go through edgeinfer.quant)"
        )


def _open_shards(folder: Path) -> dict[str, _SafetensorsFile]:
    """Map checkpoint tensor name -> the file that holds it."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFormatError(f"{index}: no 'weight_map' dict")
        files: dict[str, _SafetensorsFile] = {}
        out: dict[str, _SafetensorsFile] = {}
        for name, fname in weight_map.items():
            if fname not in files:
                fp = folder / fname
                if not fp.exists():
                    raise ModelFormatError(f"{index}: shard {fname} (holding {name!r}) is missing")
                files[fname] = _SafetensorsFile(fp)
            if name not in files[fname].meta:
                raise ModelFormatError(f"{folder / fname}: tensor {name!r} listed in {index.name} "
                                       f"is not in the shard")
            out[name] = files[fname]
        return out
    if single.exists():
        f = _SafetensorsFile(single)
        return {n: f for n in f.meta}
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    hint = f" (found {', '.join(others)} but no index)" if others else ""
    if (folder / "pytorch_model.bin").exists():
        hint += "; pytorch_model.bin is not read (pickle): convert the checkpoint to safetensors"
    raise ModelFormatError(f"{folder}: no model.safetensors or model.safetensors.index.json{hint}")


def _infer_add_bos(tok: dict, bos: str | None) -> bool:
    """Whether tokenizer.json's post-processor prepends a BOS token to single sequences."""
    pp = tok.get("post_processor") or {}
    procs = pp.get("processors", []) if pp.get("type") == "Sequence" else [pp]
    for proc in procs:
        if proc.get("type") != "TemplateProcessing":
            continue
        single = proc.get("single") or []
        if single and "SpecialToken" in single[0]:
            first = single[0]["SpecialToken"].get("id")
            return bos is None or first == bos
    return False


def _token_id(tok: dict, text: str | None) -> int | None:
    if text is None:
        return None
    for t in tok.get("added_tokens", []):
        if t.get("content") == text:
            return int(t["id"])
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        v = vocab.get(text)
        return int(v) if v is not None else None
    return None


def _token_text(tok: dict, tid: int | None) -> str | None:
    if tid is None:
        return None
    for t in tok.get("added_tokens", []):
        if t.get("id") == tid:
            return t.get("content")
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        for k, v in vocab.items():
            if v == tid:
                return k
    return None


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


def read_hf_folder(path: str | os.PathLike) -> ModelSource:
    """Read a HF model folder into a validated, lazily loaded :class:`ModelSource`.

    Args:
        path: folder with ``config.json``, ``model.safetensors`` (or sharded with
            ``model.safetensors.index.json``), ``tokenizer.json`` and optionally
            ``tokenizer_config.json``, ``generation_config.json``, ``chat_template.jinja``
            / ``chat_template.json``.

    Returns:
        ModelSource with ``format="hf"``; ``tensors`` maps canonical names to loaders
        yielding float32 arrays ``[out, in]`` (vectors ``[n]``); ``shapes`` is known
        without loading.

    Raises:
        ModelFormatError: missing/invalid files, truncated safetensors, a missing tensor,
            a wrong shape, an unexpected tensor in the decoder, or an untied config
            without ``lm_head.weight`` (the message names the file and the tensor).
        UnsupportedModelError: unknown ``model_type``, quantized checkpoints, or
            dtypes other than F32/F16/BF16/F64.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelFormatError(f"{folder}: not a folder (expected a HF model folder)")
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelFormatError(f"{folder}: no config.json (expected a HF model folder)")
    cfg_dict = _read_json(cfg_path)
    if not isinstance(cfg_dict, dict):
        raise ModelFormatError(f"{cfg_path}: expected a JSON object")
    if cfg_dict.get("quantization_config"):
        qm = cfg_dict["quantization_config"].get("quant_method", "?")
        raise UnsupportedModelError(
            f"{cfg_path}: a {qm}-quantized checkpoint; import it with the converter "
            f"(edgeinfer convert), read_hf_folder reads full-precision checkpoints"
        )

    # ---- tokenizer files ---------------------------------------------------------------
    tok_path = folder / "tokenizer.json"
    if not tok_path.exists():
        raise ModelFormatError(f"{folder}: no tokenizer.json (edgeinfer needs the fast-"
                               f"tokenizer file; a SentencePiece tokenizer.model alone is "
                               f"not read)")
    tokenizer_json = tok_path.read_text(encoding="utf-8")
    try:
        tok = json.loads(tokenizer_json)
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{tok_path}: invalid JSON ({e})") from e
    tcfg_path = folder / "tokenizer_config.json"
    tcfg = _read_json(tcfg_path) if tcfg_path.exists() else {}
    chat_template = None
    if (folder / "chat_template.jinja").exists():
        chat_template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").exists():
        chat_template = _pick_template(_read_json(folder / "chat_template.json").get("chat_template"))
    if chat_template is None:
        chat_template = _pick_template(tcfg.get("chat_template"))
    bos_token = _token_str(tcfg.get("bos_token"))
    eos_token = _token_str(tcfg.get("eos_token"))
    if bos_token is None:
        bos_token = _token_text(tok, cfg_dict.get("bos_token_id"))
    if eos_token is None:
        e = cfg_dict.get("eos_token_id")
        eos_token = _token_text(tok, e[0] if isinstance(e, list) and e else e)
    if "add_bos_token" in tcfg:
        add_bos = bool(tcfg["add_bos_token"])
    else:
        add_bos = _infer_add_bos(tok, bos_token)

    # ---- generation config + EOS union (C06) -------------------------------------------
    gen_path = folder / "generation_config.json"
    generation: dict = _read_json(gen_path) if gen_path.exists() else {}
    extra_eos: list[int] = []
    ge = generation.get("eos_token_id")
    if ge is not None:
        extra_eos += [ge] if isinstance(ge, int) else [int(x) for x in ge]
        generation["eos_token_id"] = list(extra_eos)
    tid = _token_id(tok, eos_token)
    if tid is not None:
        extra_eos.append(tid)
    config = config_from_dict(cfg_dict, str(cfg_path), extra_eos=extra_eos)

    # ---- tensors -------------------------------------------------------------------------
    where = _open_shards(folder)
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    origin: dict[str, str] = {}
    for name, f in where.items():
        canon = _canonical(name)
        if canon is None:
            continue
        if canon in loaders:
            raise ModelFormatError(f"{f.path}: tensor {canon!r} appears twice (also as "
                                   f"{origin[canon]!r})")
        loaders[canon] = (lambda f=f, n=name: f.load(n))
        shapes[canon] = f.meta[name][1]
        origin[canon] = name
    dtypes: dict[str, int] = {}
    for name, f in where.items():
        dtypes[f.meta[name][0]] = dtypes.get(f.meta[name][0], 0) + 1
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

    expected = {s.name for s in tensor_specs(config)}
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
        provenance={"files": sorted({str(f.path.name) for f in where.values()}),
                    "dtypes": dtypes},
    )
    src.validate()
    return src
