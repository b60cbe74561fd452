"""Chat templates of HF tokenizer directories, rendered as `transformers.apply_chat_template` does.

A template is the Jinja source in `tokenizer_config.json` ("chat_template": a string, or a list of
{name, template} of which "default" is used) or in `chat_template.jinja` beside it. It is rendered
in a sandbox with trim_blocks / lstrip_blocks and loop controls, a `tojson` that keeps non-ASCII
text and HTML characters as they are, `raise_exception(msg)` and `strftime_now(fmt)`, and receives
`messages`, `add_generation_prompt`, `tools` and the tokenizer's special tokens (`bos_token`,
`eos_token`, ...), the variables the templates on the hub are written against.

    template = ChatTemplate.load(checkpoint_dir)          # None when the tokenizer has none
    text = template.render([{"role": "user", "content": "1+1?"}], add_generation_prompt=True)
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TemplateError(ValueError):
    """A chat template that does not render (bad syntax, or its own raise_exception)."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.source, self.special_tokens = source, special_tokens

    @classmethod
    def load(cls, directory: str | Path) -> "ChatTemplate | None":
        directory = Path(directory)
        config_path = directory / CONFIG_FILE
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if source is None and (directory / TEMPLATE_FILE).is_file():
            source = (directory / TEMPLATE_FILE).read_text()
        if not source:
            return None
        specials = {}
        for key in SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            if isinstance(value, dict):  # older configs store AddedToken dicts
                value = value.get("content")
            if isinstance(value, str):
                specials[key] = value
        return cls(source, specials)

    @cached_property
    def _compiled(self):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(f"the chat template refused the messages: {message}")

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            return env.from_string(self.source)
        except jinja2.TemplateSyntaxError as error:
            raise TemplateError(f"the chat template does not parse (line {error.lineno}: {error.message})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        import jinja2

        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **self.special_tokens)
        except TemplateError:
            raise
        except jinja2.TemplateError as error:
            raise TemplateError(f"the chat template failed to render: {error}") from None
