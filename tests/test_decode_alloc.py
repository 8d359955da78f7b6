"""A warm decode step on the CPU backend allocates no numpy array and no Numba array.

Detection (each with a positive control that must trip it):

* numpy: a counting ``PyDataMem_Handler`` installed with numpy's C API
  (``PyDataMem_SetHandler``, reached through ``ctypes``) counts every array-data
  malloc / calloc / realloc while the steps run, transient ones included (tracemalloc's
  domain 389047 only shows the arrays still alive at a snapshot; its peak mixes in the
  Python objects every step creates, so a 4-byte positions array would go unseen);
* Numba: the runtime's allocation counter (``NRT`` stats), for arrays created inside
  the kernels (``np.empty`` in an ``@njit`` function never reaches numpy's allocator).

Model: stories260K (conftest) with RTN INT4 linears and an 8-bit head (the fused halves
of the decode plan, backends/cpu/plan.py), and with dense float32 weights, all of them
(what a GGUF dequantized at load gives: backends/cpu/stepwise.py) or with an 8-bit head;
KV cache f32 / f16 / int8 / int4 / k8v4. A tiny random Gemma-3-like model (QK-norm,
sandwich norms, (1 + w) norms, GELU-tanh, sliding-window layers, two RoPE bases:
backends/cpu/stepwise.py), 4-bit and dense float32, the same caches, quantized ones also
as rings. Sampling: the engine's ``Sampler`` workspace, greedy and
sampled (temperature / top-k / top-p / min-p / penalties), alone and inside the whole
``Engine.stream`` loop.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import tracemalloc

import numpy as np
import pytest
from edgeinfer.backends.cpu import CpuBackend
from edgeinfer.models.config import ModelConfig
from edgeinfer.models.transformer import Transformer
from numba import njit
from test_cpu_model import MODEL_DIR, PROMPT, rtn4, rtn8_rows
from tiny_models import tiny_gemma

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").exists(),
                                reason="stories260K not available")


# ---- a counting numpy data allocator ---------------------------------------------------
class _Allocator(ctypes.Structure):
    _fields_ = [("ctx", ctypes.c_void_p), ("malloc", ctypes.c_void_p),
                ("calloc", ctypes.c_void_p), ("realloc", ctypes.c_void_p),
                ("free", ctypes.c_void_p)]


class _Handler(ctypes.Structure):  # numpy's PyDataMem_Handler (version 1)
    _fields_ = [("name", ctypes.c_char * 127), ("version", ctypes.c_uint8),
                ("allocator", _Allocator)]


_libc = ctypes.CDLL(None)
_libc.malloc.restype = _libc.calloc.restype = _libc.realloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.calloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
_libc.realloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]
_COUNT = [0]
_MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_CALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)
_REALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def _malloc(ctx, n):
    _COUNT[0] += 1
    return _libc.malloc(n)


def _calloc(ctx, n, s):
    _COUNT[0] += 1
    return _libc.calloc(n, s)


def _realloc(ctx, p, n):
    _COUNT[0] += 1
    return _libc.realloc(p, n)


def _free(ctx, p, n):
    _libc.free(p)


# kept alive for the whole session: arrays allocated through the handler free through it
_FNS = (_MALLOC(_malloc), _CALLOC(_calloc), _REALLOC(_realloc), _FREE(_free))
_HANDLER = _Handler(b"edgeinfer_test_counting", 1,
                    _Allocator(None, *(ctypes.cast(f, ctypes.c_void_p) for f in _FNS)))
ctypes.pythonapi.PyCapsule_New.restype = ctypes.py_object
ctypes.pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
ctypes.pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
ctypes.pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_NAME = ctypes.create_string_buffer(b"mem_handler")  # the capsule keeps this pointer
_CAPSULE = ctypes.pythonapi.PyCapsule_New(ctypes.addressof(_HANDLER), ctypes.addressof(_NAME),
                                          None)


def _set_handler():
    """numpy's ``PyDataMem_SetHandler`` (C-API slot 304 since numpy 1.22)."""
    from numpy._core import _multiarray_umath as mu
    table = ctypes.pythonapi.PyCapsule_GetPointer(mu._ARRAY_API, None)
    fn = ctypes.cast(table, ctypes.POINTER(ctypes.c_void_p))[304]
    return ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.py_object)(fn)


@contextlib.contextmanager
def numpy_allocs():
    """Yields a list whose item 0 becomes the number of numpy data allocations made in
    the ``with`` body (this thread's context)."""
    set_handler = _set_handler()
    out = [0]
    old = set_handler(_CAPSULE)
    _COUNT[0] = 0
    try:
        yield out
    finally:
        out[0] = _COUNT[0]
        set_handler(old)


