"""Tokenizer: a thin, explicit wrapper around a Hugging Face ``tokenizers.Tokenizer``.

What this layer adds on top of the ``tokenizers`` package, and why:

- **BOS is the only special token we ever add**, and only once. ``encode(text,
  add_special=True)`` prepends BOS when the model wants one (``add_bos_token``) and the
  text does not already start with it. The tokenizer.json post-processor is never run:
  for causal LMs it only adds BOS, and running it on top of a chat template that already
  wrote ``{{ bos_token }}`` is exactly the duplicate-BOS bug of
  https://github.com/vllm-project/vllm/issues/16853 (prompts starting 128000, 128000).
- **Chat prompts are encoded without special tokens** (``apply_chat_template``): the
  rendered template already holds every control token (HF's rule, llama-cpp-python#1439).
- **Message content is text** (``apply_chat_template``): a special-token string inside a
  message ("<|im_start|>system...", "<end_of_turn>") is encoded as the plain text it is;
  only the template's own markup makes control tokens (the placeholders of
  :mod:`edgeinfer.special_text`, turned back into text by a normalizer step, after the
  added-token split). Messages without special-token strings encode exactly as HF
  ``apply_chat_template(tokenize=True)``.
- **Raw text parses special tokens by default** (``encode(text)``, as llama.cpp's
  ``parse_special=true``); ``encode(text, parse_special=False)`` encodes them as text
  (the ``tokenizers`` ``encode_special_tokens`` setting), as perplexity and calibration
  text need.
- **Text must be valid Unicode**: a lone surrogate (what Python makes of invalid UTF-8
  in ``sys.argv``, or a JSON ``"\\ud800"``) raises :class:`InvalidTextError`.
- **The EOS set is a union** (https://github.com/vllm-project/vllm/issues/4180,
  https://github.com/ollama/ollama/issues/3759): see ``eos_ids``.

The placeholder step and ``parse_special=False`` change two settings of the wrapped
``tokenizers.Tokenizer`` (its normalizer, ``encode_special_tokens``) for the duration of
one encode, under a lock every encode here takes; decoding reads neither.

Building one from a model folder's files is ``Tokenizer.from_hf_configs(json_text,
tokenizer_config, generation_config, model_config)``; ``from_json_text`` takes every
setting explicitly.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import normalizers

from edgeinfer.chat_template import ChatTemplateError, RenderLimits, plain_prompt, render_chat_template
from edgeinfer.errors import EdgeInferError
from edgeinfer.special_text import InvalidTextError, check_text, escape_special_strings

__all__ = ["END_OF_TURN_TOKENS", "InvalidTextError", "MissingChatTemplateError", "Tokenizer",
           "plain_prompt"]

# Control tokens that end an assistant turn in common chat formats. Many checkpoints name
# only the end-of-text token as EOS in their tokenizer config, while the instruct model
# ends turns with one of these (Llama-3 <|eot_id|>, Llama-3.1 tool calls <|eom_id|>,
# ChatML <|im_end|>, GPT-2/Qwen/SmolLM2 <|endoftext|>, Gemma <end_of_turn>, Phi-3 <|end|>).
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>",
                      "<end_of_turn>", "<|end|>")


class MissingChatTemplateError(EdgeInferError, ValueError):
    """The model has no chat template (a base model); the caller picks a fallback."""


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string, or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"cannot read a special token from {value!r}; expected a string or "
                     "a {'content': ...} mapping")


def _as_id_list(value: Any) -> list[int]:
    """``eos_token_id`` from a config: absent, one int, or a list of ints."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _has_byte_fallback(node: Any) -> bool:
    """True when a decoder's JSON description contains a ``ByteFallback`` step."""
    if isinstance(node, Mapping):
        return node.get("type") == "ByteFallback" or any(_has_byte_fallback(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_byte_fallback(v) for v in node)
    return False


class Tokenizer:
    """Text ↔ token ids for one model, plus its chat template and end-of-sequence ids.

    Construct with ``from_json_text`` or ``from_hf_configs``. Safe to share between
    threads: encodes take one lock (two kinds change a backend setting for the duration
    of one encode, see the module docstring); decodes need none. Encode through this
    class, not through ``backend``, while other threads may be encoding.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        chat_template: str | Mapping[str, str] | None = None,
        extra_eos_ids: Iterable[int] = (),
        template_vars: Mapping[str, str] | None = None,
    ) -> None:
        """Wrap ``backend``; see ``from_json_text`` for the meaning of the settings.

        Raises:
            ValueError: ``bos_token``/``eos_token`` is not in the vocabulary, or an
                ``extra_eos_ids`` entry is negative.
        """
        self._backend = backend
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._bos_id = self._required_id(bos_token, "bos_token")
        eos_id = self._required_id(eos_token, "eos_token")
        self._add_bos = bool(add_bos_token) and self._bos_id is not None

        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        # encodes run one at a time: two of them change backend settings for a moment
        self._encode_lock = threading.Lock()
        self._special_initials = frozenset(
            tok.content[0] for tok in added.values() if tok.special and tok.content)

        eos = set() if eos_id is None else {eos_id}
        for i in extra_eos_ids:
            if int(i) < 0:
                raise ValueError(f"extra_eos_ids must be non-negative token ids, got {i}")
            eos.add(int(i))
        for name in END_OF_TURN_TOKENS:
            i = backend.token_to_id(name)
            if i is not None and i in self._special_ids:
                eos.add(i)
        self._eos_ids = frozenset(eos)

        if chat_template is None:
            self._templates: dict[str, str] = {}
        elif isinstance(chat_template, str):
            self._templates = {"default": chat_template}
        else:
            self._templates = dict(chat_template)
        self._template_vars = dict(template_vars or {})

        self._byte_ids: frozenset[int] = frozenset()
        if backend.decoder is not None and _has_byte_fallback(json.loads(backend.decoder.__getstate__())):
            ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
            self._byte_ids = frozenset(i for i in ids if i is not None)

    def _required_id(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        i = self._backend.token_to_id(token)
        if i is None:
            raise ValueError(f"{what} {token!r} is not in the tokenizer's vocabulary")
        return i

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_json_text(
        cls,
        json_text: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        chat_template: str | Mapping[str, str] | None = None,
        extra_eos_ids: Iterable[int] = (),
    ) -> Tokenizer:
        """Build from the text of a ``tokenizer.json``.

        Args:
            json_text: contents of tokenizer.json (the ``tokenizers`` serialization).
            bos_token, eos_token: token strings, e.g. "<|begin_of_text|>", "<|end_of_text|>".
            add_bos_token: ``encode(..., add_special=True)`` prepends BOS (once).
            chat_template: Jinja source, or ``{name: source}`` for models that ship several
                (the one named "default" is used unless another is asked for).
            extra_eos_ids: more ids that end generation (``eos_token_id`` of
                generation_config.json and config.json; see ``eos_ids``).

        Raises:
            ValueError: the JSON cannot be parsed by ``tokenizers``, or a named special
                token is not in its vocabulary.
        """
        try:
            backend = tokenizers.Tokenizer.from_str(json_text)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"cannot read tokenizer.json: {e}") from e
        return cls(backend, bos_token=bos_token, eos_token=eos_token, add_bos_token=add_bos_token,
                   chat_template=chat_template, extra_eos_ids=extra_eos_ids)

    @classmethod
    def from_hf_configs(
        cls,
        json_text: str,
        tokenizer_config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        model_config: Mapping[str, Any] | None = None,
        *,
        chat_template: str | Mapping[str, str] | None = None,
    ) -> Tokenizer:
        """Build from a HF model folder's parsed JSON files.

        Reads ``bos_token``/``eos_token``/``pad_token``/``unk_token`` (strings or
        ``{"content": ...}``) and ``chat_template`` (a string or a list of
        ``{"name", "template"}``) from ``tokenizer_config``; ``eos_token_id`` (int or list)
        from ``generation_config`` and ``model_config``. ``add_bos_token`` is the config's
        value when present, otherwise whether tokenizer.json's post-processor adds BOS
        (Llama-3 and Gemma do, Qwen and SmolLM2 do not). ``chat_template`` given here
        (e.g. from transformers-5 ``chat_template.jinja``) overrides the config's.

        Raises:
            ValueError: as ``from_json_text``, or a config value has the wrong type.
        """
        tc = dict(tokenizer_config or {})
        bos = _token_content(tc.get("bos_token"))
        eos = _token_content(tc.get("eos_token"))
        template = chat_template if chat_template is not None else tc.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
            template = {t["name"]: t["template"] for t in template}
        extra = _as_id_list((generation_config or {}).get("eos_token_id"))
        extra += _as_id_list((model_config or {}).get("eos_token_id"))
        tok = cls.from_json_text(json_text, bos_token=bos, eos_token=eos, chat_template=template,
                                 extra_eos_ids=extra)
        add_bos = tc.get("add_bos_token")
        if add_bos is None and tok.bos_id is not None:
            with_special = tok._backend.encode("a", add_special_tokens=True).ids
            add_bos = bool(with_special) and with_special[0] == tok.bos_id
        tok._add_bos = bool(add_bos) and tok.bos_id is not None
        for name in ("pad_token", "unk_token", "sep_token", "cls_token", "mask_token"):
            value = _token_content(tc.get(name))
            if value is not None:
                tok._template_vars[name] = value
        return tok

    # ----------------------------------------------------------------- properties
    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (read-only use)."""
        return self._backend

    @property
    def bos_id(self) -> int | None:
        """Id of the BOS token, or None if the model has none (Qwen, SmolLM2)."""
        return self._bos_id

    @property
    def bos_token(self) -> str | None:
        """BOS token string (what a chat template's ``{{ bos_token }}`` renders)."""
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        """The tokenizer config's EOS token string (one of several ``eos_ids``)."""
        return self._eos_token

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode(..., add_special=True)`` prepends BOS."""
        return self._add_bos

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every id that ends generation.

        The union of (1) the id of ``eos_token``, (2) ``extra_eos_ids`` (the
        ``eos_token_id`` of generation_config.json and config.json), and (3) each of
        ``END_OF_TURN_TOKENS`` (``<|eot_id|>``, ``<|eom_id|>``, ``<|im_end|>``,
        ``<|endoftext|>``, ``<end_of_turn>``, ``<|end|>``) that is in the vocabulary AND
        marked special. Rule (3) catches checkpoints whose configs name only the
        end-of-text token while the chat model ends its turns with a control token
        (Llama 3's ``<|eot_id|>``); a special token never appears in normal text, so adding it is safe.
        """
        return self._eos_ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of added tokens marked special (skipped by ``decode(skip_special=True)``)."""
        return self._special_ids

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of SentencePiece ``<0xNN>`` byte tokens, when the decoder has ByteFallback; else empty."""
        return self._byte_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included.

        The model's embedding may be larger (padded, e.g. Phi-3 32064 vs 32011); ids in
        the gap decode to nothing.
        """
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """The template ``render_chat`` uses by default, or None for a base model."""
        try:
            return self._template(None, None)
        except MissingChatTemplateError:
            return None

    @property
    def chat_template_names(self) -> tuple[str, ...]:
        """Names of the chat templates the model ships (usually just ("default",))."""
        return tuple(self._templates)

    # ----------------------------------------------------------------- ids ↔ text
    def encode(self, text: str, add_special: bool = False, *, parse_special: bool = True
               ) -> list[int]:
        """Token ids of ``text``.

        With ``parse_special`` (the default, as llama.cpp's ``parse_special=true`` and HF)
        special-token strings inside ``text`` (e.g. "<|eot_id|>") become their control
        ids; with ``parse_special=False`` they are encoded as the plain text they are
        (what perplexity, calibration text and untrusted raw prompts need; llama.cpp's
        perplexity does the same). ``add_special=True`` prepends BOS when
        ``add_bos_token`` is set, unless the ids already start with BOS; nothing else is
        added (no post-processor, no EOS).

        Raises:
            TypeError: ``text`` is not a str.
            InvalidTextError: ``text`` holds a lone surrogate (invalid UTF-8).
        """
        check_text(text, "the text to encode")
        with self._encode_lock:
            enc = self._backend.encode(text, add_special_tokens=False)
            if not parse_special and self._special_ids.intersection(enc.ids):
                before = self._backend.encode_special_tokens
                self._backend.encode_special_tokens = True
                try:
                    enc = self._backend.encode(text, add_special_tokens=False)
                finally:
                    self._backend.encode_special_tokens = before
        ids = enc.ids
        if add_special and self._add_bos and (not ids or ids[0] != self._bos_id):
            ids.insert(0, self._bos_id)
        return ids

    def special_token_spans(self, text: str) -> list[tuple[int, int]]:
        """(start, end) character spans of the special tokens ``encode(text)`` would
        make, found by the tokenizer's own added-token matcher."""
        check_text(text)
        with self._encode_lock:
            enc = self._backend.encode(text, add_special_tokens=False)
        return [off for i, off in zip(enc.ids, enc.offsets) if i in self._special_ids]

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of ``ids`` (the tokenizer.json decoder chain; no clean-up of spaces).

        With ``skip_special`` the ids in ``special_ids`` are dropped before decoding.
        Ids outside the vocabulary are ignored (the ``tokenizers`` behaviour).
        """
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string, or None if it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of an id (raw vocab form, e.g. "Ġthe" or "▁the"), or None."""
        return self._backend.id_to_token(int(token_id))

    # ----------------------------------------------------------------- chat
    def _template(self, name: str | None, tools: object) -> str:
        if not self._templates:
            raise MissingChatTemplateError(
                "this model has no chat template (a base model?); pass chat_template=..., or "
                "encode plain_prompt(messages) with add_special=True")
        if name is None:
            name = "tool_use" if tools is not None and "tool_use" in self._templates else "default"
            if name not in self._templates:
                name = next(iter(self._templates))
        if name not in self._templates:
            raise MissingChatTemplateError(
                f"no chat template named {name!r}; this model has {sorted(self._templates)}")
        return self._templates[name]

    def _render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                tools: Sequence[Mapping[str, Any]] | None, template_name: str | None,
                render_limits: RenderLimits | None, template_kwargs: dict
                ) -> tuple[str, dict[str, str]]:
        """(rendered text with placeholders, {placeholder: special-token text})."""
        template = self._template(template_name, tools)
        messages, tools, placeholders = escape_special_strings(
            messages, tools, template, self.special_token_spans, self._special_initials)
        variables = {**self._template_vars, **template_kwargs}
        text = render_chat_template(
            template, messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._bos_token, eos_token=self._eos_token, tools=tools,
            render_limits=render_limits, **variables)
        return text, placeholders

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_name: str | None = None,
        render_limits: RenderLimits | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Prompt text of ``messages`` rendered with the model's chat template.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``.
            add_generation_prompt: end with the header that opens the assistant turn.
            tools: tool JSON schemas; selects the "tool_use" template when one exists.
            template_name: pick one of ``chat_template_names`` explicitly.
            render_limits: time and size bounds of the render (default ``RenderLimits()``).
            **template_kwargs: extra template variables (``enable_thinking``, ...).

        Raises:
            MissingChatTemplateError: the model has no (such) template.
            ChatTemplateError: the template raised or failed (e.g. roles not alternating),
                or reached a render limit (``ChatTemplateTimeoutError``,
                ``ChatTemplateTooLargeError``).
            InvalidTextError: a message string holds a lone surrogate.
        """
        text, placeholders = self._render(messages, add_generation_prompt, tools, template_name,
                                          render_limits, template_kwargs)
        for ph, special in placeholders.items():
            text = text.replace(ph, special)
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_name: str | None = None,
        render_limits: RenderLimits | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Prompt ids of ``messages``: the ``render_chat`` text, encoded with the template's
        markup as control tokens and the message strings as plain text.

        Equal to HF ``apply_chat_template(messages, tokenize=True, ...)`` for messages
        without special-token strings: the template writes BOS itself where the model
        wants it, so no BOS is added here (never two). A special-token string inside a
        message (a forged "<|im_start|>system") is encoded as text, never as a control
        token (see the module docstring); the ids decode to ``render_chat``'s text.
        Keyword arguments are those of ``render_chat``.

        Raises:
            MissingChatTemplateError, ChatTemplateError, InvalidTextError: as ``render_chat``.
            ChatTemplateError: a message holds a special token this tokenizer matches only
                after normalization, which cannot be kept as text.
        """
        text, placeholders = self._render(messages, add_generation_prompt, tools, template_name,
                                          render_limits, template_kwargs)
        if not placeholders:
            return self.encode(text, add_special=False)
        check_text(text, "the rendered chat prompt")
        backend = self._backend
        with self._encode_lock:
            markup = [i for i in backend.encode(text, add_special_tokens=False).ids
                      if i in self._special_ids]
            normalizer = backend.normalizer
            steps = [normalizers.Replace(ph, special) for ph, special in placeholders.items()]
            backend.normalizer = normalizers.Sequence(
                steps + ([normalizer] if normalizer is not None else []))
            try:
                ids = backend.encode(text, add_special_tokens=False).ids
            finally:
                backend.normalizer = normalizer
        if [i for i in ids if i in self._special_ids] != markup:
            raise ChatTemplateError(
                "a chat message holds a special token that this tokenizer matches after "
                "normalization, so it cannot be encoded as plain text; remove it from the "
                "message")
        return ids

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self._bos_id}, "
                f"eos_ids={sorted(self._eos_ids)}, add_bos_token={self._add_bos}, "
                f"chat_templates={list(self._templates)})")

