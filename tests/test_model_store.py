"""Model management with ollama's habits, through the CLI in a private cache:
``list`` / ``rm`` / ``ps``, ``convert NAME --method M`` into the cache as ``NAME:M``
(keeping the model card's sampling), and ``NAME:VARIANT`` accepted by every command."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli import run_cli

NAME = "smollm2-135m-instruct"


@pytest.fixture
def home(smollm2_gguf, tmp_path):
    """$EDGEINFER_HOME with the pulled SmolLM2 GGUF hard-linked in (no copy, no download)."""
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    for f in smollm2_gguf.parent.glob(smollm2_gguf.name + "*"):
        os.link(f, models / f.name)
    return tmp_path / "home"


def cli(home, *args, **kw):
    return run_cli(*args, env={**os.environ, "EDGEINFER_HOME": str(home)}, **kw)


def test_list_convert_into_the_cache_use_by_variant_and_rm(home):
    r = cli(home, "list", "--json")
    assert r.returncode == 0, r.stderr
    (entry,) = json.loads(r.stdout)
    assert (entry["ref"], entry["format"], entry["method"], entry["size"], entry["last_used"]) \
        == (f"{NAME}:gguf", "gguf", "gguf Q4_1", 98362432, None)

    r = cli(home, "convert", NAME, "--method", "rtn", "-q", timeout=600)
    assert r.returncode == 0, r.stderr
    out = home / "models" / f"{NAME}.rtn.eif"
    assert f"run it as -m {NAME}:rtn" in r.stdout and out.exists()
    # the model card's sampling travelled into the file (a GGUF carries none)
    from edgeinfer import api
    from edgeinfer.container import describe_eif
    from edgeinfer.readers import read_model

    gen = describe_eif(out)["generation"]
    assert (gen["temperature"], gen["top_p"]) == (0.2, 0.9)
    assert api.Model(read_model(str(out)), backend="reference").sampling_defaults()[
        "temperature"] == 0.2  # what the server and the chat take for omitted fields
    again = cli(home, "convert", NAME, "--method", "rtn", "-q")
    assert again.returncode == 1 and f"edgeinfer rm {NAME}:rtn" in again.stderr

    r = cli(home, "generate", "-m", f"{NAME}:rtn", "--backend", "reference", "-p",
            "The capital of France is", "-n", "4")
    assert r.returncode == 0, r.stderr
    r = cli(home, "info", f"{NAME}:rtn", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["path"] == str(out)
    listed = {e["ref"]: e for e in json.loads(cli(home, "list", "--json").stdout)}
    assert set(listed) == {f"{NAME}:gguf", f"{NAME}:rtn"}
    assert listed[f"{NAME}:rtn"]["method"] == "rtn int4 g128"
    assert time.time() - listed[f"{NAME}:rtn"]["last_used"] < 600
    assert listed[f"{NAME}:gguf"]["last_used"] is None
    table = cli(home, "list").stdout.splitlines()
    assert table[0].split() == ["NAME", "SIZE", "FORMAT", "METHOD", "LAST", "USED", "PATH"]

    missing = cli(home, "generate", "-m", f"{NAME}:gptq", "-p", "x")
    assert missing.returncode == 1
    assert f"edgeinfer convert {NAME} --method gptq" in missing.stderr

    r = cli(home, "rm", f"{NAME}:rtn")
    assert r.returncode == 0 and not out.exists() and (home / "models" / f"{NAME}.gguf").exists()
    r = cli(home, "rm", f"{NAME}:awq")
    assert r.returncode == 1 and f"{NAME}:gguf" in r.stderr  # says what is there
    r = cli(home, "rm", NAME)
    assert r.returncode == 0 and f"{NAME}.gguf.sha256" in r.stdout
    assert sorted(p.name for p in (home / "models").iterdir() if not p.name.startswith(".")) == []
    assert "no models" in cli(home, "list").stdout


def test_ps_shows_a_running_server_and_forgets_it_at_exit(stories_dir, tmp_path):
    import socket

    home = tmp_path / "home"
    env = {**os.environ, "EDGEINFER_HOME": str(home)}
    with socket.socket() as s:  # a free loopback port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = subprocess.Popen([sys.executable, "-m", "cli", "serve", "-m", str(stories_dir),
                            "--backend", "reference", "--port", str(port), "--quiet"],
                           env=env, stderr=subprocess.PIPE, text=True,
                           cwd=Path(__file__).resolve().parents[1])
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "serving model id" not in line and time.monotonic() < deadline:
            line = srv.stderr.readline()
            assert line or srv.poll() is None, "the server exited"
        assert "serving model id 'stories260K'" in line and "context 2048 tokens" in line, line
        r = run_cli("ps", "--json", env=env)
        (e,) = json.loads(r.stdout)
        assert (e["model"], e["pid"], e["backend"], e["n_ctx"]) == ("stories260K", srv.pid,
                                                                    "reference", 2048)
        assert e["url"] == f"http://127.0.0.1:{port}/v1"
        assert e["rss_bytes"] > 10 * 2**20 and e["kv_bytes"] > 0
        assert "stories260K" in run_cli("ps", env=env).stdout
    finally:
        srv.send_signal(signal.SIGINT)
        srv.wait(30)
    assert not list((home / "run").glob("serve-*.json"))
    assert "no edgeinfer server is running" in run_cli("ps", env=env).stdout


def test_ps_drops_the_state_of_a_server_that_died(tmp_path):
    from edgeinfer.model_store import running_servers

    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    state = {"pid": dead.pid, "model": "m", "path": "", "url": "u", "backend": "cpu",
             "n_ctx": 1, "kv_dtype": "int8", "started": 0.0, "weights_bytes": 0,
             "kv_bytes": 0}
    (run / f"serve-{dead.pid}.json").write_text(json.dumps(state))
    assert running_servers(tmp_path / "models") == []
    assert not (run / f"serve-{dead.pid}.json").exists()
