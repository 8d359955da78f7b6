"""Split fused checkpoint tensors (a family's ``fused`` entries) into canonical ones.

Phi-3 stores ``self_attn.qkv_proj`` (q, k, v rows, in that order) and ``mlp.gate_up_proj``
(gate then up rows), as HF's ``Phi3Attention`` / ``Phi3MLP`` slice them; the runtime uses
the separate ``q_proj`` / ``k_proj`` / ``v_proj`` / ``gate_proj`` / ``up_proj``. Each part
loads the fused tensor and copies its rows, so nothing else changes downstream.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..backends.quantized import QuantizedTensor
from ..errors import ModelFormatError
from ..models.config import ModelConfig
from ..models.families import BY_MODEL_TYPE, LAYER


def _rows(t, a: int, b: int):
    """Rows ``a:b`` of a float array or a QuantizedTensor, as a new contiguous one."""
    if isinstance(t, QuantizedTensor):
        return t.take_rows(a, b)
    return np.ascontiguousarray(t[a:b])


def split_fused(config: ModelConfig, loaders: dict[str, Callable[[], np.ndarray]],
                shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Replace, in place, every fused tensor of ``config``'s family by its row blocks.

    Raises:
        ModelFormatError: a fused tensor of the wrong shape, or present beside one of its
            parts (the message names the file ``where`` and the tensor).
    """
    fam = BY_MODEL_TYPE.get(config.model_type)
    if fam is None or not fam.fused:
        return
    for ft in fam.fused:
        parts = [LAYER[p] for p in ft.parts]
        rows = [p.shape(config)[0] for p in parts]
        width = parts[0].shape(config)[1]
        for i in range(config.num_hidden_layers):
            name = ft.name.format(i=i)
            if name not in loaders:
                continue
            want = (sum(rows), width)
            if tuple(shapes[name]) != want:
                raise ModelFormatError(
                    f"{where}: tensor {name!r} has shape {tuple(shapes[name])}, expected "
                    f"{want} ({' + '.join(map(str, rows))} rows of {', '.join(ft.parts)}) "
                    f"for this config")
            fused = loaders.pop(name)
            del shapes[name]
            start = 0
            for p, n in zip(parts, rows):
                part = p.name.format(i=i)
                if part in loaders:
                    raise ModelFormatError(f"{where}: both {name!r} and {part!r} are present; "
                                           f"a checkpoint holds one or the other")
                loaders[part] = (lambda f=fused, a=start, b=start + n: _rows(f(), a, b))
                shapes[part] = (n, width)
                start += n
