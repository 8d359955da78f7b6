"""The zero-point term ``sum_g sz[r, g] * xg[g]`` of the integer kernels, bit for bit
against a numpy reading of its documented order: group ``g`` in lane ``g % 8`` in group
order, then the tree ((0+1)+(2+3))+((4+5)+(6+7)). Group counts with and without a tail of
``ng % 8`` groups (the masked-load path), float32 and factored (int8 x float32 per 8
groups) zero-point rows."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from edgeinfer.backends.cpu._simd_ir import zero_term
from edgeinfer.backends.cpu.repack import SUPER_GROUPS, pack_factored


@njit(cache=False)
def _zt(sz, r, xg):
    return zero_term(sz, r, xg)


def _reference(sz_row: np.ndarray, xg: np.ndarray) -> np.float32:
    acc = np.zeros(8, np.float32)
    for g in range(xg.shape[0]):
        acc[g % 8] = np.float32(acc[g % 8] + np.float32(sz_row[g] * xg[g]))
    lanes = list(acc)
    while len(lanes) > 1:
        lanes = [np.float32(lanes[i] + lanes[i + 1]) for i in range(0, len(lanes), 2)]
    return lanes[0]


def _bits(v) -> int:
    return int(np.float32(v).view(np.uint32))


@pytest.mark.parametrize("ng", [0, 1, 5, 7, 8, 9, 15, 16, 17, 38, 152])
def test_zero_term_float_rows_in_the_documented_lane_order(ng):
    rng = np.random.default_rng(ng)
    sz = rng.standard_normal((6, ng)).astype(np.float32)
    xg = (rng.standard_normal(ng) * 100).astype(np.float32)
    got = [_zt(sz, r, xg) for r in range(6)]
    want = [_reference(sz[r], xg) for r in range(6)]
    assert [_bits(v) for v in got] == [_bits(v) for v in want]
    if ng:
        assert any(v != 0 for v in want)
        # order matters: the plain float32 sum of the same products differs somewhere
        plain = [np.float32(np.sum((sz[r] * xg).astype(np.float64))) for r in range(6)]
        assert ng < 9 or [_bits(v) for v in plain] != [_bits(v) for v in want]


@pytest.mark.parametrize("ng", [3, 8, 13, 38])
def test_zero_term_factored_rows_equal_their_float_values(ng):
    rng = np.random.default_rng(100 + ng)
    nsb = -(-ng // SUPER_GROUPS)
    q = rng.integers(-128, 128, (4, nsb * SUPER_GROUPS)).astype(np.int8)
    d = (rng.standard_normal((4, nsb)) * 0.01).astype(np.float32)
    d[1, 0] = -abs(d[1, 0])  # a negative factor: the masked lanes still add +0.0
    fac = pack_factored(q, d, ng)
    values = (q[:, :ng].astype(np.float32) * np.repeat(d, SUPER_GROUPS, axis=1)[:, :ng])
    xg = rng.standard_normal(ng).astype(np.float32)
    for r in range(4):
        got = _zt(fac, r, xg)
        assert _bits(got) == _bits(_reference(values[r], xg)) == _bits(_zt(values, r, xg))


def test_zero_term_reads_no_group_past_the_row():
    """The tail lanes are masked: a NaN after the last group (next row, or xg's padding)
    never reaches the sum."""
    sz = np.full((2, 16), np.nan, np.float32)
    sz[0, :5] = [1, 2, 3, 4, 5]
    xg = np.full(16, np.nan, np.float32)[:5]
    xg[:] = [1, 1, 1, 1, 2]
    row = np.ascontiguousarray(sz[:, :5])  # [2, 5], rows back to back
    row[1] = np.nan
    assert _zt(row, 0, xg) == np.float32(20.0)