def _n_arrays(args) -> int:
    return sum(_n_arrays(a) if isinstance(a, tuple) else isinstance(a, np.ndarray) for a in args)


@contextlib.contextmanager
def nrt_allocs():
    """As :func:`numpy_allocs` for arrays allocated inside Numba kernels (NRT): the
    runtime's allocation count minus one per array argument of each Numba call (passing
    an array to a kernel wraps it in a runtime record, counted as an allocation too)."""
    from numba.core.dispatcher import Dispatcher, _DispatcherBase
    from numba.core.runtime import _nrt_python, rtsys
    _nrt_python.memsys_enable_stats()
    out = [0]
    unboxed = [0]
    orig = Dispatcher.__dict__.get("__call__")

    def call(self, *a, **k):
        unboxed[0] += _n_arrays(a) + _n_arrays(tuple(k.values()))
        return _DispatcherBase.__call__(self, *a, **k)

    Dispatcher.__call__ = call
    a0 = rtsys.get_allocation_stats().alloc
    try:
        yield out
    finally:
        out[0] = rtsys.get_allocation_stats().alloc - a0 - unboxed[0]
        if orig is None:
            del Dispatcher.__call__
        else:
            Dispatcher.__call__ = orig


@njit(cache=False)
def _kernel_with_empty(n):  # positive control for nrt_allocs
    return np.empty(n, np.float32).shape[0]


@njit(cache=False)
def _sum_first(t, b):  # negative control: arrays in, no allocation
    return t[0][0] + t[1][1] + b[2]


def test_counters_catch_allocations():
    """Positive controls: a 4-byte numpy array, a numpy temporary, a Numba np.empty."""
    with numpy_allocs() as n:
        np.arange(3, 4, dtype=np.int32)
    assert n[0] == 1
    a = np.ones(5, np.float32)
    with numpy_allocs() as n:
        _ = a * 2
    assert n[0] >= 1
    with numpy_allocs() as n:
        np.multiply(a, a, out=a)  # (a Python scalar operand would allocate a 0-d array)
        _ = a[1:3].reshape(2, 1)  # views allocate no data
    assert n[0] == 0
    _kernel_with_empty(3)
    with nrt_allocs() as n:
        _kernel_with_empty(3)
    assert n[0] == 1
    _sum_first((a, a), a)
    with nrt_allocs() as n:  # array arguments alone count nothing
        _sum_first((a, a), a)
    assert n[0] == 0
    # tracemalloc's numpy domain sees only what is still alive at the snapshot
    tracemalloc.start()
    try:
        keep = np.empty(7, np.float32)
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
    finally:
        tracemalloc.stop()
    assert any(t.size >= keep.nbytes for t in snap.traces)


def _gguf_q(w: np.ndarray, qname: str):
    """``w`` [out, in] quantized by gguf's own quantizer into ``qname`` blocks and re-laid
    as a GGUF file's tensor loads natively (edgeinfer.readers.gguf_blocks)."""
    import gguf

    from edgeinfer.readers.gguf_blocks import relayout
    raw = gguf.quants.quantize(np.ascontiguousarray(w, np.float32), gguf.GGMLQuantizationType[qname])
    return relayout(raw, qname, "t", "test.gguf")


def _model(weights: str) -> Transformer:
    """stories260K on a CpuBackend: "q4" RTN INT4 linears and an 8-bit head, "f32" all
    float32 (as loaded), "f32+q8head" float32 with an 8-bit head, "gguf" GGUF blocks
    re-laid (Q4_1 linears with float mins where rows are whole blocks, a Q8_0 head)."""
    from safetensors.numpy import load_file
    cfg = ModelConfig.from_hf_dict(json.loads((MODEL_DIR / "config.json").read_text()))
    tensors = load_file(str(MODEL_DIR / "model.safetensors"))
    if weights == "gguf":
        tensors = {k: (_gguf_q(v, "Q8_0" if "head" in k else "Q4_1")
                       if v.ndim == 2 and "embed" not in k and v.shape[1] % 32 == 0 else v)
                   for k, v in tensors.items()}
        return Transformer(cfg, tensors, CpuBackend(), 256)
    if weights != "f32":
        tensors["lm_head.weight"] = rtn8_rows(tensors["lm_head.weight"])
    if weights == "q4":
        tensors = {k: rtn4(v, 32) if isinstance(v, np.ndarray) and v.ndim == 2
                   and "embed" not in k else v for k, v in tensors.items()}
    return Transformer(cfg, tensors, CpuBackend(), 256)


