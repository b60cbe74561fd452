"""The tool-calling chat checkpoint of the multi-turn tests: a tiny chat model SFT-trained (120 steps,
fp32, seeded) on conversations that call the calculator and copy its answer, so that it calls the tool.

tests/unit/rollout/test_multi_turn.py, tests/unit/rollout/test_multi_turn_adapters.py and
tests/integration/test_multi_lora_tools_run.py (both of its cases, in two xdist workers) each trained
this same checkpoint (~10-15 s each on 2 cores). `tool_caller` trains it once per test session, in a
directory beside the xdist workers' own tmp dirs, under a file lock, and every test reads it from there.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

from miles.config.schema import ModelCfg
from miles.data.example import Example

CHAT = ModelCfg(name="t", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, max_position_embeddings=256)
ALPHABET = "0123456789+*"
SFT_STEPS = 120


def conversation(a: int, b: int) -> Example:
    """`a*b`: the assistant calls the calculator, then copies the tool's answer."""
    e = f"{a}*{b}"
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
    return Example(e, str(a * b), messages=({"role": "user", "content": e},
                                            {"role": "assistant", "content": "", "tool_calls": [call]},
                                            {"role": "tool", "content": str(a * b)},
                                            {"role": "assistant", "content": str(a * b)}))


def conversations() -> list[Example]:
    """The 64 training conversations (two-digit products, seeded)."""
    rng = random.Random(0)
    return [conversation(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(64)]


def random_chat_checkpoint(out) -> str:
    """The untrained chat checkpoint (seed 0) the SFT starts from."""
    from miles.orchestrate.checkpoints import random_checkpoint

    return str(random_checkpoint(CHAT, ALPHABET, 0, out, chat=True))


def _train(out: Path) -> None:
    from miles.config.schema import AlgoCfg, AlgoName, DType, PrecisionCfg, SandboxCfg, TrainerCfg
    from miles.data.prompt_format import PromptFormat
    from miles.data.tokenizer import TokenizerInfo
    from miles.orchestrate.loop import sft_batch
    from miles.rollout.tools import build_toolbox
    from miles.trainer.torch_trainer import TorchTrainer

    chat_dir = random_chat_checkpoint(out / "random")
    tok = TokenizerInfo.load(chat_dir)
    fmt = PromptFormat(tok, True, None, build_toolbox(["calculator"], SandboxCfg()).schemas())
    examples = conversations()
    trainer = TorchTrainer(chat_dir, AlgoCfg(name=AlgoName.sft, policy_loss="nll"),
                           TrainerCfg(lr=3e-3, global_batch_size=32, micro_batch_size=32),
                           PrecisionCfg(name="fp32", train_dtype=DType.fp32, rollout_dtype=DType.fp32), threads=2,
                           seed=0)
    for step in range(SFT_STEPS):
        trainer.train_sft(sft_batch(examples[(step % 2) * 32:][:32], tok, fmt))
    trainer.save(str(out / "sft"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{chat_dir}/{name}", out / "sft")


def tool_caller(tmp_path_factory) -> str:
    """The SFT-trained checkpoint's directory, trained by the first test of the session that asks."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: the workers' shared dir
    out = root / "tool_caller"
    with FileLock(str(root / "tool_caller.lock")):
        if not (out / "done").exists():
            shutil.rmtree(out, ignore_errors=True)  # what a failed attempt left
            _train(out)
            (out / "done").touch()
    return str(out / "sft")
