"""Multi-turn rollouts with tools.

Bookkeeping (turn limits, token budget, masks, failures) runs against a scripted engine that
returns fixed model turns, so every expected token is known. The real thing: a tiny chat model
SFT-trained on tool conversations calls the calculator through the real engine, and the
trainer's recomputed log-probs of every generated token equal the engine's, with observation
tokens out of the loss."""

import pytest
import torch

from miles.config.schema import AlgoCfg, AlgoName, DType, PrecisionCfg, RolloutCfg, SandboxCfg, TrainerCfg
from miles.data.example import Example
from miles.data.chat_template import ChatTemplate, TemplateError
from miles.data.prompt_format import PromptFormat
from miles.data.tokenizer import TokenizerInfo, encode_prompt
from miles.orchestrate.handles import LocalHandle
from miles.orchestrate.loop import sft_batch
from miles.rollout.multi_turn import MultiTurn, ToolTurns
from miles.rollout.native import NativeEngine
from miles.rollout.tools import build_toolbox
from miles.trainer.torch_trainer import TorchTrainer
from miles.types import FinishReason, Sample, build_train_batch
from tool_caller import conversation, conversations, random_chat_checkpoint, tool_caller

CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call>'


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return random_chat_checkpoint(tmp_path_factory.mktemp("chat"))


def multi_turn(tok, max_turns=3, max_tool_tokens=32):
    box = build_toolbox(["calculator"], SandboxCfg())
    fmt = PromptFormat(tok, True, None, box.schemas())
    return MultiTurn(fmt, box, ToolTurns(tok, fmt.template, max_tool_tokens), max_turns, 100, 256)


