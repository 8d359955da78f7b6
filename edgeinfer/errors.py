"""Exception types raised at edgeinfer's public boundaries.

Each carries a message that names the problem and the fix; the CLI prints it as one
line. They subclass the builtin closest in meaning so callers may catch either.
"""
from __future__ import annotations

from .backends.errors import BackendUnavailableError as _BackendUnavailable


class EdgeInferError(Exception):
    """Base class of every error edgeinfer raises on purpose."""


class ModelFormatError(EdgeInferError, ValueError):
    """A model file or folder is missing, truncated, foreign, or inconsistent."""


class UnsupportedModelError(EdgeInferError, ValueError):
    """The checkpoint is readable but its architecture or a feature is not supported."""


class ContextOverflowError(EdgeInferError, ValueError):
    """A prompt does not fit in the context the memory budget allows."""


class MemoryBudgetError(EdgeInferError, MemoryError):
    """The model (or the requested context) does not fit in ``--max-memory``."""


class CatalogError(EdgeInferError, RuntimeError):
    """A catalog model could not be fetched or verified."""


class OutputError(EdgeInferError, OSError):
    """An output file cannot be written: it exists (no ``--force``), it is an input, a
    folder or not a regular file, or the folder is missing, read-only or full. ``errno``
    and ``filename`` are set as on the ``OSError`` behind it, where there is one."""

    def __init__(self, message: str, *, errno: int | None = None, filename: str | None = None):
        super().__init__(message)
        self.errno = errno
        self.filename = filename

    def __str__(self) -> str:
        return self.args[0]


class BackendUnavailableError(EdgeInferError, _BackendUnavailable):
    """The requested backend or device cannot be used on this machine."""


class GrammarError(EdgeInferError, ValueError):
    """A JSON schema or grammar for constrained output is invalid or cannot be used."""
