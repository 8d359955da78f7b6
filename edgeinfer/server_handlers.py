"""The request handlers behind one app (:func:`edgeinfer.server.create_app`): the
model, its FIFO gate and counters, the OpenAI endpoints and their JSON / SSE answers."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import ContextOverflowError, EdgeInferError
from .server_fields import LogOnce, check_fields, get_response_format, get_tools
from .server_limits import DEFAULT_QUEUE_LIMIT, ServerLimits, admit
from .server_requests import (
    APIError,
    GenRequest,
    check_auth,
    get_messages,
    get_prompt,
    invalid,
    parse_common,
    read_json,
)
from .server_stream import (
    EventStream,
    Generation,
    ServerCounters,
    openai_finish_reason,
    sse,
    usage_of,
    wait_disconnect,
)

log = logging.getLogger("edgeinfer.server")


class _Server:
    """The state behind one app: the model, its FIFO gate, counters."""

    def __init__(self, model, model_name: str, api_key: str | None,
                 default_max_tokens: int | None = None, limits: ServerLimits | None = None,
                 queue_limit: int = DEFAULT_QUEUE_LIMIT, speculate: str = "auto"):
        self.model = model
        self.speculate = speculate
        pool = getattr(model, "pool", None)
        self.parallel = pool.n if pool is not None else 1
        self.queue_limit = int(queue_limit)
        self.limits = limits or ServerLimits()
        self.live: set[Generation] = set()  # started, not finished (cancelled at shutdown)
        self.default_max_tokens = default_max_tokens
        self.model_name = model_name
        self.api_key = api_key
        # sampling for fields a request omits: the model's generation config (over
        # llama.cpp's defaults), not OpenAI's temperature 1, which small models garble
        defaults = getattr(model, "sampling_defaults", None)
        self.sampling_defaults = defaults() if callable(defaults) else None
        if self.sampling_defaults:
            log.info("default sampling for requests that omit it: %s", self.sampling_defaults)
        self.created = int(time.time())
        # FIFO admission: held from the start of a worker to its end (released by the
        # worker thread), so queued requests cost no thread and are served in order.
        self.gate = asyncio.Semaphore(self.parallel)
        self.counters = ServerCounters()
        self.log_once = LogOnce()  # unknown request fields, logged once each

    # ---- plumbing --------------------------------------------------------------------
    def _on_done(self, loop: asyncio.AbstractEventLoop, gen: Generation,
                 finish: str | None) -> None:
        with self.counters.lock:
            self.live.discard(gen)
            self.counters.active -= 1
            if finish == "cancelled":
                self.counters.cancelled += 1
                log.info("generation cancelled (client disconnected)")
            elif finish is None:
                self.counters.failed += 1
            else:
                self.counters.completed += 1
        try:
            loop.call_soon_threadsafe(self.gate.release)
        except RuntimeError:  # event loop closed
            pass

    async def _start(self, gen: Generation) -> None:
        """Wait for this request's turn (FIFO), then start its worker thread."""
        with self.counters.lock:
            self.counters.queued += 1
        try:
            await self.gate.acquire()
        finally:
            with self.counters.lock:
                self.counters.queued -= 1
        with self.counters.lock:  # before the thread exists: its on_done may run at once
            self.counters.started += 1
            self.counters.active += 1
            self.live.add(gen)
        try:
            gen.start()  # no await between acquire and start: the gate cannot leak
        except BaseException:
            with self.counters.lock:
                self.counters.active -= 1
                self.live.discard(gen)
            self.gate.release()
            raise

    def _admit(self) -> None:
        with self.counters.lock:
            waiting = self.counters.queued
        admit(self.gate.locked(), waiting, self.parallel, self.queue_limit)

    def _new_generation(self, ids: list[int], req: GenRequest, param: str) -> Generation:
        self._admit()
        if len(ids) >= self.model.n_ctx:
            raise APIError(400, f"The prompt has {len(ids)} tokens but the context holds "
                           f"{self.model.n_ctx} (and at least one must be generated); shorten "
                           f"the prompt or start the server with a larger --ctx",
                           param=param, code="context_length_exceeded")
        if req.max_tokens is None and self.default_max_tokens is not None:
            req.max_tokens = self.default_max_tokens  # else: up to the end of the context
        if req.max_tokens is not None:  # the context ends generation anyway ("length")
            req.max_tokens = min(req.max_tokens, self.model.n_ctx - len(ids))
        loop = asyncio.get_running_loop()
        gen = Generation(self.model, ids, req, loop,
                         on_done=lambda finish: self._on_done(loop, gen, finish),
                         speculate=self.speculate)
        return gen

    def cancel_all(self) -> None:
        """Cancel every running generation (server shutdown): each stops within a decode step."""
        with self.counters.lock:
            running = list(self.live)
        for gen in running:
            gen.cancel.set()

    async def _encode(self, fn: Callable[[], list[int]], param: str) -> list[int]:
        try:
            ids = await run_in_threadpool(fn)
        except ContextOverflowError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except (ValueError, TypeError) as e:  # chat template errors, bad token ids
            raise APIError(400, str(e), param=getattr(e, "param", None) or param) from None
        if not ids:
            raise invalid(param, f"'{param}' encodes to no tokens")
        return ids

    # ---- endpoints -------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "edgeinfer"}

    async def models(self, request: Request) -> Response:
        check_auth(request, self.api_key)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def retrieve_model(self, request: Request) -> Response:
        check_auth(request, self.api_key)
        if request.path_params["model_id"] != self.model_name:
            raise APIError(404, f"The model '{request.path_params['model_id']}' does not exist",
                           param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def chat_completions(self, request: Request) -> Response:
        created = int(time.time())  # when the request arrived, not when it is answered
        check_auth(request, self.api_key)
        body = await read_json(request, self.limits.max_json_depth)
        check_fields(body, True, self.log_once)
        req = parse_common(body, self.model_name, self.sampling_defaults)
        messages = get_messages(body)
        req.chat = True
        req.grammar = get_response_format(body)
        tools = get_tools(body)
        if tools.active:
            reason = self.model.tool_support()
            if reason:
                raise invalid("tools", f"this model cannot call tools: {reason}")
            if req.grammar is not None:
                raise invalid("response_format", "'response_format' with 'tools' is not "
                              "supported; give one or the other (or tool_choice 'none')")
            from .errors import GrammarError
            from .tools import call_grammar
            try:
                req.grammar = call_grammar(tools.tools, tools.choice, self.model.tokenizer,
                                           parallel=tools.parallel)
            except GrammarError as e:
                raise invalid("tools", f"a tool's parameters cannot be used: {e}") from None
            req.tools = tools
        # room for the reply: max_tokens (256 when unset), at most half the context
        reserve = min(req.max_tokens or self.default_max_tokens or 256, self.model.n_ctx // 2)

        def encode() -> list[int]:
            ids, req.dropped_turns = self.model.chat_ids(
                messages, tools=tools.tools if tools.active else None, reserve=reserve)
            return ids

        ids = await self._encode(encode, "messages")
        return await self._respond(request, ids, req, chat=True, created=created)

    async def completions(self, request: Request) -> Response:
        created = int(time.time())
        check_auth(request, self.api_key)
        body = await read_json(request, self.limits.max_json_depth)
        check_fields(body, False, self.log_once)
        req = parse_common(body, self.model_name, self.sampling_defaults)
        req.grammar = get_response_format(body)
        prompt = get_prompt(body)
        if isinstance(prompt, str):
            ids = await self._encode(lambda: self.model.encode_prompt(
                prompt, parse_special=req.parse_special), "prompt")
        else:
            vocab = self.model.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise invalid("prompt", f"token ids must be in [0, {vocab})")
            ids = list(prompt)
        return await self._respond(request, ids, req, chat=False, created=created)

    # ---- responses -------------------------------------------------------------------
    async def _respond(self, request: Request, ids: list[int], req: GenRequest,
                       chat: bool, created: int) -> Response:
        gen = self._new_generation(ids, req, "messages" if chat else "prompt")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if req.stream:
            return EventStream(self._stream(request, gen, rid, chat, created), gen.cancel)
        return await self._complete(request, gen, rid, chat, created)

    async def _complete(self, request: Request, gen: Generation, rid: str,
                        chat: bool, created: int) -> Response:
        async def run() -> tuple[str, Any]:
            await self._start(gen)
            parts, final = [], None
            async for ev in gen.events():
                parts.append(ev.text)
                if ev.finish_reason is not None:
                    final = ev
            return "".join(parts), final

        work = asyncio.ensure_future(run())
        watch = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # uvicorn cancels what outlives the shutdown grace period: answer, not a traceback
            return APIError(503, "the server is shutting down; retry the request later",
                            type="server_error", code="server_shutting_down").response()
        finally:
            if not work.done():  # the client left (or this task was cancelled)
                gen.cancel.set()
                work.cancel()
            watch.cancel()
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # nobody is listening
        text, final = self._result_or_error(work)
        calls = []
        if gen.req.tools is not None:
            from .tools import parse_tool_calls
            text, calls = parse_tool_calls(text, gen.req.tools.names)
        reason = openai_finish_reason(final.finish_reason if final else None, bool(calls))
        usage = usage_of(final.stats if final else None,
                         gen.req.dropped_turns if chat else None)
        request.state.usage = usage  # for the access log
        if chat:
            message = {"role": "assistant", "content": text}
            if calls:
                message["content"] = text or None
                message["tool_calls"] = [c.as_openai() for c in calls]
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created,
                             "model": self.model_name, "choices": [choice],
                             "usage": usage, "system_fingerprint": None})

    @staticmethod
    def _result_or_error(work: asyncio.Future):
        try:
            return work.result()
        except ContextOverflowError as e:
            raise APIError(400, str(e), code="context_length_exceeded") from None
        except EdgeInferError as e:
            raise APIError(400, str(e)) from None

    async def _stream(self, request: Request, gen: Generation, rid: str, chat: bool,
                      created: int) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, reason: str | None, role: bool = False,
                  delta: dict | None = None) -> str:
            if chat:
                if delta is None:
                    delta = {"role": "assistant", "content": ""} if role else \
                        ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            return sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                         "system_fingerprint": None, "choices": [choice]})

        parser = None
        if gen.req.tools is not None:
            from .tools import ToolCallParser
            parser = ToolCallParser(names=gen.req.tools.names)

        def tool_chunks(events: list[tuple]):
            for e in events:
                if e[0] == "content":
                    if e[1] and not (parser.calls and not e[1].strip()):
                        yield chunk(e[1], None)
                elif e[0] == "call":
                    c = e[1]
                    yield chunk(None, None, delta={"tool_calls": [
                        {"index": c.index, "id": c.id, "type": "function",
                         "function": {"name": c.name, "arguments": ""}}]})
                elif e[2]:
                    yield chunk(None, None, delta={"tool_calls": [
                        {"index": e[1], "function": {"arguments": e[2]}}]})

        if chat:
            yield chunk(None, None, role=True)
        await self._start(gen)
        final = None
        try:
            async for ev in gen.events():
                if ev.text:
                    if parser is None:
                        yield chunk(ev.text, None)
                    else:
                        for c in tool_chunks(parser.feed(ev.text)):
                            yield c
                if ev.finish_reason is not None:
                    final = ev
            if parser is not None:
                for c in tool_chunks(parser.finish()):
                    yield c
        except Exception as e:  # noqa: BLE001  headers are sent: report in-band, as OpenAI does
            err = e if isinstance(e, APIError) else APIError(
                400 if isinstance(e, EdgeInferError) else 500,
                str(e) if isinstance(e, EdgeInferError) else "generation failed (see the server log)",
                type="invalid_request_error" if isinstance(e, EdgeInferError) else "server_error")
            yield sse({"error": {"message": err.message, "type": err.type, "param": err.param,
                                  "code": err.code}})
            yield "data: [DONE]\n\n"
            return
        usage = usage_of(final.stats if final else None, gen.req.dropped_turns if chat else None)
        request.state.usage = usage  # for the access log
        yield chunk(None, openai_finish_reason(final.finish_reason if final else None,
                                               bool(parser is not None and parser.calls)))
        if gen.req.include_usage:
            yield sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                        "system_fingerprint": None, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
