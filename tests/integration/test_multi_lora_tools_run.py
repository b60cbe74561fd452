"""Two LoRA adapters with multi-turn tools in one run (trainer.lora.adapters + task.tools; in-process,
and with the engine and the trainer as Ray actors):
a tiny chat model SFT-trained to call the calculator (as tests/unit/rollout/test_multi_turn.py trains
it) is the run's checkpoint; its prompt file routes half the records to `add`, half to `mul`. The
trajectories call the tool, every turn is generated with its prompt's adapter, each adapter logs its
own metrics, and the engine's log-probs of step 2's samples (from the adapters step 1 trained) are the
trainer's (fp32). Unit-level: tests/unit/rollout/test_multi_turn_adapters.py."""

import json
import random
import shutil

import pytest

from miles.config.schema import AlgoCfg, AlgoName, DType, ModelCfg, PrecisionCfg, SandboxCfg, TrainerCfg
from miles.data.example import Example
from miles.data.prompt_format import PromptFormat
from miles.data.tokenizer import TokenizerInfo
from miles.orchestrate.checkpoints import random_checkpoint
from miles.orchestrate.loop import sft_batch
from miles.rollout.tools import build_toolbox
from miles.trainer.torch_trainer import TorchTrainer
from ray_runs import WITH_AND_WITHOUT_RAY, run_with
from runs import journal_metrics

pytestmark = pytest.mark.slow

CHAT = ModelCfg(name="t", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, max_position_embeddings=256)


def _conversation(a: int, b: int) -> Example:
    e = f"{a}*{b}"
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
    return Example(e, str(a * b), messages=({"role": "user", "content": e},
                                            {"role": "assistant", "content": "", "tool_calls": [call]},
                                            {"role": "tool", "content": str(a * b)},
                                            {"role": "assistant", "content": str(a * b)}))


@pytest.fixture(scope="module")
def tool_caller(tmp_path_factory):
    """A chat checkpoint that calls the calculator and copies its answer (120 SFT steps, fp32)."""
    base = tmp_path_factory.mktemp("chat")
    chat_dir = str(random_checkpoint(CHAT, "0123456789+*", 0, base / "random", chat=True))
    tok = TokenizerInfo.load(chat_dir)
    fmt = PromptFormat(tok, True, None, build_toolbox(["calculator"], SandboxCfg()).schemas())
    rng = random.Random(0)
    examples = [_conversation(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(64)]
    trainer = TorchTrainer(chat_dir, AlgoCfg(name=AlgoName.sft, policy_loss="nll"),
                           TrainerCfg(lr=3e-3, global_batch_size=32, micro_batch_size=32),
                           PrecisionCfg(name="fp32", train_dtype=DType.fp32, rollout_dtype=DType.fp32), threads=2,
                           seed=0)
    for step in range(120):
        trainer.train_sft(sft_batch(examples[(step % 2) * 32:][:32], tok, fmt))
    out = base / "sft"
    trainer.save(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{chat_dir}/{name}", out)
    return out


@WITH_AND_WITHOUT_RAY
def test_two_adapters_with_tools_route_every_turn(tmp_path, monkeypatch, compose, tool_caller, ray):
    monkeypatch.chdir(tmp_path)
    rng = random.Random(1)
    for split, count in (("train", 32), ("test", 8)):
        records = [{"prompt": f"{a}*{b}", "label": str(a * b), "adapter": ("add", "mul")[i % 2]}
                   for i, (a, b) in enumerate((rng.randint(10, 99), rng.randint(10, 99)) for _ in range(count))]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run_with(compose, [
        f"model.hf_checkpoint={tool_caller}", "warm_start.enabled=false", "precision=fp32", "steps=2",
        "task.name=tools", "task.kind=file", f"task.train_file={tmp_path / 'train.jsonl'}",
        f"task.eval_file={tmp_path / 'test.jsonl'}", "task.apply_chat_template=true", "task.tools=[calculator]",
        "rollout.max_turns=2", "rollout.max_new_tokens=120", "eval.max_new_tokens=120", "eval.interval=1",
        "task.eval_size=8", "tracking.log_samples=0", "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
        "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "algo.entropy_coef=0.01",
        "trainer.lora.rank=8", "trainer.lr=1e-2", "trainer.lora.adapters=[add,mul]",
        "trainer.lora.adapter_key=adapter"], tmp_path / "run", ray)
    metrics = journal_metrics(tmp_path / "run")
    for step in (1, 2):
        m = metrics[step]
        print(step, {k: v for k, v in m.items() if k.startswith(("mismatch/", "rollout/tool", "rollout/turns"))})
        assert m["rollout/tool_call_rate"] >= 0.25 and m["rollout/turns_mean"] > 1.2  # trajectories with a tool turn
        assert m["mismatch/logprob_abs_diff"] < 1e-6, m
        assert sum(m[f"rollout/samples/{name}"] for name in ("add", "mul")) == 16
        for name in ("add", "mul"):
            assert f"rollout/reward_mean/{name}" in m and f"train/grad_norm/{name}" in m
            assert f"eval/tools/accuracy/{name}" in m
    assert metrics[2]["train/entropy"] != metrics[1]["train/entropy"]
