"""The `edgeinfer` command end to end, as a user runs it (subprocesses)."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

GOLDEN = ", there was a little girl named Lily."


def run_cli(*args, input=None, timeout=240, env=None):
    return subprocess.run([sys.executable, "-m", "cli", *args], input=input, capture_output=True,
                          text=True, timeout=timeout, env=env,
                          cwd=os.path.dirname(os.path.dirname(__file__)))


def test_generate_prints_the_golden_story(stories_dir):
    r = run_cli("generate", "-m", str(stories_dir), "--backend", "reference", "-p",
                "Once upon a time", "-n", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(GOLDEN), r.stdout


def test_bad_model_path_is_one_clear_line(tmp_path):
    r = run_cli("generate", "-m", str(tmp_path / "nope.gguf"), "-p", "hi")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr


def test_info_reports_architecture(stories_dir):
    r = run_cli("info", str(stories_dir), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["architecture"] == "llama" and info["layers"] == 5 and info["vocab"] == 512


def test_chat_piped_with_slash_commands(stories_dir, tmp_path):
    saved = tmp_path / "convo.json"
    script = f"Once upon a time\n/stats\n/save {saved}\n/help\n/exit\n"
    r = run_cli("chat", "-m", str(stories_dir), "--backend", "reference", "--temperature", "0",
                "-n", "12", input=script)
    assert r.returncode == 0, r.stderr
    assert GOLDEN[:20] in r.stdout
    assert "prompt tokens" in r.stdout  # /stats
    assert "/save FILE" in r.stdout  # /help
    convo = json.loads(saved.read_text())
    assert [m["role"] for m in convo["messages"]] == ["user", "assistant"]
    assert convo["messages"][1]["content"].startswith(GOLDEN[:20])


def test_chat_piped_exits_nonzero_when_a_message_failed(stories_dir):
    """A message that cannot be answered (invalid UTF-8; one longer than the context)
    prints one error line, the chat goes on, and the exit status says it failed."""
    script = b"Once upon a time\nBad \xff byte\n" + b"word " * 200 + b"\nOnce upon a time\n"
    r = subprocess.run([sys.executable, "-m", "cli", "chat", "-m", str(stories_dir), "--backend",
                        "reference", "--temperature", "0", "-n", "8", "--ctx", "64"],
                       input=script, capture_output=True, timeout=240,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 1, err
    assert "Traceback" not in err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 2, err
    assert "not valid Unicode" in errors[0] and "byte 0xFF" in errors[0]
    assert "tokens" in errors[1]  # the context overflow
    assert out.count(GOLDEN[:12]) == 2, out  # the first and the last message were answered


def test_chat_ctrl_c_stops_the_answer_and_keeps_the_session(stories_dir, tmp_path):
    saved = tmp_path / "after.json"
    p = subprocess.Popen([sys.executable, "-m", "cli", "chat", "-m", str(stories_dir),
                          "--backend", "reference", "--temperature", "0.9", "--seed", "1",
                          "-n", "1900", "--ctx", "2048"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        p.stdin.write("Once upon a time\n")
        p.stdin.flush()
        # wait for the answer to start streaming, then interrupt it
        got = b""
        while len(got) < 40:  # a few tokens of the answer
            ready, _, _ = select.select([p.stdout], [], [], 120)
            assert ready, f"the answer did not start: {got!r}"
            got += os.read(p.stdout.fileno(), 64)
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        p.stdin.write(f"/save {saved}\n/stats\n/exit\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert "[stopped]" in out
    convo = json.loads(saved.read_text())
    assert [m["role"] for m in convo["messages"]] == ["user", "assistant"]
    # /stats describes the interrupted answer itself, not an earlier one (there is none)
    m = re.search(r"\[interrupted after (\d+) tokens\]\n\[5 prompt tokens \(0 reused\), "
                  r"(\d+) generated; TTFT \d+ ms, prefill [\d.]+ tok/s, decode ([\d.]+) tok/s", out)
    assert m, out
    assert int(m[1]) == int(m[2]) and 2 <= int(m[1]) < 1900
    assert float(m[3]) > 0  # inter-token latency measured on the interrupted answer


def test_generate_on_opencl_matches_reference(stories_dir):
    pytest.importorskip("pyopencl", reason="pyopencl[pocl] is needed for the OpenCL backend")
    r = run_cli("generate", "-m", str(stories_dir), "--backend", "opencl", "-p",
                "Once upon a time", "-n", "12")
    if "no OpenCL platform" in r.stderr:
        pytest.skip("no OpenCL platform on this machine")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(GOLDEN), r.stdout


def test_devices_lists_something_or_says_why():
    r = run_cli("devices")
    assert r.returncode in (0, 1)
    assert r.stdout.strip() or r.stderr.strip()


# ---- first run of the default model: the pulled GGUF, no conversion; NAME:int4 when asked -----
def test_chat_runs_the_pulled_gguf_and_makes_int4_only_when_asked(smollm2_gguf, tmp_path):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    for f in smollm2_gguf.parent.glob(smollm2_gguf.name + "*"):  # the pulled GGUF + marker
        os.link(f, home / "models" / f.name)
    env = {**os.environ, "EDGEINFER_HOME": str(home)}
    script = "What is the capital of France?\n/stats\n"
    args = ("chat", "--temperature", "0", "-n", "12")
    eif = home / "models" / "smollm2-135m-instruct.int4.eif"
    first = run_cli(*args, input=script, env=env)
    assert first.returncode == 0, first.stderr
    assert "convert" not in first.stderr and not eif.exists()  # the file as pulled, natively
    assert "Paris" in first.stdout, first.stdout
    # the same model as NAME:gguf and as a path: the same greedy answer
    for ref in ("smollm2-135m-instruct:gguf", str(home / "models" / smollm2_gguf.name)):
        again = run_cli(*args, "-m", ref, input=script, env=env)
        assert again.returncode == 0, again.stderr
        assert again.stdout.split("[")[0] == first.stdout.split("[")[0]

    # NAME:int4 is the signmax INT4 file, made once when asked for
    int4 = run_cli(*args, "-m", "smollm2-135m-instruct:int4", input=script, env=env)
    assert int4.returncode == 0, int4.stderr
    assert "first run: converting smollm2-135m-instruct to INT4" in int4.stderr
    assert str(eif) in int4.stderr and "converted in" in int4.stderr
    assert eif.exists() and not list((home / "models").glob(".eif-*.tmp"))
    assert "Paris" in int4.stdout, int4.stdout
    again = run_cli(*args, "-m", "smollm2-135m-instruct:int4", input=script, env=env)
    assert again.returncode == 0 and "converted" not in again.stderr, again.stderr


def test_cold_kernels_compile_before_the_first_answer_announced_by_the_cli_only(stories_dir,
                                                                               tmp_path):
    """A fresh kernel cache: the API reports it and prints nothing; the CLI compiles the
    kernels before generating (a progress line through prefill, decode and sampling), so
    the first answer has no stall: its TTFT and mean inter-token time are those of warm
    kernels (a compile inside the answer costs seconds per kernel). The sampled chain with
    a penalty runs, so the sampler's kernels are covered too."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    code = ("import edgeinfer; m = edgeinfer.load(%r, backend='cpu'); print(m.kernels_cold)"
            % str(stories_dir))
    api = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240, env=env)
    assert api.returncode == 0 and api.stdout == "True\n" and api.stderr == "", api.stderr
    gen = ("generate", "-m", str(stories_dir), "--backend", "cpu", "-p", "Once upon a time",
           "-n", "24", "--temperature", "0.8", "--repeat-penalty", "1.1", "--seed", "3", "-v")
    cold = run_cli(*gen, env=env, timeout=600)
    assert cold.returncode == 0, cold.stderr
    line = next(x for x in cold.stderr.splitlines() if x.startswith("compiling CPU kernels"))
    assert "(first run only" in line
    assert line.index(" prefill...") < line.index(" decode...") < line.index(" sampling...")
    assert " done in " in line
    stats = re.search(r"TTFT (\d+) ms, prefill [\d.]+ tok/s, decode ([\d.]+) tok/s",
                      cold.stderr)
    assert stats, cold.stderr
    ttft_ms, decode = int(stats.group(1)), float(stats.group(2))
    assert ttft_ms < 3000 and decode > 10, cold.stderr  # no compile inside the answer
    warm = run_cli(*gen, env=env)
    assert warm.returncode == 0 and warm.stdout == cold.stdout
    assert "compiling" not in warm.stderr, warm.stderr


