"""A random Qwen3 chat checkpoint as transformers writes one: config + safetensors, a byte-level BPE
tokenizer trained on given texts (digits kept apart, as Qwen's are) and a ChatML template whose end of
turn is eos. For runs of the chat-model code paths where no released model can be downloaded (CI,
an offline GPU node); the weights are random, so only speed and plumbing mean anything.

    python benchmarks/chat_checkpoint.py OUT --hidden 1024 --layers 28 --heads 16 --kv-heads 8 \\
        --head-dim 128 --intermediate 3072 --texts examples/data/gsm8k_cpu/test.jsonl   # Qwen3-0.6B dims
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_chat_checkpoint(path, texts: list[str], hidden: int = 128, intermediate: int = 384, layers: int = 3,
                          heads: int = 4, kv_heads: int = 2, head_dim: int = 32, max_positions: int = 128,
                          vocab: int = 400, seed: int = 0) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                  pad_token="<|endoftext|>")
    hf_tok.chat_template = CHATML
    hf_tok.save_pretrained(path)
    config = transformers.Qwen3Config(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
        eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=tok.token_to_id("<|endoftext|>"))
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)


def jsonl_texts(path: str | Path) -> list[str]:
    """Every string value of every record of a JSONL file (the tokenizer's training text)."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [v for r in records for v in r.values() if isinstance(v, str)]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--texts", required=True, help="JSONL file whose strings train the tokenizer")
    for name, default in (("hidden", 128), ("intermediate", 384), ("layers", 3), ("heads", 4), ("kv-heads", 2),
                          ("head-dim", 32), ("max-positions", 4096), ("vocab", 400)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args()
    write_chat_checkpoint(a.out, jsonl_texts(a.texts) * 5, a.hidden, a.intermediate, a.layers, a.heads, a.kv_heads,
                          a.head_dim, a.max_positions, a.vocab)
    print(f"random chat checkpoint in {a.out}")
