"""AWQ: activation-aware weight quantization with scales folded into the previous op.

Lin, Tang, Tang, Yang, Chen, Wang, Xiao, Dang, Gan, Han, "AWQ: Activation-aware Weight
Quantization for On-Device LLM Compression and Acceleration", MLSys 2024; reference
implementation AutoAWQ (``awq/quantize/quantizer.py``: ``_search_best_scale``,
``_search_best_clip``), read for the rules below, not copied.

Per decoder layer (:func:`awq_quantize_layer`), per scale group (a previous op feeding one
or more linears that share an input), in order:

1. **Scale search** (§3.2): with ``a = mean|x|`` per input channel and, by default,
   AutoAWQ's *duo scaling* (``w_mean`` = per-input-channel mean over rows of ``|w|`` divided
   by its group's max-abs, :func:`weight_mean`), try ``s = a^α / w_mean^(1−α)`` (or
   ``a^α`` alone with ``duo=False``) for α on a 20-point grid in [0, 1), normalize
   ``s /= sqrt(max(s)·min(s))``, keep the α whose ``Q(W·diag s)/s`` minimizes the
   objective. Objective: for gate|up, AutoAWQ's block output, the MLP output
   ``down(act(x Gᵀ) ⊙ x Uᵀ)`` with ``down`` in float, on 512 evenly strided tokens
   (:func:`mlp_objective`); for the other groups the MSE of the stacked linear outputs
   (AutoAWQ uses the attention block's output for q|k|v: a deviation, see below), exact from
   the Gram matrix when the sample outnumbers the input width, the loss averaged over at
   most 1024 evenly spaced rows, a coarse-to-fine pass over the grid (:func:`search_scale`).
2. **Fold**: the linears' input columns are multiplied by ``s`` and the previous op is
   divided by ``s`` (RMSNorm weight ``w / s``, or ``(1 + w)/s − 1`` for Gemma's (1 + w)
   norms; the rows (and bias) of a previous linear), so the runtime pays nothing.
3. **Clip search** (AutoAWQ ``_search_best_clip``, extended): per output row and group,
   the range is shrunk on the grid ``1 − i/20``, i = 0..9, keeping the candidate with the
   lowest per-group partial-output MSE, exact from per-group Gram matrices over the whole
   token sample (AutoAWQ: 512 sampled tokens). For the asymmetric format the lower and upper
   bounds shrink separately (:func:`search_clip_range`: the joint shrink, then one
   coordinate pass over each bound; AutoAWQ shrinks max-abs only, ``clip_range=False``).
   q/k are never clipped (attention logits amplify their error; AutoAWQ skips them too).
4. **Clip gate** (ours): a linear keeps its searched clip only if it lowers a whole-output
   objective: gate and up jointly on the MLP output (as in step 1), each other linear on its
   own full output (cross-group terms included). Why: the per-group objective cannot see
   errors that are small per group but *coherent* across groups and rows, such as on
   Qwen2.5's first token (the attention sink, no BOS), whose MLP output is huge: clipping
   gate/up there can multiply that token's error while lowering it elsewhere.

Deviations: q|k|v use the linear-output objective, not AutoAWQ's attention-block output
(no consistent gain, at several times the cost); no v→o group under GQA (AutoAWQ skips it
too).

The architecture knowledge (which op feeds which linears) is data: each family's
``awq_groups`` in :mod:`edgeinfer.models.families` (as mlx-lm's ``AWQ_MODEL_CONFIGS``). The v_proj → o_proj group needs ``v`` rows to map 1:1 on
``o`` columns, i.e. ``num_key_value_heads == num_attention_heads``; with GQA it is skipped
(as AutoAWQ does).
"""
from __future__ import annotations

import numpy as np

from ..backends.quantized import SYMMETRIC_ZERO_4BIT
from ..models.config import ModelConfig
from ..models.families import CAPTURE_GROUPS, FAMILIES, LINEAR_KEYS, ScaleGroup
from .rtn import SCALE_EPS, effective_group, quantize_rtn, resolve_group