# ---- --quiet / --json on pull, convert, perplexity, bench -------------------------------------
def test_pull_json_and_quiet(smollm2_gguf):
    r = run_cli("pull", "smollm2-135m-instruct", "--json", "--quiet")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    info = json.loads(r.stdout)
    assert info["path"] == str(smollm2_gguf) and info["bytes"] == 98362432
    r = run_cli("pull", "smollm2-135m-instruct", "-q")
    assert r.stdout == f"{smollm2_gguf}\n" and r.stderr == ""


def test_convert_perplexity_bench_quiet_json_and_progress(stories_dir, tmp_path):
    out = tmp_path / "s.eif"
    r = run_cli("convert", str(stories_dir), "-o", str(out), "--method", "rtn", "--group-size",
                "32", "--json", "--quiet")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    rep = json.loads(r.stdout)
    assert rep["out_path"] == str(out) and rep["file_size"] == out.stat().st_size
    assert rep["method"] == "rtn" and rep["group_size"] == 32
    r = run_cli("convert", str(stories_dir), "-o", str(out), "--method", "rtn", "--group-size", "32",
                "--force")  # the file exists now: replaced only with --force
    assert r.returncode == 0 and "rtn layers" in r.stderr  # the progress bar
    assert re.fullmatch(r"wrote .*s\.eif: [\d.]+ MiB, [\d.]+ bits/weight in all, linear layers "
                        r"4\.\d\d-4\.\d\d \(rtn, group 32\) in [\d.]+ s, peak RSS \d+ MiB\n",
                        r.stdout), r.stdout
    # the group rule is reported: stories260K's 64-wide rows take 64, its 172-wide 128 (padded)
    r = run_cli("convert", str(stories_dir), "-o", str(out), "--method", "rtn", "-q", "--force")
    assert "(rtn, group 128, 64 where 128 does not divide the row)" in r.stdout, r.stdout

    text = tmp_path / "t.txt"
    text.write_text("Once upon a time, there was a little girl named Lily. She liked to play. " * 40)
    ppl = ("perplexity", str(out), "--backend", "reference", "--text", str(text), "--chunk", "64",
           "--chunks", "2")
    r = run_cli(*ppl, "--json", "--quiet")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    res = json.loads(r.stdout)
    assert res["chunks"] == 2 and 1.0 < res["ppl"] < 50
    r = run_cli(*ppl)
    assert "perplexity" in r.stderr and r.stdout.startswith(f"perplexity {res['ppl']:.4f} over")

    bench = ("bench", str(out), "--backend", "reference", "--prompt-tokens", "8",
             "--gen-tokens", "4", "--repeat", "2")
    r = run_cli(*bench, "--json", "--quiet")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    b = json.loads(r.stdout)
    assert b["prompt_tokens"] == 8 and len(b["generated"]) == 2 and b["decode_tok_s"] > 0
    r = run_cli(*bench)
    assert r.returncode == 0 and "bench" in r.stderr and "2/2" in r.stderr
    assert re.search(r"^decode_tok_s +[\d.]+$", r.stdout, re.M), r.stdout


