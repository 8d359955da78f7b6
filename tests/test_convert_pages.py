"""quant/convert.py's ``small_pages``: numpy's huge-page advice is off while a calibrated
convert quantizes its layers, and restored afterwards (also after an error)."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.quant import convert as cv

advice = getattr(getattr(np, "_core", None), "multiarray", None)
needs_switch = pytest.mark.skipif(not hasattr(advice, "_get_madvise_hugepage"),
                                  reason="this numpy has no huge-page advice switch")


@needs_switch
def test_small_pages_turns_the_advice_off_and_restores_it():
    get, set_ = advice._get_madvise_hugepage, advice._set_madvise_hugepage
    for before in (True, False):
        set_(before)
        with cv.small_pages():
            assert get() is False
        assert get() is before
        with pytest.raises(RuntimeError), cv.small_pages():
            raise RuntimeError("a failed layer")
        assert get() is before
    set_(True)


@needs_switch
def test_convert_quantizes_its_layers_with_the_advice_off(stories_dir, tmp_path, monkeypatch):
    seen = []
    real = cv.quantize_layers

    def spy(*a, **k):
        seen.append(advice._get_madvise_hugepage())
        return real(*a, **k)

    monkeypatch.setattr(cv, "quantize_layers", spy)
    advice._set_madvise_hugepage(True)
    cv.convert(str(stories_dir), str(tmp_path / "s.eif"), method="gptq", group_size=32,
               n_calib=2, calib_len=32, progress=False)
    assert seen == [False] and advice._get_madvise_hugepage() is True