#: architecture family -> scale groups, in the order they are searched and folded.
AWQ_SCALE_GROUPS: dict[str, tuple[ScaleGroup, ...]] = {f.name: f.awq_groups for f in FAMILIES}
#: linears whose clip range is not searched (attention logits amplify their error).
NO_CLIP = ("q_proj", "k_proj")
_BIAS = {"q_proj": "q_bias", "k_proj": "k_bias", "v_proj": "v_bias"}


def fake_quantize32(w: np.ndarray, bits: int = 4, group_size: int = 128,
                    symmetric: bool = False, clip: np.ndarray | None = None) -> np.ndarray:
    """Float32 ``dequantize(quantize_rtn(w))`` for the searches (4-bit; same rules as
    :func:`~edgeinfer.quant.rtn.group_params`: range including 0, scales floored and rounded
    *up* to fp16, optional per-group max-abs ``clip``), in float32 for speed.

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


def weight_mean(w: np.ndarray, group_size: int, bits: int = 4) -> np.ndarray:
    """AutoAWQ's per-input-channel weight salience for duo scaling: ``|w|`` divided by its
    group's max-abs (per row and group), averaged over the output rows.

    Args:
        w: ``[out, in]`` (stacked linears). Returns: float64 ``[in]``.
    """
    w = np.abs(np.asarray(w, np.float64))
    out, n_in = w.shape
    g, in_pad = resolve_group(n_in, group_size, bits)
    wp = np.zeros((out, in_pad))
    wp[:, :n_in] = w
    wg = wp.reshape(out, in_pad // g, g)
    wg = wg / np.maximum(wg.max(axis=-1, keepdims=True), 1e-12)
    return wg.reshape(out, in_pad)[:, :n_in].mean(axis=0)


def mlp_objective(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                  act: str = "silu", max_tokens: int = 512) -> Callable[[np.ndarray], float]:
    """Block objective of the gate|up scale group (AutoAWQ: ``module2inspect = mlp``): the
    MSE of the MLP output ``down(act(x Gᵀ) ⊙ x Uᵀ)`` with the candidate ``[G; U]`` and the
    float ``down``, on at most ``max_tokens`` evenly spaced tokens of ``x``.

    Returns:
        ``f(wq [2·inter, in]) -> loss``.
    """
    from ..backends.reference import ReferenceBackend

    glu = ReferenceBackend().glu
    x = np.asarray(x, np.float32)
    x = x[::max(1, -(-x.shape[0] // max_tokens))]
    gate, up = np.asarray(gate, np.float32), np.asarray(up, np.float32)
    dT = np.ascontiguousarray(np.asarray(down, np.float32).T)
    ref = glu(x @ gate.T, x @ up.T, act)
    n_g = gate.shape[0]

    def f(wq: np.ndarray) -> float:
        m = glu(x @ wq[:n_g].T, x @ wq[n_g:].T, act)
        m -= ref
        return float(np.mean(np.square(m @ dT), dtype=np.float64))
    return f


def search_scale(x: np.ndarray, act_mean: np.ndarray, w: np.ndarray, bits: int = 4,
                 group_size: int = 128, symmetric: bool = False, n_grid: int = 20,
                 max_rows: int = 1024, max_direct_tokens: int = 512,
                 coarse_to_fine: bool = True, duo: bool = False,
                 objective: Callable[[np.ndarray], float] | None = None
                 ) -> tuple[np.ndarray, float, list[float]]:
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
        duo: candidates ``a^α / w_mean^(1−α)`` (AutoAWQ's duo scaling; α = 0 is then not
            RTN) instead of ``a^α``.
        objective: ``f(Q(W·s)/s) -> loss`` replacing the linear-output MSE (a block
            objective such as :func:`mlp_objective`; ``x`` is then unused).

    Returns:
        ``(s float64 [in], best α, losses per α)`` (NaN where not evaluated); ``s`` is 1
        when α = 0 wins.
    """
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float64)
    a = np.maximum(np.asarray(act_mean, np.float64), 1e-4)
    wm = weight_mean(w, group_size, bits) if duo else None
    if objective is not None:
        w32 = w.astype(np.float32)
    if objective is None and w.shape[0] > max_rows:
        w = w[np.unique(np.linspace(0, w.shape[0] - 1, max_rows).round().astype(np.int64))]
    n, n_in = x.shape
    gram = objective is None and n > n_in
    if gram:
        G = x.T @ x
    elif objective is None and n > max_direct_tokens:
        x = x[np.linspace(0, n - 1, max_direct_tokens).round().astype(np.int64)]
    norm = float(x.shape[0] if not gram else n) * w.shape[0]
    w32 = w.astype(np.float32)

    def scale(i: int) -> np.ndarray:
        al = i / n_grid
        s = a ** al if wm is None else a ** al / (wm ** (1.0 - al) + 1e-4)
        s = np.maximum(s, 1e-4)
        return s / np.sqrt(s.max() * s.min())

    def loss(i: int) -> float:
        s = scale(i)
        dw = fake_quantize32((w * s).astype(np.float32), bits, group_size, symmetric)
        dw /= s.astype(np.float32)
        if objective is not None:
            return float(objective(dw))
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


