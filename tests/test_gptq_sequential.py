"""GPTQ's true-sequential layer pass (one forward per layer) against its definition, and
the threaded paths (solve rows split over workers, calibration ops on a pool) against
the serial ones, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.models.families import CAPTURE_GROUPS, LINEAR_KEYS, layer_tensor_names
from edgeinfer.models.rope import rope_tables
from edgeinfer.models.transformer import decoder_layer, upload_layer
from edgeinfer.quant import calibrate as cal
from edgeinfer.quant import calib_backend
from edgeinfer.quant.gptq import Hessian, gptq_quantize
from edgeinfer.quant.gptq_sequential import HESSIAN_ROWS, SequentialGPTQBackend, gptq_layer
from edgeinfer.quant.rtn import effective_group


@pytest.fixture(scope="module")
def pool():
    p = cal._solver_pool()
    yield p
    p.close()


def _hessian_problem(seed, n_in, out):
    rng = np.random.default_rng(seed)
    X = (rng.normal(size=(1500, n_in)) * rng.uniform(0.2, 2, n_in)).astype(np.float32)
    h = Hessian(n_in)
    h.add(X)
    return rng.normal(0, 0.05, (out, n_in)).astype(np.float32), h.H


@pytest.mark.parametrize("out,n_in,g,act_order", [(97, 256, 64, False), (96, 256, 64, True),
                                                 (40, 100, 32, False)])
def test_gptq_rows_split_over_workers_equal_one_call(pool, out, n_in, g, act_order):
    w, H = _hessian_problem(1, n_in, out)
    a = gptq_quantize(w, H, 4, g, act_order=act_order)
    b = gptq_quantize(w, H, 4, g, act_order=act_order, pool=pool)
    assert pool.threads >= 2 or out < 4  # the split really ran (2+ cores)
    np.testing.assert_array_equal(a.qweight, b.qweight)
    np.testing.assert_array_equal(a.scales, b.scales)
    np.testing.assert_array_equal(a.zero_points(), b.zero_points())
    assert len(np.unique(a.codes())) == 16


def test_hessian_long_add_equals_batched_rows():
    """One add of many rows == the same rows added in pieces that fill whole batches
    (the calibration's sequences), and close to the float64 2XᵀX/n."""
    rng = np.random.default_rng(2)
    X = rng.normal(size=(2600, 48)).astype(np.float32)
    one, parts = Hessian(48, batch_rows=1024), Hessian(48, batch_rows=1024)
    one.add(X)
    for r in range(0, 2600, 512):
        parts.add(X[r:r + 512])
    np.testing.assert_array_equal(one.H, parts.H)
    assert one.n == 2600
    ref = 2 * X.astype(np.float64).T @ X / 2600
    np.testing.assert_allclose(one.H, ref, rtol=1e-5, atol=1e-5)


def test_calibration_ops_on_pool_equal_serial(pool):
    rng = np.random.default_rng(4)
    L, n = 40, 7
    T = n * L + calib_backend.OP_ROWS  # several row blocks
    serial = calib_backend.CalibrationBackend()
    threaded = calib_backend.CalibrationBackend(pool=pool)
    x = rng.normal(size=(T, 64)).astype(np.float32)
    w = rng.normal(size=64).astype(np.float32)
    np.testing.assert_array_equal(serial.rmsnorm(x, w, 1e-5), threaded.rmsnorm(x, w, 1e-5))
    y = rng.normal(0, 3, (T, 128)).astype(np.float32)
    np.testing.assert_array_equal(serial.glu(y[:, :64], y[:, 64:]),
                                  threaded.glu(y[:, :64], y[:, 64:]))
    # the in-place SiLU gating == the reference's expression, also where tanh saturates
    y[:8] *= 40
    ref = ReferenceBackend().glu(y[:, :64], y[:, 64:])
    np.testing.assert_array_equal(threaded.glu(y[:, :64], y[:, 64:]), ref)
    assert (ref[:8] == 0).any() and np.abs(ref).max() > 100
    q = rng.normal(size=(n * L, 4, 16)).astype(np.float32)
    k = rng.normal(size=(n * L, 2, 16)).astype(np.float32)
    v = rng.normal(size=(n * L, 2, 16)).astype(np.float32)
    serial.seq_len = threaded.seq_len = L
    np.testing.assert_array_equal(serial.attention(q, k, v, None, 0, 0, 0.25),
                                  threaded.attention(q, k, v, None, 0, 0, 0.25))


def _capture(cfg, tensors, i, x2d, pos, rope, L):
    """The linears' inputs of layer i (a plain calibration forward, no quantization)."""
    be = calib_backend.CalibrationBackend()
    be.seq_len = L
    names = layer_tensor_names(i)
    lw = upload_layer(be, {names[k]: v for k, v in tensors.items()}, i)
    cache = be.new_kv_cache(1, cfg.num_key_value_heads, cfg.head_dim, L)
    cap: dict = {}
    y = decoder_layer(be, cfg, lw, x2d, pos, rope, cache, 0, i, capture=cap)
    return cap, y


def layer_problem(stories_dir, n, L, i, act_order, pool):
    """stories260K's layer ``i`` on ``n`` random sequences of ``L`` tokens: ``(cfg, x
    [n, L, D] (the embeddings), float tensors by short name, rope, a sequential backend
    solving GPTQ in groups of 32)``."""
    from edgeinfer.readers import read_model

    src = read_model(str(stories_dir))
    cfg = src.config
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (n, L)).astype(np.int32)
    x = np.asarray(src.tensors["model.embed_tokens.weight"], np.float32)[ids]
    names = layer_tensor_names(i)
    cos, sin = rope_tables(cfg, L, cfg.layer_rope_theta(i))

    def solve(key, w, H):
        return gptq_quantize(w, H, 4, effective_group(w.shape[1], 32), False,
                             act_order=act_order, name=names[key], pool=pool)

    return (cfg, x, cal.load_layer(src, i), (cos.astype(np.float32), sin.astype(np.float32)),
            SequentialGPTQBackend(solve, pool=pool))


