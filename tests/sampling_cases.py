"""Random sampling inputs shared by test_sampling and test_sampling_kernels: logits that
stress each step (ties at the top-k / top-p boundaries, masked entries, magnitudes
near float64's limit, flat and sorted vectors) and random settings."""
from __future__ import annotations

import numpy as np

from edgeinfer.sampling import SamplingParams

KINDS = ("normal", "ties", "-inf", "huge", "flat", "ascending", "peaked")


def random_logits(g: np.random.Generator, vocab: int, kind: str, dtype=np.float64) -> np.ndarray:
    """Logits [vocab] of ``dtype`` of one of :data:`KINDS`."""
    x = g.normal(size=vocab) * g.choice([0.05, 1.0, 4.0, 30.0])
    if kind == "ties":       # few distinct values: ties at the top-k / top-p boundaries
        x = np.round(x / 4.0)
    elif kind == "-inf":     # masked entries (grammar / banned tokens)
        x[g.random(vocab) < 0.4] = -np.inf
        x[g.integers(vocab)] = 0.5
    elif kind == "huge":     # magnitudes float64 holds but float32 / float16 do not
        x = x * {np.float64: 1e300, np.float32: 1e30}.get(dtype, 1e2)
    elif kind == "flat":
        x[:] = 1.25
    elif kind == "ascending":  # the top-k heap's worst case: its quickselect fallback
        x = np.sort(np.round(x, 1))
    elif kind == "peaked":   # a few dominant ids: small nuclei, min-p cuts
        x[g.integers(vocab, size=3)] += 12.0
    return x.astype(dtype)


def random_params(g: np.random.Generator, vocab: int) -> SamplingParams:
    """Settings over every step's interesting values (off, edge, typical)."""
    return SamplingParams(
        temperature=float(g.choice([0.0, 0.25, 0.7, 0.8, 1.0, 1.7])),
        top_k=int(g.choice([0, 1, 2, 20, 40, vocab, vocab + 5])),
        top_p=float(g.choice([1.0, 0.95, 0.9, 0.8, 0.5, 0.05])),
        min_p=float(g.choice([0.0, 0.05, 0.1, 0.2, 1.0])),
        repetition_penalty=float(g.choice([1.0, 1.05, 1.1, 1.3, 0.9])),
        presence_penalty=float(g.choice([0.0, 0.0, 0.4, -0.3])),
        frequency_penalty=float(g.choice([0.0, 0.0, 0.25])),
        penalty_last_n=int(g.choice([-1, 0, 1, 3, 64])))


def candidates(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A filtered [V] vector as the Sampler's candidate set: ascending ids of its entries
    above -inf and their values."""
    ids = np.flatnonzero(x > -np.inf)
    return ids, x[ids]


def bits(a: np.ndarray) -> np.ndarray:
    """float64 values as their bit patterns (so that -0.0 != 0.0 and equality is exact)."""
    return np.ascontiguousarray(a, dtype=np.float64).view(np.int64)