def _group_err(x: np.ndarray, n_in: int, g: int, in_pad: int
               ) -> Callable[[np.ndarray], np.ndarray]:
    """``err(dw [out, in_pad]) -> [out, n_groups]``: per (row, group) partial-output squared
    error ``Σ_t (x_tj · Δw_rj)²``, exact from the per-group Gram matrices ``G_j = x_jᵀ x_j``
    (``out·in·g`` per candidate)."""
    ng = in_pad // g
    xs = np.zeros((x.shape[0], in_pad), np.float32)  # padded columns see zero input
    xs[:, :n_in] = np.asarray(x, np.float32)
    xg = xs.reshape(-1, ng, g).transpose(1, 0, 2)  # [G, n, g]
    G = np.matmul(xg.transpose(0, 2, 1), xg)  # [G, g, g]

    def err(dw: np.ndarray) -> np.ndarray:
        d = dw.reshape(dw.shape[0], ng, g).transpose(1, 0, 2)  # [G, out, g]
        return np.sum(np.matmul(d, G) * d, axis=-1).T
    return err


def search_clip(x: np.ndarray, w: np.ndarray, bits: int = 4, group_size: int = 128,
                symmetric: bool = False, n_grid: int = 20, max_shrink: float = 0.5) -> np.ndarray:
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
    group_err = _group_err(x, n_in, g, in_pad)
    wp = np.zeros((out, in_pad))
    wp[:, :n_in] = w
    org_max = np.abs(wp.reshape(out, ng, g)).max(axis=-1)  # [out, G]
    w32 = wp.astype(np.float32)
    best_err = np.full((out, ng), np.inf)
    best_clip = org_max.copy()
    for i in range(int(max_shrink * n_grid)):
        clip = org_max * (1.0 - i / n_grid)
        err = group_err(fake_quantize32(w32, bits, g, symmetric, clip.astype(np.float32)) - w32)
        better = err < best_err
        best_err[better] = err[better]
        best_clip[better] = clip[better]
    return best_clip