@pytest.mark.parametrize("act_order", [False, True])
def test_true_sequential_layer_is_its_definition(stories_dir, pool, act_order):
    """Each group is GPTQ on the Hessian of its input computed with the *earlier* groups
    quantized and the later ones float (q/k/v, o, gate/up, down in order); the output is
    the fully quantized layer's."""
    n, L, i = 5, 48, 1
    cfg, x, lw, rope, be = layer_problem(stories_dir, n, L, i, act_order, pool)
    y, q, y_float = gptq_layer(be, cfg, lw, i, x, rope)
    assert y_float is None
    assert all(type(q[k]).__name__ == "QuantizedTensor" for k in LINEAR_KEYS)

    pos = np.tile(np.arange(L, dtype=np.int32), n)
    done = dict(lw)  # float, then each group replaced by its quantized weights in order
    for key, members in CAPTURE_GROUPS.items():
        cap, _ = _capture(cfg, done, i, x.reshape(-1, x.shape[2]), pos, rope, L)
        h = Hessian(lw[key].shape[1], batch_rows=HESSIAN_ROWS)
        h.add(cap[key])
        w = np.concatenate([lw[m] for m in members])
        ref = gptq_quantize(w, h.H, 4, effective_group(w.shape[1], 32), False,
                            act_order=act_order)
        got = np.concatenate([q[m].codes() for m in members])
        np.testing.assert_array_equal(got, ref.codes(), err_msg=key)
        np.testing.assert_array_equal(np.concatenate([q[m].scales for m in members]),
                                      ref.scales, err_msg=key)
        done.update({m: q[m] for m in members})
    _, y_ref = _capture(cfg, done, i, x.reshape(-1, x.shape[2]), pos, rope, L)
    np.testing.assert_allclose(y.reshape(y_ref.shape), y_ref, rtol=1e-5,
                               atol=1e-5 * np.abs(y_ref).max())
    # control: the later groups' Hessians do see the quantized earlier ones
    cap_float, _ = _capture(cfg, lw, i, x.reshape(-1, x.shape[2]), pos, rope, L)
    cap_q, _ = _capture(cfg, {**lw, **{m: q[m] for m in CAPTURE_GROUPS["q_proj"]}}, i,
                        x.reshape(-1, x.shape[2]), pos, rope, L)
    assert not np.allclose(cap_float["o_proj"], cap_q["o_proj"], rtol=1e-4, atol=1e-5)


