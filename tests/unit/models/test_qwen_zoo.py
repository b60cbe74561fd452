"""The Qwen dense families through the shared zoo checks (see zoo_checks.py)."""

import transformers

from zoo_checks import (check_decode_matches_forward, check_loads_transformers_checkpoint,
                         check_transformers_loads_ours, tiny_hf_model)


def test_qwen3_passes_the_zoo_checks(tmp_path):
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    ours = check_loads_transformers_checkpoint(tiny_hf_model(cfg), tmp_path)
    check_transformers_loads_ours(ours, tmp_path)
    check_decode_matches_forward(ours)
