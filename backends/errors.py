"""Errors raised by backends (``edgeinfer.errors`` builds its public types on these;
backends cannot import upward)."""
from __future__ import annotations


class BackendUnavailableError(RuntimeError):
    """A backend or device cannot be used on this machine (no platform, bad device
    index, a missing capability). The message names the problem and the fix."""
