"""Several LoRA adapters with multi-turn tools (trainer.lora.adapters + task.tools): every turn of a
prompt's trajectories is generated with the prompt's adapter, and its samples carry it.

- bookkeeping against a scripted engine: the first call routes each prompt, each later turn (a
  prompt of its own: the trajectory's context) its trajectory's adapter, whatever the batching;
- the real thing: a tiny chat model SFT-trained to call the calculator, two adapters of different
  random weights synced into the native engine; the trajectories call the tool, and the trainer's
  recomputed log-probs of every generated token, each sample routed to its adapter, equal the
  engine's (fp32); the same samples routed to the other adapter do not.
"""

from dataclasses import replace

import pytest
import torch
from test_multi_turn import CALL, ScriptedEngine, multi_turn
from tool_caller import conversations, tool_caller

from miles.config.schema import AlgoCfg, AlgoName, DType, LoRACfg, PrecisionCfg, RolloutCfg, TrainerCfg
from miles.data.example import Example
from miles.data.tokenizer import TokenizerInfo
from miles.orchestrate.handles import LocalHandle
from miles.rollout.native import NativeEngine
from miles.trainer.torch_trainer import TorchTrainer
from miles.types import build_train_batch

from test_multi_turn import chat_dir  # noqa: F401  (the module's checkpoint fixture)

TWO = LoRACfg(rank=4, alpha=8.0, adapters=["add", "mul"], adapter_key="adapter")
FP32 = PrecisionCfg(name="fp32", train_dtype=DType.fp32, rollout_dtype=DType.fp32)


class RoutedScriptedEngine(ScriptedEngine):
    """ScriptedEngine that takes each prompt's adapter, as the engines do, and records them."""

    def __init__(self, tok, turns):
        super().__init__(tok, turns)
        self.adapters = []

    def call(self, method, prompts, labels, n, temperature, max_new, prompt_ids=None, adapters=None):
        self.adapters.append(adapters)
        samples = super().call(method, prompts, labels, n, temperature, max_new, prompt_ids)
        for s in samples:
            s.adapter = adapters[s.group]
        return samples


def test_every_turn_goes_to_its_prompts_adapter(chat_dir):  # noqa: F811
    tok = TokenizerInfo.load(chat_dir)
    engine = RoutedScriptedEngine(tok, [CALL.format("12*3"), CALL.format("36+1"), "37"])
    # Prompts of different lengths, so the later turns' batches are not in the prompts' order.
    examples = [Example("12*3+1", "37"), Example("1*2", "2"), Example("4*5", "20")]
    samples, metrics = multi_turn(tok).generate(engine, examples, 2, 1.0, 200, adapters=[1, 0, 1])
    assert metrics["rollout/turns_mean"] == 3.0 and len(engine.adapters) == 3
    assert engine.adapters[0] == [1, 0, 1]
    for k in (1, 2):  # each later call: one row per trajectory, its prompt's adapter
        contexts = engine.calls[k][0]
        expected = [[1, 0, 1][next(i for i, e in enumerate(examples) if user_turn(tok, ids) == e.prompt)]
                    for ids in contexts]
        assert engine.adapters[k] == expected and sorted(expected) == [0, 0, 1, 1, 1, 1]
    assert [s.adapter for s in samples] == [1, 1, 0, 0, 1, 1]


def user_turn(tok, ids):
    """The user turn of a context (the chat template's `<|user|>...<eos>`)."""
    text = tok.tokenizer.decode(ids, skip_special_tokens=False)
    return text.split("<|user|>")[1].split("<eos>")[0]


@pytest.mark.slow
def test_two_adapters_multi_turn_logprobs_are_the_trainers(tmp_path_factory):
    ckpt = tool_caller(tmp_path_factory)  # as test_multi_turn.py: the model learned to call the calculator
    tok = TokenizerInfo.load(ckpt)
    mt = multi_turn(tok)
    examples = conversations()
    trainer = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), TrainerCfg(lr=1e-2, global_batch_size=16,
                                                                          micro_batch_size=4, lora=TWO), FP32, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # two different adapters, small enough to keep the tool calls
        for p in trainer.lora.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=120, max_prompt_len=32), seed=0, lora=TWO)
    weights, digest = trainer.get_weights()
    assert engine.update_weights(weights, digest) == digest
    prompts = [Example(e.prompt, e.label) for e in examples[:8]]
    routes = [i % 2 for i in range(len(prompts))]
    samples, metrics = mt.generate(LocalHandle(engine), prompts, 2, 1.0, 120, adapters=routes)
    assert metrics["rollout/tool_call_rate"] >= 0.5 and metrics["rollout/turns_mean"] > 1.5, metrics
    assert [s.adapter for s in samples] == [r for r in routes for _ in range(2)]
    batch = build_train_batch(samples, torch.zeros(len(samples)), tok.pad_id)
    mask = batch.loss_mask > 0
    assert (batch.loss_mask.sum(1) < torch.tensor([len(s.response_ids) for s in samples])).sum() >= 4  # tool turns
    recomputed = trainer.logprobs(batch)
    diff = (recomputed - batch.rollout_logprobs)[mask].abs()
    swapped = (trainer.logprobs(replace(batch, adapter_ids=1 - batch.adapter_ids)) - batch.rollout_logprobs)[mask]
    print(f"engine - trainer: max {float(diff.max()):.2e} mean {float(diff.mean()):.2e} at logp "
          f"{float(batch.rollout_logprobs[mask][diff.argmax()]):.2f}; other adapter: {float(swapped.abs().max()):.2e}")
    torch.testing.assert_close(recomputed[mask], batch.rollout_logprobs[mask], atol=1e-5, rtol=1e-5)  # as one adapter
    assert swapped.abs().max() > 1e4 * diff.mean()
