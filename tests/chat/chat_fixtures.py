# ruff: noqa: E501  (the reference Jinja templates keep their original long lines)
"""Test helpers for rljax.chat: tokenizers trained in code, reference chat templates, random data.

Tokenizers: byte-level BPE trained in well under a second on a synthetic corpus with the
Qwen2 / Llama 3 pre-tokenizer regexes (so merges such as ``"\\n\\n"`` or ``" {"`` exist), then
the format's special tokens are added and the result is wrapped in
``transformers.PreTrainedTokenizerFast`` with a Jinja chat template.

The templates below are written for these tests from the formats' documentation (Qwen2.5 /
Qwen3 model cards and chat-template behaviour, Llama 3 / 3.1 model cards). They are the
*independent reference*: renderers must match ``apply_chat_template`` on them token for token.
"""

from __future__ import annotations

import json
import random
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

WORDS = (
    "the a an of to and is in it you that he was for on are with as his they be at one have this from "
    "or had by word but what some we can out other were all there when up use your how said each she "
    "which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over know "
    "water than call first who may down side been now find weather search city temperature result "
    "error ok value query answer tool user assistant system think json name arguments parameters "
    "café naïve straße 東京 北京 Ωmega résumé 🙂 ünïcödé"
).split()
PUNCT = [
    ".",
    ",",
    "!",
    "?",
    ":",
    ";",
    "-",
    "(",
    ")",
    '"',
    "'",
    "{",
    "}",
    "[",
    "]",
    "`",
    "#",
    "*",
    "/",
    "=",
    "<",
    ">",
]
SPACES = ["\n", "\n\n", "  ", "\t", " \n", "\n\n\n"]


# -- random data ------------------------------------------------------------------------------
def random_text(rng: random.Random, *, max_words: int = 14, edges: bool = True, min_words: int = 0) -> str:
    """Random text with words, numbers, punctuation, unicode and odd whitespace."""
    out = []
    for _ in range(rng.randint(min_words, max_words)):
        r = rng.random()
        if r < 0.7:
            tok = rng.choice(WORDS)
        elif r < 0.8:
            tok = str(rng.randint(0, 99999))
        elif r < 0.92:
            tok = rng.choice(PUNCT)
        else:
            tok = rng.choice(SPACES)
        out.append(tok + rng.choice([" ", " ", " ", "", "\n"]))
    text = "".join(out)
    if edges and rng.random() < 0.25:
        text = rng.choice([" ", "\n", "\n\n", "  \n", "\t"]) + text
    if edges and rng.random() < 0.25:
        text += rng.choice([" ", "\n", "\n\n", " \n "])
    return text


def clean_text(rng: random.Random, *, max_words: int = 10) -> str:
    """Non-empty text without leading/trailing whitespace (exact body attribution)."""
    while True:
        text = random_text(rng, max_words=max_words, edges=False, min_words=1).strip()
        if text and not text.startswith("{"):
            return text


def random_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if r < 0.3:
        return random_text(rng, max_words=4, edges=False)
    if r < 0.45:
        return rng.randint(-1000, 100000)
    if r < 0.55:
        return round(rng.uniform(-100, 100), rng.randint(0, 4))
    if r < 0.65:
        return rng.choice([True, False, None])
    if r < 0.8 and depth < 2:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 2:
        return random_arguments(rng, depth + 1)
    return rng.choice(WORDS)


def random_arguments(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    keys = ["city", "query", "n", "unit", "path", "x", "y", "verbose", "items", "options", "ключ", "名前"]
    return {k: random_value(rng, depth) for k in rng.sample(keys, rng.randint(0, 3))}


TOOL_NAMES = ["get_weather", "search", "add", "read_file", "lookup_city", "calc"]


def random_tools(rng: random.Random) -> list[dict[str, Any]]:
    tools = []
    for name in rng.sample(TOOL_NAMES, rng.randint(1, 3)):
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": random_text(rng, max_words=6, edges=False).strip() or "does things",
                    "parameters": {
                        "type": "object",
                        "properties": {"x": {"type": "string", "description": "an input ünï"}},
                        "required": ["x"],
                    },
                },
            }
        )
    return tools


def random_call(rng: random.Random, *, nested: bool = True) -> dict[str, Any]:
    fn = {"name": rng.choice(TOOL_NAMES), "arguments": random_arguments(rng)}
    return {"type": "function", "function": fn} if nested else fn


def random_assistant(
    rng: random.Random,
    *,
    calls: int = 0,
    reasoning: str = "random",
    nested_calls: bool = True,
) -> dict[str, Any]:
    """An assistant message; ``reasoning`` in {"random", "always", "never"}."""
    message: dict[str, Any] = {"role": "assistant"}
    if calls:
        message["content"] = rng.choice([None, "", random_text(rng)])
        message["tool_calls"] = [
            random_call(rng, nested=nested_calls or rng.random() < 0.5) for _ in range(calls)
        ]
    else:
        message["content"] = random_text(rng)
    if reasoning == "always" or (reasoning == "random" and rng.random() < 0.5):
        message["reasoning_content"] = (
            random_text(rng, min_words=1) if reasoning == "always" else random_text(rng)
        )
        if reasoning == "always" and not message["reasoning_content"].strip("\n"):
            message["reasoning_content"] = "hmm"
    return message


