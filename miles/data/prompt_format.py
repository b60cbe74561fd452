"""From a task example to what the engine is prompted with, and to SFT token sequences.

- A text prompt is given as it is, or (`task.apply_chat_template`) as a user turn, after the
  optional `task.system_prompt`, rendered through the tokenizer's chat template with the
  assistant's turn opened (`add_generation_prompt`).
- A `messages` prompt always goes through the template: its turns up to the first assistant reply
  are the prompt; a reference reply after them (assistant turns, tool turns) is SFT data.
- With tools, the template also receives their schemas (`tools=`), as transformers passes them.

SFT of a conversation trains on the assistant turns only: each turn is tokenized as the template
renders it after the turns before it, so prompt, tool and role tokens carry no loss.

An example with images (a vision-language run) is encoded by `vision` (miles/data/vision_inputs.py):
the template's image placeholders widened to the image's merged patches, plus its pixels.
"""

from __future__ import annotations

from miles.data.example import Example
from miles.data.chat_template import ChatTemplate, TemplateError
from miles.data.tokenizer import TokenizerInfo, encode_prompt
from miles.data.vision_inputs import VisionInputs

NO_TEMPLATE = ("the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja): use a chat "
               "model's tokenizer")


class PromptFormat:
    def __init__(self, tok: TokenizerInfo, apply_chat_template: bool, system_prompt: str | None = None,
                 tools: list[dict] | None = None, vision: VisionInputs | None = None):
        self.tok, self.apply, self.system_prompt, self.tools = tok, apply_chat_template, system_prompt, tools or None
        self.vision = vision
        if (apply_chat_template or tools) and tok.chat_template is None:
            needs = "task.tools" if tools else "task.apply_chat_template=true"
            raise ValueError(f"{needs} needs a chat template, but {NO_TEMPLATE} or set task.apply_chat_template=false")

    @property
    def template(self) -> ChatTemplate:
        if self.tok.chat_template is None:
            raise ValueError(f"prompts given as messages need a chat template, but {NO_TEMPLATE}")
        return self.tok.chat_template

    def messages(self, example: Example) -> list[dict]:
        """The turns the rollout starts from: the system prompt (unless the record has its own), then
        the record's turns before its first assistant reply, or the text as a user turn."""
        turns = prompt_turns(example.messages) if example.messages else [{"role": "user", "content": example.prompt}]
        if self.system_prompt and turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": self.system_prompt})
        return turns

    def __call__(self, example: Example) -> str:
        if not example.messages and not self.apply:
            return example.prompt
        return self.template.render(self.messages(example), add_generation_prompt=True, tools=self.tools)

    def encode(self, example: Example) -> tuple[list[int], dict | None]:
        """(prompt ids, the images' {"pixel_values", "image_grid_thw"} or None) the engine is given."""
        if not example.images:
            return encode_prompt(self.tok, self(example)), None
        if self.vision is None:
            raise ValueError("image prompts need a vision-language model whose checkpoint has an image processor "
                             "(preprocessor_config.json): set model=qwen2_5_vl_tiny or a Qwen2.5-VL model.hf_checkpoint")
        return self.vision.encode(self(example), example.images)

    def sft_sequence(self, example: Example, target: str) -> tuple[list[int], list[int], list[int]]:
        """(prompt ids, response ids, response loss mask) of one SFT example: a record with a
        reference conversation trains on its assistant turns; otherwise the reply is `target`
        followed by eos."""
        reply = example.messages[len(prompt_turns(example.messages)):] if example.messages else []
        prompt_ids = self.encode(example)[0]
        if not reply:
            ids = self.tok.tokenizer.encode(target, add_special_tokens=False).ids
            ids += [self.tok.eos_id] if self.tok.eos_id is not None else []
            return prompt_ids, ids, [1] * len(ids)
        turns, rendered = self.messages(example), self(example)
        response, mask = [], []
        for message in reply:
            if message["role"] == "assistant":  # the template's opening of this turn is already rendered
                before = self.template.render(turns, add_generation_prompt=True, tools=self.tools)
            else:
                before = self.template.render(turns, add_generation_prompt=False, tools=self.tools)
            turns.append(dict(message))
            after = self.template.render(turns, add_generation_prompt=False, tools=self.tools)
            if not after.startswith(rendered) or not before.startswith(rendered):
                raise TemplateError("the chat template renders earlier turns differently once later turns follow; "
                                    "SFT of conversations needs a template that appends turns")
            # Text between what is rendered so far and this turn's start (e.g. the assistant opening)
            # is not the model's; the turn itself is, for an assistant.
            lead, body = before[len(rendered):], after[len(before):]
            for text, trained in ((lead, 0), (body, int(message["role"] == "assistant"))):
                ids = self.tok.tokenizer.encode(text, add_special_tokens=False).ids if text else []
                response += ids
                mask += [trained] * len(ids)
            rendered = after
        return prompt_ids, response, mask


def prompt_turns(messages) -> list[dict]:
    """A record's messages up to (not including) the first assistant turn: what a rollout is
    prompted with; the rest (a reference reply) is for SFT."""
    turns = []
    for message in messages:
        if message["role"] == "assistant":
            break
        turns.append(dict(message))
    return turns
