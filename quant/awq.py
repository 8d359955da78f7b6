"""AWQ: activation-aware weight quantization with scales folded into the previous op.

Lin, Tang, Tang, Yang, Chen, Wang, Xiao, Dang, Gan, Han, "AWQ: Activation-aware Weight
Quantization for On-Device LLM Compression and Acceleration", MLSys 2024.

Per scale group (a previous op feeding one or more linears that share an input):

1. **Scale search** (§3.2, AutoAWQ ``_search_best_scale``): with ``a = mean|x|`` per
   input channel, try ``s = a^α`` for α on a 20-point grid in [0, 1), normalize
   ``s /= sqrt(max(s)·min(s))``, and keep the α minimizing the MSE between the group's
   float output ``x Wᵀ`` and ``x (Q(W·diag s)/s)ᵀ`` (α = 0 is plain RTN, so the search never
   does worse than RTN on its own objective). Deviation from AutoAWQ, documented: the
   objective is the stacked linear outputs of the group (e.g. q|k|v), not the whole
   attention/MLP block output.
2. **Clip search** (AutoAWQ ``_search_best_clip``): per output row and group, shrink the
   max-abs range by (1 − i/20), i = 0..9, keeping the shrink with the lowest per-group
   partial-output MSE on 512 sampled tokens. Skipped for q/k (their errors are amplified
   by the attention softmax; AutoAWQ skips them too).
3. **Fold**: the linears' input columns are multiplied by ``s`` and the previous op is
   divided by ``s`` (RMSNorm weight ``w / s``, or ``(1 + w)/s − 1`` for Gemma's (1 + w)
   norms; the rows (and bias) of a previous linear), so the runtime pays nothing.

The architecture knowledge (which op feeds which linears) is data: :data:`AWQ_SCALE_GROUPS`,
as mlx-lm's ``AWQ_MODEL_CONFIGS``. The v_proj → o_proj group needs ``v`` rows to map 1:1 on
``o`` columns, i.e. ``num_key_value_heads == num_attention_heads``; with GQA it is skipped
(as AutoAWQ does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..models.config import ModelConfig
from .rtn import fake_quantize, quantize_rtn, resolve_group


@dataclass(frozen=True)
class ScaleGroup:
    """``prev`` op (short layer-tensor name) feeding ``linears`` whose shared input was
    captured under ``capture`` (a key of ``decoder_layer``'s ``capture``)."""

    prev: str
    linears: tuple[str, ...]
    capture: str
    when: Callable[[ModelConfig], bool] = lambda c: True


_LLAMA = (
    ScaleGroup("input_layernorm", ("q_proj", "k_proj", "v_proj"), "q_proj"),
    ScaleGroup("v_proj", ("o_proj",), "o_proj",
               when=lambda c: c.num_key_value_heads == c.num_attention_heads),
    ScaleGroup("post_attention_layernorm", ("gate_proj", "up_proj"), "gate_proj"),
    ScaleGroup("up_proj", ("down_proj",), "down_proj"),
)
_GEMMA3 = (
    ScaleGroup("input_layernorm", ("q_proj", "k_proj", "v_proj"), "q_proj"),
    ScaleGroup("v_proj", ("o_proj",), "o_proj",
               when=lambda c: c.num_key_value_heads == c.num_attention_heads),
    ScaleGroup("pre_feedforward_layernorm", ("gate_proj", "up_proj"), "gate_proj"),
    ScaleGroup("up_proj", ("down_proj",), "down_proj"),
)
#: architecture family -> scale groups, in the order they are searched and folded.
AWQ_SCALE_GROUPS: dict[str, tuple[ScaleGroup, ...]] = {
    "llama": _LLAMA, "qwen2": _LLAMA, "gemma3": _GEMMA3,
}
#: linears whose clip range is not searched (attention logits amplify their error).
NO_CLIP = ("q_proj", "k_proj")
_BIAS = {"q_proj": "q_bias", "k_proj": "k_bias", "v_proj": "v_bias"}


def search_scale(x: np.ndarray, act_mean: np.ndarray, w: np.ndarray, bits: int = 4,
                 group_size: int = 128, symmetric: bool = False,
                 n_grid: int = 20) -> tuple[np.ndarray, float, list[float]]:
    """Grid-search AWQ's per-input-channel scale (paper §3.2).

    Args:
        x: float32 ``[n, in]`` calibration inputs of the group (a token sample).
        act_mean: float ``[in]`` mean |x| per channel over all calibration tokens.
        w: float ``[out, in]`` stacked weights of the linears sharing this input.
        bits, group_size, symmetric: the target format.
        n_grid: grid points α = i / n_grid, i = 0..n_grid-1.

    Returns:
        ``(s float64 [in], best α, losses per α)``; ``s`` is 1 when α = 0 wins.
    """
    x = np.asarray(x, np.float32)
    w64 = np.asarray(w, np.float64)
    ref = x @ w64.T.astype(np.float32)
    a = np.maximum(np.asarray(act_mean, np.float64), 1e-4)
    losses, best = [], (np.inf, 0.0, np.ones_like(a))
    for i in range(n_grid):
        alpha = i / n_grid
        s = np.maximum(a ** alpha, 1e-4)
        s = s / np.sqrt(s.max() * s.min())
        wq = fake_quantize(w64 * s, bits, group_size, symmetric) / s
        loss = float(np.mean((x @ wq.T.astype(np.float32) - ref) ** 2))
        losses.append(loss)
        if loss < best[0]:
            best = (loss, alpha, s)
    return best[2], best[1], losses


def search_clip(x: np.ndarray, w: np.ndarray, bits: int = 4, group_size: int = 128,
                symmetric: bool = False, n_grid: int = 20, max_shrink: float = 0.5,
                n_tokens: int = 512) -> np.ndarray:
    """Per (row, group) max-abs clip minimizing the group's partial output MSE (AutoAWQ).

    Args:
        x: float ``[n, in]`` inputs (already divided by the AWQ scale).
        w: float ``[out, in]`` weight (already multiplied by the AWQ scale).
        n_tokens: tokens sampled evenly from ``x``.

    Returns:
        float64 ``[out, n_groups]`` clip values (the original max-abs where no shrink helps),
        for :func:`~edgeinfer.quant.rtn.quantize_rtn`'s ``clip``.
    """
    w = np.asarray(w, np.float64)
    out, n_in = w.shape
    g, in_pad = resolve_group(n_in, group_size, bits)
    ng = in_pad // g
    step = max(1, x.shape[0] // n_tokens)
    sub = np.asarray(x, np.float32)[::step][:n_tokens]
    xs = np.zeros((sub.shape[0], in_pad), np.float32)  # padded columns see zero input
    xs[:, :n_in] = sub
    xg = xs.reshape(-1, ng, g).transpose(1, 0, 2)  # [G, n, g]
    wp = np.zeros((out, in_pad))
    wp[:, :n_in] = w
    wg = wp.reshape(out, ng, g)
    org_max = np.abs(wg).max(axis=-1)  # [out, G]
    ref = np.matmul(xg, wg.transpose(1, 2, 0).astype(np.float32))  # [G, n, out]
    best_err = np.full((out, ng), np.inf)
    best_clip = org_max.copy()
    for i in range(int(max_shrink * n_grid)):
        clip = org_max * (1.0 - i / n_grid)
        wq = fake_quantize(wp, bits, g, symmetric, clip=clip).reshape(out, ng, g)
        cur = np.matmul(xg, wq.transpose(1, 2, 0).astype(np.float32))
        err = np.mean((cur - ref) ** 2, axis=1).T  # [out, G]
        better = err < best_err
        best_err[better] = err[better]
        best_clip[better] = clip[better]
    return best_clip


def _fold_prev(lw: dict, prev: str, s: np.ndarray, cfg: ModelConfig) -> None:
    """Divide the previous op's output by ``s`` (in place on ``lw``'s float arrays)."""
    if prev.endswith("_proj"):  # a linear: scale its rows (and bias)
        lw[prev] = lw[prev] / s[:, None]
        b = _BIAS.get(prev)
        if b and b in lw:
            lw[b] = lw[b] / s
    elif cfg.norm_unit_offset:  # gemma (1 + w) RMSNorm: fold on (1 + w)
        lw[prev] = (1.0 + lw[prev].astype(np.float64)) / s - 1.0
    else:
        lw[prev] = lw[prev].astype(np.float64) / s


def fold_scale(cfg: ModelConfig, lw: dict, group: ScaleGroup, s: np.ndarray) -> None:
    """Fold a per-input-channel scale into a layer, in place: the group's linears get
    ``W·diag(s)`` and the previous op is divided by ``s``, so the float function of the
    layer is unchanged (paper §3.2: ``Q(W·s)(x/s)``, with x/s absorbed upstream).

    Args:
        cfg: config (``norm_unit_offset`` selects the (1 + w) fold).
        lw: short name -> float64 array of one layer (modified).
        group: the scale group.
        s: float64 ``[in]`` scale of the group's shared input.
    """
    _fold_prev(lw, group.prev, s, cfg)
    for n in group.linears:
        lw[n] = lw[n] * s


def awq_quantize_layer(cfg: ModelConfig, lw: dict, inputs: dict, *, bits: int = 4,
                       group_size: int = 128, symmetric: bool = False, n_grid: int = 20,
                       clip: bool = True) -> tuple[dict, dict]:
    """AWQ-quantize one decoder layer.

    Args:
        cfg: model config (selects :data:`AWQ_SCALE_GROUPS` and the (1 + w) fold).
        lw: short name -> float array of this layer (as :func:`upload_layer` names them);
            not modified.
        inputs: capture key -> ``(x_sample float32 [n, in], act_mean [in])`` from calibration.
        bits, group_size, symmetric: target format.
        n_grid: α grid size. clip: run the clip search.

    Returns:
        ``(new layer dict, info)``: linears become QuantizedTensor (method "awq"); folded
        norms float32; ``info`` maps each group to its chosen α.
    """
    lw = {k: np.asarray(v, np.float64) for k, v in lw.items()}
    xs = {k: (np.asarray(x, np.float32), np.asarray(m, np.float64)) for k, (x, m) in inputs.items()}
    info: dict[str, float] = {}
    for grp in AWQ_SCALE_GROUPS[cfg.arch]:
        if not grp.when(cfg) or grp.prev not in lw:
            continue
        x, am = xs[grp.capture]
        w = np.concatenate([lw[n] for n in grp.linears], axis=0)
        s, alpha, _ = search_scale(x, am, w, bits, group_size, symmetric, n_grid)
        info["+".join(grp.linears)] = alpha
        fold_scale(cfg, lw, grp, s)
        # the captured input of this group now sees x / s (AutoAWQ scales input_feat too)
        xs[grp.capture] = (x / s.astype(np.float32), am / s)
    out: dict = {}
    for k, v in lw.items():
        if k in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            cap = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(k, k)
            c = None
            if clip and k not in NO_CLIP:
                c = search_clip(xs[cap][0], v, bits, group_size, symmetric)
            out[k] = quantize_rtn(v, bits, group_size, symmetric, clip=c, method="awq", name=k)
        else:
            out[k] = v.astype(np.float32)
    return out, info