def search_clip_range(x: np.ndarray, w: np.ndarray, bits: int = 4, group_size: int = 128,
                      n_grid: int = 20, max_shrink: float = 0.5, rounds: int = 1
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Clip search with separate bounds for the asymmetric format: per (row, group) a lower
    bound ``f_lo·min(w, 0)`` and an upper bound ``f_hi·max(w, 0)``, the shrinks on the same
    grid as :func:`search_clip` (``1 − i/n_grid``, i < ``max_shrink·n_grid``), minimizing the
    same exact per-group partial-output MSE (Gram matrices). Search: the joint shrink
    ``f_lo = f_hi`` first (10 candidates), then ``rounds`` coordinate passes over ``f_lo``
    then ``f_hi`` (10 each; a group keeps its current pair unless a candidate lowers its
    error, so the result is never worse on this objective than the best joint shrink).
    The weights are clamped to the bounds (not saturated as the max-abs clip is), exactly as
    they are then stored (:func:`clamp_groups`). Cost: ``(1 + 2·rounds)`` times
    :func:`search_clip`'s.

    Args:
        x: float ``[n, in]`` inputs (already divided by the AWQ scale).
        w: float ``[out, in]`` weight (already multiplied by the AWQ scale).

    Returns:
        ``(lo [out, n_groups] ≤ 0, hi [out, n_groups] ≥ 0)`` float64: clamp each group to
        ``[lo, hi]`` before :func:`~edgeinfer.quant.rtn.quantize_rtn` (see :func:`clamp_groups`).
    """
    w = np.asarray(w, np.float64)
    out, n_in = w.shape
    g, in_pad = resolve_group(n_in, group_size, bits)
    ng = in_pad // g
    group_err = _group_err(x, n_in, g, in_pad)
    wp = np.zeros((out, in_pad), np.float32)
    wp[:, :n_in] = w
    wg = wp.reshape(out, ng, g)
    lo0, hi0 = np.minimum(wg.min(axis=-1), 0.0), np.maximum(wg.max(axis=-1), 0.0)
    fr = [1.0 - i / n_grid for i in range(int(max_shrink * n_grid))]

    def err(fl: np.ndarray, fh: np.ndarray) -> np.ndarray:
        lo, hi = (lo0 * fl)[..., None], (hi0 * fh)[..., None]
        wq = fake_quantize32(np.clip(wg, lo, hi).reshape(out, in_pad), bits, g, False)
        return group_err(wq - wp)  # [out, G]

    best_l, best_h = np.ones((out, ng)), np.ones((out, ng))
    best = np.full((out, ng), np.inf)

    def trial(fl, fh):
        nonlocal best
        e = err(fl, fh)
        m = e < best
        best = np.where(m, e, best)
        best_l[m] = np.broadcast_to(fl, m.shape)[m]
        best_h[m] = np.broadcast_to(fh, m.shape)[m]

    for f in fr:
        trial(np.full((out, ng), f), np.full((out, ng), f))
    for _ in range(rounds):
        for f in fr:
            trial(np.full((out, ng), f), best_h.copy())
        for f in fr:
            trial(best_l.copy(), np.full((out, ng), f))
    return lo0 * best_l, hi0 * best_h


def group_bounds(w: np.ndarray, group_size: int, bits: int = 4
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per (row, group) ``(min(w, 0), max(w, 0))`` (padding as in the quantizer)."""
    w = np.asarray(w, np.float64)
    out, n_in = w.shape
    g, in_pad = resolve_group(n_in, group_size, bits)
    wp = np.zeros((out, in_pad))
    wp[:, :n_in] = w
    wg = wp.reshape(out, in_pad // g, g)
    return np.minimum(wg.min(axis=-1), 0.0), np.maximum(wg.max(axis=-1), 0.0)


def linear_objective(x: np.ndarray, w: np.ndarray, max_tokens: int = 512
                     ) -> Callable[[np.ndarray], float]:
    """``f(wq) = mean((x wqᵀ − x wᵀ)²)`` on every ``⌈n / max_tokens⌉``-th token of ``x``."""
    x = np.asarray(x, np.float32)[::max(1, -(-x.shape[0] // max_tokens))]
    ref = x @ np.asarray(w, np.float32).T

    def f(wq: np.ndarray) -> float:
        return float(np.mean(np.square(x @ wq.T - ref), dtype=np.float64))
    return f


def clamp_groups(w: np.ndarray, lo: np.ndarray, hi: np.ndarray, group_size: int,
                 bits: int = 4) -> np.ndarray:
    """``w`` clamped per (row, group) to ``[lo, hi]`` (padding handled as in the quantizer);
    the asymmetric quantizer then takes exactly ``[lo, hi]`` as the group's range, and the
    codes equal those of the unclamped ``w`` quantized on that range (out-of-range weights
    saturate to the edge codes either way)."""
    w = np.asarray(w, np.float64)
    out, n_in = w.shape
    g, in_pad = resolve_group(n_in, group_size, bits)
    wp = np.zeros((out, in_pad))
    wp[:, :n_in] = w
    wg = np.clip(wp.reshape(out, in_pad // g, g), lo[..., None], hi[..., None])
    return wg.reshape(out, in_pad)[:, :n_in]


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
                       clip: bool = True, duo: bool = True, block: bool = True,
                       no_clip: tuple[str, ...] = NO_CLIP, clip_range: bool = True,
                       clip_gate: bool = True
                       ) -> tuple[dict, dict]:
    """AWQ-quantize one decoder layer (module docstring: steps 1-4).

    Args:
        cfg: model config (selects :data:`AWQ_SCALE_GROUPS` and the (1 + w) fold).
        lw: short name -> float array of this layer (as :func:`upload_layer` names them);
            not modified.
        inputs: capture key -> ``(x_sample float32 [n, in], act_mean [in])`` from calibration.
        bits, group_size, symmetric: target format.
        n_grid: α grid size. clip: run the clip search (at all).
        duo: AutoAWQ's duo scaling ``s = a^α / w_mean^(1−α)`` (else ``s = a^α``).
        block: gate|up's scale search on the MLP output (else the stacked linear outputs).
        no_clip: linears never clipped. clip_range: separate lower / upper clip bounds
            (asymmetric format only; else AutoAWQ's max-abs shrink).
        clip_gate: keep a linear's searched clip only when it lowers the whole output (MLP
            output for gate+up jointly, the linear's output otherwise).

    Returns:
        ``(new layer dict, info)``: linears become QuantizedTensor (method "awq"); folded
        norms float32; ``info`` maps each scale group to its chosen α and, with
        ``clip_gate``, ``"clip:<linears>"`` to 1.0 (clip kept) or 0.0 (dropped).
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
        obj = None
        if block and grp.linears == ("gate_proj", "up_proj") and "down_proj" in lw:
            obj = mlp_objective(x, lw["gate_proj"], lw["up_proj"], lw["down_proj"],
                                cfg.activation)
        s, alpha, _ = search_scale(x, am, w, bits, g, symmetric, n_grid, duo=duo,
                                   objective=obj)
        info["+".join(grp.linears)] = alpha
        fold_scale(cfg, lw, grp, s)
        # the captured input of this group now sees x / s (AutoAWQ scales input_feat too)
        xs[grp.capture] = (x / s.astype(np.float32), am / s)
    lin = [k for k in LINEAR_KEYS if k in lw]
    cap_of = {m: key for key, members in CAPTURE_GROUPS.items() for m in members}
    prop: dict = {}  # linear -> (clamped weight, max-abs clip): its searched clip
    for k in lin:
        if not clip or k in no_clip:
            continue
        v, g = lw[k], effective_group(lw[k].shape[1], group_size)
        x_c = xs[cap_of.get(k, k)][0]
        if clip_range and not symmetric:
            lo, hi = search_clip_range(x_c, v, bits, g)
            prop[k] = (clamp_groups(v, lo, hi, g, bits), None)
        else:  # saturating max-abs clip, as quantize_rtn / fake_quantize32 apply it
            prop[k] = (v, search_clip(x_c, v, bits, g, symmetric))
    if clip_gate and prop:  # keep a searched clip only if a whole-output objective agrees
        def fq(k: str, use: bool) -> np.ndarray:
            w, c = prop[k] if use else (lw[k], None)
            return fake_quantize32(np.asarray(w, np.float32), bits,
                                   effective_group(w.shape[1], group_size), symmetric,
                                   None if c is None else np.asarray(c, np.float32))
        act = cfg.activation
        glu = ("gate_proj", "up_proj")
        joint = all(k in prop for k in glu) and "down_proj" in lw
        for ks in ([glu] if joint else []) + [(k,) for k in prop if not (joint and k in glu)]:
            if ks == glu:
                f = mlp_objective(xs["gate_proj"][0], lw["gate_proj"], lw["up_proj"],
                                  lw["down_proj"], act)
            else:
                f = linear_objective(xs[cap_of.get(ks[0], ks[0])][0], lw[ks[0]])
            errs = [f(np.concatenate([fq(k, use) for k in ks], axis=0)) for use in (False, True)]
            keep = bool(errs[1] < errs[0])
            info["clip:" + "+".join(ks)] = float(keep)
            if not keep:
                for k in ks:
                    del prop[k]
    out: dict = {}
    for k, v in lw.items():
        if k in lin:
            w, c = prop.get(k, (v, None))
            out[k] = quantize_rtn(w, bits, effective_group(v.shape[1], group_size), symmetric,
                                  clip=c, method="awq", name=k)
        else:
            out[k] = v.astype(np.float32)
    return out, info
