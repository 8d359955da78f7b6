"""Block-dot numerics of 5- and 8-bit weights on AMX CPUs (backends/cpu/_blockdot.py,
_amx_few.py, _amx.py): the 5-bit row kernels follow the documented float steps (nibbles
and fifth bits of Q5_0 / Q5_1; the 8-bit ones: tests/test_cpu_blockdot.py); the GEMM of
every token count (the row kernels below the tiles' thresholds, then the few-token
tiles: 8-bit codes loaded straight from the rows, 5-bit unpacked with their fifth bits;
5-bit from 32 tokens the 16-token tiles) equals the decode GEMV row by row, bit for bit;
the backend's linear and logits take these paths."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.backends.cpu import CpuBackend, _amx, _amx_few, _blockdot, gemv, qgemm
from edgeinfer.backends.cpu.gemv import _finish_rows
from edgeinfer.backends.cpu.repack import term_values
from edgeinfer.readers.gguf_blocks import relayout
from test_cpu_blockdot import _act, _emulate, _gemv_rows, rows_of
from test_cpu_kernels import random_q
from test_gguf_q5 import q5_blocks

CPU = CpuBackend(threads=2)
pytestmark = pytest.mark.skipif(not _blockdot.BLOCKDOT,
                                reason="8-bit weights keep the lane numerics without AMX-INT8")
needs_tiles = pytest.mark.skipif(not _amx.HAVE_AMX, reason="this CPU or OS gives no AMX tiles")


def _same(a, b):
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_the_8bit_gemv_is_the_block_dot_one():
    rng = np.random.default_rng(3)
    h = CPU.upload_weight(random_q(rng, 300, 576, 8, -1))
    x = rng.standard_normal((1, 576)).astype(np.float32)
    y = np.empty(300, np.float32)
    gemv.gemv_quant(y, x[0], h, None, CPU.act_scratch)
    assert _same(y, _gemv_rows(h, x, None)[0])


@pytest.mark.parametrize("out,n_in,group", [(37, 192, 32), (64, 800, 32), (300, 896, -1),
                                            (16, 576, 128), (9, 70, 64)])
def test_8bit_gemm_equals_the_gemv_row_by_row(out, n_in, group):
    rng = np.random.default_rng(out + n_in)
    _assert_gemms_equal_the_gemv(CPU.upload_weight(random_q(rng, out, n_in, 8, group)), rng)


def _assert_gemms_equal_the_gemv(h, rng):
    """Every GEMM path of ``h`` (the backend's, the row kernels, the few-token and, 5-bit,
    the 16-token tiles) equals the backend's decode GEMV of each token, for 2-33 tokens
    (the GEMV itself: the ``*_gemv_is_the_block_dot_one`` tests)."""
    for t_n in (2, 3, 4, 5, 8, 9, 15, 16, 17, 33):
        x = rng.standard_normal((t_n, h.in_features)).astype(np.float32)
        x[t_n - 1, 5] = 60.0
        for bias in (None, rng.standard_normal(h.out_features).astype(np.float32)):
            want = np.stack([CPU.linear(x[t:t + 1], h, bias)[0] for t in range(t_n)])
            assert _same(qgemm.gemm_int(x, h, bias), want), (t_n, bias is None)
            assert _same(_amx.gemm_rows(x, h, bias), want)
            if _amx.HAVE_AMX and t_n >= 3:
                assert _same(_amx_few.gemm_few(x, h, bias), want), t_n
            if _amx.HAVE_AMX and t_n >= 9 and h.bits != 8:  # 16-token tiles, padded past T
                assert _same(_amx.gemm_amx(x, h, bias), want), t_n
    assert np.abs(want).max() > 0


def test_the_8bit_gemm_path_by_token_count():
    for t, tiles in [(1, "gemm_rows"), (2, "gemm_rows"), (3, "gemm_few"), (16, "gemm_few"),
                     (300, "gemm_few")]:
        want = tiles if _amx.HAVE_AMX else "gemm_rows"
        assert qgemm.blockdot_path(t, 8).__name__ == want, t


def test_backend_8bit_linear_and_logits_equal_decode():
    rng = np.random.default_rng(21)
    h = CPU.upload_weight(random_q(rng, 200, 576, 8, -1))
    x = rng.standard_normal((7, 576)).astype(np.float32)
    decode = np.stack([CPU.linear(x[t:t + 1], h)[0] for t in range(7)])
    assert _same(CPU.linear(x, h), decode)
    assert _same(CPU.logits(x, h), np.stack([CPU.logits(x[t:t + 1], h)[0] for t in range(7)]))


def _codes5(h) -> np.ndarray:
    """int64 [out, nb * 32]: the 5-bit codes of ``h`` read from its packed chunks."""
    wp = h.wp.astype(np.int64)
    out, nb = h.out_features, h.n_blocks
    c = np.zeros((out, nb * 32), np.int64)
    for b in range(nb):
        c0, half = (b // 2) * 40, b % 2
        for j in range(32):
            code = (wp[:, c0 + j] >> (4 * half)) & 15
            code |= ((wp[:, c0 + 32 + 4 * half + (j >> 3)] >> (j & 7)) & 1) << 4
            c[:, 32 * b + j] = code
    return c


def _q5_weight(seed: int, qname: str, out: int, nblk: int):
    rng = np.random.default_rng(seed)
    h = CPU.upload_weight(relayout(q5_blocks(rng, qname, out, nblk), qname, "t", "x.gguf"))
    assert h.bits == 5
    return h, rng


@pytest.mark.parametrize("qname,out,nblk", [("Q5_0", 37, 6), ("Q5_1", 13, 18), ("Q5_0", 9, 7),
                                            ("Q5_1", 6, 28)])
def test_5bit_rows_follow_the_documented_float_steps(qname, out, nblk):
    h, rng = _q5_weight(out * nblk, qname, out, nblk)
    codes = _codes5(h)
    assert codes.min() == 0 and codes.max() == 31
    for scale in (1.0, 1e-3, 50.0):
        x = (rng.standard_normal(h.in_features) * scale).astype(np.float32)
        x[3] = 40 * scale
        xq, dx, _ = _act(h, x)
        y = np.full(out, np.nan, np.float32)
        _rows5(y, h.wp, h.sc, xq, dx, h.bmap, h.n_blocks)
        want = _emulate(codes, term_values(h.sc, h.n_blocks), xq, dx, h.bmap)
        assert _same(y, want)
        assert np.abs(want).max() > 0


_rows5 = rows_of(_blockdot.BLOCKDOT_ROWS5[4], _blockdot.BLOCKDOT_ROWS5[1])


@pytest.mark.parametrize("qname,out,nblk", [("Q5_0", 37, 6), ("Q5_1", 64, 18), ("Q5_0", 300, 28),
                                            ("Q5_1", 16, 7)])
def test_5bit_gemm_equals_the_gemv_row_by_row(qname, out, nblk):
    h, rng = _q5_weight(out + nblk, qname, out, nblk)
    _assert_gemms_equal_the_gemv(h, rng)


def test_the_5bit_gemv_is_the_block_dot_one():
    h, rng = _q5_weight(5, "Q5_0", 40, 10)
    x = rng.standard_normal(h.in_features).astype(np.float32)
    xq, dx, xg = _act(h, x)
    xg *= np.float32(h.zero_scale)
    want = np.empty(40, np.float32)
    _rows5(want, h.wp, h.sc, xq, dx, h.bmap, h.n_blocks)
    _finish_rows(want, 0, 40, h.sz, xg, np.zeros(0, np.float32))
    y = np.empty(40, np.float32)
    gemv.gemv_quant(y, x, h, None, CPU.act_scratch)
    assert _same(y, want)


def test_the_5bit_gemm_path_by_token_count():
    for t, tiles in [(1, "gemm_rows"), (2, "gemm_rows"), (3, "gemm_few"), (31, "gemm_few"),
                     (32, "gemm_amx"), (300, "gemm_amx")]:
        want = tiles if _amx.HAVE_AMX else "gemm_rows"
        assert qgemm.blockdot_path(t, 5).__name__ == want, t
