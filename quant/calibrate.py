"""Calibration data and the layer-by-layer quantization driver.

Calibration text:
  * ``calib_path`` (plain text): tokenized once (no special tokens added; special-token
    strings in it, such as WikiText's "<unk>", are encoded as text) and cut into
    ``n_seq`` windows of ``seq_len`` tokens at seeded random offsets (GPTQ's recipe); with
    ``add_bos_token`` the first token of each window is replaced by BOS, like the model sees
    text at inference;
  * no file: *data-free* text the model generates itself, seeded multinomial sampling
    (temperature 1) from BOS through the reference backend, recorded in the provenance.
    Generation is token by token, so the default is smaller (8 x 128).

Driver (:func:`quantize_layers`), GPTQ's "sequential" mode:
  embed the calibration tokens; for each layer: load only that layer's float32 tensors
  (``source.tensors`` may be lazy), run it with ``capture`` to collect the inputs of its
  linear groups (GPTQ: Hessians accumulated on the fly; AWQ: per-channel mean |x| plus an
  evenly spaced token sample), quantize it, then run the *quantized* layer to produce the
  next layer's input, so later layers calibrate on the errors they will really see.
  Memory: one layer's weights + the activations ``[n_seq, seq_len, hidden]`` + capture
  statistics. Inside a layer the inputs of o_proj / down_proj come from the float layer
  (not from quantized q/k/v), a documented simplification; GPTQ by default instead runs
  GPTQ's true-sequential order in a single forward per layer (:mod:`.gptq_sequential`:
  each linear's Hessian from its input with the earlier linears quantized; all
  calibration rows in one call, so memory holds one layer's full activations). The layer
  forwards run on :class:`~.calib_backend.CalibrationBackend` (the reference ops, attention by BLAS
  matmuls), many sequences per call (:data:`CHUNK_TOKENS` rows per GEMM), the linears,
  row-wise ops, attention and Hessian products spread over worker threads (GPTQ); GPTQ's
  solves run on worker threads with one BLAS thread each. The lm_head is never run during
  calibration.

Cost (profiled with py-spy): with the searches vectorized (see :mod:`.awq`, :mod:`.gptq`)
the two forwards per layer dominate; ``n_seq x seq_len`` sets that cost linearly. The
benchmarks use 16 x 256 tokens (AWQ's paper, "data efficiency" (Fig. 8): 16 sequences
suffice for AWQ; GPTQ's paper uses 128 x 2048 tokens, more than these machines afford).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

import numpy as np

from ..backends.quantized import QuantizedTensor
from ..backends.reference import ReferenceBackend
from ..errors import ModelFormatError
from ..models.families import CAPTURE_GROUPS, LINEAR_KEYS, layer_tensor_names
from ..models.rope import rope_switch, rope_tables
from ..models.transformer import decoder_layer, upload_layer
from ..source import ModelSource
from .awq import awq_quantize_layer
from .calib_backend import CalibrationBackend
from .gptq import Hessian, gptq_quantize
from .grid import quantize_grid
from .mse import quantize_mse
from .rtn import effective_group, quantize_rtn
from .signmax import quantize_signmax

#: methods that read the weights only (no calibration ids, no forward passes)
DATA_FREE = ("rtn", "grid", "signmax")

log = logging.getLogger(__name__)


def _tokenizer(source: ModelSource):
    from tokenizers import Tokenizer

    if not source.tokenizer_json:
        raise ValueError(f"{source.path}: no tokenizer: cannot tokenize calibration text")
    return Tokenizer.from_str(source.tokenizer_json)


def _bos_id(source: ModelSource) -> int | None:
    if source.config.bos_token_id is not None:
        return int(source.config.bos_token_id)
    if source.bos_token and source.tokenizer_json:
        return _tokenizer(source).token_to_id(source.bos_token)
    return None


def calibration_ids(source: ModelSource, calib_path: str | None = None, n_seq: int | None = None,
                    seq_len: int | None = None, seed: int = 0,
                    progress: bool = False) -> tuple[np.ndarray, str]:
    """Calibration token windows and a one-line description for the provenance.

    Args:
        source: the model (tokenizer, config; the weights only for data-free generation).
        calib_path: plain-text file, or None for data-free self-generated text.
        n_seq, seq_len: window count and length (defaults 32 x 512 with a file, 8 x 128
            data-free); shortened when the text is too short.
        seed: RNG seed for window offsets / sampling.

    Returns:
        ``(ids int32 [n_seq, seq_len], description)``.

    Raises:
        ValueError: a file too short for even one window of 16 tokens.
    """
    rng = np.random.default_rng(seed)
    bos = _bos_id(source)
    if calib_path is not None:
        n_seq, seq_len = n_seq or 32, seq_len or 512
        with open(calib_path, encoding="utf-8") as f:
            text = f.read()
        tok = _tokenizer(source)
        tok.encode_special_tokens = True  # "<unk>" in the text is text, as in perplexity
        toks = np.asarray(tok.encode(text, add_special_tokens=False).ids, np.int32)
        if len(toks) < 16:
            raise ValueError(f"calibration file {calib_path} has only {len(toks)} tokens")
        seq_len = min(seq_len, len(toks))
        starts = rng.integers(0, len(toks) - seq_len + 1, size=n_seq)
        ids = np.stack([toks[s:s + seq_len] for s in starts])
        if source.add_bos_token and bos is not None:
            ids[:, 0] = bos
        return ids, (f"file {calib_path}: {n_seq} windows x {seq_len} tokens at random offsets "
                     f"(seed {seed}) of {len(toks)} tokens")
    n_seq, seq_len = n_seq or 8, seq_len or 128
    return _self_generated(source, n_seq, seq_len, rng, bos, progress), (
        f"data-free: {n_seq} sequences x {seq_len} tokens sampled by the model itself from BOS "
        f"(temperature 1, seed {seed})")


def random_ids(source: ModelSource, n_seq: int = 2, seq_len: int = 256,
               seed: int = 0) -> tuple[np.ndarray, str]:
    """Data-free input statistics: ``n_seq`` windows of ``seq_len`` uniformly random token
    ids (seeded; BOS first where the model adds one) and their provenance line. One
    prefill per window (no generation), for per-channel activation scales only.
    """
    cfg = source.config
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (n_seq, seq_len)).astype(np.int32)
    bos = _bos_id(source)
    if source.add_bos_token and bos is not None:
        ids[:, 0] = bos
    return ids, (f"data-free: {n_seq} x {seq_len} uniformly random token ids (seed {seed}) "
                 f"for per-channel input scales")


def _self_generated(source: ModelSource, n_seq: int, seq_len: int, rng: np.random.Generator,
                    bos: int | None, progress: bool) -> np.ndarray:
    from ..models.transformer import Transformer

    # the whole float model is materialized here anyway: check every tensor first
    tensors = {k: (check_finite(k, v) if not isinstance(v, QuantizedTensor) else v)
               for k, v in source.tensors.items()}
    model = Transformer(source.config, tensors, ReferenceBackend(), max_positions=seq_len + 1)
    start = bos if bos is not None else 0
    out = np.zeros((n_seq, seq_len), np.int32)
    # LongRoPE: the whole window with the factors of its length, as the layers see it below
    kw = {} if model.rope_switch is None else {"long_rope": model.long_rope(seq_len)}
    for j in range(n_seq):
        cache = model.new_cache(seq_len)
        tok = start
        out[j, 0] = tok
        for t in range(1, seq_len):
            logits = model.forward(np.array([tok]), cache, **kw)[0].astype(np.float64)
            p = np.exp(logits - logits.max())
            p /= p.sum()
            tok = int(rng.choice(len(p), p=p))
            out[j, t] = tok
    return out


def check_finite(name: str, a: np.ndarray) -> np.ndarray:
    """Return ``a`` as float32, or raise ModelFormatError naming a tensor with NaN/inf."""
    a = np.asarray(a, np.float32)
    if not np.isfinite(a).all():
        bad = int(np.size(a) - np.isfinite(a).sum())
        raise ModelFormatError(f"tensor {name!r} contains {bad} non-finite values (NaN/inf); "
                               f"the source checkpoint is damaged: re-download or re-export it")
    return a


def load_layer(source: ModelSource, i: int) -> dict[str, np.ndarray]:
    """Short name -> float32 array of layer ``i`` (only this layer is materialized)."""
    out = {}
    for short, name in layer_tensor_names(i).items():
        if name in source.tensors:
            out[short] = check_finite(name, source.tensors[name])
    return out


def split_rows(qt: QuantizedTensor, sizes: list[int]) -> list[QuantizedTensor]:
    """Split a row-stacked QuantizedTensor into consecutive row blocks."""
    out, r = [], 0
    for n in sizes:
        sl = slice(r, r + n)
        z = None if qt.zeros is None else np.ascontiguousarray(qt.zeros[sl])
        out.append(QuantizedTensor(np.ascontiguousarray(qt.qweight[sl]),
                                   np.ascontiguousarray(qt.scales[sl]), z, qt.bits,
                                   qt.group_size, qt.in_features, qt.method))
        r += n
    return out


#: Calibration tokens run through one layer call (a GEMM of this many rows).
CHUNK_TOKENS = 4096


def _solver_pool():
    """Worker threads with one BLAS thread each (:class:`~edgeinfer.backends.cpu.gemm.GemmPool`),
    one per core (at most 4: a layer has four independent GPTQ solves)."""
    from ..backends.cpu.gemm import GemmPool

    return GemmPool(min(4, os.cpu_count() or 1))


def _run_layer(be, cfg, tensors_short: dict, i: int, x: np.ndarray, rope,
               stats=None, per_chunk: bool = False) -> np.ndarray | None:
    """Run layer ``i`` on every calibration sequence x [N, L, D] and return its output; with
    ``stats``, only feed the captured linear inputs to ``stats(j, capture)`` (sequence
    ``j``'s rows; with ``per_chunk``, once per chunk: ``j`` its first sequence, the rows of
    all its sequences) (the layer's last projection is skipped) and return None.

    Sequences go through in chunks of ``CHUNK_TOKENS // L`` (one GEMM per linear per
    chunk, :class:`CalibrationBackend`'s batched attention); each sequence's values are
    those of running it alone up to BLAS blocking (the rows of a GEMM do not interact)."""
    names = layer_tensor_names(i)
    lw = upload_layer(be, {names[k]: v for k, v in tensors_short.items()}, i)
    n, L, D = x.shape
    per = max(1, CHUNK_TOKENS // L)
    y = np.empty_like(x) if stats is None else None
    cache = be.new_kv_cache(1, cfg.num_key_value_heads, cfg.head_dim, L)  # never written
    be.seq_len = L
    try:
        for j0 in range(0, n, per):
            j1 = min(n, j0 + per)
            pos = np.tile(np.arange(L, dtype=np.int32), j1 - j0)
            xs = x[j0:j1].reshape(-1, D)
            if stats is None:
                y[j0:j1] = decoder_layer(be, cfg, lw, xs, pos, rope, cache, 0, i).reshape(-1, L, D)
            else:
                cap: dict = {}
                decoder_layer(be, cfg, lw, xs, pos, rope, cache, 0, i, capture=cap,
                              capture_only=True)
                if per_chunk:
                    stats(j0, cap)
                    continue
                for j in range(j0, j1):
                    r = (j - j0) * L
                    stats(j, {k: a[r:r + L] for k, a in cap.items()})
    finally:
        be.seq_len = None
    return y


def quantize_layers(source: ModelSource, ids: np.ndarray | None, method: str, *, bits: int = 4,
                    group_size: int = 128, symmetric: bool = False, act_order: bool = False,
                    n_search: int = 2048, on_layer: Callable[[int], None] | None = None,
                    true_sequential: bool = True,
                    gptq_grid: str = "minmax", gptaq: bool = False) -> tuple[dict[str, Any], dict]:
    """Quantize every decoder layer of ``source`` (module docstring: sequential driver).

    Args:
        source: the float model (lazy tensors welcome).
        ids: int32 ``[n_seq, seq_len]`` calibration tokens (unused, may be None, for
            :data:`DATA_FREE` methods).
        method: "rtn", "grid" (:mod:`.grid`), "signmax" (:mod:`.signmax`), "awq", "gptq" or "mse" (:mod:`.mse`, the
            columns weighted by the mean squared input over ``ids``).
        bits, group_size, symmetric: the linear weights' format.
        act_order: GPTQ column order (see :mod:`.gptq`).
        n_search: AWQ token sample size for the scale/clip searches.
        on_layer: called after each layer (progress bars).
        true_sequential: GPTQ in one forward per layer, each group's Hessian from the
            inputs with the earlier groups quantized (:mod:`.gptq_sequential`); False:
            every Hessian from the float layer (a capture forward, then the quantized
            layer's forward).
        gptq_grid: GPTQ's group-parameter rule (:data:`.gptq.GRIDS`).
        gptaq: true-sequential GPTQ on the float model's layer outputs as targets
            (:func:`.gptq_sequential.asymmetric_target`; a float forward beside the
            quantized one).

    Returns:
        ``(canonical name -> QuantizedTensor / float32 array, info)``; ``info["awq_alpha"]``
        records AWQ's chosen α per layer and group.

    Raises:
        ModelFormatError: a non-finite weight (naming it). ValueError: unknown method;
        ``gptaq`` without true-sequential GPTQ.
    """
    if method not in ("rtn", "grid", "signmax", "awq", "gptq", "mse"):
        raise ValueError(f"unknown method {method!r}; choose rtn, grid, signmax, awq, gptq or mse")
    if gptaq and not (method == "gptq" and true_sequential):
        raise ValueError("gptaq needs true-sequential GPTQ (method 'gptq', true_sequential=True)")
    pool = None if method in DATA_FREE else _solver_pool()
    try:
        return _quantize_layers(source, ids, method, bits, group_size, symmetric, act_order,
                                n_search, on_layer, pool, true_sequential, gptq_grid, gptaq)
    finally:
        if pool is not None:
            pool.close()


def _quantize_layers(source, ids, method, bits, group_size, symmetric, act_order, n_search,
                     on_layer, pool, true_sequential, gptq_grid, gptaq):
    from .gptq_sequential import ASYM_SEQUENCES, SequentialGPTQBackend, gptq_layer

    cfg = source.config
    out: dict[str, Any] = {}
    info: dict = {"awq_alpha": {}}
    be = CalibrationBackend(pool=pool)
    names = None

    def solve_group(key, w, H):  # a linear group of layer i (true-sequential GPTQ)
        return gptq_quantize(w, H, bits, effective_group(w.shape[1], group_size), symmetric,
                             act_order=act_order, grid=gptq_grid, name=names[key], pool=pool)

    seq_be = SequentialGPTQBackend(solve_group, pool=pool)
    x = None
    if method not in DATA_FREE:
        emb = check_finite("model.embed_tokens.weight", source.tensors["model.embed_tokens.weight"])
        x = emb[ids] * np.float32(cfg.embed_scale)  # [N, L, D]
        del emb
        x_float = x[:ASYM_SEQUENCES].copy() if gptaq else None  # the float model's (GPTAQ)
        L = ids.shape[1]
        ropes = {}

    def rope_of(i):
        theta = cfg.layer_rope_theta(i)
        if theta not in ropes:  # LongRoPE: a window of L tokens uses the factors of L
            switch = rope_switch(cfg)
            cos, sin = rope_tables(cfg, L, theta, long=switch is not None and L > switch)
            ropes[theta] = (be.upload(cos), be.upload(sin))
        return ropes[theta]

    for i in range(cfg.num_hidden_layers):
        names = layer_tensor_names(i)
        lw = load_layer(source, i)
        if method == "rtn":
            q = {k: (quantize_rtn(v, bits, effective_group(v.shape[1], group_size), symmetric,
                                  name=names[k])
                     if k in LINEAR_KEYS else v) for k, v in lw.items()}
        elif method in ("grid", "signmax"):
            fn = quantize_grid if method == "grid" else quantize_signmax
            q = {k: (fn(v, effective_group(v.shape[1], group_size), symmetric, name=names[k])
                     if k in LINEAR_KEYS else v) for k, v in lw.items()}
        elif method == "gptq" and true_sequential:  # one forward, quantizing as it goes
            x, q, x_float = gptq_layer(seq_be, cfg, lw, i, x, rope_of(i), x_float)
        else:
            rope = rope_of(i)
            n_tok = ids.size
            step = max(1, n_tok // n_search)
            if method == "gptq":
                hs = {k: Hessian(lw[k].shape[1], pool=pool) for k in CAPTURE_GROUPS}

                def stats(j, cap, hs=hs):
                    for k, h in hs.items():
                        h.add(cap[k])
            elif method == "mse":
                sq = {k: np.zeros(lw[k].shape[1]) for k in CAPTURE_GROUPS}

                def stats(j, cap, sq=sq):
                    for k in CAPTURE_GROUPS:
                        a = np.asarray(cap[k], np.float32).reshape(-1, sq[k].shape[0])
                        sq[k] += np.einsum("ij,ij->j", a, a, dtype=np.float64)
            else:
                sums = {k: np.zeros(lw[k].shape[1]) for k in CAPTURE_GROUPS}
                samples: dict[str, list] = {k: [] for k in CAPTURE_GROUPS}

                def stats(j, cap, sums=sums, samples=samples):
                    rows = np.arange(j * L, (j + 1) * L) % step == 0
                    for k in CAPTURE_GROUPS:
                        a = np.asarray(cap[k], np.float32)
                        sums[k] += np.abs(a).sum(axis=0, dtype=np.float64)
                        samples[k].append(a[rows])
            _run_layer(be, cfg, lw, i, x, rope, stats, per_chunk=method == "gptq")
            if method == "gptq":
                q = dict(lw)
                solved: dict[str, QuantizedTensor] = {}

                def solve(cap_key, lw=lw, hs=hs, names=names, solved=solved):
                    members = CAPTURE_GROUPS[cap_key]
                    w = np.concatenate([lw[m] for m in members], axis=0)
                    solved[cap_key] = gptq_quantize(
                        w, hs[cap_key].H, bits, effective_group(w.shape[1], group_size),
                        symmetric, act_order=act_order, grid=gptq_grid, name=names[members[0]])

                # the four solves are independent: one per worker, one BLAS thread each
                # (small LAPACK calls on a multi-threaded BLAS mostly wait for each other)
                pool.run(solve, sorted(CAPTURE_GROUPS, key=lambda k: -hs[k].n_features))
                for cap_key, members in CAPTURE_GROUPS.items():
                    parts = split_rows(solved[cap_key], [lw[m].shape[0] for m in members])
                    for m, part in zip(members, parts):
                        q[m] = part
                del hs, solved
            elif method == "mse":  # each linear on its own, columns weighted by mean x²
                q = dict(lw)
                for cap_key, members in CAPTURE_GROUPS.items():
                    for m in members:
                        q[m] = quantize_mse(lw[m], effective_group(lw[m].shape[1], group_size),
                                            symmetric, importance=sq[cap_key] / n_tok,
                                            name=names[m])
            else:
                inputs = {k: (np.concatenate(samples[k]), sums[k] / n_tok) for k in CAPTURE_GROUPS}
                q, alphas = awq_quantize_layer(cfg, lw, inputs, bits=bits, group_size=group_size,
                                               symmetric=symmetric)
                info["awq_alpha"][i] = alphas
                del inputs, samples
            x = _run_layer(be, cfg, q, i, x, rope)  # propagate through the quantized layer
        for k, v in q.items():
            out[names[k]] = v if isinstance(v, QuantizedTensor) else np.asarray(v, np.float32)
        if on_layer:
            on_layer(i)
    return out, info