@pytest.fixture(scope="module", params=["q4", "f32", "f32+q8head", "gguf"])
def quant_model(request):
    """The model under test, once per weight format (the name predates the dense ones)."""
    return _model(request.param)


def _warm_steps(m, kv, max_chunk=512):
    """A cache of dtype ``kv`` after a prompt and two warm-up decode steps (scratch,
    prepared arguments, compiled kernels), a [1] id buffer and a logits buffer."""
    cache = m.new_cache(64, kv, max_chunk)
    m.forward(PROMPT, cache)
    ids = np.zeros(1, np.int32)
    out = np.empty((1, m.cfg.vocab_size), np.float32)
    for t in (7, 300):
        ids[0] = t
        m.forward(ids, cache, out=out)
    return cache, ids, out


def _three_steps(m, cache, ids, out):
    """Three decode steps (ids 11, 42, 5) into ``out``; returns the last result."""
    for t in (11, 42, 5):
        ids[0] = t
        y = m.forward(ids, cache, out=out)
    return y


@pytest.mark.parametrize("kv", ["int8", "f16", "f32", "int4", "k8v4"])
def test_warm_decode_step_allocates_nothing(quant_model, kv):
    m = quant_model
    cache, ids, out = _warm_steps(m, kv)
    with numpy_allocs() as n_np, nrt_allocs() as n_nrt:
        y = _three_steps(m, cache, ids, out)
    assert y is out
    assert n_np[0] == 0, f"{n_np[0]} numpy allocations in 3 decode steps ({kv} cache)"
    assert n_nrt[0] == 0, f"{n_nrt[0]} Numba allocations in 3 decode steps ({kv} cache)"
    # the same loop with one np.empty per step is caught (positive control in situ)
    with numpy_allocs() as n_np:
        for t in (11, 42, 5):  # (inline: the extra np.empty goes inside the loop)
            ids[0] = t
            m.forward(ids, cache, out=out)
            np.empty(1, np.int32)
    assert n_np[0] >= 3
    p = m.plan(cache)  # the decode plan ran, with an in-place attention in every layer
    assert p is not None and all(lp.attn is not None for lp in p.layers)


def _stepwise_controls(m, kv, monkeypatch) -> tuple[int, int]:
    """numpy allocations in 3 warm decode steps of ``m`` (a ``kv`` cache) with one hidden
    temporary in the step-wise path's GLU (backends/cpu/stepwise.py), then with
    ``exact_decode`` (no plan: the composition of ops the plan replaces)."""
    from edgeinfer.backends.cpu import stepwise
    glu_into = stepwise.glu_into

    def glu_alloc(y, g, u, gelu):  # the same values through a temporary
        y[...] = glu_into(np.empty_like(y), g, u, gelu)
        return y

    counts = []
    try:
        for hidden in (True, False):
            with monkeypatch.context() as mp:
                if hidden:
                    mp.setattr(stepwise, "glu_into", glu_alloc)
                m.backend.exact_decode = not hidden  # read when a cache's plan is compiled
                cache, ids, out = _warm_steps(m, kv)
                assert (m.plan(cache) is None) == (not hidden)
                with numpy_allocs() as n_np:
                    _three_steps(m, cache, ids, out)
                counts.append(n_np[0])
    finally:
        m.backend.exact_decode = False
    return counts[0], counts[1]


@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_dense_decode_positive_controls(kv, monkeypatch):
    """The dense path's zero is real: one hidden allocation inside its MLP stage (the GLU
    into a temporary) is counted once per layer and step, and the contract's composition
    (what dense weights ran before backends/cpu/stepwise.py: 85 arrays a step with an f32
    cache, 90 int8) is counted in full (77 a step here: GLU constants no longer allocate,
    the head is composed too)."""
    m = _model("f32")
    hidden, composed = _stepwise_controls(m, kv, monkeypatch)
    assert hidden == 3 * m.cfg.num_hidden_layers
    assert composed >= 3 * 10 * m.cfg.num_hidden_layers


