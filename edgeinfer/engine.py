"""The generation engine: prefill, decode loop, stop conditions, prefix reuse, stats.

Layered generators (as mlx-lm's ``generate_step`` → ``stream_generate`` → ``generate``):
:meth:`Engine.stream` yields :class:`GenerationEvent` s (a text delta with its token id,
then one final event carrying the finish reason and :class:`GenerationStats`);
:meth:`Engine.generate` joins them into a string.

Policy (documented for users):

* Prefill runs in chunks of ``prefill_chunk`` tokens, so scratch memory is bounded.
* Prefix reuse: the engine remembers the token ids held in its KV cache. A new prompt
  that shares a prefix with them keeps that part of the cache and computes only the
  rest; the last prompt token is always recomputed (its logits are needed).
* A prompt longer than the context raises :class:`ContextOverflowError` (nothing is
  truncated silently); generation that reaches the end of the context stops with
  finish reason ``"length"``.
* Stops on any EOS id (config + generation config + tokenizer), on stop strings (text
  that may still become one is held back; a stop string that is exactly one special
  token, such as "<start_of_turn>", stops on that token's id, since special tokens
  decode to no text), on ``max_tokens`` ("length"), or when the caller's cancel event is
  set ("cancelled").
"""
from __future__ import annotations

import resource
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .backends.kvformat import KSTAT_POSITIONS
from .detokenizer import StreamingDetokenizer
from .errors import ContextOverflowError
from .sampling import Sampler, SamplingParams
from .speculative import Speculator, speculation_problem
from .stopping import StopChecker, stop_strings_to_ids
from .tokenizer import Tokenizer


