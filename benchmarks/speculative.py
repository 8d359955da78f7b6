"""Prompt-lookup speculative decoding: decode speed with and without, same output.

    python benchmarks/speculative.py [--model PATH_OR_CATALOG_NAME] [--threads 2] [--json]
        [--slopes 0.1,0.2,0.4,0.63,1]

Two greedy chat requests, each run with ``speculate="off"``, ``"ngram"`` and ``"auto"``
(after one warm-up generation): a code edit (rewrite a given ~300-token Python function with one
small change: its output repeats most of the prompt) and a free chat question. Prints
per request: generated tokens, decode tok/s (generated tokens after the first over their
time) of each run and the ratios to "off", drafted / accepted counts, forward calls
(decode steps plus verifies) and the rows they ran, and whether the outputs are
identical token for token. Default model: Qwen2.5-Coder-0.5B-Instruct (catalog).

Modelled speed-ups (deterministic, whatever the machine's load): the greedy output of
"off" is replayed through the real :class:`edgeinfer.speculative.Speculator` on a
:class:`ReplayEngine` whose verify of k drafts costs ``1 + slope * k`` decode steps (and
whose clock reports exactly that to ``auto``), for each ``--slopes`` value; the speed-up
is (generated - 1) decode steps over the modelled cost.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import edgeinfer
from edgeinfer.speculative import Speculator

FUNCTION = '''def summarize_orders(orders, currency="EUR", min_total=0.0):
    """Group orders by customer and return per-customer totals, sorted by total."""
    totals = {}
    counts = {}
    for order in orders:
        customer = order.get("customer")
        if customer is None:
            continue
        amount = 0.0
        for item in order.get("items", []):
            price = float(item.get("price", 0.0))
            quantity = int(item.get("quantity", 1))
            if quantity <= 0:
                continue
            amount += price * quantity
        if order.get("currency", currency) != currency:
            rate = order.get("rate", 1.0)
            amount = amount * rate
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1
    result = []
    for customer, total in totals.items():
        if total < min_total:
            continue
        average = total / counts[customer]
        result.append({
            "customer": customer,
            "total": round(total, 2),
            "orders": counts[customer],
            "average": round(average, 2),
            "currency": currency,
        })
    result.sort(key=lambda row: row["total"], reverse=True)
    return result
'''

REQUESTS = {
    "code_edit": ("Rewrite this Python function so that the variable `totals` is named "
                  "`sums` everywhere. Reply with the complete function only, in one "
                  "```python block.\n\n```python\n" + FUNCTION + "```"),
    "free_chat": "Write a short story about a lighthouse keeper who finds a message in a "
                 "bottle.",
}


class _Cache:
    def __init__(self, length: int):
        self.length = length

    def trim(self, n: int) -> None:
        self.length = min(self.length, n)


class ReplayEngine:
    """The parts of :class:`edgeinfer.engine.Engine` a :class:`Speculator` uses, replaying
    a known greedy continuation instead of running a model.

    A forward of M ids at cache position p returns rows [M, 1] holding the ids that
    follow positions p .. p + M - 1 in ``prompt + output`` (-1 past its end): the greedy
    token of every row whose prefix was the true one, which are the only rows a greedy
    stream reads. Each forward adds ``cost(M)`` to :attr:`t` (read by :meth:`clock`) and
    M to :attr:`forwards`.
    """

    def __init__(self, prompt, output, cost, n_ctx: int = 1 << 20, prefill_chunk: int = 512):
        self.seq = [int(t) for t in (*prompt, *output)]
        self.cached_ids = [int(t) for t in prompt]
        self.cache = _Cache(len(prompt))
        self.model = self
        self.n_ctx, self.prefill_chunk = n_ctx, prefill_chunk
        self._switch, self._cache_long = None, False
        self.cost = cost
        self.t = 0.0
        self.forwards: list[int] = []

    def clock(self) -> float:
        return self.t

    def forward(self, ids, cache, all_logits: bool = False) -> np.ndarray:
        p, m = cache.length, len(ids)
        cache.length += m
        self.t += self.cost(m)
        self.forwards.append(m)
        return np.array([[self.seq[i + 1] if i + 1 < len(self.seq) else -1]
                         for i in range(p, p + m)])

    def decode_one(self, token: int) -> np.ndarray:
        row = self.forward([token], self.cache)[0]
        self.cached_ids.append(int(token))
        return row

    def prefill(self, ids):
        self.cache.length = len(ids) - 1
        self.cached_ids = list(ids)
        return self.decode_one(ids[-1]), 0


def replay(prompt, output, mode: str, cost, **engine_kw) -> dict:
    """Greedy ``output`` of ``prompt`` regenerated through a :class:`Speculator` in
    ``mode`` on a :class:`ReplayEngine` with ``cost``: forward calls, rows, drafted /
    accepted and the modelled speed-up over decode steps of cost ``cost(1)``.

    Raises:
        AssertionError: a replayed token differs from ``output`` (the speculator broke
            greedy identity).
    """
    eng = ReplayEngine(prompt, output, cost, **engine_kw)
    spec = Speculator(eng, prompt, len(output), mode=mode, clock=eng.clock)
    row = np.array([output[0]])
    for i, want in enumerate(output):
        assert int(row[0]) == want, (i, int(row[0]), want)
        if i + 1 == len(output):
            break
        row = spec.next_logits(want)
    spec.close()
    return {"forwards": len(eng.forwards), "verifies": sum(m > 1 for m in eng.forwards),
            "rows": sum(eng.forwards), "drafted": spec.drafted, "accepted": spec.accepted,
            "speedup": round((len(output) - 1) * cost(1) / max(eng.t, 1e-12), 3)}


def linear_cost(slope: float, fixed: float = 0.0):
    """Decode steps a forward of M ids costs: 1 for M = 1, else 1 + fixed + slope * (M - 1)."""
    return lambda m: 1.0 if m == 1 else 1.0 + fixed + slope * (m - 1)


def run(model, ids, speculate: str, max_tokens: int) -> tuple[list[int], object, list[int]]:
    """(tokens, final stats, M of every forward call after the prefill)."""
    model.engine.reset()
    tr = model.engine.model
    forwards: list[int] = []
    prefilling = [True]

    def counted(feed, cache, *a, **kw):
        if not prefilling[0]:
            forwards.append(len(feed))
        return type(tr).forward(tr, feed, cache, *a, **kw)

    tr.forward = counted  # instance attribute: shadows the method for this run
    try:
        evs = []
        for ev in model.stream_ids(ids, max_tokens=max_tokens, speculate=speculate):
            prefilling[0] = False
            evs.append(ev)
    finally:
        del tr.forward
    return [e.token for e in evs if e.token is not None], evs[-1].stats, forwards


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--kv-dtype", default="int8")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--slopes", default="0.1,0.2,0.4,0.63,1",
                    help="verify costs per draft, in decode steps, for the modelled speed-ups")
    args = ap.parse_args()
    slopes = [float(x) for x in args.slopes.split(",") if x]
    model = edgeinfer.load(args.model, backend=args.backend, kv_dtype=args.kv_dtype,
                           threads=args.threads, n_ctx=2048)
    model.chat([{"role": "user", "content": "warm up"}], max_tokens=8)  # compile kernels
    out = {}
    for name, text in REQUESTS.items():
        ids, _ = model.chat_ids([{"role": "user", "content": text}])
        off, st_off, fw_off = run(model, ids, "off", args.max_tokens)
        r = out[name] = {"prompt_tokens": len(ids), "generated": len(off),
                         "decode_tok_s_off": round(st_off.decode_tok_s, 2),
                         "forwards_off": len(fw_off)}
        for mode in ("ngram", "auto"):
            on, st, fw = run(model, ids, mode, args.max_tokens)
            r[mode] = {
                "decode_tok_s": round(st.decode_tok_s, 2),
                "speedup": round(st.decode_tok_s / max(st_off.decode_tok_s, 1e-9), 3),
                "drafted": st.drafted, "accepted": st.accepted,
                "acceptance": round(st.accepted / max(st.drafted, 1), 3),
                "forwards": len(fw), "verifies": sum(m > 1 for m in fw), "rows": sum(fw),
                "identical": on == off,
                "modelled": {str(b): replay(ids, off, mode, linear_cost(b))["speedup"]
                             for b in slopes},
            }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for name, r in out.items():
        print(f"{name}: {r['prompt_tokens']} prompt, {r['generated']} generated; off "
              f"{r['decode_tok_s_off']:.1f} tok/s, {r['forwards_off']} forwards")
        for mode in ("ngram", "auto"):
            m = r[mode]
            modelled = ", ".join(f"{b}: {x:.2f}x" for b, x in m["modelled"].items())
            print(f"  {mode}: {m['decode_tok_s']:.1f} tok/s ({m['speedup']:.2f}x); accepted "
                  f"{m['accepted']}/{m['drafted']} ({m['acceptance']:.0%}); {m['forwards']} "
                  f"forwards ({m['verifies']} verifies, {m['rows']} rows); identical: "
                  f"{m['identical']}; modelled at slope {modelled}")


if __name__ == "__main__":
    main()
