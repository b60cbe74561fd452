"""Runs without Ray (the path the GPU machine uses): a real HF checkpoint written by `transformers`,
user prompt files, and SFT. Each is a short real run through launch.py, checked on its outputs.
"""

import json

import pytest

from launch_cli import run_launch

pytestmark = pytest.mark.slow

TINY = [
    "ray.enabled=false", "steps=1", "eval.interval=1", "task.eval_size=8",
    "rollout.batch_size=2", "rollout.n_samples_per_prompt=4",
    "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
]


def _char_checkpoint(ckpt):
    """A random tiny Qwen3 saved by transformers with the project's char tokenizer (no chat template)."""
    import torch
    import transformers

    from miles.data.tokenizer import DEFAULT_ALPHABET, TokenizerInfo, build_char_tokenizer, save_tokenizer

    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    info = TokenizerInfo.from_tokenizer(tok)
    config = transformers.Qwen3Config(
        vocab_size=info.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=True, bos_token_id=info.bos_id, eos_token_id=info.eos_id, pad_token_id=info.pad_id,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(ckpt)
    save_tokenizer(tok, ckpt)
    return ckpt


def test_hf_checkpoint_written_by_transformers(tmp_path):
    """model.hf_checkpoint=<dir> alone is enough: config.json + safetensors + tokenizer.json."""
    ckpt = _char_checkpoint(tmp_path / "hf")
    proc = run_launch([*TINY, f"model.hf_checkpoint={ckpt}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "building the warm-start" not in proc.stdout  # a given checkpoint is used as is
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    saved = json.loads((run_dir / "checkpoint" / "config.json").read_text())
    assert saved["model_type"] == "qwen3" and saved["hidden_size"] == 32


def test_missing_hf_checkpoint_is_a_user_error(tmp_path):
    proc = run_launch([*TINY, f"model.hf_checkpoint={tmp_path / 'nope'}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "model.hf_checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def test_prompt_files_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"q": f"{a}*{b}=", "a": a * b} for a in range(2, 9) for b in range(2, 9)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = tmp_path / "eval.parquet"
    pq.write_table(pa.table({"q": [r["q"] for r in rows[:8]], "a": [str(r["a"]) for r in rows[:8]]}), held_out)
    proc = run_launch(
        [*TINY, "task.kind=file", f"task.train_file={train}", f"task.eval_file={held_out}", "task.prompt_key=q",
         "task.label_key=a", "task.name=times", "warm_start.enabled=false"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "eval times" in proc.stdout


# From a random init (loss ~ log(vocab) = 3) the answer format and the leading digits are learned within
# ~25 steps, then the loss stays on a plateau (measured: 2.93 at step 1, 1.40-1.62 over steps 21-100).
# 30 steps in `make test`; the 100-step run in the `learning` tier (make test-learning).
@pytest.mark.parametrize("steps", [30, pytest.param(100, marks=pytest.mark.learning)])
def test_sft_trains_the_base_policy(tmp_path, steps):
    from mlflow.tracking import MlflowClient

    proc = run_launch(
        ["ray.enabled=false", "algo=sft", f"steps={steps}", f"eval.interval={steps}", "task.eval_size=64",
         "trainer.lr=3e-3", "trainer.global_batch_size=32", "trainer.micro_batch_size=32"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("miles").experiment_id])
    loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert set(loss) == set(range(1, steps + 1))
    assert loss[1] > 2.5 and max(loss[s] for s in range(steps - 9, steps + 1)) < 0.6 * loss[1]
    assert len(list((tmp_path / "outputs").glob("*/*/checkpoint/model.safetensors"))) == 1


def _chat_checkpoint(path):
    """A random tiny Qwen3 saved by transformers with a byte-level BPE tokenizer and a ChatML template
    whose end of turn (<|im_end|>) is eos; generation_config.json lists <|endoftext|> as well."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = __import__("tokenizers").decoders.ByteLevel()
    tok.train_from_iterator([f"{a}*{b}={a * b} Answer with the number." for a in range(10) for b in range(10)],
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                                 "<|im_end|>"]))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                  pad_token="<|endoftext|>")
    hf_tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                            "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    hf_tok.save_pretrained(path)
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")}
    config = transformers.Qwen3Config(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        tie_word_embeddings=True, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.save_pretrained(path)
    return hf_tok


def test_chat_template_prompts_from_a_transformers_checkpoint(tmp_path):
    """task.apply_chat_template renders each prompt as transformers would, the engine stops at the
    template's end of turn, and the recorded samples carry the rendered prompts."""
    hf_tok = _chat_checkpoint(tmp_path / "chat")
    rows = [{"q": f"{a}*{b}=", "a": str(a * b)} for a in range(2, 9) for b in range(2, 9)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_launch(
        [*TINY, f"model.hf_checkpoint={tmp_path / 'chat'}", "task.kind=file", f"task.train_file={train}",
         f"task.eval_file={train}",
         "task.prompt_key=q", "task.label_key=a", "task.apply_chat_template=true",
         "task.system_prompt=Answer with the number.", "rollout.max_new_tokens=6", "rollout.max_prompt_len=48"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (journal,) = (tmp_path / "outputs").glob("*/*/mlflow/journal.jsonl")
    tables = [json.loads(line) for line in journal.read_text().splitlines() if '"op": "table"' in line]
    prompts = {row["prompt"] for table in tables for row in table["rows"]}
    rendered = {hf_tok.apply_chat_template(
        [{"role": "system", "content": "Answer with the number."}, {"role": "user", "content": r["q"]}],
        tokenize=False, add_generation_prompt=True) for r in rows}
    assert prompts and prompts <= rendered  # the eval samples' prompts, as transformers renders them


def test_apply_chat_template_without_a_template_is_a_user_error(tmp_path):
    """A checkpoint of yours without a template (the project's own random / warm-start models get the
    tiny chat format instead)."""
    ckpt = _char_checkpoint(tmp_path / "hf")
    proc = run_launch([*TINY, f"model.hf_checkpoint={ckpt}", "task.apply_chat_template=true"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "the tokenizer has no chat_template" in proc.stderr and "Traceback" not in proc.stderr
