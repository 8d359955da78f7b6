"""benchmarks/bench_cpu.py's fairness machinery: the peer's environment, its files, its
failure message (the timings themselves are not tested here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import llamacpp_peer as peer  # noqa: E402

# a stand-in for peer_bench.py: reports the environment it was started with
DUMP_ENV = "import json, os; print(json.dumps({'env': dict(os.environ)}))"

# a process that starts like bench_cpu.py (captures its environment at import), then
# imports and runs edgeinfer's CPU backend, then adds a variable of its own (as a library
# might), then starts the peer
BENCH_PROCESS = r"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import bench_cpu
import numpy as np
from edgeinfer.backends.cpu import CpuBackend
be = CpuBackend(threads=2)
be.rmsnorm(np.ones((64, 1024), np.float32), np.ones(1024, np.float32), 1e-5)
os.environ["EDGEINFER_TEST_ADDED"] = "1"
policy = None if sys.argv[3] == "-" else sys.argv[3]
env = bench_cpu.peer.peer_env(bench_cpu.USER_ENV, policy)
r = bench_cpu.peer.run_peer(Path("model.gguf"), 1, 1, 2, env, Path(sys.argv[2]))
print(json.dumps(r["env"]))
"""


def _bench_process(tmp_path, policy: str | None) -> tuple[dict, dict]:
    script = tmp_path / "dump_env.py"
    script.write_text(DUMP_ENV)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    env.update(LC_ALL="C.UTF-8", EDGEINFER_TEST_USER_VAR="kept")  # no locale coercion
    r = subprocess.run([sys.executable, "-c", BENCH_PROCESS, str(BENCH), str(script),
                        policy or "-"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return env, json.loads(r.stdout.strip().splitlines()[-1])


def test_peer_gets_exactly_the_users_environment(tmp_path):
    user, seen = _bench_process(tmp_path, None)
    assert seen == user
    assert "OMP_WAIT_POLICY" not in seen and "EDGEINFER_TEST_ADDED" not in seen
    assert seen["EDGEINFER_TEST_USER_VAR"] == "kept"


def test_tuning_both_sides_adds_only_the_wait_policy(tmp_path):
    user, seen = _bench_process(tmp_path, "ACTIVE")
    assert seen == {**user, "OMP_WAIT_POLICY": "ACTIVE"}


def test_peer_env_copies_and_adds_nothing_else():
    user = {"PATH": "/bin", "X": "1"}
    env = peer.peer_env(user)
    assert env == user and env is not user
    assert peer.peer_env(user, "PASSIVE") == {"PATH": "/bin", "X": "1",
                                              "OMP_WAIT_POLICY": "PASSIVE"}
    assert user == {"PATH": "/bin", "X": "1"}


def test_a_peer_that_dies_with_sigill_names_the_rebuild(tmp_path):
    script = tmp_path / "sigill.py"
    script.write_text("import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    with pytest.raises(peer.PeerError) as e:
        peer.run_peer(Path("m.gguf"), 1, 1, 1, dict(os.environ), script)
    assert "SIGILL" in str(e.value)
    assert "CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python==0.3.36" in str(e.value)
    # other failures say the exit status and the peer's last words, not SIGILL
    script.write_text("import sys; sys.stderr.write('no such model'); sys.exit(3)")
    with pytest.raises(peer.PeerError) as e:
        peer.run_peer(Path("m.gguf"), 1, 1, 1, dict(os.environ), script)
    assert "exit status 3" in str(e.value) and "no such model" in str(e.value)
    assert "SIGILL" not in str(e.value)


def _check_f32_copy(src: Path, out: Path) -> None:
    """out: every field of src (file type ALL_F32), every tensor dequantized exactly; and
    edgeinfer reads both to the same config and weights."""
    import gguf

    from edgeinfer.readers.gguf import read_gguf
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(out)
    skip = {"general.file_type", "general.quantization_version"}
    fa = {k for k in a.fields if not k.startswith("GGUF.") and k not in skip}
    fb = {k for k in b.fields if not k.startswith("GGUF.") and k not in skip}
    assert fa == fb
    for k in fa:
        assert a.fields[k].types == b.fields[k].types, k
        assert a.fields[k].contents() == b.fields[k].contents(), k
    assert b.fields["general.file_type"].contents() == peer.FTYPE_ALL_F32
    assert peer.gguf_format(out) == "ALL_F32"
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert tb.tensor_type == gguf.GGMLQuantizationType.F32
        assert list(ta.shape) == list(tb.shape), ta.name
        want = gguf.quants.dequantize(ta.data, ta.tensor_type)
        np.testing.assert_array_equal(np.asarray(tb.data).reshape(want.shape), want)
    sa, sb = read_gguf(src, native=False), read_gguf(out, native=False)  # float32 both sides
    assert sa.config == sb.config and sa.tokenizer_json == sb.tokenizer_json
    assert sa.chat_template == sb.chat_template
    for name in sa.tensors:
        np.testing.assert_array_equal(sa.tensors[name], sb.tensors[name], err_msg=name)


def test_f32_gguf_copies_metadata_and_weights(stories_gguf, tmp_path):
    out = peer.f32_gguf(stories_gguf, tmp_path / "s-f32.gguf")
    _check_f32_copy(stories_gguf, out)
    mtime = out.stat().st_mtime_ns
    assert peer.f32_gguf(stories_gguf, out) == out and out.stat().st_mtime_ns == mtime  # reused
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.slow
def test_f32_gguf_of_a_quantized_catalog_model(smollm2_gguf, tmp_path):
    # Q4_1 / Q8_0 tensors: the dequantization path; the tokenizer with 49k tokens + merges
    _check_f32_copy(smollm2_gguf, peer.f32_gguf(smollm2_gguf, tmp_path / "m-f32.gguf"))


def _llama_cpp_runs() -> str | None:
    """None when llama.cpp loads on this CPU, else why not."""
    r = subprocess.run([sys.executable, "-c", "import llama_cpp; llama_cpp.llama_backend_init()"],
                       capture_output=True, text=True)
    if r.returncode == 0:
        return None
    return f"llama.cpp does not run here (exit {r.returncode}): {r.stderr[-300:]}"


@pytest.mark.slow
def test_q4_0_from_the_f32_gguf_loads_in_llama_cpp(stories_gguf, tmp_path):
    why = _llama_cpp_runs()
    if why:
        pytest.skip(why)
    f32 = peer.f32_gguf(stories_gguf, tmp_path / "s-f32.gguf")
    q4 = peer.q4_0_gguf(f32, tmp_path / "s-q4_0.gguf", dict(os.environ))
    assert peer.gguf_format(q4) == "MOSTLY_Q4_0"
    script = Path(__file__).resolve().parents[2] / "shared" / "peer" / "peer_bench.py"
    r = peer.run_peer(q4, 16, 4, 1, dict(os.environ), script if script.exists() else peer.PEER)
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0


def test_ours_eif_quantizes_the_dequantized_catalog_weights(smollm2_gguf, tmp_path, monkeypatch):
    """The Q4_1 / Q8_0 catalog file: ours is RTN of its float32 weights (the reader's native
    blocks once reached RTN as objects and failed)."""
    import bench_cpu
    from edgeinfer.container import read_eif
    from edgeinfer.quant.rtn import quantize_rtn
    from edgeinfer.readers.gguf import read_gguf

    monkeypatch.setattr(bench_cpu.peer, "cache_dir", lambda: tmp_path)
    out = bench_cpu.ours_eif(smollm2_gguf, 128, 8)
    assert out.parent == tmp_path and out.exists()
    got = read_eif(out).tensors
    src = read_gguf(smollm2_gguf, native=False).tensors
    emb = quantize_rtn(src["model.embed_tokens.weight"], bits=8, group_size=-1)
    np.testing.assert_array_equal(got["model.embed_tokens.weight"].dequantize(), emb.dequantize())
    q = quantize_rtn(src["model.layers.3.mlp.up_proj.weight"], bits=4, group_size=128)
    np.testing.assert_array_equal(got["model.layers.3.mlp.up_proj.weight"].dequantize(),
                                  q.dequantize())
    assert bench_cpu.ours_eif(smollm2_gguf, 128, 8) == out  # cached