def random_conversation(
    rng: random.Random,
    *,
    tools_ok: bool = True,
    max_calls: int = 2,
    reasoning: str = "random",
    dict_tool_content: bool = False,
    end_with_assistant: bool | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A random multi-turn conversation with tool cycles; returns ``(messages, tools)``."""
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": random_text(rng)})
    tools = random_tools(rng) if tools_ok and rng.random() < 0.7 else None
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": random_text(rng)})
        for _ in range(rng.randint(0, 2) if tools else 0):
            n = rng.randint(1, max_calls)
            messages.append(random_assistant(rng, calls=n, reasoning=reasoning))
            for k in range(n):
                content: Any = random_text(rng)
                if dict_tool_content and rng.random() < 0.3:
                    content = random_arguments(rng)
                messages.append({"role": "tool", "content": content, "tool_call_id": f"call_{k}"})
        if rng.random() < 0.75:
            messages.append(random_assistant(rng, reasoning=reasoning))
    if end_with_assistant is True and messages[-1]["role"] != "assistant":
        messages.append(random_assistant(rng, reasoning=reasoning))
    if end_with_assistant is False and messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": random_text(rng)})
    return messages, tools


# -- reference templates ----------------------------------------------------------------------
_TOOLS_TEXT = (
    r"# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    r"You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    r"\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    r"<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
    r"\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
)

# ChatML/Qwen2.5 message loop (Qwen2.5 template behaviour): tool results grouped in a user turn.
_QWEN25_LOOP = r"""
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN25_TEMPLATE = (
    r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n"""
    + _TOOLS_TEXT
    + r"""" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- """
    + '"'
    + _TOOLS_TAIL
    + '"'
    + r""" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}"""
    + _QWEN25_LOOP
)

CHATML_TEMPLATE = (
    r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\n\n' }}
    {%- endif %}
    {{- """
    + '"'
    + _TOOLS_TEXT
    + '"'
    + r""" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- """
    + '"'
    + _TOOLS_TAIL
    + '"'
    + r""" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}"""
    + _QWEN25_LOOP
)

QWEN3_TEMPLATE = (
    r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- """
    + '"'
    + _TOOLS_TEXT
    + '"'
    + r""" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- """
    + '"'
    + _TOOLS_TAIL
    + '"'
    + r""" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""
)

LLAMA31_TEMPLATE = r"""
{{- bos_token }}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
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
{%- if tools_in_user_message and not tools is none %}
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

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Gemma-style: no system role (raises), assistant is "model".
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# Rewrites history when messages are added (the count is in the first turn): never bridgeable.
COUNTING_TEMPLATE = (
    "{{ '<|im_start|>system\nturns: ' + (messages|length|string) + '<|im_end|>\n' }}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# SmolLM2-Instruct's chat template (the ``tokenizer.chat_template`` of its GGUF file and HF repo).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


# SmolLM2 with the ChatML family's tool convention (rljax's SmolLM2 renderer with tools): Qwen2.5's
# tools block after SmolLM2's system text, assistant calls as Qwen2.5 writes them, tool results as
# SmolLM2's own template renders any role. Without tools it is SMOLLM2_TEMPLATE.
SMOLLM2_TOOLS_TEMPLATE = (
    r"""
{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- default_system }}
    {%- endif %}
    {{- "\n\n"""
    + _TOOLS_TEXT
    + r"""" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- """
    + '"'
    + _TOOLS_TAIL
    + '"'
    + r""" }}
{%- elif messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\n' + default_system + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "system" and loop.first and tools %}
    {%- elif message.role == "assistant" and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
)


# -- tokenizers -------------------------------------------------------------------------------
def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(1200):
        lines.append(random_text(rng, max_words=30))
        if rng.random() < 0.3:
            lines.append(json.dumps(random_arguments(rng), ensure_ascii=False))
        if rng.random() < 0.2:
            lines.append(json.dumps(random_tools(rng)[0], ensure_ascii=False, indent=rng.choice([None, 4])))
    lines += ['system\nuser\nassistant\n\n<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>'] * 50
    lines += ["Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n", "ipython\n\n"] * 50
    return lines


def train_bpe(pattern: str, *, seed: int, vocab_size: int = 1500) -> Tokenizer:
    """A byte-level BPE with the given pre-tokenizer regex, trained on a synthetic corpus."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(seed), trainer)
    return tok


def wrap(
    base: Tokenizer,
    *,
    special: list[str],
    added: list[str] = (),  # type: ignore[assignment]
    chat_template: str | None = None,
    **tokens: str,
) -> PreTrainedTokenizerFast:
    """Copies ``base``, adds tokens, wraps it as a HF fast tokenizer with a chat template."""
    tok = Tokenizer.from_str(base.to_str())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)
    if chat_template is not None:
        hf.chat_template = chat_template
    return hf


QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
LLAMA_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
GEMMA_SPECIAL = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]


def build_tokenizers() -> dict[str, PreTrainedTokenizerFast]:
    """All test tokenizers, keyed by template name."""
    qwen = train_bpe(QWEN_PATTERN, seed=0)
    llama = train_bpe(LLAMA3_PATTERN, seed=1)
    q = dict(special=QWEN_SPECIAL, added=QWEN_ADDED, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    l3 = dict(
        special=LLAMA_SPECIAL,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
    )
    return {
        "chatml": wrap(qwen, chat_template=CHATML_TEMPLATE, **q),
        "qwen2.5": wrap(qwen, chat_template=QWEN25_TEMPLATE, **q),
        "qwen3": wrap(qwen, chat_template=QWEN3_TEMPLATE, **q),
        "counting": wrap(qwen, chat_template=COUNTING_TEMPLATE, **q),
        "smollm2": wrap(qwen, chat_template=SMOLLM2_TEMPLATE, **q),
        "smollm2-tools": wrap(qwen, chat_template=SMOLLM2_TOOLS_TEMPLATE, **q),
        "llama3.1": wrap(llama, chat_template=LLAMA31_TEMPLATE, **l3),
        "llama3": wrap(llama, chat_template=LLAMA3_TEMPLATE, **l3),
        "gemma": wrap(
            qwen, special=GEMMA_SPECIAL, chat_template=GEMMA_TEMPLATE, bos_token="<bos>", eos_token="<eos>"
        ),
    }


def hf_ids(
    tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools=None, **kwargs: Any
) -> list[int]:
    """``apply_chat_template(..., tokenize=True)`` as a list (transformers 5 returns a BatchEncoding)."""
    out = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return [int(i) for i in out]


def plain_ids(tokenizer: Any) -> list[int]:
    """Ids of ordinary (non-added) tokens."""
    added = set(tokenizer.added_tokens_decoder)
    return [i for i in range(len(tokenizer)) if i not in added]


def hf_text(
    tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools=None, **kwargs: Any
) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )


def canonical_completion(
    tokenizer: Any,
    history: list[dict[str, Any]],
    assistant: dict[str, Any],
    *,
    end_of_turn: str,
    tools=None,
    **kwargs: Any,
) -> list[int]:
    """Completion ids a model would sample for ``assistant``: the template's text of that turn after
    the generation prompt, tokenized on its own (as generated), plus the end-of-turn token."""
    prompt = hf_text(tokenizer, history, add_generation_prompt=True, tools=tools, **kwargs)
    full = hf_text(tokenizer, [*history, assistant], add_generation_prompt=False, tools=tools, **kwargs)
    assert full.startswith(prompt), "the template does not extend the generation prompt"
    text = full[len(prompt) :].split(end_of_turn)[0]
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(end_of_turn)]


def assert_bridge_matches_template(
    tokenizer: Any, bridged: list[int], n_prev: int, conversation, *, tools=None, **kwargs: Any
) -> None:
    """The bridged ids spell the template's text of the whole conversation, and the appended ids are
    exactly the template's tokens after the completion (they follow a special token)."""
    text = hf_text(tokenizer, conversation, add_generation_prompt=True, tools=tools, **kwargs)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert decode(bridged) == text
    head = decode(bridged[:n_prev])
    assert text.startswith(head)
    assert bridged[n_prev:] == tokenizer.encode(text[len(head) :], add_special_tokens=False)


def is_query(message: dict[str, Any]) -> bool:
    """Qwen3's notion of a user query (independent restatement for the tests)."""
    c = message.get("content")
    return (
        message["role"] == "user"
        and isinstance(c, str)
        and not (c.startswith("<tool_response>") and c.endswith("</tool_response>"))
    )


def env_messages(rng: random.Random, parsed: Any, *, dict_tool_content: bool = False) -> list[dict[str, Any]]:
    """What a simple environment answers: one tool result per call, else (or sometimes) a user turn."""
    out: list[dict[str, Any]] = []
    for k, _ in enumerate(parsed.tool_calls):
        content: Any = random_text(rng)
        if dict_tool_content and rng.random() < 0.3:
            content = random_arguments(rng)
        out.append({"role": "tool", "content": content, "tool_call_id": f"call_{k}"})
    if not out or rng.random() < 0.15:
        out.append({"role": "user", "content": random_text(rng)})
    return out


def merge_linear(steps: list[tuple[list[int], list[int]]]) -> list[dict[str, Any]]:
    """Reference prefix merge (design §2.5, linear case): a turn extends the running sample when the
    running prompt+response is a prefix of its prompt; gap tokens get mask 0."""
    samples: list[dict[str, Any]] = []
    for j, (prompt, completion) in enumerate(steps):
        if samples:
            s = samples[-1]
            full = s["prompt"] + s["response"]
            if len(prompt) >= len(full) and prompt[: len(full)] == full:
                gap = prompt[len(full) :]
                s["response"] += gap + completion
                s["mask"] += [0] * len(gap) + [1] * len(completion)
                s["last"] = j
                continue
        samples.append(
            {"prompt": list(prompt), "response": list(completion), "mask": [1] * len(completion), "last": j}
        )
    return samples
