"""Subcommands of the server: serve, ps."""
from __future__ import annotations

import json
import os
import sys

from .shared import _age, _load, _table


def cmd_serve(args) -> int:
    try:
        from edgeinfer.server import ServerLimits, default_model_name, serve
    except ImportError as e:
        print(f"error: `edgeinfer serve` needs the serve extra: pip install 'edgeinfer[serve]' "
              f"({e.name} is missing)", file=sys.stderr)
        return 1
    import contextlib
    import signal

    from edgeinfer.model_store import server_state

    limits = ServerLimits(max_body=args.max_body, header_timeout=args.header_timeout,
                          body_timeout=args.body_timeout)
    model = _load(args, warm=True)  # the first request pays no kernel loading
    # a catalog name (or NAME:VARIANT) is a nicer id than the cached file's name; a path
    # gives its stem
    name = args.model_name or (default_model_name(model) if os.path.exists(args.model)
                               else args.model)
    key_note = " (API key required)" if args.api_key else ""
    state = contextlib.ExitStack()

    def listening(url: str) -> None:
        state.enter_context(server_state(model, name, url))
        par = model.pool.n if model.pool is not None else 1
        print(f"serving model id '{name}' ({model.backend.name} backend, context "
              f"{model.n_ctx} tokens, {par} in parallel) at {url}{key_note}; clients send "
              f"model=\"{name}\"; Ctrl-C stops", file=sys.stderr)

    def on_term(signum, frame):  # uvicorn re-raises SIGTERM once it has shut down: the
        state.close()            # run file goes, then the default action (exit by signal)
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    signal.signal(signal.SIGTERM, on_term)
    with state:
        serve(model, host=args.host, port=args.port, api_key=args.api_key, model_name=name,
              log_level=str(args.log_level).lower(), default_max_tokens=args.max_tokens,
              access_log=not args.quiet, limits=limits, on_listening=listening,
              queue_limit=args.queue_limit, speculate=args.speculate)
    return 0


def cmd_ps(args) -> int:
    from edgeinfer.model_store import running_servers

    servers = running_servers()
    if args.json:
        print(json.dumps([e.as_dict() for e in servers], indent=2))
        return 0
    if not servers:
        print("no edgeinfer server is running")
        return 0
    rows = [["MODEL", "PID", "URL", "BACKEND", "CONTEXT", "MEMORY", "WEIGHTS + KV", "UP"]]
    for e in servers:
        rss = "?" if e.rss_bytes is None else f"{e.rss_bytes / 2**20:.0f} MiB"
        up = _age(e.started).replace(" ago", "").replace("just now", "<1 minute")
        rows.append([e.model, str(e.pid), e.url, e.backend, f"{e.n_ctx} ({e.kv_dtype} KV)",
                     rss, f"{(e.weights_bytes + e.kv_bytes) / 2**20:.0f} MiB", up])
    print(_table(rows))
    return 0
