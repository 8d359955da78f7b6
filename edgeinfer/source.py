"""The in-memory model description every reader produces.

A :class:`ModelSource` is what a HF folder, a GGUF file or an ``.eif`` file becomes:
config, named tensors (canonical HF names, float32 arrays or
:class:`~edgeinfer.backends.quantized.QuantizedTensor`), tokenizer, chat template and
generation settings. The runtime and the converter consume only this type.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backends.quantized import QuantizedTensor
from .errors import ModelFormatError
from .models.arch import tensor_specs
from .models.config import ModelConfig


class LazyTensors(Mapping):
    """A read-only mapping name -> tensor whose values are produced on first access.

    Readers use it so a converter can walk a model layer by layer without holding
    every float32 tensor at once. Values are not cached (call sites keep what they need).
    """

    def __init__(self, loaders: dict[str, Callable[[], Any]]):
        self._loaders = loaders

    def __getitem__(self, name: str):
        try:
            loader = self._loaders[name]
        except KeyError:
            raise KeyError(name) from None
        return loader()

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


@dataclass
class ModelSource:
    """A loaded (or lazily loadable) model.

    Attributes:
        path: the file or folder it came from.
        format: "hf", "gguf" or "eif".
        config: the architecture hyper-parameters.
        tensors: canonical name -> float32 ndarray or QuantizedTensor (may be lazy).
        shapes: canonical name -> logical shape, known without loading the data.
        tokenizer_json: the HF ``tokenizer.json`` text (also rebuilt for GGUF).
        chat_template: Jinja2 chat template or None.
        bos_token / eos_token: special-token strings from the tokenizer config.
        add_bos_token: whether plain-text prompts get a BOS prepended.
        generation: generation_config values (``eos_token_id`` list, sampling defaults).
        provenance: format-specific facts (sha256, quantization, converter settings).
        mapping: the read-only ``mmap`` the tensors view (``.eif``), or None.
    """

    path: str
    format: str
    config: ModelConfig
    tensors: Mapping[str, Any]
    shapes: dict[str, tuple[int, ...]]
    tokenizer_json: str
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False
    generation: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    mapping: Any = None

    def drop_resident_pages(self) -> None:
        """Give back the resident pages of the file mapping (``.eif``: ``mapping`` is its
        read-only ``mmap``) once a backend has copied what it needs.

        A backend that repacks every weight leaves the mapped pages it read resident and
        counted in RSS (Qwen2.5-0.5B: +469 MB, the whole file). ``MADV_DONTNEED`` on a
        read-only file mapping only unmaps them: a tensor still viewed is re-read from the
        page cache on its next access, so this is always safe. No-op where unsupported.
        """
        import mmap

        if self.mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                self.mapping.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):  # closed map or a platform refusing the advice
                pass

    def validate(self) -> None:
        """Strict check: every tensor the architecture needs is present with its shape.

        Raises:
            ModelFormatError: naming the file, the tensor and the expected shape.
        """
        for spec in tensor_specs(self.config):
            if spec.name not in self.shapes:
                raise ModelFormatError(
                    f"{self.path}: tensor {spec.name!r} is missing; a {self.config.model_type} "
                    f"model with this config needs it (expected shape {spec.shape(self.config)})"
                )
            want = tuple(spec.shape(self.config))
            got = tuple(self.shapes[spec.name])
            if got != want:
                raise ModelFormatError(
                    f"{self.path}: tensor {spec.name!r} has shape {got}, expected {want} "
                    f"from the config"
                )


def tensor_shape(t: Any) -> tuple[int, ...]:
    """Logical shape of a dense array or a QuantizedTensor."""
    return tuple(t.shape) if isinstance(t, (np.ndarray, QuantizedTensor)) else tuple(np.shape(t))
