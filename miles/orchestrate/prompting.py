"""How a run prompts its model: the prompt format (chat template, system prompt, tools) and, with
`task.tools`, the multi-turn rollout; checked against the data before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

from miles.config.schema import RunCfg
from miles.data.adapter_routing import AdapterRouting
from miles.data.chat_template import TemplateError
from miles.data.prompt_format import PromptFormat
from miles.data.source import PromptSource
from miles.data.tokenizer import TokenizerInfo
from miles.data.vision_inputs import VisionInputs
from miles.rollout.multi_turn import MultiTurn, ToolTurns
from miles.rollout.tools import build_toolbox


def uses_chat(cfg: RunCfg, source: PromptSource) -> bool:
    """Whether the run's prompts go through a chat template (a tiny model then gets the tiny one)."""
    examples = source.train[:1] + source.eval[:1]
    return cfg.task.apply_chat_template or bool(cfg.task.tools) or any(e.messages for e in examples)


def prompt_setup(cfg: RunCfg, checkpoint_dir: Path, source: PromptSource) -> tuple[PromptFormat, MultiTurn | None]:
    """The prompt format and multi-turn rollout (None: single-turn) of a run of `checkpoint_dir`;
    every problem of the template with the data or the tools is a ConfigError naming the key to
    change (the tools themselves were checked by miles.validate)."""
    from miles.config.errors import ConfigError

    t, r = cfg.task, cfg.rollout
    tok = TokenizerInfo.load(checkpoint_dir)
    config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    max_context = {**config, **config.get("text_config", {})}["max_position_embeddings"]  # VLMs nest the decoder's
    try:
        toolbox = build_toolbox(t.tools, t.sandbox) if t.tools else None
        fmt = PromptFormat(tok, t.apply_chat_template, t.system_prompt, toolbox.schemas() if toolbox else None,
                           VisionInputs.load(checkpoint_dir, tok))
        multi = None
        if toolbox is not None:
            multi = MultiTurn(fmt, toolbox, ToolTurns(tok, fmt.template, r.max_tool_response_tokens), r.max_turns,
                              r.max_new_tokens, max_context)
            multi.turns.tokens(["0"], tok.eos_id)  # the template renders a tool turn
        for example in source.train[:1] + source.eval[:1]:  # now, not at the first rollout
            fmt.encode(example)
    except (ValueError, TemplateError) as error:
        raise ConfigError([str(error)]) from None
    return fmt, multi


def adapter_routing(cfg: RunCfg, source: PromptSource) -> AdapterRouting | None:
    """Each prompt's LoRA adapter (trainer.lora.adapters; None without named adapters), every record
    of the prompt files checked to name one before anything starts: a ConfigError lists those that
    do not (never skipped: a prompt without its adapter would train another's)."""
    from miles.config.errors import ConfigError

    lo = cfg.trainer.lora
    if lo.rank <= 0 or not lo.adapters:
        return None
    routing = AdapterRouting(tuple(lo.adapters), lo.adapter_key)
    problems = routing.problems(source.train, cfg.task.train_file or "task.train_file")
    problems += routing.problems(source.eval, cfg.task.eval_file or "task.eval_file")
    if problems:
        raise ConfigError(problems)
    return routing
