"""Prompt-lookup speculative decoding: decode speed with and without, same output.

    python benchmarks/speculative.py [--model PATH_OR_CATALOG_NAME] [--threads 2] [--json]

Two greedy chat requests, each run with ``speculate="off"``, ``"ngram"`` and ``"auto"``
(after one warm-up generation): a code edit (rewrite a given ~300-token Python function with one
small change: its output repeats most of the prompt) and a free chat question. Prints
per request: generated tokens, decode tok/s (generated tokens after the first over their
time) of each run and the ratios to "off", drafted / accepted counts and whether the
outputs are identical token for token. Default model: Qwen2.5-Coder-0.5B-Instruct (catalog).
"""
from __future__ import annotations

import argparse
import json
import time

import edgeinfer

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


def run(model, ids, speculate: str, max_tokens: int) -> tuple[list[int], object, float]:
    model.engine.reset()
    t0 = time.perf_counter()
    evs = list(model.stream_ids(ids, max_tokens=max_tokens, speculate=speculate))
    wall = time.perf_counter() - t0
    return [e.token for e in evs if e.token is not None], evs[-1].stats, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--kv-dtype", default="int8")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = edgeinfer.load(args.model, backend=args.backend, kv_dtype=args.kv_dtype,
                           threads=args.threads, n_ctx=2048)
    model.chat([{"role": "user", "content": "warm up"}], max_tokens=8)  # compile kernels
    out = {}
    for name, text in REQUESTS.items():
        ids, _ = model.chat_ids([{"role": "user", "content": text}])
        off, st_off, _ = run(model, ids, "off", args.max_tokens)
        r = out[name] = {"prompt_tokens": len(ids), "generated": len(off),
                         "decode_tok_s_off": round(st_off.decode_tok_s, 2)}
        for mode in ("ngram", "auto"):
            on, st, _ = run(model, ids, mode, args.max_tokens)
            r[mode] = {
                "decode_tok_s": round(st.decode_tok_s, 2),
                "speedup": round(st.decode_tok_s / max(st_off.decode_tok_s, 1e-9), 3),
                "drafted": st.drafted, "accepted": st.accepted,
                "acceptance": round(st.accepted / max(st.drafted, 1), 3),
                "identical": on == off,
            }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for name, r in out.items():
        print(f"{name}: {r['prompt_tokens']} prompt, {r['generated']} generated; off "
              f"{r['decode_tok_s_off']:.1f} tok/s")
        for mode in ("ngram", "auto"):
            m = r[mode]
            print(f"  {mode}: {m['decode_tok_s']:.1f} tok/s ({m['speedup']:.2f}x); accepted "
                  f"{m['accepted']}/{m['drafted']} ({m['acceptance']:.0%}); identical: "
                  f"{m['identical']}")


if __name__ == "__main__":
    main()
