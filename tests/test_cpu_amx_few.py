"""The few-token AMX GEMM of 4-bit weights (backends/cpu/_amx_few.py): every (token, row)
equals the block-dot decode GEMV of that token bit for bit, across token groups of 4 / 8
(with zero-padded tokens), rows past the last 16-row panel, groups of 32 / 96 / 128 /
per-row, factored (Q4_K) scales and bias; and the backend's 4-bit linear takes it for
4 to 15 tokens where the OS grants the tiles."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.backends.cpu import CpuBackend, _amx, _amx_few, qgemm
from test_cpu_blockdot import _gemv_rows, factored_pair
from test_cpu_kernels import random_q

CPU = CpuBackend(threads=2)
needs_tiles = pytest.mark.skipif(not _amx.HAVE_AMX, reason="this CPU or OS gives no AMX tiles")


def _same(a, b):
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


@needs_tiles
@pytest.mark.parametrize("out,n_in,group,sym", [(37, 192, 32, False), (64, 576, 128, False), (9, 128, 32, False),
                                                (50, 576, 96, True), (33, 256, -1, False),
                                                (300, 896, 128, False), (96, 1536, 64, True)])
def test_few_token_gemm_equals_the_gemv_row_by_row(out, n_in, group, sym):
    rng = np.random.default_rng(out * 7 + n_in)
    h = CPU.upload_weight(random_q(rng, out, n_in, 4, group, sym))
    for t_n in (4, 5, 7, 8, 9, 11, 12, 15):
        x = rng.standard_normal((t_n, n_in)).astype(np.float32)
        x[t_n - 1, 5] = 60.0  # an outlier block in the last (possibly padded-group) token
        for bias in (None, rng.standard_normal(out).astype(np.float32)):
            y = _amx_few.gemm_few(x, h, bias)
            assert y.shape == (t_n, out)
            assert _same(y, _gemv_rows(h, x, bias)), (t_n, bias is None)
    assert np.abs(y).max() > 0


@needs_tiles
def test_few_token_gemm_reads_factored_scales():
    h, hf, rng = factored_pair(5, 48)
    x = rng.standard_normal((6, h.in_features)).astype(np.float32)
    y = _amx_few.gemm_few(x, hf, None)
    assert _same(y, _amx.gemm_rows(x, hf, None))
    assert not np.array_equal(y, _amx_few.gemm_few(x, h, None))  # the scales were read


def test_token_groups_cover_every_token_once():
    assert _amx_few.token_groups(2) == [4]
    assert _amx_few.token_groups(3) == [4]
    assert _amx_few.token_groups(4) == [4]
    assert _amx_few.token_groups(5) == [8]
    assert _amx_few.token_groups(9) == [8, 4]
    assert _amx_few.token_groups(11) == [8, 4]
    assert _amx_few.token_groups(15) == [8, 8]
    for t in range(1, 40):
        g = _amx_few.token_groups(t)
        assert sum(g) >= t > sum(g) - g[-1]


def test_the_4_bit_gemm_path_by_token_count():
    for t, tiles in [(1, "gemm_rows"), (3, "gemm_rows"), (4, "gemm_few"), (15, "gemm_few"),
                     (16, "gemm_amx"), (300, "gemm_amx")]:
        want = tiles if _amx.HAVE_AMX else "gemm_rows"
        assert qgemm.blockdot_path(t).__name__ == want, t


@needs_tiles
def test_backend_linear_of_a_few_tokens_equals_decode():
    rng = np.random.default_rng(13)
    h = CPU.upload_weight(random_q(rng, 112, 576, 4, 128, sym=False))
    x = rng.standard_normal((6, 576)).astype(np.float32)
    decode = np.stack([CPU.linear(x[t:t + 1], h)[0] for t in range(6)])
    assert _same(CPU.linear(x, h), decode)
