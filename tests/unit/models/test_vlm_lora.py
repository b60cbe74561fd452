"""LoRA on a vision-language model's decoder (the tower is never adapted: targets are `layers.*`),
saved in PEFT's format: `peft.PeftModel.from_pretrained` on the transformers model of each VLM
family gives our adapted model's float32 logits on a batch with images, and the adapter loads back.
PEFT matches the modules of transformers' in-memory model, where a VLM's decoder sits under
`model.language_model.` whatever the checkpoint's layout (Qwen2.5-VL's files keep `model.layers.`)."""

import pytest
import torch
import transformers

from miles.models import from_pretrained
from miles.models.lora import LoRA
from miles.models.lora_peft import load_peft, save_peft
from test_qwen3_vl import _hf_config as qwen3_vl_config
from vlm_checks import hf_logits, image_batch, rel_err, tiny_hf_model

peft = pytest.importorskip("peft")

FAMILIES = {
    "qwen2_5_vl": (lambda: transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=100, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103),
        transformers.Qwen2_5_VLForConditionalGeneration, 14),
    "qwen3_vl": (lambda: qwen3_vl_config("qwen3_vl"), transformers.Qwen3VLForConditionalGeneration, 16),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_peft_loads_a_vlm_adapter_with_the_same_logits(tmp_path, family):
    make_config, model_class, patch = FAMILIES[family]
    hf = tiny_hf_model(model_class, make_config())
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf").eval()
    lora = LoRA(ours, rank=4, alpha=8.0, seed=0)
    assert lora.names and all(n.startswith("layers.") for n in lora.names)  # the decoder's, no tower module
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for b in lora.lora_B:  # as if trained: B off zero
            b.copy_(torch.randn(b.shape, generator=gen) * 0.2)
    save_peft(lora, ours.config, tmp_path / "adapter")

    ids, mask, pixels, grids = image_batch(patch)
    with torch.no_grad():
        mine = ours(ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids)
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    assert rel_err(mine, hf_logits(adapted, ids, mask, pixels, grids), mask) < 1e-4
    with adapted.disable_adapter():  # the adapter matters
        assert rel_err(mine, hf_logits(adapted, ids, mask, pixels, grids), mask) > 1e-3

    again = LoRA(from_pretrained(tmp_path / "hf"), rank=4, alpha=8.0, seed=1)
    load_peft(again, ours.config, tmp_path / "adapter")
    assert all(torch.equal(again.tensors()[k], v) for k, v in lora.tensors().items())
