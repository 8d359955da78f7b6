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
   attention/MLP block output. Cost (see :func:`search_scale`): exact Gram-matrix form when
   the token sample outnumbers the input width, float32 fake quantization, the loss averaged
   over at most 1024 evenly spaced output rows, a coarse-to-fine pass over the grid.
2. **Clip search** (AutoAWQ ``_search_best_clip``): per output row and group, shrink the
   max-abs range by (1 − i/20), i = 0..9, keeping the shrink with the lowest per-group
   partial-output MSE, computed exactly from per-group Gram matrices over the whole token
   sample (AutoAWQ: 512 sampled tokens). Skipped for q/k (their errors are amplified
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

from ..backends.quantized import SYMMETRIC_ZERO_4BIT
from ..models.config import ModelConfig
from .rtn import SCALE_EPS, effective_group, quantize_rtn, resolve_group


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


def fake_quantize32(w: np.ndarray, bits: int = 4, group_size: int = 128,
                    symmetric: bool = False, clip: np.ndarray | None = None) -> np.ndarray:
    """Float32 ``dequantize(quantize_rtn(w))`` for the searches (4-bit; same rules as
    :func:`~edgeinfer.quant.rtn.group_params`: range including 0, scales floored and rounded
    *up* to fp16, optional per-group max-abs ``clip``), about 3x faster than the float64 path.

    Args:
        w: float32 ``[out, in]``. clip: ``[out, n_groups]`` or None.

    Returns:
        float32 ``[out, in]``.
    """
    w = np.asarray(w, np.float32)
    out, n_in = w.shape
    g, in_pad = resolve_group(n_in, group_size, bits)
    if in_pad != n_in:
        w = np.concatenate([w, np.zeros((out, in_pad - n_in), np.float32)], axis=1)
    wg = w.reshape(out, in_pad // g, g)
    r = wg if clip is None else np.clip(wg, -clip[..., None], clip[..., None])
    if symmetric:
        s = 2.0 * np.abs(r).max(axis=-1) / 15.0
    else:
        lo, hi = np.minimum(r.min(axis=-1), 0.0), np.maximum(r.max(axis=-1), 0.0)
        s = (hi - lo) / 15.0
    s = np.maximum(s, np.float32(SCALE_EPS))
    with np.errstate(over="ignore"):
        s16 = s.astype(np.float16)
    if np.isfinite(s16).all():  # round up to the stored fp16 value (as round_scales_up)
        low = s16.astype(np.float32) < s
        s16[low] = np.nextafter(s16[low], np.float16(np.inf))
        s = s16.astype(np.float32)
    z = np.float32(SYMMETRIC_ZERO_4BIT) if symmetric else np.clip(np.round(-lo / s), 0, 15)
    s3 = s[..., None]
    z3 = z if symmetric else z[..., None]
    q = np.clip(np.round(wg / s3) + z3, 0, 15)
    return ((q - z3) * s3).reshape(out, in_pad)[:, :n_in]


def search_scale(x: np.ndarray, act_mean: np.ndarray, w: np.ndarray, bits: int = 4,
                 group_size: int = 128, symmetric: bool = False, n_grid: int = 20,
                 max_rows: int = 1024, max_direct_tokens: int = 512,
                 coarse_to_fine: bool = True) -> tuple[np.ndarray, float, list[float]]:
    """Grid-search AWQ's per-input-channel scale (paper §3.2).

    The loss of a candidate is the output MSE ``mean((x ΔWᵀ)²)`` with
    ``ΔW = Q(W·diag s)/s − W``. Cost control (exact where stated):

    * when the token sample is longer than the row is wide (``n > in``) the loss is computed
      exactly from the Gram matrix ``G = xᵀx``: ``Σ (ΔW G) ⊙ ΔW / n`` (``out·in²`` per
      candidate instead of ``n·in·out``);
    * otherwise on at most ``max_direct_tokens`` evenly spaced tokens of the sample;
    * the loss is averaged over at most ``max_rows`` evenly spaced output rows (α is shared
      by all rows, so this is an unbiased estimate of the same objective);
    * ``coarse_to_fine``: the even grid points first, then the two odd neighbours of the
      best one (12 of 20 evaluations; the same answer as the full grid whenever the loss
      is unimodal around its minimum, as it is in practice: tested).

    Args:
        x: float32 ``[n, in]`` calibration inputs of the group (a token sample).
        act_mean: float ``[in]`` mean |x| per channel over all calibration tokens.
        w: float ``[out, in]`` stacked weights of the linears sharing this input.
        bits, group_size, symmetric: the target format.
        n_grid: grid points α = i / n_grid, i = 0..n_grid-1.
        max_rows, max_direct_tokens, coarse_to_fine: the cost controls above.

    Returns:
        ``(s float64 [in], best α, losses per α)`` (NaN where not evaluated); ``s`` is 1
        when α = 0 wins.
    """
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float64)
    if w.shape[0] > max_rows:
        w = w[np.unique(np.linspace(0, w.shape[0] - 1, max_rows).round().astype(np.int64))]
    n, n_in = x.shape
    gram = n > n_in
    if gram:
        G = x.T @ x
    elif n > max_direct_tokens:
        x = x[np.linspace(0, n - 1, max_direct_tokens).round().astype(np.int64)]
    norm = float(x.shape[0] if not gram else n) * w.shape[0]
    a = np.maximum(np.asarray(act_mean, np.float64), 1e-4)
    w32 = w.astype(np.float32)

    def scale(i: int) -> np.ndarray:
        s = np.maximum(a ** (i / n_grid), 1e-4)
        return s / np.sqrt(s.max() * s.min())

    def loss(i: int) -> float:
        s = scale(i)
        dw = fake_quantize32((w * s).astype(np.float32), bits, group_size, symmetric)
        dw /= s.astype(np.float32)
        dw -= w32
        e = (dw @ G) * dw if gram else np.square(x @ dw.T)
        return float(np.sum(e, dtype=np.float64)) / norm

    losses = [float("nan")] * n_grid
    for i in range(0, n_grid, 2 if coarse_to_fine else 1):
        losses[i] = loss(i)
    if coarse_to_fine:  # refine: the odd neighbours of the best even point
        b = int(np.nanargmin(losses))
        for j in (b - 1, b + 1):
            if 0 <= j < n_grid and np.isnan(losses[j]):
                losses[j] = loss(j)
    i = int(np.nanargmin(losses))  # first minimum: ties go to the smaller α
    return scale(i), i / n_grid, losses


def search_clip(x: np.ndarray, w: np.ndarray, bits: int = 4, group_size: int = 128,
                symmetric: bool = False, n_grid: int = 20, max_shrink: float = 0.5
                ) -> np.ndarray:
    """Per (row, group) max-abs clip minimizing the group's partial output MSE (AutoAWQ).

    The error of a candidate on group ``j`` of row ``r`` is ``mean_t (x_tj · Δw_rj)²``,
    computed exactly from the per-group Gram matrices ``G_j = x_jᵀ x_j`` (``out·in·g`` per
    candidate, all tokens of the sample; AutoAWQ uses 512 sampled tokens directly).

    Args:
        x: float ``[n, in]`` inputs (already divided by the AWQ scale).
        w: float ``[out, in]`` weight (already multiplied by the AWQ scale).

    Returns:
        float64 ``[out, n_groups]`` clip values (the original max-abs where no shrink helps),
        for :func:`~edgeinfer.quant.rtn.quantize_rtn`'s ``clip``.
    """
    w = np.asarray(w, np.float64)
    out, n_in = w.shape
    g, in_pad = resolve_group(n_in, group_size, bits)
    ng = in_pad // g
    x = np.asarray(x, np.float32)
    xs = np.zeros((x.shape[0], in_pad), np.float32)  # padded columns see zero input
    xs[:, :n_in] = x
    xg = xs.reshape(-1, ng, g).transpose(1, 0, 2)  # [G, n, g]
    G = np.matmul(xg.transpose(0, 2, 1), xg)  # [G, g, g]
    wp = np.zeros((out, in_pad))
    wp[:, :n_in] = w
    org_max = np.abs(wp.reshape(out, ng, g)).max(axis=-1)  # [out, G]
    w32 = wp.astype(np.float32)
    best_err = np.full((out, ng), np.inf)
    best_clip = org_max.copy()
    for i in range(int(max_shrink * n_grid)):
        clip = org_max * (1.0 - i / n_grid)
        dw = (fake_quantize32(w32, bits, g, symmetric, clip.astype(np.float32)) - w32)
        dw = dw.reshape(out, ng, g).transpose(1, 0, 2)  # [G, out, g]
        err = np.sum(np.matmul(dw, G) * dw, axis=-1).T  # [out, G] (x n)
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
        g = effective_group(w.shape[1], group_size)
        s, alpha, _ = search_scale(x, am, w, bits, g, symmetric, n_grid)
        info["+".join(grp.linears)] = alpha
        fold_scale(cfg, lw, grp, s)
        # the captured input of this group now sees x / s (AutoAWQ scales input_feat too)
        xs[grp.capture] = (x / s.astype(np.float32), am / s)
    out: dict = {}
    for k, v in lw.items():
        if k in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            cap = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(k, k)
            c, g = None, effective_group(v.shape[1], group_size)
            if clip and k not in NO_CLIP:
                c = search_clip(xs[cap][0], v, bits, g, symmetric)
            out[k] = quantize_rtn(v, bits, g, symmetric, clip=c, method="awq", name=k)
        else:
            out[k] = v.astype(np.float32)
    return out, info
