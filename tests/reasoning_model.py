"""A tiny Qwen3-style reasoning checkpoint: the seeded random qwen3 model of tiny_models, with the
chat markup and think tokens added and a chat template that, like Qwen3's, takes `enable_thinking`
and drops the thinking of assistant turns before the last user message."""

from __future__ import annotations

from pathlib import Path

import tiny_models

SPECIAL = ["<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
"""Added tokens that are not special, as in Qwen3's tokenizer (they are text to a grammar)."""

TEMPLATE = """\
{%- if tools -%}
{{- "<|im_start|>system\\n# Tools\\n<tools>" -}}
{%- for t in tools -%}{{- "\\n" + (t | tojson) -}}{%- endfor -%}
{{- "\\n</tools><|im_end|>\\n" -}}
{%- endif -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}{%- if m.role == "user" -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == "assistant" -%}
{%- set content = m.content or "" -%}
{%- set reasoning = m.reasoning_content or "" -%}
{%- if "</think>" in content -%}
{%- set reasoning = content.split("</think>")[0].split("<think>")[-1].strip("\\n") -%}
{%- set content = content.split("</think>")[-1].lstrip("\\n") -%}
{%- endif -%}
{%- if loop.index0 > ns.last_query and reasoning -%}
{{- "<|im_start|>assistant\\n<think>\\n" + reasoning.strip("\\n") + "\\n</think>\\n\\n" + content.lstrip("\\n") -}}
{%- else -%}
{{- "<|im_start|>assistant\\n" + content -}}
{%- endif -%}
{%- for tc in m.tool_calls or [] -%}
{%- set args = tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson -%}
{{- "\\n<tool_call>\\n{\\"name\\": \\"" + tc.function.name + "\\", \\"arguments\\": " + args + "}\\n</tool_call>" -}}
{%- endfor -%}
{{- "<|im_end|>\\n" -}}
{%- elif m.role == "tool" -%}
{{- "<|im_start|>user\\n<tool_response>\\n" + m.content + "\\n</tool_response><|im_end|>\\n" -}}
{%- else -%}
{{- "<|im_start|>" + m.role + "\\n" + m.content + "<|im_end|>\\n" -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- "<|im_start|>assistant\\n" -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- "<think>\\n\\n</think>\\n\\n" -}}{%- endif -%}
{%- endif -%}"""


OBSERVATION_QUERIES = TEMPLATE.replace(
    '{%- if m.role == "user" -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}',
    '{%- if m.role == "user" and not (m.content.startswith("<tool_response>") and '
    'm.content.endswith("</tool_response>")) -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}')
"""Qwen3's own rule for the last query: a user message wrapped in <tool_response> tags is a tool's
result (a text-protocol agent's observation), not a query, so the thinking before it is kept."""


def make_reasoning_checkpoint(path, template: str = TEMPLATE) -> Path:
    return tiny_models.make_chat_checkpoint("qwen3", path, template, SPECIAL, ADDED)
