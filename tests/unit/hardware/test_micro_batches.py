"""The planner sizes activations for the micro-batch the trainer really forms (miles/trainer/packing.py)
and the KV cache for max_prompt_len + max_new_tokens: long responses, by hand, on qwen3_tiny."""

from rich.console import Console

from miles.hardware.footprint import param_groups
from miles.hardware.planner import TrainLayout, make_plan, micro_batch_shape, rollout_usage, train_usage
from miles.hardware.report import plan_table

# qwen3_tiny, 100-token vocabulary, bf16 on an H100: hidden 128, 3 layers, GQA with head_dim 32 (the
# variable-length kernel packs rows). Defaults: 64 prompts x 8 = 512 sequences = one optimizer step,
# prompts up to 64 tokens, trainer.max_tokens_per_micro_batch 8192, micro_batch_size 128.
TINY = ["model.vocab_size=100", "precision=bf16", "hardware=h100"]
LONG = TINY + ["rollout.max_new_tokens=4096"]  # sequences of 64 + 4096 = 4160 tokens


def activations(tokens, act_bytes=2):
    """3 layers x tokens x hidden 128 x 34 bytes (for 2-byte activations), TP=1."""
    return 3 * tokens * 128 * 34 * act_bytes / 2


def usage(cfg):
    return train_usage(cfg, param_groups(cfg.model.arch(100), cfg.precision), TrainLayout(), gpus=8)


def test_kv_cache_follows_the_response_budget(compose):
    cfg = compose(LONG)
    arch = cfg.model.arch(100)
    _, kv_seqs, per_seq = rollout_usage(cfg, param_groups(arch, cfg.precision), gpus_per_engine=2, capacity=10e9)
    assert per_seq == 3 * 2 * 2 * 32 * 2 * 4160 / 2  # layers x (K, V) x kv heads x head_dim x bf16 x tokens / GPUs
    _, short_seqs, short = rollout_usage(compose(TINY), param_groups(arch, cfg.precision), 2, 10e9)
    assert per_seq == short * 4160 / 72 and kv_seqs < short_seqs


def test_packed_micro_batches_hold_the_token_budget_not_micro_batch_size(compose):
    cfg = compose(LONG)
    assert usage(cfg)["activations"] == activations(8192)  # two 4160-token sequences do not fit 8192: one does
    assert usage(cfg)["logits"] == 8192 * 100 * 4 * 2
    assert usage(compose(LONG + ["trainer.micro_batch_size=1"]))["activations"] == activations(8192)
    # A sequence longer than the budget gets a micro-batch of its own.
    assert usage(compose(LONG + ["trainer.max_tokens_per_micro_batch=2048"]))["activations"] == activations(4160)
    # A step smaller than the budget is one micro-batch: 16 x 72 tokens.
    small = TINY + ["rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=16"]
    assert usage(compose(small))["activations"] == activations(16 * 72)


def test_padded_micro_batches_hold_micro_batch_size_rows(compose):
    cfg = compose(LONG + ["trainer.pack_sequences=false"])
    assert usage(cfg)["activations"] == activations(128 * 4160)
    # Linear attention (qwen3_next) trains padded whatever pack_sequences says.
    next_tiny = compose(["model=qwen3_next_tiny", "model.vocab_size=100", "precision=bf16", "hardware=h100"])
    assert micro_batch_shape(next_tiny, next_tiny.model.arch(100)).tokens == 128 * 72


def test_shared_prompts_on_the_masked_kernel_keep_a_prompt_and_its_responses_in_one_row(compose):
    # fp32 on the CPU takes the masked kernel: the 8 samples of a prompt share one row of 64 + 8 x 4096 tokens.
    cpu = ["model.vocab_size=100", "rollout.max_new_tokens=4096"]
    cfg = compose(cpu)
    assert micro_batch_shape(cfg, cfg.model.arch(100)).tokens == 64 + 8 * 4096
    assert usage(cfg)["activations"] == activations(64 + 8 * 4096, act_bytes=4)
    cfg = compose(cpu + ["trainer.share_prompts=false"])
    assert usage(cfg)["activations"] == activations(8192, act_bytes=4)
    # MLA takes the masked kernel on CUDA too.
    mla = compose(["model=deepseek_v3_tiny", "precision=bf16", "hardware=h100"] + cpu)
    assert micro_batch_shape(mla, mla.model.arch(100)).tokens == 64 + 8 * 4096


def test_the_plan_table_says_how_the_micro_batch_is_formed(compose):
    def table(overrides):
        cfg = compose(overrides)
        console = Console(width=400, record=True)
        console.print(plan_table(cfg, make_plan(cfg)))
        return console.export_text()

    assert "packed: 8,192 tokens (max_tokens_per_micro_batch) of 4,160-token sequences" in table(LONG)
    assert "micro-batch 128 x 4,160 tokens, padded" in table(LONG + ["trainer.pack_sequences=false"])
    assert "holds" in table(LONG) and "sequences of 4160 tokens" in table(LONG)
