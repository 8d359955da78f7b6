"""Where resident memory grows during one generation: RSS steps attributed to Python frames.

usage:
  python benchmarks/rss_timeline.py MODEL [--prompt-tokens N] [--gen-tokens N] [--step MIB]

Loads MODEL (a catalog name, ``.gguf`` or ``.eif``) and runs one generation of a random-id
prompt (``speculate="off"``) while a sampler thread reads ``VmRSS`` every 0.3 ms. Each time
RSS has moved by more than ``--step`` MiB since the last report, it records the main
thread's innermost frames. Prints one JSON object: RSS after load, the run's peak
(``VmHWM`` since load), and the RSS changes summed per innermost frames (MiB; a release
counts negative), largest first. Linux only (``/proc/self/status``). Frames are where the
main thread was when the sampler saw the change, so a step can be charged to the op after
the one that allocated it.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
import traceback


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=4)
    ap.add_argument("--step", type=float, default=1.5, help="MiB change that is reported")
    a = ap.parse_args(argv)

    import numpy as np

    from edgeinfer import api
    from edgeinfer.engine import reset_peak_rss, window_peak_rss_mb

    model = api.load(a.model)
    after_load = _rss_mib()
    reset_peak_rss()
    main_id = threading.get_ident()
    last, grown, done = [after_load], collections.Counter(), threading.Event()

    def sample():
        while not done.is_set():
            r = _rss_mib()
            if abs(r - last[0]) > a.step:
                frame = sys._current_frames().get(main_id)
                if frame is not None:
                    st = traceback.extract_stack(frame)[-3:][::-1]
                    grown[" < ".join(f"{f.name}:{f.lineno}" for f in st)] += r - last[0]
                last[0] = r
            time.sleep(0.0003)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    ids = np.random.default_rng(0).integers(100, min(model.config.vocab_size, 30000),
                                            size=a.prompt_tokens).tolist()
    for _ in model.engine.stream(ids, max_tokens=a.gen_tokens, stop=(), speculate="off"):
        pass
    done.set()
    t.join()
    out = {"model": a.model, "rss_after_load_mib": round(after_load, 1),
           "run_peak_mib": round(window_peak_rss_mb(), 1),
           "rss_after_run_mib": round(_rss_mib(), 1),
           "growth_by_frame_mib": {k: round(v, 1) for k, v in grown.most_common()
                                   if abs(v) >= a.step}}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