def test_true_sequential_changes_only_the_later_groups(stories_dir):
    """Layer 0 under both drivers: q/k/v see the same input (rmsnorm of the embeddings) and,
    with under 1024 rows, the same Hessian, so equal codes; o/gate/up/down see the float
    layer's inputs in one and the quantized earlier groups' in the other."""
    from edgeinfer.readers import read_model

    src = read_model(str(stories_dir))
    ids = np.random.default_rng(1).integers(0, src.config.vocab_size, (3, 40)).astype(np.int32)
    seq, _ = cal.quantize_layers(src, ids, "gptq", group_size=32, act_order=True)
    flt, _ = cal.quantize_layers(src, ids, "gptq", group_size=32, act_order=True,
                                 true_sequential=False)
    names = layer_tensor_names(0)
    for k in ("q_proj", "k_proj", "v_proj"):
        np.testing.assert_array_equal(seq[names[k]].codes(), flt[names[k]].codes())
    for k in ("o_proj", "down_proj"):
        assert (seq[names[k]].codes() != flt[names[k]].codes()).mean() > 0.001
    assert set(seq) == set(flt)


def test_linear_on_pool_equals_one_gemm(pool):
    """The calibration linears in row blocks on the workers == one sgemm, bit for bit."""
    rng = np.random.default_rng(5)
    T = 2 * calib_backend.LINEAR_ROWS + 300  # three blocks, the last one short
    x = rng.normal(size=(T, 96)).astype(np.float32)
    w = rng.normal(0, 0.1, (80, 96)).astype(np.float32)
    b = rng.normal(size=80).astype(np.float32)
    threaded = calib_backend.CalibrationBackend(pool=pool)
    for bias in (None, b):
        ref = x @ w.T if bias is None else x @ w.T + bias
        got = threaded.linear(x, w, bias)
        assert got.shape == (T, 80) and got.dtype == np.float32
        np.testing.assert_array_equal(got, ref)
    assert np.abs(ref).max() > 1.0  # a real product, not zeros


def test_hessian_on_pool_equals_serial(pool):
    """Whole batches multiplied on the workers and summed in order == one at a time,
    also with rows left pending between adds."""
    rng = np.random.default_rng(6)
    X = rng.normal(size=(3000, 40)).astype(np.float32)
    serial, threaded = Hessian(40, batch_rows=256), Hessian(40, batch_rows=256, pool=pool)
    for h in (serial, threaded):
        for r0, r1 in ((0, 1100), (1100, 1200), (1200, 3000)):
            h.add(X[r0:r1])
    assert serial.n == threaded.n == 3000
    np.testing.assert_array_equal(serial.H, threaded.H)
    np.testing.assert_allclose(serial.H, 2 * X.astype(np.float64).T @ X / 3000, rtol=1e-5,
                               atol=1e-5)


def test_op_outputs_reuse_only_unreferenced_buffers():
    """A calibration op's output reuses a kept buffer of its size only when nothing
    references that buffer any more (not the array, not a view of it)."""
    be = calib_backend.CalibrationBackend()
    a = be._new((4, 6))
    b = be._new((4, 6))
    assert not np.shares_memory(a, b)
    view = a[1:]
    del a
    c = be._new((24,))  # a's buffer is still held through the view
    assert not np.shares_memory(c, view) and not np.shares_memory(c, b)
    del view, c
    d = be._new((2, 12))  # now free: reused
    assert len(be._spares) == 3 and np.shares_memory(d, be._spares[0])
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    s = be.add(x, x)
    np.testing.assert_array_equal(s, 2 * x)
    assert not np.shares_memory(s, d) and not np.shares_memory(s, b)
