"""Tensor specs of a config: which canonical tensors it needs, with their shapes.

Canonical tensor names are the Hugging Face checkpoint names (``model.layers.{i}...``) of
:data:`edgeinfer.models.families.LAYER_TENSORS`; every reader maps its own names onto
them and the transformer only asks for them. Loading is strict: every key present,
every shape checked, optional and tied tensors declared.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import ModelConfig
from .families import GLOBAL_TENSORS, LAYER_TENSORS, LINEAR_KEYS


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: canonical name, shape rule, and whether optional."""

    name: str
    shape: Callable[[ModelConfig], tuple[int, ...]]
    when: Callable[[ModelConfig], bool] = lambda c: True  # present for this config?
    linear: bool = False  # a [out, in] matmul weight (quantizable)


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor this config needs, with layer indices expanded."""
    out = [TensorSpec(t.name, t.shape, t.when, t.linear) for t in GLOBAL_TENSORS if t.when(cfg)]
    for i in range(cfg.num_hidden_layers):
        for t in LAYER_TENSORS:
            if t.when(cfg):
                out.append(TensorSpec(t.name.format(i=i), t.shape, t.when, t.linear))
    return out


_LINEAR_SUFFIXES = tuple(t.name.split("}.", 1)[1] for t in LAYER_TENSORS if t.short in LINEAR_KEYS)


def is_linear(name: str) -> bool:
    """Whether a canonical tensor name is a quantizable matmul weight."""
    return name.endswith(_LINEAR_SUFFIXES) or name == "lm_head.weight"