# ---- the chat prompt in a terminal (a pty): /help, /quit, Ctrl-D ------------------------------
def _pty_chat(stories_dir, keys: list[str], timeout=120) -> tuple[bytes, int]:
    """Run ``edgeinfer chat`` on a pty; send each key string after the next ">>> " prompt.

    Returns (everything the terminal showed, exit status)."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI with the pty as its terminal
        os.chdir(os.path.dirname(os.path.dirname(__file__)))
        os.execv(sys.executable, [sys.executable, "-m", "cli", "chat", "-m", str(stories_dir),
                                  "--backend", "reference", "--temperature", "0", "-n", "8"])
    shown, deadline, sent = b"", time.monotonic() + timeout, 0
    try:
        while True:
            if shown.count(b">>> ") > sent and sent < len(keys):
                os.write(fd, keys[sent].encode())
                sent += 1
            assert time.monotonic() < deadline, shown
            ready, _, _ = select.select([fd], [], [], 1)
            if ready:
                try:
                    data = os.read(fd, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                shown += data
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return shown, os.waitstatus_to_exitcode(status)


def test_sampling_flags_over_the_models_defaults_over_DEFAULTS():
    """chat: a flag given > the model's generation config > CHAT_BASE (DEFAULTS with a
    repetition penalty 1.1); generate passes only the flags given (the API then is
    greedy with DEFAULTS). No flag default is a table of its own."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    import cli
    from edgeinfer.sampling import DEFAULTS, sampling_defaults

    class Model:
        def sampling_defaults(self, base):
            return sampling_defaults({"temperature": 0.2, "top_p": 0.9}, base)

    args = cli.build_parser().parse_args(["chat", "--top-p", "0.5", "--seed", "3"])
    assert cli._sampling(args, Model()) == {
        "temperature": 0.2, "top_p": 0.5, "top_k": DEFAULTS.top_k, "min_p": DEFAULTS.min_p,
        "repetition_penalty": 1.1, "seed": 3}
    args = cli.build_parser().parse_args(["generate", "-p", "x", "--top-k", "5"])
    assert cli._sampling(args) == {"top_k": 5}
    args = cli.build_parser().parse_args(["generate", "-p", "x"])
    assert cli._sampling(args) == {}


