"""TTFT of the 5th turn of a scripted chat, with and without prefix reuse.

    python benchmarks/chat_ttft.py [--model smollm2-135m-instruct] [--backend cpu]

Runs five user turns through one :class:`edgeinfer.ChatSession` (greedy, 48 tokens per
reply), timing the 5th; then empties the KV cache and prefills the same 5-turn prompt
from scratch. Prints both TTFTs and the ratio.
"""
from __future__ import annotations

import argparse
import json

import edgeinfer

TURNS = [
    "Hi! Can you tell me about the city of Paris?",
    "What is the most famous museum there?",
    "And what is a good dish to try?",
    "How do I get from the airport to the centre?",
    "Thanks! Summarize our conversation in one sentence.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--kv-dtype", default="int8")
    args = ap.parse_args()
    model = edgeinfer.load(args.model, backend=args.backend, kv_dtype=args.kv_dtype)
    chat = edgeinfer.ChatSession(model)
    model.chat([{"role": "user", "content": "warm up"}], max_tokens=4)  # compile kernels
    for text in TURNS[:4]:
        chat.send(text, max_tokens=48)
    # reuse: the cache holds turns 1-4 as the session left them
    chat.send(TURNS[4], max_tokens=1)
    reuse = chat.last_stats
    # fresh: the same 5-turn prompt from an empty cache
    model.engine.reset()
    fresh = list(model.chat_stream(chat.messages[:-1], max_tokens=1))[-1].stats
    print(json.dumps({
        "model": args.model, "backend": args.backend, "kv_dtype": args.kv_dtype,
        "turn5_prompt_tokens": fresh.prompt_tokens,
        "ttft_fresh_s": round(fresh.ttft_s, 4), "ttft_reuse_s": round(reuse.ttft_s, 4),
        "reused_tokens": reuse.reused_tokens,
        "ratio": round(reuse.ttft_s / fresh.ttft_s, 3),
    }))


if __name__ == "__main__":
    main()
