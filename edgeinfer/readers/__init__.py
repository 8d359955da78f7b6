"""Model readers: every on-disk format becomes a :class:`~edgeinfer.source.ModelSource`.

* a folder with ``config.json``      -> :func:`edgeinfer.readers.hf.read_hf_folder`
* a file starting with ``GGUF``      -> :func:`edgeinfer.readers.gguf.read_gguf`
* an ``.eif`` file                   -> :func:`edgeinfer.container.read_eif`

Readers map every tensor onto the canonical Hugging Face names of
:mod:`edgeinfer.models.arch`, in HF orientation (``[out, in]``) and HF conventions
(rotate-half RoPE layout of Q/K rows, Gemma's ``(1 + w)`` norm weights), as float32,
loaded lazily. Anything malformed raises :class:`~edgeinfer.errors.ModelFormatError`
naming the file; a readable but unsupported architecture raises
:class:`~edgeinfer.errors.UnsupportedModelError`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import ModelFormatError, UnsupportedModelError
from ..models.config import SUPPORTED_MODEL_TYPES, ConfigError, ModelConfig, UnsupportedConfigError
from ..source import ModelSource

__all__ = ["config_from_dict", "read_gguf", "read_hf_folder", "read_model"]

GGUF_MAGIC = b"GGUF"


def read_model(path: str | os.PathLike) -> ModelSource:
    """Read a model from a HF folder, a ``.gguf`` file or an ``.eif`` container.

    Dispatch is on content, not on the name: a directory is read as a HF folder,
    a file whose first four bytes are ``GGUF`` as GGUF, a file named ``*.eif`` as
    edgeinfer's own container (through ``edgeinfer.container.read_eif``).

    Returns:
        A validated :class:`ModelSource` with lazily loaded tensors (float32, or
        :class:`~edgeinfer.backends.quantized.QuantizedTensor` for an ``.eif``'s quantized
        weights and a GGUF's native block types).

    Raises:
        ModelFormatError: the path does not exist, is not a folder or regular file, is
            empty, truncated, or is not one of the formats above (the message names the
            path and what was expected).
        UnsupportedModelError: readable, but the architecture is not supported.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFormatError(f"{p}: no such file or folder (expected a HF model folder, "
                               f"a .gguf file or an .eif file)")
    if p.is_dir():
        from .hf import read_hf_folder

        return read_hf_folder(p)
    if not p.is_file():
        raise ModelFormatError(f"{p}: not a regular file (a device, pipe or socket); expected a "
                               f"HF model folder, a .gguf file or an .eif file")
    try:
        with open(p, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelFormatError(f"{p}: cannot read ({e})") from e
    if head[:4] == GGUF_MAGIC:
        from .gguf import read_gguf

        return read_gguf(p)
    if p.suffix.lower() == ".eif":
        try:
            from ..container import read_eif
        except ImportError as e:
            raise ModelFormatError(f"{p}: .eif support is not available in this install ({e})") from e
        return read_eif(p)
    if p.suffix.lower() == ".gguf":
        raise ModelFormatError(f"{p}: named .gguf but does not start with the GGUF magic "
                               f"(first bytes {head[:4]!r}); the file is damaged or not GGUF")
    if p.name == "config.json" or p.suffix.lower() == ".safetensors":
        raise ModelFormatError(f"{p}: pass the folder that holds config.json and the "
                               f"safetensors files, not a single file")
    raise ModelFormatError(
        f"{p}: unrecognised model file (first bytes {head[:4]!r}); expected a HF model folder "
        f"(config.json + *.safetensors), a GGUF file or an .eif file"
    )


def read_hf_folder(path: str | os.PathLike) -> ModelSource:
    """See :func:`edgeinfer.readers.hf.read_hf_folder`."""
    from .hf import read_hf_folder as _read

    return _read(path)


def read_gguf(path: str | os.PathLike, native: bool = True) -> ModelSource:
    """See :func:`edgeinfer.readers.gguf.read_gguf`."""
    from .gguf import read_gguf as _read

    return _read(path, native=native)


def config_from_dict(d: dict[str, Any], where: str, extra_eos: list[int] | None = None) -> ModelConfig:
    """``ModelConfig.from_hf_dict`` with reader-grade errors.

    Args:
        d: HF-style config dict.
        where: the file it came from (named in errors).
        extra_eos: more EOS ids (generation config, tokenizer).

    Raises:
        UnsupportedModelError: the ``model_type`` (or the RoPE scaling) is not one
            edgeinfer implements.
        ModelFormatError: a required key is missing, a value has the wrong type or range
            (``num_key_value_heads`` 0, ``rope_theta`` <= 0, NaN ``rms_norm_eps`` ...), or
            sizes are inconsistent.
    """
    if not isinstance(d, dict):
        raise ModelFormatError(f"{where}: expected a JSON object, found a {type(d).__name__}")
    mt = d.get("model_type")
    if isinstance(d.get("text_config"), dict) and "hidden_size" not in d:
        mt = d["text_config"].get("model_type", mt)
    if isinstance(mt, str) and mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{where}: model_type {mt!r} is not supported; edgeinfer supports "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    try:
        return ModelConfig.from_hf_dict(d, extra_eos=extra_eos)
    except UnsupportedConfigError as e:
        raise UnsupportedModelError(f"{where}: {e}") from None
    except ConfigError as e:
        raise ModelFormatError(f"{where}: {e}; fix the config or re-download the model") from None