def _gemma_model(weights: str) -> Transformer:
    """A tiny random Gemma-3-like model on a CpuBackend ("q4": RTN INT4 linears, "f32",
    "gguf": GGUF blocks re-laid, 8- and 4-bit)."""
    cfg, tensors = tiny_gemma(vocab_size=512, hidden_size=64, intermediate_size=96,
                              num_attention_heads=4)
    if weights == "q4":
        tensors = {k: rtn4(v, 32) if v.ndim == 2 and "embed" not in k else v
                   for k, v in tensors.items()}
    if weights == "gguf":  # a Q4_K_M-like mix: 8-bit Q5_0 / Q5_1 / Q8_0, 4-bit Q4_1
        kinds = {"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q8_0", "o_proj": "Q4_1",
                 "gate_proj": "Q5_1", "up_proj": "Q5_1", "down_proj": "Q4_1", "embed": "Q8_0"}
        tensors = {k: next((_gguf_q(v, q) for n, q in kinds.items() if n in k), v)
                   if v.ndim == 2 else v for k, v in tensors.items()}
    return Transformer(cfg, tensors, CpuBackend(), 256)


@pytest.fixture(scope="module", params=["q4", "f32", "gguf"])
def gemma_model(request):
    return _gemma_model(request.param)


@pytest.mark.parametrize("kv,chunk", [("f32", 512), ("f16", 512), ("int8", 512),
                                      ("int4", 512), ("k8v4", 512), ("int8", 8),
                                      ("int4", 8), ("k8v4", 8)])
def test_gemma_warm_decode_step_allocates_nothing(gemma_model, kv, chunk):
    """QK-norm and sandwich norms take the scratch path of backends/cpu/stepwise.py; chunk
    8 makes the two sliding-window layers rings of 13 slots (f32/f16 rings take the
    attention op, which allocates: not tested here)."""
    from edgeinfer.backends.cpu.stepwise import StepwiseBlock
    m = gemma_model
    cache, ids, out = _warm_steps(m, kv, chunk)
    assert (cache.slots == [13, 13, 64]) == (chunk == 8)
    with numpy_allocs() as n_np, nrt_allocs() as n_nrt:
        y = _three_steps(m, cache, ids, out)
    assert y is out
    assert n_np[0] == 0, f"{n_np[0]} numpy allocations in 3 decode steps ({kv} cache)"
    assert n_nrt[0] == 0, f"{n_nrt[0]} Numba allocations in 3 decode steps ({kv} cache)"
    p = m.plan(cache)
    assert all(isinstance(lp.steps, StepwiseBlock) for lp in p.layers)
    assert all(lp.attn is not None for lp in p.layers)  # the in-place attention ran


@pytest.mark.parametrize("weights", ["q4", "f32"])
def test_gemma_decode_positive_controls(weights, monkeypatch):
    """The Gemma path's zero is real: one hidden allocation in its MLP stage is counted
    once per layer and step, and the composition of ops it replaces (``exact_decode``)
    is counted in full (measured before backends/cpu/stepwise.py: 16-22 arrays per layer
    and step, by weights and cache)."""
    m = _gemma_model(weights)
    hidden, composed = _stepwise_controls(m, "int8", monkeypatch)
    assert hidden == 3 * m.cfg.num_hidden_layers
    assert composed >= 3 * 15 * m.cfg.num_hidden_layers


def test_engine_decode_one_allocates_nothing(quant_model):
    """The engine's decode step reuses its id and logits buffers; greedy sampling through
    a ``Sampler`` reads the logits without a float64 copy and allocates nothing either."""
    from edgeinfer.engine import Engine
    from edgeinfer.sampling import Sampler, SamplingParams, sample
    eng = Engine(quant_model, None, n_ctx=64, kv_dtype="int8", prefill_chunk=8)
    logits, _ = eng.prefill(PROMPT.tolist())
    params = SamplingParams(temperature=0.0)
    rng = np.random.default_rng(0)
    s = Sampler(logits.shape[-1])
    s.start(params, PROMPT.tolist())
    tok = s.sample(logits, rng)
    for _ in range(2):  # warm-up
        logits = eng.decode_one(tok)
        tok = s.sample(logits, rng)
    with numpy_allocs() as n_step, nrt_allocs() as n_nrt:
        for _ in range(3):
            logits = eng.decode_one(tok)
    with numpy_allocs() as n_sample:
        for _ in range(3):
            tok = s.sample(logits, rng)
            s.accept(tok)
    assert n_step[0] == 0 and n_nrt[0] == 0
    assert n_sample[0] == 0
    assert tok == int(np.argmax(logits)) == sample(logits, params, rng)


SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1}


@pytest.mark.parametrize("extra", [{}, {"top_k": 0}, {"presence_penalty": 0.3,
                                   "frequency_penalty": 0.2, "penalty_last_n": 4},
                                   {"penalty_last_n": -1, "top_p": 1.0, "min_p": 0.0}])
