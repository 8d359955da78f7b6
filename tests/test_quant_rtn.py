"""RTN quantization and the INT4 layout: hard-coded vectors, guards (C09/C10), padding (C11),
the writer's pack round trip (C13)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
from edgeinfer.backends.quantized import QuantizedTensor, pack_nibbles, unpack_nibbles
from edgeinfer.quant.rtn import SCALE_EPS, fake_quantize, quantize_rtn


def _bound(qt: QuantizedTensor) -> np.ndarray:
    """Per-element INT4/INT8 rounding bound s/2 ``[out, in]`` (scales repeated per group)."""
    s = np.repeat(qt.scales.astype(np.float64), qt.group_size, axis=1)[:, : qt.in_features]
    return 0.5 * s * (1 + 1e-6) + 1e-9


def test_pack_hardcoded_vectors():
    codes = np.arange(1, 9, dtype=np.uint8)  # 1..8
    packed = pack_nibbles(codes)
    assert packed.tolist() == [0x21, 0x43, 0x65, 0x87]  # low nibble first
    assert pack_nibbles([15, 0, 0, 15]).tolist() == [0x0F, 0xF0]
    assert pack_nibbles([7]).tolist() == [0x07]  # odd length padded with a zero code
    assert unpack_nibbles(np.array([0x21, 0xF0], np.uint8)).tolist() == [1, 2, 0, 15]
    with pytest.raises(ValueError):
        pack_nibbles([16])


def test_pack_unpack_round_trips():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(7, 64)).astype(np.uint8)
    assert np.array_equal(unpack_nibbles(pack_nibbles(codes)), codes)
    raw = rng.integers(0, 256, size=(5, 33)).astype(np.uint8)  # C13: pack(unpack(x)) == x
    assert np.array_equal(pack_nibbles(unpack_nibbles(raw)), raw)


def test_dequant_hand_written_block():
    # one row, group 4: codes [0, 1, 2, 15], zero point 3, scale 0.5
    qt = QuantizedTensor(pack_nibbles([[0, 1, 2, 15]]), np.array([[0.5]], np.float16),
                         pack_nibbles([[3]]), 4, 4, 4)
    assert qt.dequantize().tolist() == [[-1.5, -1.0, -0.5, 6.0]]
    # symmetric: zero point 8
    qs = QuantizedTensor(pack_nibbles([[8, 0, 15, 9]]), np.array([[0.25]], np.float16), None, 4, 4, 4)
    assert qs.dequantize().tolist() == [[0.0, -2.0, 1.75, 0.25]]


def test_rtn_known_vector_and_determinism():
    w = (np.arange(16, dtype=np.float32) * 0.5)[None, :]  # 0 .. 7.5, one group of 16
    qt = quantize_rtn(w, 4, 16)
    assert qt.scales[0, 0] == np.float16(0.5)
    assert qt.codes()[0].tolist() == list(range(16))
    assert qt.zero_points()[0, 0] == 0
    np.testing.assert_array_equal(qt.dequantize(), w)
    rng = np.random.default_rng(1)
    w2 = rng.standard_normal((16, 96)).astype(np.float32)
    a, b = quantize_rtn(w2, 4, 32), quantize_rtn(w2, 4, 32)
    assert np.array_equal(a.qweight, b.qweight) and np.array_equal(a.scales, b.scales)
    assert np.all(np.abs(a.dequantize() - w2) <= _bound(a))
    np.testing.assert_allclose(fake_quantize(w2, 4, 32), a.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("symmetric", [False, True])
def test_rtn_error_bound(symmetric):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((32, 256)).astype(np.float32)
    qt = quantize_rtn(w, 4, 64, symmetric)
    assert (qt.zeros is None) == symmetric
    err = np.abs(qt.dequantize() - w)
    assert np.all(err <= _bound(qt))
    assert qt.bits_per_weight == pytest.approx(4 + 16 / 64 + (0 if symmetric else 4 / 64))


def test_int8_per_row_embedding():
    rng = np.random.default_rng(3)
    e = rng.standard_normal((50, 24)).astype(np.float32)
    qt = quantize_rtn(e, bits=8, group_size=-1)
    assert qt.qweight.dtype == np.int8 and qt.scales.shape == (50, 1) and qt.zeros is None
    np.testing.assert_allclose(qt.scales[:, 0], np.abs(e).max(1) / 127, rtol=1e-3)
    assert np.all(np.abs(qt.dequantize() - e) <= _bound(qt))
    rows = qt.dequantize(np.array([3, 7]))
    np.testing.assert_array_equal(rows, qt.dequantize()[[3, 7]])


def test_c09_zero_and_tiny_groups_no_nan():
    w = np.zeros((4, 128), np.float32)
    w[1, :64] = 1e-9  # tiny values next to an all-zero group
    w[2, 64:] = 1e5   # large but within fp16 scales
    w[3, :] = np.linspace(-1, 1, 128)
    for sym in (False, True):
        qt = quantize_rtn(w, 4, 64, sym)
        d = qt.dequantize()
        assert np.isfinite(d).all() and np.isfinite(qt.scales.astype(np.float32)).all()
        assert np.all(qt.scales.astype(np.float32) >= SCALE_EPS * 0.999)
        assert np.all(d[0] == 0)  # an all-zero row stays exactly zero
        assert np.all(np.abs(d[1]) <= 1e-4)
        assert qt.scales.dtype == np.float16
        if not sym:  # a constant group: z = 0, code 15 (the range includes 0)
            np.testing.assert_allclose(d[2, 64:], 1e5, rtol=1e-3)  # fp16 scale
        assert np.all(np.abs(d - w) <= _bound(qt) + 1e-9)


def test_c10_fp16_overflow_keeps_float32_scales(caplog):
    w = np.zeros((2, 64), np.float32)
    w[0, :32] = np.linspace(-1e6, 1e6, 32)  # range/15 = 1.3e5 > 65504
    w[1] = 0.5
    with caplog.at_level(logging.WARNING):
        qt = quantize_rtn(w, 4, 32, name="blk.overflow")
    assert qt.scales.dtype == np.float32
    assert "blk.overflow" in caplog.text and "float32" in caplog.text
    d = qt.dequantize()
    assert np.isfinite(d).all()
    assert np.all(np.abs(d - w) <= _bound(qt))


@pytest.mark.parametrize("n_in", [4304, 192, 11008])
@pytest.mark.parametrize("g", [128, 64, 32])
def test_c11_padding_rule(n_in, g):
    rng = np.random.default_rng(n_in + g)
    w = rng.standard_normal((6, n_in)).astype(np.float32)
    qt = quantize_rtn(w, 4, g)
    pad = -(-n_in // g) * g
    assert qt.in_features == n_in and qt.in_padded == pad and qt.shape == (6, n_in)
    assert qt.qweight.shape == (6, pad // 2) and qt.scales.shape == (6, pad // g)
    # padded columns hold the zero point: they dequantize to exactly 0 (C09 guard, no NaN)
    codes = qt.codes().astype(np.float32)
    z = np.repeat(qt.zero_points(), g, axis=1)
    assert np.all(codes[:, n_in:] == z[:, n_in:])
    d = qt.dequantize()
    assert np.isfinite(d).all() and np.all(np.abs(d - w) <= _bound(qt))
    x = rng.standard_normal((3, n_in)).astype(np.float32)
    y_err = np.abs(x @ d.T - x @ w.T)
    assert np.all(y_err <= np.abs(x) @ _bound(qt).T + 1e-3)  # the INT4 output bound


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="layers.0.q_proj"):
        quantize_rtn(np.array([[1.0, np.nan]], np.float32), name="layers.0.q_proj")
    with pytest.raises(ValueError):
        quantize_rtn(np.ones((2, 8), np.float32), 4, 3)  # odd group for 4 bits
    with pytest.raises(ValueError):
        quantize_rtn(np.ones(8, np.float32))


def test_effective_group_rule():
    """Converter rule: the requested group if it divides the row, else the largest dividing
    multiple of 32 below it (recorded per tensor), else the request with padding (C11)."""
    from edgeinfer.quant.rtn import effective_group

    assert effective_group(576, 128) == 96  # SmolLM2 hidden: 4.21 bpw instead of 4.63 padded
    assert effective_group(1536, 128) == 128 and effective_group(896, 128) == 128
    assert effective_group(4864, 128) == 128 and effective_group(640, 128) == 128
    assert effective_group(576, 64) == 64 and effective_group(192, 128) == 96
    assert effective_group(172, 32) == 32 and effective_group(4304, 128) == 128  # padded
    assert effective_group(100, -1) == -1
    w = np.random.default_rng(0).standard_normal((4, 576)).astype(np.float32)
    qt = quantize_rtn(w, 4, effective_group(576, 128))
    assert qt.in_padded == 576 and qt.group_size == 96 and qt.bits_per_weight < 4.5
