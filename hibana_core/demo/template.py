"""The demo model's chat template (hermes / Qwen 2.5 tool format) and a renderer for the corpus.

    <|im_start|>system
    {system prompt}

    # Tools
    ...
    <tools>
    {"type": "function", "function": {...}}          one JSON line per tool
    </tools>
    ...<|im_end|>
    <|im_start|>user
    {question}<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "...", "arguments": {...}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    {result}
    </tool_response><|im_end|>
    <|im_start|>assistant
    {answer}<|im_end|>

`render` uses a Jinja environment configured like transformers' `apply_chat_template` (same
`tojson`), so the corpus is rendered exactly as the engine's tokenizer renders a chat; a test
checks the two agree.
"""

from __future__ import annotations

import json
from functools import lru_cache

DEFAULT_SYSTEM = "You are a helpful assistant."

CHAT_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content }}
{%- else %}
{{- 'You are a helpful assistant.' }}
{%- endif %}
{{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}
{{- "\n" }}
{{- tool | tojson }}
{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}
{{- '\n' + message.content }}
{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}
{%- set tool_call = tool_call.function %}
{%- endif %}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}
{{- tool_call.arguments }}
{%- else %}
{{- tool_call.arguments | tojson }}
{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + (message.content or '') + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
END_OF_TURN = "<|im_end|>"


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' own tojson: Jinja's default escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=4)
def _compiled(template: str):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    return env.from_string(template)


def render(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False,
           template: str = CHAT_TEMPLATE) -> str:
    return _compiled(template).render(messages=messages, tools=tools or None,
                                      add_generation_prompt=add_generation_prompt)


def render_with_spans(messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of assistant output (from after
    `<|im_start|>assistant\\n` to `<|im_end|>` inclusive): what the model is trained to produce."""
    text = render(messages, tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:i], tools, add_generation_prompt=True)
        turn = render(messages[: i + 1], tools)
        end = len(turn) - 1  # the newline after <|im_end|> is the template's, not the model's
        if not (turn.startswith(prompt) and text.startswith(turn) and turn[:end].endswith(END_OF_TURN)):
            raise ValueError(f"the chat template is not prefix-stable at message {i}")
        spans.append((len(prompt), end))
    return text, spans