def test_chat_help_lists_quit_and_ctrl_d_ends_on_a_fresh_line(stories_dir):
    shown, code = _pty_chat(stories_dir, ["/help\n", "\x04"])
    assert code == 0, shown
    assert b"/exit, /quit     quit (or Ctrl-D)" in shown, shown
    # Ctrl-D at the prompt: a newline after ">>> ", so the shell prompt starts a new line
    assert shown.endswith(b">>> \r\n"), shown[-80:]


def test_chat_quit_command_exits(stories_dir):
    shown, code = _pty_chat(stories_dir, ["/quit\n"])
    assert code == 0 and shown.count(b">>> ") == 1, shown
    r = run_cli("chat", "-m", str(stories_dir), "--backend", "reference", input="/quit\n")
    assert r.returncode == 0 and r.stdout == "", r.stdout


def _read_some(p, n: int, timeout: float = 300) -> bytes:
    """At least ``n`` more bytes of ``p``'s stdout (a pipe)."""
    got = b""
    while len(got) < n:
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        assert ready, f"no output for {timeout} s: {got!r}"
        chunk = os.read(p.stdout.fileno(), 256)
        assert chunk, f"stdout closed: {got!r}"
        got += chunk
    return got


def test_chat_after_ctrl_c_reuses_the_partial_answer(smollm2_gguf):
    """SmolLM2 (a chat template): the turn after an interrupted answer reuses the KV of the
    whole partial answer, exactly as generated, not only the prompt before it. (Where
    the sampled ids are not the tokenizer's spelling of the text, see
    tests/test_conversation.py::test_a_reply_sampled_off_the_canonical_tokenization_...)"""
    p = subprocess.Popen([sys.executable, "-m", "cli", "chat", "-m", str(smollm2_gguf),
                          "--backend", "cpu", "--seed", "1", "-n", "400", "--ctx", "1024"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        out = b""
        for message in ("Explain quantum computing in simple terms.", "Go on."):
            p.stdin.write(message.encode() + b"\n")
            p.stdin.flush()
            out += _read_some(p, 60)  # a few tokens of the answer, then Ctrl-C
            p.send_signal(signal.SIGINT)
            time.sleep(0.5)
            p.stdin.write(b"/stats\n")
            p.stdin.flush()
            while not re.search(rb"peak RSS \d+ MiB\]\n$", out):
                out += _read_some(p, 1)
        p.stdin.write(b"/exit\n")
        p.stdin.flush()
        rest, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    text = (out + rest).decode()
    assert p.returncode == 0, err
    stats = re.findall(r"\[interrupted after (\d+) tokens\]\n\[(\d+) prompt tokens \((\d+) "
                       r"reused\), (\d+) generated", text)
    assert len(stats) == 2 and text.count("[stopped]") == 2, text
    (n1, p1, r1, g1), (n2, p2, r2, g2) = [tuple(map(int, s)) for s in stats]
    assert r1 == 0 and n1 == g1 >= 2 and n2 == g2 >= 1
    # the second prompt holds the first one, the partial answer and "Go on.": all of the
    # first prompt and of the partial answer (g1 tokens) come from the cache
    assert r2 == p1 + g1, text
    assert p2 > r2


def test_convert_gptq_rotation_and_grid_flags(stories_dir, tmp_path):
    """`--no-rotate --gptq-grid minmax` reach the converter (recorded in the file); the
    default rotates stories260K (a llama) and searches its groups."""
    from edgeinfer.container import describe_eif

    text = tmp_path / "c.txt"
    text.write_text("Once upon a time, there was a little girl named Lily. She liked to play. " * 40)
    common = ("--method", "gptq", "--group-size", "32", "--calib", str(text), "--n-calib", "2", "-q")
    out = tmp_path / "plain.eif"
    r = run_cli("convert", str(stories_dir), "-o", str(out), *common, "--no-rotate",
                "--gptq-grid", "minmax")
    assert r.returncode == 0, r.stderr
    prov = describe_eif(out)["provenance"]
    assert prov["rotation"] is None and prov["gptq_grid"] == "minmax"
    out = tmp_path / "rot.eif"
    r = run_cli("convert", str(stories_dir), "-o", str(out), *common)
    assert r.returncode == 0, r.stderr
    prov = describe_eif(out)["provenance"]
    assert prov["rotation"]["residual"] == "random orthogonal" and prov["gptq_grid"] == "mse"
    r = run_cli("convert", str(stories_dir), "-o", str(tmp_path / "v.eif"), "--method", "gptq",
                "--group-size", "32", "--calib", str(text), "--n-calib", "2")
    assert r.returncode == 0 and "(gptq, group 32, rotated, mse grid)" in r.stdout, r.stdout
    for flags in (("--rotate",), ("--gptq-grid", "minmax"), ("--method", "awq", "--rotate")):
        r = run_cli("convert", str(stories_dir), "-o", str(tmp_path / "w.eif"), *flags)
        assert r.returncode == 2 and "to --method gptq or gptaq only" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "w.eif").exists()


def test_convert_gptaq_method(stories_dir, tmp_path):
    """`--method gptaq` writes a GPTQ file fitted to the float model (recorded, and said in
    the summary line) that differs from plain GPTQ's; it refuses --no-true-sequential.
    GPTQ is the method of a --calib without --method."""
    from edgeinfer.container import describe_eif, read_eif

    text = tmp_path / "c.txt"
    text.write_text("Once upon a time, there was a little girl named Lily. She liked to play. " * 40)
    common = ("--group-size", "32", "--calib", str(text), "--n-calib", "2", "--no-rotate")
    outs = {}
    for m in ("gptq", "gptaq"):
        outs[m] = tmp_path / f"{m}.eif"
        r = run_cli("convert", str(stories_dir), "-o", str(outs[m]), "--method", m, *common)
        assert r.returncode == 0, r.stderr
        assert f"({m}, group 32, not rotated, mse grid)" in r.stdout, r.stdout
    r = run_cli("convert", str(stories_dir), "-o", str(tmp_path / "d.eif"), *common)
    assert r.returncode == 0 and "(gptq, group 32," in r.stdout, r.stdout  # --calib's default
    prov = describe_eif(outs["gptaq"])["provenance"]
    assert prov["method"] == "gptaq" and prov["gptaq"]["alpha"] == 0.5
    assert prov["gptaq"]["float_sequences"] == 2
    assert describe_eif(outs["gptq"])["provenance"]["gptaq"] is None
    a, b = (read_eif(str(outs[m])).tensors["model.layers.1.mlp.down_proj.weight"].codes()
            for m in ("gptq", "gptaq"))
    assert (a != b).mean() > 0.01
    r = run_cli("convert", str(stories_dir), "-o", str(tmp_path / "w.eif"), "--method", "gptaq",
                "--no-true-sequential", *common)
    assert r.returncode == 2 and "--method gptaq needs --true-sequential" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "w.eif").exists()
