"""Qwen2.5-VL (miles.models.vlm / vision) against transformers' Qwen2_5_VLForConditionalGeneration.

A tiny random model saved by transformers loads through `from_pretrained` and gives the same
float32 logits on a left-padded batch whose rows hold images of different sizes (one of them
spanning several attention windows); our checkpoint loads in transformers with nothing missing;
the save / load round trip is bitwise. All weights are randomized (norms and biases included) so
that a swapped or dropped tensor shows. Max relative error bound: 1e-4 (observed ~1e-6).
"""

import json

import pytest
import torch
import transformers

from miles.models import from_hf_config, from_pretrained, save_pretrained
from miles.models.vlm import VisionLM

IMAGE, START, END = 100, 102, 103
RTOL = 1e-4


def _hf_config():
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}),
        # window_size 56 = 2 merger blocks of 2 x 14 px: an 8 x 12-patch image spans 2 x 3 windows.
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=101, vision_start_token_id=START, vision_end_token_id=END)


def _randomize(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.ndim == 1 else 0.0))


def _batch():
    """Two left-padded rows: row 0 one 8 x 12-patch image, row 1 a 4 x 4 and a 6 x 2 image."""
    grids = torch.tensor([[1, 8, 12], [1, 4, 4], [1, 6, 2]])
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 14 * 14, generator=gen)
    span = lambda n: [START] + [IMAGE] * n + [END]  # noqa: E731
    rows = [[5, 6] + span(24) + [7, 8, 9], [10] + span(4) + [11, 12] + span(3) + [13]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask, pixels, grids


def _rel_err(ours, ref, mask):
    keep = mask.bool()
    return ((ours - ref)[keep].abs().max() / ref[keep].abs().max()).item()


def _hf_logits(hf, ids, mask, pixels, grids):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids,
                  mm_token_type_ids=(ids == IMAGE).int()).logits


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    cfg = _hf_config()
    cfg._attn_implementation = "eager"
    hf = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    _randomize(hf, 0)
    return hf


def test_transformers_checkpoint_matches_logits_with_images(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    assert isinstance(ours, VisionLM)
    assert ours.config.mrope_section == [2, 3, 3] and ours.config.vision.fullatt_block_indexes == [1]
    ids, mask, pixels, grids = _batch()
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids)
    assert _rel_err(got, _hf_logits(hf_model, ids, mask, pixels, grids), mask) < RTOL


def test_text_only_prompt_matches(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _rel_err(ours(ids), hf_model(input_ids=ids).logits, torch.ones_like(ids)) < RTOL


def test_image_token_count_must_match_features(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    ids, mask, pixels, grids = _batch()
    with pytest.raises(ValueError, match="image tokens"):
        ours(ids[:1], attention_mask=mask[:1], pixel_values=pixels, image_grid_thw=grids)


def test_transformers_loads_our_checkpoint(tmp_path):
    cfg = from_hf_config(_hf_config().to_dict())
    ours = VisionLM(cfg, seed=3).eval()
    _randomize(ours, 3)
    save_pretrained(ours, tmp_path)
    hf, info = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask, pixels, grids = _batch()
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids)
    assert _rel_err(got, _hf_logits(hf.eval(), ids, mask, pixels, grids), mask) < RTOL


def test_save_load_round_trip_is_bitwise(tmp_path):
    cfg = from_hf_config(_hf_config().to_dict())
    ours = VisionLM(cfg, seed=7)
    save_pretrained(ours, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    loaded = from_pretrained(tmp_path)
    assert loaded.config == cfg
    a, b = ours.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_published_legacy_config_reads():
    """The layout of Qwen/Qwen2.5-VL-7B-Instruct's config.json: decoder keys at the top level,
    mRoPE under rope_scaling, `in_chans`."""
    d = {"model_type": "qwen2_5_vl", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
         "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 1e6,
         "rms_norm_eps": 1e-6, "max_position_embeddings": 128000, "image_token_id": 151655,
         "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
         "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                           "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                           "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                           "tokens_per_second": 2}}
    cfg = from_hf_config(d)
    assert (cfg.head_dim, cfg.mrope_section, cfg.vision.head_dim) == (128, [16, 24, 24], 80)
    with torch.device("meta"):
        model = VisionLM(cfg)
    # 8.29B: the published checkpoint's parameter count (untied lm_head).
    assert sum(p.numel() for p in model.parameters()) == 8_292_166_656


def test_cached_decode_needs_explicit_mrope_positions():
    """After an image, text positions depend on the prompt's grids: a decode step cannot guess them."""
    ours = VisionLM(from_hf_config(_hf_config().to_dict()), seed=0)
    with pytest.raises(ValueError, match="mrope_position_ids"):
        ours(torch.tensor([[1, 2]]), cache=ours.new_cache(1, 8))
