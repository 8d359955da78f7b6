"""The Python API desktop apps embed.

>>> import edgeinfer
>>> model = edgeinfer.load("smollm2-135m-instruct")          # doctest: +SKIP
>>> model.chat([{"role": "user", "content": "Hi!"}], max_tokens=32)  # doctest: +SKIP

A :class:`Model` owns one engine (weights on a backend + one KV cache). Calls are
serialized with a lock, so a model may be shared between threads; each call can be
cancelled from another thread with a :class:`threading.Event` passed as ``cancel``.
Nothing here prints; diagnostics go to the ``edgeinfer`` logger. :func:`load` and the
helpers a model is built with live in :mod:`.loading`, :class:`ChatSession` in
:mod:`.chat_session`; both are importable from here.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np

from .backends.errors import BackendUnavailableError as _BackendUnavailable
from .chat_session import ChatSession, _with_dropped_turns  # noqa: F401  (ChatSession re-exported)
from .chat_template import RenderLimits
from .constrained import Grammar, as_grammar
from .engine import Engine, GenerationEvent, GenerationStats, peak_rss_mb
from .errors import BackendUnavailableError, ContextOverflowError
from .loading import (  # noqa: F401  (load re-exported)
    default_backend,
    load,
    source_weight_bytes,
    tokenizer_for,
)
from .memory import (
    context_length,
    release_free_heap,
    release_jit_compiler_pages,
)
from .sampling import DEFAULTS, SamplingParams, sampling_defaults
from .source import ModelSource
from .speculative import check_mode

log = logging.getLogger("edgeinfer")

DEFAULT_MODEL = "smollm2-135m-instruct"
#: KV cache dtype when none is given: int8 costs +0.0% perplexity on SmolLM2 at half
#: the bytes of f16 (benchmarks/kv_quality.py; README table).
DEFAULT_KV_DTYPE = "int8"


class Model:
    """A loaded model ready to generate.

    Args:
        source: the model description (from :func:`edgeinfer.readers.read_model`).
        backend: "cpu", "reference" or "opencl" (default: :func:`default_backend`).
        n_ctx: context length in tokens (KV cache positions preallocated); default:
            4096, lowered to what ``max_memory`` allows, capped by the model's positions
            (:func:`edgeinfer.memory.context_length`).
        kv_dtype: KV cache storage dtype: "int8" (default), "f32", "f16", "int4", "k8v4".
        max_memory: total memory budget in MiB (weights + scratch + KV cache); the
            context is sized to fit, and a model that cannot fit is refused before any
            weight is loaded.
        threads: CPU threads (cpu backend).
        device: OpenCL device (opencl backend).
        prefill_chunk: tokens per prefill step (bounds scratch memory).
        self_check: for OpenCL, compare a tiny model on the device with the reference
            at start-up and fall back to the CPU backend (with a warning) on a mismatch:
            drivers that miscompute exist.
        parallel: sequences that generate at once (continuous batching,
            :mod:`edgeinfer.batching`): with N > 1, N streams / chat sessions of this
            model run concurrently from any threads (one copy of the weights, one KV
            cache per sequence; with ``max_memory`` the context is sized so that all N
            fit); more wait their turn. 1 (default): calls take turns (a lock).

    Raises:
        BackendUnavailableError: the backend cannot run here.
        MemoryBudgetError: ``max_memory`` is too small for the weights (or for ``n_ctx``).
    """

    def __init__(self, source: ModelSource, backend: str | None = None, n_ctx: int | None = None,
                 kv_dtype: str | None = None, threads: int | None = None,
                 device: str | None = None, prefill_chunk: int = 512, self_check: bool = True,
                 max_memory: float | None = None, parallel: int = 1):
        from .backends import get_backend
        from .memory import plan_memory
        from .models.transformer import Transformer

        self.source = source
        self.config = source.config
        self.tokenizer = tokenizer_for(source)
        release_free_heap()  # the JSON parse's garbage: 23 (SmolLM2) to 60 MiB (Qwen2.5)
        name = backend or default_backend()
        kv_dtype = kv_dtype or DEFAULT_KV_DTYPE
        model_max = source.config.max_position_embeddings
        self.memory_plan = None
        if int(parallel) < 1:
            raise ValueError(f"parallel must be at least 1, got {parallel}")
        if max_memory is not None:
            self.memory_plan = plan_memory(source.config, source_weight_bytes(source, name),
                                           max_memory, kv_dtype, prefill_chunk, n_ctx=n_ctx,
                                           parallel=int(parallel))
            if n_ctx is not None and not self.memory_plan.fits:
                from .errors import MemoryBudgetError
                from .memory import format_plan
                raise MemoryBudgetError(
                    f"a context of {n_ctx} tokens does not fit in --max-memory {max_memory:g} MiB "
                    f"(at most {self.memory_plan.max_context}):\n{format_plan(self.memory_plan)}")
        opts = {}
        if threads is not None:
            opts["threads"] = threads
        if device is not None:
            opts["device"] = device
        try:
            self.backend = get_backend(name, **opts)
        except ImportError as e:
            raise BackendUnavailableError(f"backend {name!r} cannot be imported: {e}") from e
        except _BackendUnavailable as e:
            raise BackendUnavailableError(str(e)) from e
        if name == "opencl" and self_check:
            self.backend = self._checked_opencl(self.backend, source, kv_dtype, threads)
        n_ctx = context_length(model_max, n_ctx,
                               self.memory_plan.max_context if self.memory_plan else None)
        t0 = time.perf_counter()
        self.transformer = Transformer(source.config, source.runtime_tensors(self.backend),
                                       self.backend, max_positions=max(n_ctx, 1))
        self.load_s = time.perf_counter() - t0
        source.drop_resident_pages()  # the backend holds its own (repacked) copy now
        #: bytes of the weights on this backend (:func:`source_weight_bytes`), kept for
        #: display: :attr:`source` no longer holds the tensors.
        self.weight_bytes = source_weight_bytes(source, self.backend.name)
        # what runs needs neither the source's tensors (the backend has its copy) nor the
        # tokenizer.json text (the tokenizer is built; a large vocabulary's text is tens
        # of MiB as a str). The caller's object is left as it is.
        self.source = dataclasses.replace(source, tensors={}, row_tables={},
                                          tokenizer_json="")
        release_free_heap()  # repacking temporaries
        if self.backend.name == "cpu":  # LLVM pages touched by `import numba` (~40 MiB)
            release_jit_compiler_pages()
        self.engine = Engine(self.transformer, self.tokenizer, n_ctx=n_ctx, kv_dtype=kv_dtype,
                             prefill_chunk=prefill_chunk)
        self._lock = threading.Lock()
        #: the slots of continuous batching (parallel > 1), else None
        self.pool = None
        if parallel > 1:
            from .batching import SlotPool, scheduler_chunk
            self.pool = SlotPool(self.transformer, self.tokenizer, int(parallel), n_ctx,
                                 kv_dtype, scheduler_chunk(self.transformer, prefill_chunk),
                                 first_cache=self.engine.cache)
            self.engine = self.pool.engine(0)  # slot 0: its forwards go through the scheduler
        #: True when the CPU backend's Numba kernels are not compiled yet (a fresh
        #: install): the first generation then compiles them (30-90 s on 2 cores, once;
        #: cached on disk after). False when warm, None when unknown or not the CPU.
        self.kernels_cold = None
        if self.backend.name == "cpu":
            from .selfcheck import cpu_kernel_cache_cold
            self.kernels_cold = cpu_kernel_cache_cold()
            if self.kernels_cold:
                log.info("compiling CPU kernels on the first call (first run only, "
                         "about 30-90 s on 2 cores; cached on disk for later runs)")

    @staticmethod
    def _checked_opencl(backend, source: ModelSource, kv_dtype: str, threads: int | None):
        from .backends import get_backend
        from .selfcheck import self_check

        ok, err = self_check(source.config, source.tensors, backend, kv_dtype=kv_dtype)
        if ok:
            return backend
        log.warning("OpenCL device failed the start-up self-check (max error %.3g); "
                    "falling back to the CPU backend", err)
        return get_backend(default_backend(), **({"threads": threads} if threads else {}))

    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    def sampling_defaults(self, base: SamplingParams = DEFAULTS) -> dict:
        """The model's recommended sampling settings: its generation config over ``base``
        (:func:`edgeinfer.sampling.sampling_defaults`). The server and the chat use them
        for fields a request omits; :meth:`stream_ids` itself stays greedy by default."""
        return sampling_defaults(self.source.generation, base)

    def warm_up(self, progress=None) -> float:
        """Run every kernel a generation uses once, so the first real answer does not
        stall: on a fresh install (:attr:`kernels_cold`) this compiles the CPU backend's
        Numba kernels (about 30-90 s on 2 cores, cached on disk for later runs); on a warm cache it loads
        them from disk (about 0.4 s on 2 idle cores, over 1.5 s on a loaded machine),
        which would otherwise count in the first answer's TTFT. What runs: prompts of
        3, then 8 and 20 more tokens (every prefill GEMM shape: the row kernels, and on
        CPUs with AMX the few-token and the 16-token tiles), a speculative verify of 4
        tokens (logits of every row), two decode steps, the sampler's kernels for a full
        chain (temperature, top-k, top-p, min-p, repetition/presence penalties) and the
        token-mask kernels of constrained output; the KV cache is reset afterwards.
        Takes the model's lock, so a call made meanwhile waits for it.
        ``edgeinfer.load(..., warm=True)`` calls it; the chat runs it while the user
        types the first message.

        Args:
            progress: ``callable(str)`` called with each stage's name ("prefill",
                "decode", "sampling") as it starts, e.g. for a progress line.

        Returns:
            seconds spent.
        """
        from .constrained import mask_words
        from .sampling import Sampler

        say = progress or (lambda stage: None)
        t0 = time.perf_counter()
        ids = (self.encode_prompt("Hello, world") + [0] * 35)[:35]
        sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                                 repetition_penalty=1.1, presence_penalty=0.1, seed=0)
        with self._exclusive():
            try:
                say("prefill")
                eng = self.engine
                sizes = [n for n in (3, 11, 31) if n < eng.n_ctx] or [min(3, eng.n_ctx)]
                for n in sizes:  # 3 tokens, then 8 and 20 more (the prefix is reused)
                    logits, _ = eng.prefill(ids[:n])
                if sizes[-1] + 4 < eng.n_ctx and hasattr(eng.cache, "trim"):  # a verify
                    eng.model.forward(np.array(ids[sizes[-1]:sizes[-1] + 4], np.int32),
                                      eng.cache, all_logits=True)
                    eng.cache.trim(sizes[-1])  # (logits of every row), undone
                say("decode")
                token = int(np.argmax(logits))
                for _ in range(2):
                    token = int(np.argmax(self.engine.decode_one(token)))
                say("sampling")
                row = np.ascontiguousarray(self.engine.decode_one(token))
                mask = np.full(mask_words(row.size), -1, np.int32)
                for params in (sampled, SamplingParams(temperature=0.0)):
                    s = Sampler(row.size)
                    s.start(params, ids[:3])
                    for m in (None, mask):
                        s.accept(s.sample(row, np.random.default_rng(0), m))
            finally:
                self.engine.reset()
            release_free_heap()  # kernel loading's garbage, the fused weights' old copies
            if self.backend.name == "cpu":
                release_jit_compiler_pages()  # LLVM is idle once the kernels are loaded
        if self.kernels_cold:
            self.kernels_cold = False
        return time.perf_counter() - t0

    # ---- prompts ---------------------------------------------------------------------
    def encode_prompt(self, prompt: str, *, parse_special: bool = True) -> list[int]:
        """Token ids of a plain-text prompt (BOS added once if the model wants it).

        ``parse_special`` (default True, as llama.cpp): special-token strings in the prompt
        ("<|im_start|>") become control tokens; False encodes them as plain text, for
        prompts from untrusted sources.

        Raises:
            InvalidTextError: the prompt is not valid Unicode (a lone surrogate).
        """
        return self.tokenizer.encode(prompt, add_special=True, parse_special=parse_special)

    @property
    def render_limits(self) -> RenderLimits:
        """Bounds on rendering a chat template here: 2 s, and
        ``CHARS_PER_CONTEXT_TOKEN`` (8) characters per context token."""
        return RenderLimits.for_context(self.n_ctx)

    def encode_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None
                    ) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template
        (generation prompt added). Message content is text: special-token strings in it
        are encoded as plain text, never as control tokens. Models without a template
        get the message contents joined by blank lines
        (:func:`edgeinfer.chat_template.plain_prompt`), also encoded as text.

        ``tools``: OpenAI function tools, rendered by the template (see
        :meth:`tool_support`); assistant ``tool_calls`` and ``tool`` messages in
        ``messages`` are rendered as the template spells them.

        Raises:
            ChatTemplateTooLargeError: the render exceeds ``render_limits`` (a
                ``ContextOverflowError``: it could not fit the context).
            ChatTemplateError: the template failed or ran past its time limit.
            InvalidTextError: a message is not valid Unicode.
            ToolError: ``tools`` given to a model whose template cannot take them.
        """
        from .tools import normalize_tools, template_messages

        if tools is not None:
            reason = self.tool_support()
            if reason:
                from .tools import ToolError
                raise ToolError(reason, "tools")
            tools = normalize_tools(list(tools))
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(template_messages(messages),
                                                      add_generation_prompt=True, tools=tools,
                                                      render_limits=self.render_limits)
        from .tokenizer import plain_prompt
        return self.tokenizer.encode(plain_prompt(list(messages)), add_special=True,
                                     parse_special=False)

    def tool_support(self) -> str | None:
        """Why this model cannot be given tools (a sentence), or None when it can: its
        chat template renders ``tools`` and teaches the ``<tool_call>`` format
        (:func:`edgeinfer.tools.tool_support`; Qwen2.5 can, SmolLM2 cannot)."""
        from .tools import tool_support

        return tool_support(self.tokenizer.chat_template)

    # ---- generation ------------------------------------------------------------------
    def stream_ids(self, ids: Sequence[int], *, max_tokens: int = 256, stop: Sequence[str] = (),
                   cancel: threading.Event | None = None, json_schema=None, grammar=None,
                   leading_space: bool = True, speculate: str = "auto",
                   **sampling) -> Iterator[GenerationEvent]:
        """Stream events for a prompt given as token ids (see :class:`GenerationEvent`).

        ``sampling`` keys are :class:`SamplingParams` fields (temperature, top_k, top_p,
        min_p, repetition_penalty, seed). Default: greedy (temperature 0); other omitted
        fields take :data:`edgeinfer.sampling.DEFAULTS` (the model's own defaults:
        ``stream_ids(ids, **model.sampling_defaults())``).

        Constrained output: ``json_schema`` (a dict or JSON text) makes the output one
        JSON value valid under that schema (``{"type": "object"}``: any JSON object);
        ``grammar`` takes a Lark grammar (llguidance's dialect) or an
        :class:`edgeinfer.constrained.Grammar`. A generation that ends by itself then
        always parses; one cut by ``max_tokens`` ends with finish reason "length". The
        first constrained call on a model builds the vocabulary's token table (about a
        second for 150k ids), later ones reuse it.

        ``leading_space``: a completion keeps the space that begins its first word on
        SentencePiece models whose decoder strips it (" there", as llama.cpp prints it);
        :meth:`chat_stream` passes False (a reply starts at its first character).

        ``speculate``: "ngram" drafts tokens from n-grams of the prompt and the output
        and verifies them in one forward where that is exact; "auto" (default) does so
        while it pays by measured time; "off" never (:mod:`edgeinfer.speculative`: the
        same tokens, greedy or seeded, in every mode). The final stats' ``drafted`` /
        ``accepted`` count the drafts.

        Every stream ends with one event whose ``finish_reason`` and ``stats`` are set
        (a stream cancelled before it started gets stats with 0 generated tokens).

        Arguments are checked here, before the first ``next()``; the model's lock is taken
        when iteration starts and released when the stream ends or is closed (use
        ``contextlib.closing`` if you may abandon a stream half-read). While waiting for
        the lock, and between prefill chunks, ``cancel`` is honoured.

        Raises:
            ValueError: invalid sampling values, ``max_tokens`` < 1 or an unknown
                ``speculate``.
            ContextOverflowError: the prompt does not fit the context.
            GrammarError: an invalid ``json_schema`` / ``grammar``, or both given.
        """
        sampling.setdefault("temperature", 0.0)
        params = SamplingParams(**sampling)
        check_mode(speculate)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        ids = list(ids)
        self.engine.check_prompt(ids)
        constraint = self.constraint(as_grammar(json_schema, grammar))
        return self._locked_stream(ids, params, max_tokens, stop, cancel, constraint,
                                   leading_space, speculate)

    def constraint(self, grammar: Grammar | None):
        """A fresh :class:`edgeinfer.constrained.Constraint` of ``grammar`` for this
        model's vocabulary (None for None). Raises GrammarError."""
        if grammar is None:
            return None
        from .constrained import Constraint, token_table

        vocab = self.config.vocab_size
        return Constraint(token_table(self.tokenizer, vocab), grammar, vocab)

    def _exclusive(self):
        """The lock, or with ``parallel`` > 1 slot 0 of the pool held (warm-up)."""
        if self.pool is None:
            return self._lock
        from .batching import held_slot
        return held_slot(self.pool, 0)

    def _locked_stream(self, ids, params, max_tokens, stop, cancel, constraint=None,
                       leading_space=True, speculate="auto"):
        if self.pool is not None:  # batched decode steps: no speculation (it would not pay)
            from .batching import pooled_stream
            yield from pooled_stream(self.pool, ids, cancel, params=params,
                                     max_tokens=max_tokens, stop=stop, constraint=constraint,
                                     leading_space=leading_space, speculate="off")
            return
        while not self._lock.acquire(timeout=0.05):
            if cancel is not None and cancel.is_set():
                yield GenerationEvent(finish_reason="cancelled", stats=GenerationStats(
                    prompt_tokens=len(ids), peak_rss_mb=peak_rss_mb()))
                return
        try:
            yield from self.engine.stream(ids, params=params, max_tokens=max_tokens,
                                          stop=stop, cancel=cancel, constraint=constraint,
                                          leading_space=leading_space,
                                          speculate=speculate)
        finally:
            self._lock.release()

    def stream(self, prompt: str, *, parse_special: bool = True, **kw) -> Iterator[GenerationEvent]:
        """Stream a completion of a plain-text prompt (``parse_special``: see
        :meth:`encode_prompt`; other keywords: :meth:`stream_ids`)."""
        return self.stream_ids(self.encode_prompt(prompt, parse_special=parse_special), **kw)

    def generate(self, prompt: str, *, parse_special: bool = True, **kw) -> str:
        """Complete a plain-text prompt; returns the generated text (``parse_special``:
        see :meth:`encode_prompt`)."""
        return "".join(ev.text for ev in self.stream(prompt, parse_special=parse_special, **kw))

    def chat_stream(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                    tool_choice=None, parallel_tool_calls: bool = False,
                    **kw) -> Iterator[GenerationEvent]:
        """Stream the assistant's reply to OpenAI-style messages ``[{"role", "content"}]``.

        A conversation longer than the context loses its oldest whole turns (the system
        prompt is kept; room for ``max_tokens`` is reserved up to half the context): see
        :func:`edgeinfer.conversation.fit_messages`; the final event's
        ``stats.dropped_turns`` says how many. Where the KV cache holds the previous
        reply as sampled and that differs from the re-tokenized text (a non-canonical
        split, "Q"+"LT" for "QL"+"T"), the sampled ids are kept so the whole reply is
        reused (:func:`edgeinfer.conversation.reuse_cached_ids`).

        ``tools`` (OpenAI function tools) are rendered by the model's template; the reply
        then may hold ``<tool_call>`` blocks (:func:`edgeinfer.tools.parse_tool_calls`
        reads them). ``tool_choice``: "auto" (default), "none" (tools not rendered),
        "required" or a function name / ``{"type": "function", "function": {"name"}}``
        (the reply is forced to be such a call, through a grammar: one call, or for
        "required" with ``parallel_tool_calls`` one or more).

        Raises:
            ContextOverflowError: even the system prompt and the last turn do not fit.
            ToolError: tools for a model that cannot take them, a bad ``tool_choice``.
        """
        from .conversation import reuse_cached_ids
        from .tools import call_grammar, normalize_tool_choice, normalize_tools

        if tools is not None or tool_choice is not None:
            tools = normalize_tools(list(tools)) if tools is not None else None
            choice = normalize_tool_choice(tool_choice, tools)
            if choice == "none":
                tools = None
            elif kw.get("json_schema") is not None or kw.get("grammar") is not None:
                from .tools import ToolError
                raise ToolError("tools with a json_schema/grammar: give one or the other",
                                "tools")
            else:
                reason = self.tool_support()
                if reason:
                    from .tools import ToolError
                    raise ToolError(reason, "tools")
                kw["grammar"] = call_grammar(tools, choice, self.tokenizer,
                                             parallel=parallel_tool_calls)
        reserve = min(kw.get("max_tokens", 256), self.n_ctx // 2)
        ids, dropped = self.chat_ids(messages, tools=tools, reserve=reserve)
        # the previous reply as the model sampled it (and its KV cache holds it), even
        # where that is not how the tokenizer would spell its text: reused, not recomputed
        cached = (self.engine.cached_ids if self.pool is None
                  else self.pool.cached_ids_for(ids))
        spliced = reuse_cached_ids(ids, list(cached),
                                   lambda t: self.tokenizer.decode(t, skip_special=False))
        if len(spliced) <= self.n_ctx:
            ids = spliced
        events = self.stream_ids(ids, leading_space=False, **kw)
        return _with_dropped_turns(events, dropped) if dropped else events

    def chat_ids(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                 reserve: int = 256) -> tuple[list[int], int]:
        """Prompt ids of a chat that fit the context with ``reserve`` tokens to spare, and
        how many of its oldest whole turns were dropped for that (0 when it fits; the
        system prompt stays: :func:`edgeinfer.conversation.fit_messages`).

        Raises:
            ContextOverflowError: even the system prompt and the last turn do not fit.
            ToolError: as :meth:`encode_chat`.
        """
        from .conversation import fit_messages, split_turns

        reserve = max(0, min(int(reserve), self.n_ctx - 1))
        try:
            ids = self.encode_chat(messages, tools=tools)
        except ContextOverflowError:  # the render outgrew render_limits: drop old turns
            ids = None
        if ids is not None and len(ids) + reserve <= self.n_ctx:
            return ids, 0
        encode = (lambda msgs: self.encode_chat(msgs, tools=tools))
        kept, n_messages = fit_messages(list(messages), encode, self.n_ctx, reserve)
        dropped = len(split_turns(messages)[1]) - len(split_turns(kept)[1])
        log.info("context full: dropped the %d oldest turns (%d messages)", dropped, n_messages)
        return encode(kept), dropped

    def chat(self, messages: Sequence[dict], **kw) -> str:
        """The assistant's reply to OpenAI-style messages, as a string."""
        return "".join(ev.text for ev in self.chat_stream(messages, **kw))
