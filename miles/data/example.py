"""`Example`: one prompt record with its reference answer, whatever task or file it came from.

Every prompt source (the arithmetic task, prompt files, the example tasks) yields them; the loop,
the prompt format and multi-turn rollout consume them (miles/data/source.py's `PromptSource`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer.

    `messages`: the record's conversation (role / content dicts) when its prompt field held one;
    `prompt` is then its last user turn, for logs. `fields`: the record's other fields, handed to
    the reward function as keyword info. `images`: the visual parts of an image / video prompt, in
    part order: PIL images and `Video`s (frames + fps, miles/data/videos.py); the `messages` then hold
    `{"type": "image"}` / `{"type": "video"}` parts (miles/data/images.py).
    """

    prompt: str
    label: str
    messages: tuple[dict, ...] | None = field(default=None, hash=False)
    fields: dict = field(default_factory=dict, compare=False, hash=False)
    images: tuple = field(default=(), compare=False, hash=False)
