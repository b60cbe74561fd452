"""The one-GPU math presets (conf/experiment/qwen3_*_math_gpu.yaml): without the user's checkpoint and
data they stop at their placeholders; with them they validate and fit one H200 in the memory planner."""

import json

import pytest

from miles.validate import validate
from miles.data.prompts import DataError
from miles.data.source import PromptSource
from miles.hardware.planner import make_plan

PRESETS = {"qwen3_0_6b_math_gpu": ("qwen3_0_6b", "Qwen3-0.6B", 1024),
           "qwen3_1_7b_math_gpu": ("qwen3_1_7b", "Qwen3-1.7B", 1024),
           "qwen3_4b_math_gpu": ("qwen3_4b", "Qwen3-4B", 2048)}
H200 = ["dry_run=true", "hardware.memory_gb=141"]  # hardware=gpu reads the memory of a GPU this machine lacks


def user_values(tmp_path, compose, preset):
    """An HF directory of the preset's model (its config.json, which the planner reads) and a GSM8K-format file."""
    ckpt, data = tmp_path / "ckpt", tmp_path / "gsm8k.jsonl"
    ckpt.mkdir()
    model = compose([f"model={PRESETS[preset][0]}"]).model
    (ckpt / "config.json").write_text(json.dumps(model.arch(model.vocab_size).to_hf_config("bfloat16")))
    (ckpt / "tokenizer.json").write_text("{}")  # validate() only checks that it is there
    data.write_text(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n")
    return [f"model.hf_checkpoint={ckpt}", f"task.train_file={data}", f"task.eval_file={data}"]


@pytest.mark.parametrize("preset", PRESETS)
def test_without_the_checkpoint_and_the_data_a_run_stops(compose, preset):
    cfg = compose([f"+experiment={preset}", *H200])
    hf_name = PRESETS[preset][1]
    assert validate(cfg) == [f"model.hf_checkpoint=<your {hf_name} HF directory> must be an HF checkpoint "
                             "directory; missing: config.json, tokenizer.json"]
    with pytest.raises(DataError, match="prompt file not found: <your GSM8K-format train .jsonl>"):
        PromptSource(cfg.task, cfg.seed)  # what a run reads before anything starts


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_validates_and_fits_one_h200(compose, tmp_path, preset):
    cfg = compose([f"+experiment={preset}", *H200, *user_values(tmp_path, compose, preset)])
    assert validate(cfg) == []
    plan = make_plan(cfg)
    assert plan.fits, plan.problems
    assert plan.gpus == 1 and plan.capacity == pytest.approx(141e9 * 0.9)
    # The whole step decodes in one wave; the trainer packs 8192-token micro-batches.
    assert plan.kv_sequences >= plan.sequences_per_engine == cfg.rollout.batch_size * 8
    assert plan.micro_batch.tokens == 8192

    model, _, new_tokens = PRESETS[preset]
    assert cfg.model.name == model and cfg.precision.name == "bf16" and cfg.hardware.name == "gpu"
    assert cfg.rollout.max_new_tokens == cfg.eval.max_new_tokens == new_tokens and cfg.rollout.max_prompt_len == 512
    assert (cfg.rollout.n_samples_per_prompt, cfg.rollout.temperature) == (8, 1.0)
    assert not cfg.warm_start.enabled and cfg.trainer.lr == 1e-6 and cfg.steps == 200 and cfg.eval.interval == 20
    t = cfg.task
    assert (t.kind.value, t.prompt_key, t.label_key, t.label_extractor, t.reward) == (
        "file", "question", "answer", "gsm8k", "math")
    assert t.apply_chat_template and t.system_prompt.endswith(r"final answer within \boxed{}.")


@pytest.mark.parametrize("preset", PRESETS)
def test_the_published_sizes_plan_without_a_checkpoint(compose, preset):
    """The header's dry run: model.hf_checkpoint=null plans the model config's own sizes."""
    assert make_plan(compose([f"+experiment={preset}", *H200, "model.hf_checkpoint=null"])).fits