@dataclass
class GenerationStats:
    """Timing and size figures of one generation.

    Attributes:
        prompt_tokens: tokens in the prompt.
        reused_tokens: prompt tokens whose KV came from the previous call (prefix reuse).
        generated_tokens: tokens sampled.
        ttft_s: seconds from the call to the first sampled token (prefill + 1 sample).
        prefill_tok_s: prompt tokens computed per second.
        decode_tok_s: generated tokens per second after the first.
        itl_mean_s / itl_p90_s: inter-token latency, seconds.
        kv_bytes: bytes of KV cache in use (positions held × bytes per position).
        peak_rss_mb: the process's peak resident memory, MiB.
        dropped_turns: oldest whole turns a chat dropped to fit the context
            (:meth:`edgeinfer.api.Model.chat_stream`); 0 otherwise.
        drafted / accepted: speculative draft ids verified / accepted
            (:mod:`edgeinfer.speculative`); 0 without speculation.
    """

    prompt_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    itl_mean_s: float = 0.0
    itl_p90_s: float = 0.0
    kv_bytes: int = 0
    peak_rss_mb: float = 0.0
    dropped_turns: int = 0
    drafted: int = 0
    accepted: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class GenerationEvent:
    """One step of a generation stream.

    ``text`` is the new printable text (may be empty while a multi-byte character or a
    possible stop string is held back); ``token`` the sampled id (None on the final
    event); ``finish_reason`` and ``stats`` are set on the final event only:
    "stop" (EOS or stop string), "length" (max_tokens or context full), "cancelled".
    """

    text: str = ""
    token: int | None = None
    finish_reason: str | None = None
    stats: GenerationStats | None = None


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (Linux ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter (``VmHWM``) at the current RSS, so that
    :func:`window_peak_rss_mb` measures a phase (e.g. decode, after loading). Linux 4.0+
    (``/proc/self/clear_refs``, value 5); returns False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def window_peak_rss_mb() -> float:
    """Peak RSS in MiB since the last :func:`reset_peak_rss` (``VmHWM``), or the process
    lifetime's peak where ``/proc`` is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return peak_rss_mb()


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Engine:
    """A model on a backend with one KV cache: the unit that generates.

    Not thread-safe by itself: :class:`edgeinfer.api.Model` serializes callers with a lock.

    Args:
        model: a :class:`edgeinfer.models.transformer.Transformer`.
        tokenizer: the model's :class:`Tokenizer`.
        n_ctx: context length (positions preallocated in the KV cache).
        kv_dtype: KV cache storage dtype.
        prefill_chunk: tokens per prefill forward call.
    """

    model: object
    tokenizer: Tokenizer
    n_ctx: int = 4096
    kv_dtype: str = "f32"
    prefill_chunk: int = 512
    cache: object = None
    cached_ids: list[int] = field(default_factory=list)
    # decode_one's reused buffers: the token id int32 [1] and the logits float32 [1, V]
    _ids1: np.ndarray = field(default=None, init=False, repr=False, compare=False)
    _logits: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    # the sampling workspace (V-sized buffers) reused by one stream after another; a
    # stream takes it out while it runs, so a second stream started meanwhile (another
    # thread, an abandoned generator) makes its own instead of sharing it
    _sampler: Sampler | None = field(default=None, init=False, repr=False, compare=False)
    # LongRoPE models (``model.rope_switch``, see edgeinfer.models.rope): the switch length
    # and whether the cached prefix was computed with the long factors
    _switch: int | None = field(default=None, init=False, repr=False, compare=False)
    _cache_long: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cache is None:
            self.cache = self.model.new_cache(self.n_ctx, self.kv_dtype, self.prefill_chunk)
        self._ids1 = np.zeros(1, np.int32)
        self._switch = getattr(self.model, "rope_switch", None)

    # ---- low level -------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the cached prefix."""
        self.cache.reset()
        self.cached_ids = []
        self._cache_long = False

    def check_prompt(self, ids: Sequence[int]) -> None:
        """Raise if a prompt cannot be run.

        Raises:
            ValueError: empty prompt.
            ContextOverflowError: ``len(ids)`` exceeds the context.
        """
        if len(ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if len(ids) > self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx}; "
                f"shorten the prompt or raise the context (--ctx / more --max-memory)"
            )

    def prefill(self, ids: Sequence[int], cancel: threading.Event | None = None
                ) -> tuple[np.ndarray | None, int]:
        """Make the cache hold exactly ``ids`` and return the last position's logits.

        Reuses the longest common prefix with what the cache already holds (always
        recomputing at least the last token). A LongRoPE model runs the whole prompt with
        the factors of its length; a cached prefix computed with the other ones is not
        reused; nor is an int4 cache's prefix whose K statistics came from other rows than
        a fresh prefill of ``ids`` would take them from (``Int4KVCache.stat_rows``).

        Returns:
            (logits float32 [V], number of reused tokens); logits is None when ``cancel``
            was set between prefill chunks (the cache then holds a valid shorter prefix).

        Raises:
            ContextOverflowError: ``len(ids)`` exceeds the context.
            ValueError: empty prompt.
        """
        self.check_prompt(ids)
        keep = min(common_prefix_len(self.cached_ids, ids), len(ids) - 1)
        kw = {}
        if self._switch is not None:
            long = len(ids) > self._switch
            if long != self._cache_long:
                keep = 0
            self._cache_long = long
            kw = {"long_rope": long}
        stat_rows = getattr(self.cache, "stat_rows", None)  # int4 KV: K statistics' rows
        if stat_rows and keep and (keep < stat_rows or stat_rows != min(
                KSTAT_POSITIONS, self.prefill_chunk, len(ids))):
            keep = 0  # a fresh prefill would fix other statistics: a hit must not differ
        self.cache.trim(min(keep, self.cache.length))
        keep = self.cache.length
        self.cached_ids = list(ids[:keep])
        logits = None
        for s in range(keep, len(ids), self.prefill_chunk):
            if cancel is not None and cancel.is_set():
                return None, keep
            chunk = ids[s:s + self.prefill_chunk]
            logits = self.model.forward(np.asarray(chunk, np.int32), self.cache, **kw)
            self.cached_ids.extend(chunk)
        return logits[-1], keep

    def decode_one(self, token: int) -> np.ndarray:
        """Append one token and return the next logits float32 [V].

        The logits are a view of a buffer this engine reuses (so that a decode step
        allocates nothing on the CPU backend): valid until the next ``decode_one``; copy
        them to keep them longer. On a LongRoPE model, the step that takes the sequence
        past the switch length re-runs the whole sequence with the long factors (as HF's
        Phi-3 does), so its logits equal a from-scratch forward.
        """
        if (self._switch is not None and not self._cache_long
                and self.cache.length >= self._switch):
            last, _ = self.prefill(self.cached_ids + [int(token)])
            self._logits = last.reshape(1, -1)
            return self._logits[-1]
        self._ids1[0] = token
        if self._logits is None:  # the first step's result becomes the reused buffer
            self._logits = self.model.forward(self._ids1, self.cache)
        else:
            self.model.forward(self._ids1, self.cache, out=self._logits)
        self.cached_ids.append(int(token))
        return self._logits[-1]

    # ---- generation ------------------------------------------------------------------
    def stream(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
               max_tokens: int = 256, stop: Sequence[str] = (),
               cancel: threading.Event | None = None,
               constraint=None, leading_space: bool = True,
               speculate: str = "auto") -> Iterator[GenerationEvent]:
        """Generate from ``prompt_ids``, yielding events (see :class:`GenerationEvent`).

        Args:
            prompt_ids: the full prompt (chat template already applied).
            params: sampling settings (default: greedy).
            max_tokens: most tokens to generate.
            stop: stop strings; matched text is not emitted. One that is exactly a special
                token (``stop_strings_to_ids``) stops on its id; that token is not emitted.
            cancel: checked between steps; when set the stream ends with "cancelled".
            constraint: an :class:`edgeinfer.constrained.Constraint` (fresh, at the
                grammar's start): each token is sampled under its mask.
            leading_space: keep the space that begins the first word where a
                SentencePiece decoder strips it (a completion of "Once upon a time,"
                starts " there", as llama.cpp prints it); chat replies pass False.
            speculate: "ngram": prompt-lookup speculative decoding where it is exact
                (:mod:`edgeinfer.speculative`; the same tokens as without it); "auto"
                (default): the same, while it pays by measured time; "off": one
                decode step per token.

        Raises:
            ValueError: an unknown ``speculate``.
            ContextOverflowError: the prompt does not fit the context.
            GrammarError: the constraint failed (a grammar limit).
        """
        params = params or SamplingParams(temperature=0.0)
        spec_reason = speculation_problem(self, speculate)
        rng = np.random.default_rng(params.seed)
        tok = self.tokenizer
        detok = StreamingDetokenizer(tok, leading_space=leading_space)
        stop_ids, stop_texts = stop_strings_to_ids(stop, tok)
        stopper = StopChecker(tok.eos_ids | stop_ids, stop_texts, max_tokens)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        t0 = time.perf_counter()
        logits, reused = self.prefill(list(prompt_ids), cancel)
        stats.reused_tokens = reused
        t_prefill = time.perf_counter() - t0
        stats.prefill_tok_s = (len(prompt_ids) - reused) / max(t_prefill, 1e-9)
        spec = None
        if logits is not None and spec_reason is None:
            spec = Speculator(self, prompt_ids, max_tokens, mode=speculate)
        sampler = None
        step_times: list[float] = []
        finish = None
        t_last = t0
        while finish is None:
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            if sampler is None:  # after prefill: V is the logits' length
                sampler, self._sampler = self._sampler, None
                if sampler is None or sampler.vocab != logits.shape[-1]:
                    sampler = Sampler(logits.shape[-1])
                sampler.start(params, prompt_ids)
            token = sampler.sample(logits, rng,
                                   None if constraint is None else constraint.fill())
            now = time.perf_counter()
            if stats.generated_tokens == 0:
                stats.ttft_s = now - t0
            else:
                step_times.append(now - t_last)
            t_last = now
            stats.generated_tokens += 1
            sampler.accept(token)
            finish = stopper.on_token(token)
            if finish == "stop":  # an EOS id (on_token's only "stop"): not emitted
                break
            if constraint is not None:
                constraint.accept(token)
            text, finish_text = stopper.feed(detok.add(token))
            if text:
                yield GenerationEvent(text=text, token=token)
            elif finish_text is None:
                yield GenerationEvent(text="", token=token)
            finish = finish or finish_text
            if finish is not None:
                break
            if (self.cache.length if spec is None else spec.length) >= self.n_ctx:
                finish = "length"
                break
            logits = self.decode_one(token) if spec is None else spec.next_logits(token)
        if spec is not None:
            spec.close()
            stats.drafted, stats.accepted = spec.drafted, spec.accepted
        if sampler is not None:
            self._sampler = sampler
        if finish != "stop" or not stopper.stopped_by_string:
            tail, _ = stopper.feed(detok.flush())
            tail += stopper.flush()
            if tail:
                yield GenerationEvent(text=tail)
        if step_times:
            st = np.asarray(step_times)
            stats.itl_mean_s = float(st.mean())
            stats.itl_p90_s = float(np.percentile(st, 90))
            stats.decode_tok_s = 1.0 / stats.itl_mean_s
        stats.kv_bytes = int(self.cache.used_nbytes())  # ring layers hold <= their slots
        stats.peak_rss_mb = peak_rss_mb()
        yield GenerationEvent(finish_reason=finish, stats=stats)

    def generate(self, prompt_ids: Sequence[int], **kw) -> tuple[str, GenerationEvent]:
        """Run :meth:`stream` to the end; returns (text, final event)."""
        parts = []
        last = None
        for ev in self.stream(prompt_ids, **kw):
            parts.append(ev.text)
            last = ev
        return "".join(parts), last
