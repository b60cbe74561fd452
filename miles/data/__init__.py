"""Data for miles: tokenizers, chat formats, the built-in arithmetic task, user prompt files, rewards."""

from miles.data.arithmetic import ArithmeticTask
from miles.data.example import Example
from miles.data.prompts import DataError, load_prompt_file
from miles.data.prompt_format import PromptFormat
from miles.data.rewards import REWARDS, RewardFn, RewardScorer, batched, build_scorer, exact_match, get_reward_fn
from miles.data.sandbox import SandboxResult, run_python
from miles.data.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    TokenizerInfo,
    build_char_tokenizer,
    load_tokenizer,
    save_tokenizer,
    special_ids,
)

__all__ = [
    "ArithmeticTask",
    "BOS_TOKEN",
    "DataError",
    "EOS_TOKEN",
    "Example",
    "PAD_TOKEN",
    "PromptFormat",
    "REWARDS",
    "RewardFn",
    "RewardScorer",
    "SandboxResult",
    "batched",
    "build_scorer",
    "TokenizerInfo",
    "build_char_tokenizer",
    "exact_match",
    "get_reward_fn",
    "load_prompt_file",
    "load_tokenizer",
    "run_python",
    "save_tokenizer",
    "special_ids",
]
