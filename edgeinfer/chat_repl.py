"""The terminal chat loop of ``edgeinfer chat``: reading messages, slash commands, Ctrl-C.

Kept out of ``cli`` (argument parsing) so that each stays short. Everything here
writes to the terminal (stdout for the conversation, stderr for status lines); the
library layers below never print.

Policy (documented for users in ``/help``):

* Ctrl-C while an answer streams stops it within one decode step; the partial answer
  stays in the conversation, exactly as generated, so the next turn reuses its KV cache.
* Ctrl-C at the prompt says how to quit; Ctrl-D (EOF), ``/exit``, ``/quit`` or ``/bye``
  quit, leaving the terminal on a fresh line.
* A message that fails (it does not fit the context, it is not valid UTF-8, the chat
  template fails) prints ``error: ...`` and the chat goes on; the exit status is then 1,
  so a script piping messages in can tell (0 when every message was answered).
"""
from __future__ import annotations

import json
import queue
import signal
import sys
import threading
from collections.abc import Callable

from .errors import EdgeInferError

CHAT_HELP = """commands:
  /help            this text
  /reset           forget the conversation (the system prompt stays)
  /system TEXT     set the system prompt (and start over)
  /stats           TTFT, tokens/s, KV cache use and memory of the last answer
                   (an answer stopped with Ctrl-C: what it had generated)
  /save FILE       save the conversation as JSON;  /load FILE  load one
  /exit, /quit     quit (or Ctrl-D)
Type \"\"\" on a line of its own to start and end a multi-line message.
Ctrl-C stops the current answer and keeps the conversation."""

QUIT_COMMANDS = ("/exit", "/quit", "/bye")


def read_message(prompt: str) -> str:
    """One user message: a line, or a block between two lines of triple quotes.

    Args:
        prompt: shown before the line ("" when stdin is not a terminal).

    Raises:
        EOFError: end of input (Ctrl-D). KeyboardInterrupt: Ctrl-C.
    """
    line = input(prompt)
    if line.strip() != '"""':
        return line
    lines = []
    while True:
        more = input("... " if prompt else "")
        if more.strip() == '"""':
            return "\n".join(lines)
        lines.append(more)


def chat_command(text: str, state: dict, print_stats: Callable) -> bool:
    """Run a slash command; returns False when the chat should end.

    Args:
        text: the line, starting with "/".
        state: ``system`` (str or None), ``messages`` (list of dicts), ``stats`` (the last
            answer's GenerationStats or None), ``interrupted`` (bool); updated in place.
        print_stats: ``print_stats(stats, stream, interrupted=...)`` for ``/stats``.
    """
    cmd, _, rest = text.partition(" ")
    rest = rest.strip()
    if cmd in QUIT_COMMANDS:
        return False
    if cmd == "/help":
        print(CHAT_HELP)
    elif cmd == "/reset":
        state["messages"].clear()
        print("[conversation cleared]")
    elif cmd == "/system":
        state["system"] = rest or None
        state["messages"].clear()
        print("[system prompt set; conversation cleared]" if rest else "[system prompt removed]")
    elif cmd == "/stats":
        if state["stats"]:
            print_stats(state["stats"], sys.stdout, interrupted=state["interrupted"])
        else:
            print("[no answer yet]")
    elif cmd == "/save":
        if not rest:
            print("usage: /save FILE")
        else:
            with open(rest, "w", encoding="utf-8") as f:
                json.dump({"system": state["system"], "messages": state["messages"]}, f,
                          ensure_ascii=False, indent=2)
            print(f"[saved {len(state['messages'])} messages to {rest}]")
    elif cmd == "/load":
        try:
            with open(rest, encoding="utf-8") as f:
                data = json.load(f)
            msgs = data["messages"]
            if not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in msgs):
                raise ValueError("every message needs a role and a content")
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"[cannot load {rest!r}: {e}]")
        else:
            state["system"] = data.get("system")
            state["messages"][:] = msgs
            print(f"[loaded {len(msgs)} messages]")
    else:
        print(f"unknown command {cmd}; /help lists them")
    return True


_END = object()