def test_sampled_decode_loop_allocates_nothing(quant_model, extra):
    """decode_one + Sampler.sample + accept with temperature / top-k / top-p / min-p /
    penalties: no numpy and no Numba allocation per token once warm (the penalty window
    slides: last_n 4 makes ids leave it). The one-shot ``sample`` (which builds its
    workspace per call, as the numpy chain made its arrays per call) is the positive
    control: the counters see its allocations in the same loop."""
    from edgeinfer.engine import Engine
    from edgeinfer.sampling import Sampler, SamplingParams, sample
    eng = Engine(quant_model, None, n_ctx=64, kv_dtype="int8", prefill_chunk=8)
    params = SamplingParams(**{**SAMPLED, **extra, "seed": 3})
    logits, _ = eng.prefill(PROMPT.tolist())
    rng = np.random.default_rng(params.seed)
    s = Sampler(logits.shape[-1])
    s.start(params, PROMPT.tolist())
    history = PROMPT.tolist()
    for _ in range(3):  # warm-up: compiled kernels, buffers
        tok = s.sample(logits, rng)
        s.accept(tok)
        history.append(tok)
        logits = eng.decode_one(tok)
    with numpy_allocs() as n_np, nrt_allocs() as n_nrt:
        for _ in range(6):
            tok = s.sample(logits, rng)
            s.accept(tok)
            history.append(tok)
            logits = eng.decode_one(tok)
    assert n_np[0] == 0, f"{n_np[0]} numpy allocations in 6 sampled decode steps"
    assert n_nrt[0] == 0, f"{n_nrt[0]} Numba allocations in 6 sampled decode steps"
    with numpy_allocs() as n_old:
        for _ in range(3):
            tok = sample(logits, params, rng, history)
            history.append(tok)
            logits = eng.decode_one(tok)
    assert n_old[0] >= 3 * 5  # per token: the float64 copy, candidate arrays, ...


def test_engine_stream_allocates_nothing_per_sampled_token(quant_model):
    """The whole Engine.stream loop (sampling, stop checks, detokenizer, timing) with the
    sampled settings: 60 tokens allocate exactly as many numpy arrays as 20 (prefill,
    workspace and stats are per stream, not per token)."""
    from edgeinfer.api import tokenizer_for
    from edgeinfer.engine import Engine
    from edgeinfer.readers import read_model
    from edgeinfer.sampling import SamplingParams
    eng = Engine(quant_model, tokenizer_for(read_model(str(MODEL_DIR))), n_ctx=128,
                 kv_dtype="int8", prefill_chunk=8)
    params = SamplingParams(**SAMPLED, seed=3)
    # speculate="off": the plain decode loop (a speculative verify is a prefill forward,
    # which allocates; edgeinfer/speculative.py)
    list(eng.stream(PROMPT.tolist(), params, max_tokens=8, speculate="off"))  # warm-up
    counts = []
    for n in (20, 60):
        eng.reset()
        with numpy_allocs() as n_np:
            final = list(eng.stream(PROMPT.tolist(), params, max_tokens=n,
                                    speculate="off"))[-1]
        assert final.stats.generated_tokens == n  # (the tiny model emits no EOS here)
        counts.append(n_np[0])
    assert counts[1] == counts[0], counts


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {**SAMPLED, "seed": 1}])
def test_masked_sampling_allocates_nothing(quant_model, params):
    """The sampler under a token mask (constrained output) allocates nothing per token:
    the mask kernels work in place on the logits / workspace. The numpy reference with
    the mask is the positive control: the counters see its copies."""
    from edgeinfer.constrained import mask_words
    from edgeinfer.engine import Engine
    from edgeinfer.sampling import Sampler, SamplingParams, sample
    eng = Engine(quant_model, None, n_ctx=64, kv_dtype="int8", prefill_chunk=8)
    p = SamplingParams(**params)
    logits, _ = eng.prefill(PROMPT.tolist())
    vocab = logits.shape[-1]
    mask = np.zeros(mask_words(vocab), np.int32)
    mask[:2] = -1  # ids 0..63 allowed
    s = Sampler(vocab)
    s.start(p, PROMPT.tolist())
    rng = np.random.default_rng(0)
    for _ in range(3):  # warm-up
        tok = s.sample(logits, rng, mask)
        s.accept(tok)
        logits = eng.decode_one(tok)
    with numpy_allocs() as n_np, nrt_allocs() as n_nrt:
        for _ in range(4):
            tok = s.sample(logits, rng, mask)
            s.accept(tok)
            assert tok < 64
    assert n_np[0] == 0 and n_nrt[0] == 0, (n_np[0], n_nrt[0])
    with numpy_allocs() as n_ref:
        sample(logits, p, rng, PROMPT.tolist(), mask)
    assert n_ref[0] >= 1
