"""Chat templates and prompt ids (case C07: exactly one BOS), checked against HF transformers."""
from __future__ import annotations

import json

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from edgeinfer.chat_template import ChatTemplateError, compile_chat_template, render_chat_template
from edgeinfer.tokenizer import MissingChatTemplateError, Tokenizer, plain_prompt

# Llama-3.2-Instruct's chat template (tokenizer_config.json of meta-llama/Llama-3.2-1B-Instruct).
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# SmolLM2-Instruct's ChatML template: no BOS, a default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"]
CORPUS = ["system user assistant Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024 "
          "S Q hello world. What is 2+2? é 你好"] * 10


def _byte_level_bpe(vocab_size: int) -> dict:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return json.loads(tok.to_str())


def _added(i: int, content: str) -> dict:
    return dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False,
                normalized=False, special=True)


def llama3_tokenizer_json() -> str:
    """Llama-3 layout: 128000 ordinary ids, then the control tokens from 128000; the
    post-processor prepends <|begin_of_text|> (as the real tokenizer.json does)."""
    d = _byte_level_bpe(400)
    vocab = d["model"]["vocab"]
    for i in range(len(vocab), 128000):  # filler so that the special ids are the real ones
        vocab[f"<unused_{i}>"] = i
    d["added_tokens"] = [_added(128000 + j, c) for j, c in enumerate(LLAMA3_SPECIALS)]
    d["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [128000],
                                                 "tokens": ["<|begin_of_text|>"]}},
    }
    return json.dumps(d)


def chatml_tokenizer_json() -> str:
    """SmolLM2 layout: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2, no BOS added."""
    d = _byte_level_bpe(400)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i + len(specials) for t, i in d["model"]["vocab"].items()}
    vocab.update({t: i for i, t in enumerate(specials)})
    d["model"]["vocab"] = vocab
    d["added_tokens"] = [_added(i, t) for i, t in enumerate(specials)]
    return json.dumps(d)


MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
DATE = {"date_string": "26 Jul 2024"}  # the template would otherwise read today's date


@pytest.fixture(scope="module")
def llama3_json() -> str:
    return llama3_tokenizer_json()


@pytest.fixture(scope="module")
def llama3(llama3_json) -> Tokenizer:
    return Tokenizer.from_hf_configs(
        llama3_json,
        tokenizer_config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                          "chat_template": LLAMA3_TEMPLATE},
        generation_config={"eos_token_id": [128001, 128008, 128009]})


@pytest.fixture(scope="module")
def chatml() -> Tokenizer:
    return Tokenizer.from_json_text(chatml_tokenizer_json(), eos_token="<|im_end|>",
                                    chat_template=CHATML_TEMPLATE)