class ScriptedEngine:
    """Stands in for the engine handle: the k-th generate call answers every row with turns[k]
    (text + eos), log-prob -0.5 per token; records the contexts it was given."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.calls = tok, turns, []

    def call(self, method, prompts, labels, n, temperature, max_new, prompt_ids=None):
        ids = prompt_ids or [encode_prompt(self.tok, p) for p in prompts]
        self.calls.append((ids, max_new))
        text = self.turns[len(self.calls) - 1]
        response = (self.tok.tokenizer.encode(text, add_special_tokens=False).ids + [self.tok.eos_id])[:max_new]
        stopped = response[-1] == self.tok.eos_id
        return [Sample(prompt=p, label=label, prompt_ids=list(row), response_ids=response,
                       rollout_logprobs=[-0.5] * len(response),
                       response=self.tok.tokenizer.decode(response, skip_special_tokens=True),
                       finish_reason=FinishReason.stop if stopped else FinishReason.length, group=i // n)
                for i, (p, label, row) in enumerate(zip([q for q in prompts for _ in range(n)],
                                                        [q for q in labels for _ in range(n)],
                                                        [r for r in ids for _ in range(n)]))]


def test_tool_turn_is_appended_as_the_template_renders_it(chat_dir):
    tok = TokenizerInfo.load(chat_dir)
    mt = multi_turn(tok)
    engine = ScriptedEngine(tok, [CALL.format("12*3"), "36"])
    samples, metrics = mt.generate(engine, [Example("12*3", "36", fields={"id": 7})], 2, 1.0, 200)
    prompt = encode_prompt(tok, "<|user|>12*3<eos><|assistant|>")
    turn1 = tok.tokenizer.encode(CALL.format("12*3"), add_special_tokens=False).ids + [tok.eos_id]
    tool = tok.tokenizer.encode("<|tool|>36<eos><|assistant|>", add_special_tokens=False).ids
    turn2 = tok.tokenizer.encode("36", add_special_tokens=False).ids + [tok.eos_id]
    assert engine.calls[1][0] == [prompt + turn1 + tool] * 2  # the second turn continues the whole context
    for s in samples:
        assert s.prompt_ids == prompt and s.response_ids == turn1 + tool + turn2
        assert s.response_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
        assert s.rollout_logprobs == [-0.5] * len(turn1) + [0.0] * len(tool) + [-0.5] * len(turn2)
        assert s.response == "36" and s.finish_reason == FinishReason.stop and s.info["id"] == 7
        assert s.info["trajectory"] == [{"role": "user", "content": "12*3"},
                                        {"role": "assistant", "content": CALL.format("12*3")},
                                        {"role": "tool", "content": "36"}, {"role": "assistant", "content": "36"}]
    assert metrics == {"rollout/turns_mean": 2.0, "rollout/tool_calls_mean": 1.0, "rollout/tool_call_rate": 1.0,
                       "rollout/tool_errors": 0.0}
    # The batch the trainer gets: observation tokens carry no loss and no advantage.
    batch = build_train_batch(samples, torch.tensor([1.0, -1.0]), tok.pad_id)
    p, t1, n_tool = len(prompt), len(turn1), len(tool)
    assert batch.loss_mask[0, p - 1 + t1: p - 1 + t1 + n_tool].sum() == 0
    assert batch.advantages[0, p - 1 + t1: p - 1 + t1 + n_tool].abs().sum() == 0
    assert batch.loss_mask[0].sum() == len(turn1) + len(turn2) and batch.advantages[1].sum() == -(t1 + len(turn2))


def test_turn_limit_budget_and_tool_errors(chat_dir):
    tok = TokenizerInfo.load(chat_dir)
    # max_turns=2: the second turn's call is never run.
    samples, metrics = multi_turn(tok, max_turns=2).generate(
        ScriptedEngine(tok, [CALL.format("1+1"), CALL.format("2+2")]), [Example("q", "4")], 1, 1.0, 500)
    assert metrics["rollout/turns_mean"] == 2 and metrics["rollout/tool_calls_mean"] == 1
    assert samples[0].response == CALL.format("2+2") and samples[0].finish_reason == FinishReason.stop
    # A call the calculator refuses and a malformed one: two failures shown to the model, counted.
    engine = ScriptedEngine(tok, ['<tool_call>{"name": "calculator", "arguments": {"expression": "x"}}</tool_call>'
                                  "<tool_call>{oops}</tool_call>", "done"])
    samples, metrics = multi_turn(tok).generate(engine, [Example("q", "4")], 1, 1.0, 500)
    assert metrics["rollout/tool_errors"] == 2.0 and samples[0].response == "done"
    assert [m["content"][:6] for m in samples[0].info["trajectory"] if m["role"] == "tool"] == ["error:"] * 2
    # The budget covers model and observation tokens; the last turn is cut and ends on length.
    turn1 = len(tok.tokenizer.encode(CALL.format("1+1"), add_special_tokens=False).ids) + 1
    tool = len(tok.tokenizer.encode("<|tool|>2<eos><|assistant|>", add_special_tokens=False).ids)
    engine = ScriptedEngine(tok, [CALL.format("1+1"), "222222"])
    samples, _ = multi_turn(tok).generate(engine, [Example("q", "2")], 1, 1.0, turn1 + tool + 3)
    assert engine.calls[1][1] == 3  # what the first turn and the tool turn left of the budget
    assert len(samples[0].response_ids) == turn1 + tool + 3 and samples[0].finish_reason == FinishReason.length
    assert samples[0].response == "222"
    # Observations are cut to max_tool_response_tokens.
    engine = ScriptedEngine(tok, [CALL.format("9**20"), "ok"])
    samples, _ = multi_turn(tok, max_tool_tokens=4).generate(engine, [Example("q", "")], 1, 1.0, 500)
    assert samples[0].info["trajectory"][2]["content"] == str(9**20)[:4]


def test_a_template_that_rewrites_history_is_refused(chat_dir):
    tok = TokenizerInfo.load(chat_dir)
    rewriting = ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}{{ messages | length }}", {})
    with pytest.raises(TemplateError, match="renders earlier turns differently"):
        ToolTurns(tok, rewriting, 8).tokens(["1"], tok.eos_id)


_conversation = conversation  # test_multi_turn_adapters.py imports it from here


@pytest.mark.slow
def test_a_trained_model_calls_the_tool_and_the_trainer_agrees_on_every_logprob(chat_dir, tmp_path_factory):
    tok = TokenizerInfo.load(chat_dir)
    mt = multi_turn(tok)
    examples = conversations()
    # SFT on conversations (tests/tool_caller.py trains on these): the loss covers the assistant turns only.
    batch = sft_batch(examples[:32], tok, mt.fmt)
    user, assistant = tok.tokenizer.token_to_id("<|user|>"), tok.tokenizer.token_to_id("<|tool|>")
    targets = batch.tokens[:, 1:][batch.loss_mask > 0]
    assert user not in targets and assistant not in targets
    sft = tool_caller(tmp_path_factory)  # 120 SFT steps from chat_dir's weights, shared by the session
    fp32 = PrecisionCfg(name="fp32", train_dtype=DType.fp32, rollout_dtype=DType.fp32)
    trainer = TorchTrainer(sft, AlgoCfg(name=AlgoName.sft, policy_loss="nll"),
                           TrainerCfg(lr=3e-3, global_batch_size=32, micro_batch_size=32), fp32, threads=2, seed=0)
    engine = NativeEngine(sft, RolloutCfg(max_new_tokens=120, max_prompt_len=32), seed=0)
    prompts = [Example(e.prompt, e.label) for e in examples[:8]]  # the user turn only
    greedy, metrics = mt.generate(LocalHandle(engine), prompts, 1, 0.0, 120)
    assert metrics["rollout/tool_call_rate"] == 1.0
    assert sum(s.response == s.label for s in greedy) >= 6  # the answer is copied from the tool's
    sampled, _ = mt.generate(LocalHandle(engine), prompts, 2, 1.0, 120)
    batch = build_train_batch(sampled, torch.zeros(len(sampled)), tok.pad_id)
    masked = batch.loss_mask.sum(1) < torch.tensor([len(s.response_ids) for s in sampled])  # a tool turn
    assert masked.sum() >= len(sampled) // 2
    recomputed = trainer.logprobs(batch)
    mask = batch.loss_mask > 0
    torch.testing.assert_close(recomputed[mask], batch.rollout_logprobs[mask], atol=1e-5, rtol=1e-5)
