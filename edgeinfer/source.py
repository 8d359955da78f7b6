"""The in-memory model description every reader produces.

A :class:`ModelSource` is what a HF folder, a GGUF file or an ``.eif`` file becomes:
config, named tensors (canonical HF names, float32 arrays or
:class:`~edgeinfer.backends.quantized.QuantizedTensor`), tokenizer, chat template and
generation settings. The runtime and the converter consume only this type.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backends.quantized import QuantizedTensor
from .errors import ModelFormatError
from .models.arch import TensorSpec, tensor_specs
from .models.config import ModelConfig

#: Elements per chunk of the finite-value check (bounds its temporary to 1 MiB of bools).
FINITE_CHECK_CHUNK = 1 << 20
_LAYER_PREFIX = "model.layers."


def layer_indices(names: Iterable[str], prefix: str = _LAYER_PREFIX) -> set[int]:
    """The layer numbers ``i`` of names ``{prefix}{i}.…`` (``model.layers.3.mlp…`` -> 3)."""
    out: set[int] = set()
    for n in names:
        if n.startswith(prefix):
            head = n[len(prefix):].split(".", 1)[0]
            if head.isdigit() and len(head) < 10:
                out.add(int(head))
    return out


def check_layer_count(n_layers: int, names: Iterable[str], where: str, field: str,
                      prefix: str = _LAYER_PREFIX) -> None:
    """Refuse a layer count the tensors do not back, before anything per layer is built.

    A config claiming 10^9 layers would otherwise be expanded into 10^9 x 16 tensor specs
    (or a 10^9-entry layer list) before the first missing tensor is noticed. This costs
    one pass over the tensor names.

    Raises:
        ModelFormatError: some layer below ``n_layers`` has no tensor at all (naming it).
    """
    have = layer_indices(names, prefix)
    if n_layers > len(have):
        missing = next(i for i in range(len(have) + 1) if i not in have)
        raise ModelFormatError(
            f"{where}: {field} = {n_layers} layers, but the file has tensors for {len(have)} "
            f"(none for layer {missing}: no '{prefix}{missing}.*'); the config and the weights "
            f"disagree")


def expected_specs(config: ModelConfig, names: Iterable[str], where: str) -> list[TensorSpec]:
    """``tensor_specs(config)`` once the layer count is backed by ``names`` (see
    :func:`check_layer_count`)."""
    check_layer_count(config.num_hidden_layers, names, where, "num_hidden_layers")
    return tensor_specs(config)


def first_nonfinite(a: np.ndarray) -> tuple[int, int] | None:
    """``(count, first flat index)`` of the NaN/inf values of a float array, or None.

    One read pass in chunks of :data:`FINITE_CHECK_CHUNK` elements (temporary memory
    bounded by the chunk, whatever the tensor's size).
    """
    if a.dtype.kind != "f" or a.size == 0:
        return None
    flat = a.reshape(-1)
    count, first = 0, -1
    for i in range(0, flat.size, FINITE_CHECK_CHUNK):
        ok = np.isfinite(flat[i:i + FINITE_CHECK_CHUNK])
        if not ok.all():
            bad = np.flatnonzero(~ok)
            if first < 0:
                first = i + int(bad[0])
            count += int(bad.size)
    return (count, first) if count else None


def check_finite(a: np.ndarray, name: str, where: str) -> np.ndarray:
    """``a`` itself, after :func:`first_nonfinite` found no NaN/inf in it.

    Raises:
        ModelFormatError: naming the file, the tensor, the count and the first position.
    """
    bad = first_nonfinite(a)
    if bad is not None:
        pos = tuple(int(x) for x in np.unravel_index(bad[1], a.shape))
        raise ModelFormatError(
            f"{where}: tensor {name!r} holds {bad[0]} non-finite values (NaN/inf; first at "
            f"{pos}); the weights are corrupt: re-download or re-convert the model")
    return a


def finite_loader(loader: Callable[[], np.ndarray], name: str, where: str) -> Callable[[], np.ndarray]:
    """A loader returning ``check_finite(loader(), name, where)``."""
    return lambda: check_finite(loader(), name, where)


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


class _Overlay(Mapping):
    """``base`` with the names of ``loaders`` loaded from them instead."""

    def __init__(self, base: Mapping[str, Any], loaders: Mapping[str, Callable[[], Any]]):
        self._base, self._loaders = base, loaders

    def __getitem__(self, name: str) -> Any:
        if name in self._loaders:
            return self._loaders[name]()
        return self._base[name]

    def __iter__(self):
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)

    def __contains__(self, name: object) -> bool:
        return name in self._base


def _dequantized(loader: Callable[[], Any]) -> Callable[[], Any]:
    def load():
        t = loader()
        return t.dequantize() if isinstance(t, QuantizedTensor) else t
    return load


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
        row_tables: canonical name -> loader of a
            :class:`~edgeinfer.backends.blockrows.BlockRows` table holding the same values
            as ``tensors[name]`` in the file's own blocks (a GGUF's untied embedding), for
            backends that decode rows on lookup (:meth:`runtime_tensors`).
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
    row_tables: Mapping[str, Callable[[], Any]] = field(default_factory=dict)

    def runtime_tensors(self, backend) -> Mapping[str, Any]:
        """``tensors`` as ``backend`` runs them: with each of :attr:`row_tables` in place of
        its tensor when the backend reads block rows (``reads_block_rows``)."""
        if not self.row_tables or not getattr(backend, "reads_block_rows", False):
            return self.tensors
        return _Overlay(self.tensors, self.row_tables)

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

    def float32(self) -> "ModelSource":
        """This model with every quantized tensor dequantized to float32 on access (what a
        converter re-quantizes from); ``self`` when nothing is quantized lazily."""
        from dataclasses import replace

        loaders = getattr(self.tensors, "_loaders", None)
        if loaders is None:
            return self
        return replace(self, tensors=LazyTensors({k: _dequantized(f) for k, f in loaders.items()}))

    def validate(self) -> None:
        """Strict check: every tensor the architecture needs is present with its shape.

        Raises:
            ModelFormatError: naming the file, the tensor and the expected shape; a layer
                count the tensors do not back is refused before the specs are expanded.
        """
        for spec in expected_specs(self.config, self.shapes, self.path):
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
