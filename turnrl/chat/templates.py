"""Chat templates for the built-in models, written as Jinja strings.

Three families cover the chat formats that small open models use, so that the
token-exact context (``turnrl.rollout.context``) is exercised against each
kind of template it will meet with a downloaded checkpoint:

- ``CHATML``: the Qwen2 / Qwen2.5 format. Every message is
  ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; a default system message is
  rendered when the conversation has none (as Qwen2.5 does).
- ``QWEN3``: ChatML plus reasoning handling. The assistant turns after the
  last user query show their reasoning as ``<think>\\n...\\n</think>\\n\\n``;
  earlier assistant turns have their ``<think>...</think>`` part stripped.
  ``enable_thinking=False`` adds an empty think block to the generation prompt.
  No default system message.
- ``QWEN3_THINKING``: Qwen3's, but the generation prompt opens the think block
  itself (``<think>\\n``), as the thinking-only Qwen3 models' templates do.
- ``LLAMA3``: ``<|begin_of_text|>`` once, then
  ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>``;
  contents are trimmed of surrounding whitespace, as the Llama-3 templates do.

Contents may be a string or a list of OpenAI-style parts:
``{"type": "text", "text": ...}`` and ``{"type": "image"}`` (also
``"image_url"``, the OpenAI name). ChatML and Qwen3 draw an image as
``<|vision_start|><|image_pad|><|vision_end|>`` (a vision processor later
expands the single ``<|image_pad|>`` to one token per image patch group);
Llama-3 draws ``<|image|>``. An unknown part type is an error, never dropped.

``TEMPLATES`` maps the names used across turnrl (``"chatml"``, ``"qwen3"``,
``"qwen3_thinking"``, ``"llama3"``) to :class:`TemplateSpec` records that also list the special
tokens each template needs, so the tokenizer builder and the templates cannot
drift apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_SYSTEM_MESSAGE = "You are a helpful assistant."
"""What ChatML renders as the system message when the conversation has none."""

# A Jinja macro shared by the templates: renders a message content that is a
# string or a list of parts. `image_text` is what one image part becomes.
_CONTENT_MACRO = """\
{%- macro render_content(content, image_text, video_text) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is none -%}
        {{- '' -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part.type == 'image' or part.type == 'image_url' -%}
                {{- image_text -}}
            {%- elif part.type == 'video' -%}
                {{- video_text -}}
            {%- else -%}
                {{- raise_exception('Unsupported content part type: ' ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""

_QWEN_IMAGE = "'<|vision_start|><|image_pad|><|vision_end|>'"
_QWEN_VIDEO = "'<|vision_start|><|video_pad|><|vision_end|>'"

CHATML = (
    _CONTENT_MACRO
    + """\
{%- if messages and messages[0].role == 'system' -%}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content, IMAGE, VIDEO) + '<|im_end|>\\n' -}}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {{- '<|im_start|>system\\nDEFAULT_SYSTEM<|im_end|>\\n' -}}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content, IMAGE, VIDEO) + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
""".replace("IMAGE", _QWEN_IMAGE)
    .replace("VIDEO", _QWEN_VIDEO)
    .replace("DEFAULT_SYSTEM", DEFAULT_SYSTEM_MESSAGE)
)
"""Qwen2 / Qwen2.5 style ChatML, with a default system message."""

QWEN3 = (
    _CONTENT_MACRO
    + """\
{#- The last user query: assistant turns after it keep their reasoning. -#}
{%- set ns = namespace(last_query=messages|length - 1, found=false) -%}
{%- for message in messages[::-1] -%}
    {%- if not ns.found and message.role == 'user' -%}
        {%- set ns.found = true -%}
        {%- set ns.last_query = messages|length - 1 - loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set content = render_content(message.content, IMAGE, VIDEO) -%}
    {%- if message.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
        {%- endif -%}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' -}}
            {{- content.lstrip('\\n') + '<|im_end|>\\n' -}}
        {%- else -%}
            {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- endif -%}
{%- endif -%}
""".replace("IMAGE", _QWEN_IMAGE).replace("VIDEO", _QWEN_VIDEO)
)
"""Qwen3 style: ChatML with reasoning kept only after the last user query."""

QWEN3_THINKING = QWEN3.replace(
    """    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- endif -%}""",
    """    {{- '<|im_start|>assistant\\n<think>\\n' -}}""",
)
"""Qwen3 thinking-only style (Qwen3-*-Thinking-2507): Qwen3's, with a generation prompt that opens the think block
itself, so the model's response continues inside it."""

LLAMA3 = (
    _CONTENT_MACRO
    + """\
{{- '<|begin_of_text|>' -}}
{%- for message in messages -%}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' -}}
    {{- render_content(message.content, '<|image|>', '<|image|>') | trim -}}
    {{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{%- endif -%}
"""
)
"""Llama-3 style headers, contents trimmed, ``<|begin_of_text|>`` once."""


@dataclass(frozen=True)
class TemplateSpec:
    """A chat template and the tokens its tokenizer must have."""

    name: str
    """Name used in configs: ``"chatml"``, ``"qwen3"``, ``"qwen3_thinking"`` or ``"llama3"``."""
    chat_template: str
    """The Jinja source stored as the tokenizer's ``chat_template``."""
    special_tokens: tuple[str, ...]
    """Control tokens (special: never split, skipped by ``skip_special_tokens``)."""
    added_tokens: tuple[str, ...]
    """Non-special added tokens (atomic in text, kept when decoding), e.g. ``<think>``."""
    end_of_turn: str
    """The token that ends an assistant turn; the tokenizer's ``eos_token``."""
    end_of_text: str
    """End-of-document token; the tokenizer's ``pad_token``."""
    bos: str | None
    """Beginning-of-text token, or None when the family has none (Qwen)."""


_QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

TEMPLATES: dict[str, TemplateSpec] = {
    "chatml": TemplateSpec(
        name="chatml",
        chat_template=CHATML,
        special_tokens=_QWEN_SPECIALS,
        added_tokens=(),
        end_of_turn="<|im_end|>",
        end_of_text="<|endoftext|>",
        bos=None,
    ),
    "qwen3": TemplateSpec(
        name="qwen3",
        chat_template=QWEN3,
        special_tokens=_QWEN_SPECIALS,
        added_tokens=("<think>", "</think>"),
        end_of_turn="<|im_end|>",
        end_of_text="<|endoftext|>",
        bos=None,
    ),
    "qwen3_thinking": TemplateSpec(
        name="qwen3_thinking",
        chat_template=QWEN3_THINKING,
        special_tokens=_QWEN_SPECIALS,
        added_tokens=("<think>", "</think>"),
        end_of_turn="<|im_end|>",
        end_of_text="<|endoftext|>",
        bos=None,
    ),
    "llama3": TemplateSpec(
        name="llama3",
        chat_template=LLAMA3,
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|image|>",
        ),
        added_tokens=(),
        end_of_turn="<|eot_id|>",
        end_of_text="<|end_of_text|>",
        bos="<|begin_of_text|>",
    ),
}


def template_spec(name: str) -> TemplateSpec:
    """The :class:`TemplateSpec` called ``name``; a clear error for unknown names."""
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown chat template {name!r}; choose one of {sorted(TEMPLATES)}") from None


_TAG = re.compile(r"<(/?)([A-Za-z_][A-Za-z0-9_\-]*)>")


def open_tags(text: str) -> list[str]:
    """The names of the tags ``text`` opens and does not close, outermost first (``"<think>\\n"``: ``["think"]``;
    ``"<think>\\n\\n</think>\\n\\n"``: none). A closing tag closes the innermost open tag of its name."""
    opened: list[str] = []
    for match in _TAG.finditer(text):
        closing, name = match.groups()
        if not closing:
            opened.append(name)
        elif name in opened:
            del opened[len(opened) - 1 - opened[::-1].index(name) :]
    return opened
