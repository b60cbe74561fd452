import json

import pytest

from miles.config.schema import TaskCfg, TaskKind
from miles.data.source import PromptSource


def _file_cfg(tmp_path, n=5, **overrides) -> TaskCfg:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "label": str(i)}) + "\n" for i in range(n)))
    return TaskCfg(name="file", kind=TaskKind.file, train_file=str(path), **overrides)


def _prompts(source: PromptSource, n: int) -> list[str]:
    return [ex.prompt for ex in source.next_batch(n)]


def test_file_order_when_not_shuffled(tmp_path):
    source = PromptSource(_file_cfg(tmp_path, n=4, shuffle=False), seed=0)
    assert _prompts(source, 3) == ["p0", "p1", "p2"]
    assert _prompts(source, 3) == ["p3", "p0", "p1"]
    assert _prompts(source, 3) == ["p2", "p3", "p0"]


def test_shuffled_epochs_are_seeded_permutations(tmp_path):
    cfg = _file_cfg(tmp_path, n=8)
    epochs = [_prompts(PromptSource(cfg, seed=0), 24)[i : i + 8] for i in (0, 8, 16)]
    assert all(sorted(epoch) == [f"p{i}" for i in range(8)] for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) > 1  # a fresh order each epoch
    assert _prompts(PromptSource(cfg, seed=0), 24) == sum(epochs, [])
    assert _prompts(PromptSource(cfg, seed=1), 24) != sum(epochs, [])


# 5 prompts: stop mid-epoch, exactly at the epoch's end, and inside the second epoch.
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drawn_before_stop", [2, 5, 7])
def test_resume_from_state_draws_the_same_next_prompts(tmp_path, shuffle, drawn_before_stop):
    cfg = _file_cfg(tmp_path, n=5, shuffle=shuffle)
    uninterrupted = PromptSource(cfg, seed=3)
    _prompts(uninterrupted, drawn_before_stop)
    state = json.loads(json.dumps(uninterrupted.state()))  # as it goes through a checkpoint

    resumed = PromptSource(cfg, seed=3)
    resumed.load_state(state)
    # 13 more prompts cross at least two epoch boundaries.
    assert _prompts(resumed, 13) == _prompts(uninterrupted, 13)


def test_label_extractor_and_eval_file(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "q", "answer": "so 3\n#### 3"}) + "\n")
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps({"question": f"e{i}", "answer": f"#### {i}"}) + "\n" for i in range(3)))
    cfg = TaskCfg(name="gsm8k", kind=TaskKind.file, train_file=str(train), eval_file=str(eval_file),
                  prompt_key="question", label_key="answer", label_extractor="gsm8k", eval_size=2)
    source = PromptSource(cfg, seed=0)
    assert [(ex.prompt, ex.label) for ex in source.train] == [("q", "3")]
    assert [(ex.prompt, ex.label) for ex in source.eval] == [("e0", "0"), ("e1", "1")]


def test_alphabet_covers_message_contents(tmp_path):
    path = tmp_path / "chat.jsonl"
    messages = [{"role": "system", "content": "Be"}, {"role": "user", "content": "hi"}]
    path.write_text(json.dumps({"prompt": messages, "label": "4"}) + "\n")
    source = PromptSource(TaskCfg(name="chat", kind=TaskKind.file, train_file=str(path)), seed=0)
    # The system turn's "B" and "e" reach the model too; role names are template text, not data.
    assert source.alphabet() == "4Behi"