# ---------------------------------------------------------------- C07
def test_c07_llama3_exactly_one_bos_and_assistant_header(llama3):
    assert llama3.bos_id == 128000 and llama3.add_bos_token  # inferred from the post-processor
    ids = llama3.apply_chat_template(MESSAGES, add_generation_prompt=True, **DATE)
    assert ids[0] == 128000
    assert ids.count(128000) == 1
    header = [128006] + llama3.encode("assistant") + [128007] + llama3.encode("\n\n")
    assert ids[-len(header):] == header
    text = llama3.render_chat(MESSAGES, **DATE)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert text.endswith("S<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nQ<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_c07_the_bug_class_is_real_and_avoided(llama3):
    text = llama3.render_chat(MESSAGES, **DATE)
    # encoding the rendered text WITH the post-processor duplicates BOS (vllm#16853) ...
    assert llama3.backend.encode(text, add_special_tokens=True).ids[:2] == [128000, 128000]
    # ... our encode never adds a second one, even when asked to add specials
    assert llama3.encode(text, add_special=True).count(128000) == 1
    assert llama3.encode(text, add_special=True) == llama3.apply_chat_template(MESSAGES, **DATE)


def test_c07_base_model_without_template(llama3_json):
    base = Tokenizer.from_json_text(llama3_json, bos_token="<|begin_of_text|>",
                                    eos_token="<|end_of_text|>", add_bos_token=True)
    assert base.chat_template is None
    with pytest.raises(MissingChatTemplateError, match="no chat template") as e:
        base.apply_chat_template(MESSAGES)
    assert isinstance(e.value, ValueError)
    prompt = plain_prompt(MESSAGES)
    assert prompt == "S\n\nQ"
    ids = base.encode(prompt, add_special=True)
    assert ids[0] == 128000 and ids.count(128000) == 1  # add_bos_token applies, once
    assert base.encode(prompt, add_special=False)[0] != 128000
    assert plain_prompt([{"role": "user", "content": "Once upon"}]) == "Once upon"


def test_c07_matches_transformers(llama3, llama3_json, chatml):
    transformers = pytest.importorskip("transformers")

    def hf_ids(tok_json, template, **special):
        hf = transformers.PreTrainedTokenizerFast(
            tokenizer_object=HFTokenizer.from_str(tok_json), chat_template=template, **special)
        return lambda msgs, **kw: _ids(hf.apply_chat_template(msgs, tokenize=True, **kw))

    def _ids(out):
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    hf_llama = hf_ids(llama3_json, LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>",
                      eos_token="<|eot_id|>")
    tools = [{"type": "function", "function": {"name": "add", "description": "Añade <a> & b",
              "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]
    convs = [MESSAGES, MESSAGES[1:],
             MESSAGES + [{"role": "assistant", "content": " 4 "}, {"role": "user", "content": "é 你好"}]]
    for msgs in convs:
        for agp in (True, False):
            assert llama3.apply_chat_template(msgs, agp, **DATE) == \
                hf_llama(msgs, add_generation_prompt=agp, **DATE)
    assert llama3.apply_chat_template(MESSAGES, tools=tools, **DATE) == \
        hf_llama(MESSAGES, tools=tools, add_generation_prompt=True, **DATE)

    hf_chatml = hf_ids(chatml_tokenizer_json(), CHATML_TEMPLATE, eos_token="<|im_end|>")
    for msgs in convs:
        assert chatml.apply_chat_template(msgs) == hf_chatml(msgs, add_generation_prompt=True)


# ---------------------------------------------------------------- ChatML
def test_chatml_no_bos_and_eos_set(chatml):
    assert chatml.bos_id is None
    ids = chatml.apply_chat_template([{"role": "user", "content": "hello"}])
    assert ids[:1] == [1]  # <|im_start|>, no BOS
    tail = [1] + chatml.encode("assistant\n")
    assert ids[-len(tail):] == tail
    text = chatml.render_chat([{"role": "user", "content": "hello"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    assert chatml.eos_ids == {0, 2}  # <|im_end|> (eos) and <|endoftext|> (end-of-turn rule)


def test_eos_union(llama3):
    # config eos <|eot_id|>, generation_config [128001, 128008, 128009]
    assert llama3.eos_ids == {128001, 128008, 128009}
    only_text = Tokenizer.from_json_text(llama3.backend.to_str(), eos_token="<|end_of_text|>")
    assert only_text.eos_ids == {128001, 128008, 128009}  # eot/eom found by the end-of-turn rule


# ---------------------------------------------------------------- the Jinja environment
def test_raise_exception_gives_clear_error(chatml):
    tpl = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
           "{% endif %}{{ m['content'] }}{% endfor %}")
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError) as e:
        render_chat_template(tpl, bad)
    assert str(e.value) == "Conversation roles must alternate user/assistant/user/assistant/..."
    assert isinstance(e.value, jinja2.TemplateError) and isinstance(e.value, ValueError)
    assert render_chat_template(tpl, bad[:1]) == "a"


def test_syntax_and_sandbox_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        compile_chat_template("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="render"):  # immutable sandbox: no list.append
        render_chat_template("{% set _ = messages.append(1) %}", [])
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__ }}", [])


def test_tojson_like_hf():
    out = render_chat_template("{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}",
                               [{"role": "user", "content": "é <b> & 你"}])
    assert out == ('{"role": "user", "content": "é <b> & 你"}|'
                   '{\n  "role": "user",\n  "content": "é <b> & 你"\n}')


def test_trim_lstrip_blocks_and_extensions():
    tpl = ("{% for m in messages %}\n    {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
           "{% generation %}[{{ m.content }}]{% endgeneration %}\n{% endfor %}\n")
    msgs = [{"role": "user", "content": "a"}, {"role": "skip", "content": "x"},
            {"role": "user", "content": "b"}]
    # lstrip_blocks eats the indent before a tag, trim_blocks the newline after one
    assert render_chat_template(tpl, msgs) == "[a][b]"


def test_template_variables():
    tpl = "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ tools }}|{{ extra }}"
    assert render_chat_template(tpl, [], bos_token="<s>", eos_token="</s>", extra=3) == \
        "<s>|</s>|True|None|3"
    assert render_chat_template(tpl, [], add_generation_prompt=False) == "||False|None|"
    # None-valued message keys are dropped, so "is defined" checks work (as in HF)
    assert render_chat_template("{{ messages[0].content is defined }}",
                                [{"role": "assistant", "content": None}]) == "False"
    assert len(render_chat_template("{{ strftime_now('%Y') }}", [])) == 4


def test_compile_is_cached():
    assert compile_chat_template(CHATML_TEMPLATE) is compile_chat_template(CHATML_TEMPLATE)


def test_named_templates(llama3_json):
    tok = Tokenizer.from_hf_configs(llama3_json, tokenizer_config={
        "bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|eot_id|>",
        "chat_template": [{"name": "default", "template": "D{{ messages|length }}"},
                          {"name": "tool_use", "template": "T{{ tools|length }}"}]})
    assert tok.chat_template_names == ("default", "tool_use")
    assert tok.render_chat(MESSAGES) == "D2"
    assert tok.render_chat(MESSAGES, tools=[{"name": "f"}]) == "T1"
    with pytest.raises(MissingChatTemplateError, match="rag"):
        tok.render_chat(MESSAGES, template_name="rag")
