"""The chat format of the project's own tiny models (random init and the SFT warm start).

A real chat model brings its tokenizer's template; a char-level tiny model has none, so a task
with `task.apply_chat_template=true` or tools gets this one: ChatML-like turns whose role markers
and tool-call tags are single added tokens (a char-level model would otherwise spend dozens of
positions on each), every turn closed by the tokenizer's eos, tool calls written Hermes style:

    <bos><|user|>What is 123*456?<eos><|assistant|><tool_call>{"name": "calculator",
    "arguments": {"expression": "123*456"}}</tool_call><eos><|tool|>56088<eos><|assistant|>56088<eos>

A turn whose content is a list of parts (an image prompt, miles/data/images.py) writes its text
parts as they are, each image part as Qwen's `<|vision_start|><|image_pad|><|vision_end|>` and
each video part as `<|vision_start|><|video_pad|><|vision_end|>`.

The tool schemas are not rendered into the prompt (hundreds of characters a tiny model does not
need); a real model's template does that.
"""

from __future__ import annotations

import string

ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
# Not special: decoding keeps them, so the tool-call parser sees them in the response text.
TOOL_TAGS = ("<tool_call>", "</tool_call>")
# What a chat conversation can contain besides the task's own characters: JSON of tool calls,
# words of system prompts.
CHAT_ALPHABET = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")

TINY_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "<|{{ m.role }}|>"
    "{%- if m.content is string -%}{{ m.content }}{%- else -%}"
    "{%- for part in m.content -%}"
    "{%- if part.type == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part.type == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>{%- else -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- for call in m.tool_calls or [] -%}"
    "{%- set f = call.function if call.function is defined else call -%}"
    '<tool_call>{"name": {{ f.name | tojson }}, "arguments": '
    "{{ (f.arguments if f.arguments is string else f.arguments | tojson) }}}</tool_call>"
    "{%- endfor -%}"
    "{{ eos_token }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def chat_alphabet(alphabet: str) -> str:
    """`alphabet` extended by the characters chat turns and tool calls need, each once."""
    return alphabet + "".join(c for c in CHAT_ALPHABET if c not in alphabet)
