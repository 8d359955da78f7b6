"""Why two correct quantized-KV implementations may store different bits, and the check
that tells such a rounding-boundary case from an error (tests/kv_admissible.py).

Reproduced on the host, deterministically: the data of the OpenCL test that failed on
Intel (``test_attention_quantized_cache_matches_host_format[...-3-1-256-int4]``, 1.74e-4
against 1e-5), written into two host int4 caches whose K rotation sums in two different
float32 orders (elementwise numpy, so the same bits on every machine).
"""
from __future__ import annotations

import numpy as np
import pytest

import edgeinfer.backends.kvcache as kvc
from edgeinfer.backends.kvformat import hadamard
from edgeinfer.backends.reference import ReferenceBackend
from kv_admissible import assert_same_format, check_k, rotated_exact

REF = ReferenceBackend()


def _grouped(fn):
    def rotate(x, h):
        g = h.shape[0]
        return fn(x.reshape(-1, g).astype(np.float32), h).reshape(x.shape).astype(np.float32)
    return rotate


@_grouped
def rotate_sequential(xg, h):
    """acc = fl(acc + fl(x_j h_j)), j = 0 .. G-1: an unfused loop."""
    acc = np.zeros(xg.shape, np.float32)
    for j in range(h.shape[0]):
        acc = acc + xg[:, j:j + 1] * h[j][None, :]
    return acc


@_grouped
def rotate_rounded_exact(xg, h):
    """fl(exact sum): what a fused or a wider-accumulator evaluation approaches."""
    return (xg.astype(np.float64) @ h.astype(np.float64)).astype(np.float32)


def nerr(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(y - ref)) / max(np.max(np.abs(ref)), 1.0))


def _failing_case(monkeypatch, rotate, hq=3, hkv=1, hd=256, steps=(7, 1, 1, 25, 1)):
    """The OpenCL test's calls (seed 0, layer 1) on a host int4 cache rotating with
    ``rotate``: (outputs per call, cache, keys, values, positions)."""
    monkeypatch.setattr(kvc, "_rotate", rotate)
    rng = np.random.default_rng(0)
    c = REF.new_kv_cache(2, hkv, hd, 64, "int4")
    outs, ks, vs, pos = [], [], [], 0
    for t in steps:
        q, k, v = (rng.standard_normal((t, h, hd)).astype(np.float32) for h in (hq, hkv, hkv))
        outs.append(REF.attention(q, k, v, c, 1, pos, hd ** -0.5))
        ks.append(k)
        vs.append(v)
        pos += t
    return outs, c, np.concatenate(ks), np.concatenate(vs), pos


def test_summation_order_moves_one_f16_scale_and_the_output_by_1e_4(monkeypatch):
    out_a, a, k, v, n = _failing_case(monkeypatch, rotate_sequential)
    out_b, b, _, _, _ = _failing_case(monkeypatch, rotate_rounded_exact)
    ra, rb = a.raw(1), b.raw(1)
    # one K group's f16 scale, one ulp apart: (max y - mn) / 15 = 0.204528809 in float32,
    # the f16 midpoint 0.20452880859375
    diff = np.argwhere(ra["k_scale"][:n] != rb["k_scale"][:n]).tolist()
    assert diff == [[26, 0, 7]]
    assert (float(ra["k_scale"][26, 0, 7]), float(rb["k_scale"][26, 0, 7])) == (0.2044677734375,
                                                                                0.20458984375)
    y, _ = rotated_exact(((k - ra["k_off"]) / ra["k_cs"]).astype(np.float32), 32)
    g = y[26, 0, 7 * 32:8 * 32]
    r = (g.max() - float(ra["k_min"][26, 0, 7])) / 15
    assert abs(r - 0.20452880859375) < 1e-8
    # the size of the Intel failure, from this one scale
    worst = max(nerr(x, z) for x, z in zip(out_a, out_b))
    assert 1e-4 < worst < 3e-4
    # both are float32 evaluations of the format: the check accepts both
    assert assert_same_format("int4", k, v, ra, {n_: np.asarray(x if n_ in ("k_off", "k_cs")
                                                             else x[:n])
                                                 for n_, x in rb.items()}, n) == 1


def test_the_check_rejects_a_code_or_scale_off_a_rounding_boundary(monkeypatch):
    _, c, k, v, n = _failing_case(monkeypatch, rotate_sequential)
    raw = {name: np.array(x if name in ("k_off", "k_cs") else x[:n]) for name, x in c.raw(1).items()}
    ok, _ = check_k("int4", k, raw, n)
    assert ok.all()  # positive control: the host's own cache is admissible
    bad = {name: x.copy() for name, x in raw.items()}
    bad["k_q"][3, 0, 5] ^= 0x01  # one code off by one (low nibble of channel 10, group 0)
    ok, _ = check_k("int4", k, bad, n)
    assert np.argwhere(~ok).tolist() == [[3, 0, 0]]
    bad = {name: x.copy() for name, x in raw.items()}
    s = bad["k_scale"][12, 0, 2]
    bad["k_scale"][12, 0, 2] = np.nextafter(s, np.float16(np.inf))  # one f16 ulp up
    ok, _ = check_k("int4", k, bad, n)
    assert np.argwhere(~ok).tolist() == [[12, 0, 2]]
    with pytest.raises(AssertionError, match="must match bit for bit"):
        worse = {name: x.copy() for name, x in raw.items()}
        worse["v_q"][0, 0, 0] ^= 0x10
        assert_same_format("int4", k, v, raw, worse, n)


@pytest.mark.parametrize("dtype", ["int8", "k8v4"])
def test_the_check_covers_8_bit_k(dtype):
    rng = np.random.default_rng(3)
    c = REF.new_kv_cache(1, 2, 64, 16, dtype)
    k = rng.standard_normal((9, 2, 64)).astype(np.float32)
    k[..., 5] *= 40
    v = rng.standard_normal((9, 2, 64)).astype(np.float32)
    REF.attention(rng.standard_normal((9, 4, 64)).astype(np.float32), k, v, c, 0, 0, 0.125)
    raw = {name: np.array(x[:9]) for name, x in c.raw(0).items()}
    ok, _ = check_k(dtype, k, raw, 9)
    assert ok.all()
    raw["k_q"][4, 1, 40] += 1 if raw["k_q"][4, 1, 40] < 127 else -1
    ok, _ = check_k(dtype, k, raw, 9)
    assert np.argwhere(~ok).tolist() == [[4, 1, 1]]


def test_hadamard_rows_have_equal_magnitude():
    # rotated_exact's bound uses |H_G| = 1/sqrt(G) everywhere
    h = hadamard(32)
    np.testing.assert_array_equal(np.abs(h), np.full((32, 32), np.float32(32 ** -0.5)))