def answer(model, convo: list[dict], max_tokens: int, stop: list[str],
           sampling: dict) -> tuple[str, object, bool]:
    """Stream one reply to stdout; returns (text, final event or None, interrupted).

    Generation runs on a worker thread; while it does, SIGINT (Ctrl-C) only sets the
    cancel event (a handler replaces KeyboardInterrupt on the main thread, so no event
    can be lost between the queue and the reply), and the stream ends within a step
    with its final event (stats of the tokens so far, for /stats). The returned text is
    every delta, unchanged: the KV cache holds exactly those tokens.

    Raises:
        EdgeInferError: e.g. the conversation cannot fit the context.
    """
    cancel = threading.Event()
    events: queue.Queue = queue.Queue()

    def work() -> None:
        try:
            for ev in model.chat_stream(convo, max_tokens=max_tokens, stop=stop,
                                        cancel=cancel, **sampling):
                events.put(ev)
        except BaseException as e:  # noqa: BLE001  re-raised on the main thread
            events.put(e)
        finally:
            events.put(_END)

    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: cancel.set())
    except ValueError:  # not the main thread: Ctrl-C arrives as KeyboardInterrupt
        previous = None
    worker = threading.Thread(target=work, name="edgeinfer-chat", daemon=True)
    worker.start()
    reply, final, error = [], None, None
    try:
        while True:
            try:
                item = events.get(timeout=0.1)
            except queue.Empty:
                continue
            except KeyboardInterrupt:
                cancel.set()  # the worker stops between steps; keep draining its events
                continue
            if item is _END:
                break
            if isinstance(item, BaseException):
                error = item
                continue
            if item.stats is not None:
                final = item
            if item.text:
                reply.append(item.text)
                sys.stdout.write(item.text)
                sys.stdout.flush()
        worker.join()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if error is not None:
        raise error
    stopped = cancel.is_set() and (final is None or final.finish_reason == "cancelled")
    return "".join(reply), final, stopped


def run_chat(model, *, system: str | None, max_tokens: int, stop: list[str], sampling: dict,
             print_stats: Callable, compile_notice: Callable[[object], None]) -> int:
    """The read-answer loop until EOF or /exit; returns the exit status: 0 when every
    message was answered, 1 when one failed (its error was printed).

    Args:
        model: an :class:`edgeinfer.api.Model`.
        system: the system prompt, or None.
        max_tokens: most tokens per answer.
        stop: stop strings.
        sampling: :class:`edgeinfer.sampling.SamplingParams` fields (and ``speculate``).
        print_stats: ``print_stats(stats, stream, interrupted=...)``.
        compile_notice: called with the model before each answer (says when the CPU
            kernels compile).
    """
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    interactive = sys.stdin.isatty()
    if interactive and getattr(model, "kernels_cold", None) is False:
        # load the CPU kernels from their disk cache while the user types (else the
        # first answer's TTFT pays for it); the first answer waits for it if need be
        threading.Thread(target=model.warm_up, name="edgeinfer-warm-up", daemon=True).start()
    if getattr(sys.stdin, "errors", None) == "strict" and hasattr(sys.stdin, "reconfigure"):
        # invalid UTF-8 then reaches the tokenizer as lone surrogates, which refuses that
        # one message clearly; a strict decoder would drop the whole buffered chunk
        sys.stdin.reconfigure(errors="surrogateescape")
    state = {"system": system, "messages": [], "stats": None, "interrupted": False}
    prompt = ">>> " if interactive else ""
    failed = 0
    while True:
        try:
            text = read_message(prompt).strip()
        except EOFError:
            if prompt:
                print(flush=True)  # Ctrl-D: leave the shell prompt on a fresh line
            break
        except UnicodeDecodeError as e:  # a stdin that could not be reconfigured
            print(f"error: the input is not valid UTF-8 ({e.reason} at byte {e.start})",
                  file=sys.stderr)
            failed += 1
            continue
        except KeyboardInterrupt:
            print("\n[Ctrl-D or /exit quits]" if interactive else "")
            continue
        if not text:
            continue
        if text.startswith("/"):
            if not chat_command(text, state, print_stats):
                break
            continue
        state["messages"].append({"role": "user", "content": text})
        system = state["system"]
        convo = ([{"role": "system", "content": system}] if system else []) + state["messages"]
        compile_notice(model)
        try:
            reply, final, interrupted = answer(model, convo, max_tokens, stop, sampling)
        except EdgeInferError as e:  # e.g. the conversation outgrew the context
            state["messages"].pop()
            print(f"\nerror: {e}", file=sys.stderr)
            failed += 1
            continue
        if final is not None:
            state["stats"], state["interrupted"] = final.stats, interrupted
        sys.stdout.write("\n[stopped]\n" if interrupted else "\n")
        sys.stdout.flush()
        # the reply exactly as generated (not stripped): the KV cache holds these tokens,
        # and a re-render that spells them the same reuses all of them next turn
        state["messages"].append({"role": "assistant", "content": reply})
    return 1 if failed else 0
