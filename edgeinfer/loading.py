"""What a :class:`edgeinfer.api.Model` is built from: the backend choice, the weights'
size on a backend, the tokenizer; and :func:`load`, a model by path or catalog name."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import EdgeInferError, ModelFormatError
from .source import ModelSource
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .api import Model

log = logging.getLogger("edgeinfer")


def source_weight_bytes(source: ModelSource, backend: str) -> int:
    """Bytes the weights will take on ``backend``, from shapes alone (nothing is loaded).

    An ``.eif`` file's quantized tensors keep their packed size (the reference backend
    dequantizes them to float32), so do a GGUF's natively re-laid block types; other
    HF/GGUF tensors are held as float32.
    """

    if source.format == "eif" and backend != "reference":
        # the container maps the file: reading nbytes touches no weight data
        return int(sum(int(t.nbytes) for t in source.tensors.values()))
    native = (source.provenance or {}).get("native_weight_bytes")
    if source.format == "gguf" and backend != "reference" and isinstance(native, int):
        return native  # the re-laid block types (edgeinfer.readers.gguf_blocks)
    return int(sum(4 * int(np.prod(shape)) for shape in source.shapes.values()))


def default_backend() -> str:
    """The CPU (Numba) backend when it can be imported, else the numpy reference."""
    try:
        import edgeinfer.backends.cpu  # noqa: F401
        return "cpu"
    except ImportError as e:  # numba missing or broken: still usable, slowly
        log.warning("CPU backend unavailable (%s); using the reference backend", e)
        return "reference"


def tokenizer_for(source: ModelSource) -> Tokenizer:
    """Build the runtime tokenizer of a model source.

    Raises:
        ModelFormatError: ``tokenizers`` cannot build the tokenizer (the readers check the
            file's structure first; this catches what only the library itself refuses),
            naming the model file.
    """
    try:
        return Tokenizer.from_json_text(
            source.tokenizer_json,
            bos_token=source.bos_token,
            eos_token=source.eos_token,
            add_bos_token=source.add_bos_token,
            chat_template=source.chat_template,
            extra_eos_ids=tuple(source.config.eos_token_ids),
        )
    except ValueError as e:
        if isinstance(e, EdgeInferError):
            raise
        raise ModelFormatError(f"{source.path}: the tokenizer cannot be loaded ({e}); "
                               f"re-download the model or re-convert it") from None


def load(path_or_name: str | Path, *, converter=None,
         progress: bool = False, notify=None, warm: bool = False, **kw) -> Model:
    """Load a model by path (HF folder, .gguf, .eif) or catalog name.

    A catalog name runs as the GGUF it pulls, at its own quality (its block types re-laid
    natively, no float32 copy). ``NAME:int4`` is the RTN INT4 ``.eif``: the cached one, or
    one made now by ``converter`` (:func:`edgeinfer.catalog.prepare`); the converter is
    passed in because it is the layer above the runtime (``edgeinfer.quant``), which the
    runtime never imports.

    >>> model = edgeinfer.load("smollm2-135m-instruct")             # doctest: +SKIP
    >>> from edgeinfer.quant.convert import convert                # doctest: +SKIP
    >>> int4 = edgeinfer.load("smollm2-135m-instruct:int4", converter=convert)  # doctest: +SKIP

    Args:
        path_or_name: a path or a catalog name (``smollm2-135m-instruct`` ...).
        converter: ``edgeinfer.quant.convert.convert`` (or a compatible callable) to make
            ``NAME:int4`` on first use; None uses a cached one only.
        progress: progress bars on stderr while a first use downloads or converts
            (default off: the API writes nothing to the terminal).
        notify: ``callable(str)`` for first-use status lines (they also go to the
            ``edgeinfer`` logger at INFO), e.g. to show them in an app's window.
        warm: run :meth:`Model.warm_up` before returning, so the first answer does not
            stall (on a fresh install: compiles the CPU kernels, about 30-90 s once; else about
            a second); ``notify`` is told when it starts and each of its stages.
        **kw: go to :class:`Model` (backend, n_ctx, kv_dtype, threads, device, max_memory).

    Raises:
        edgeinfer.errors.ModelFormatError: unreadable or inconsistent model.
        edgeinfer.errors.CatalogError: an unknown name, or a pull that failed.
    """
    from .api import Model  # the module above this one (it re-exports load)
    from .catalog import read_resolved, resolve_model

    path = resolve_model(str(path_or_name), progress=progress, converter=converter,
                         notify=notify)
    model = Model(read_resolved(path), **kw)
    if warm:
        say = notify or (lambda msg: None)
        if model.kernels_cold:
            say("compiling the CPU kernels (first run only, about 30-90 s on 2 cores; cached "
                "for later runs)")
        model.warm_up(progress=lambda stage: say(f"warming up: {stage}"))
    return model
