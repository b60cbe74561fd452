"""Videos in every vision-language family against transformers 5 (Qwen2.5-VL, Qwen3-VL dense and
MoE, GLM-4.5V): a tiny random transformers model saved by transformers loads through our
`from_pretrained` and gives the same float32 logits on a left-padded batch whose first row holds a
video and whose second an image and a video of other sizes; our mRoPE positions equal the model's
`get_rope_index` on every real token. Each batch is laid out as the family's processor writes it:

  Qwen2.5-VL   one `<vision_start> <video_pad> x t*h*w/4 <vision_end>` span per video; temporal
               patches second_per_grid_t * tokens_per_second apart (2/3 s per patch here: 2.67
               positions, truncated as transformers does);
  Qwen3-VL     per temporal patch `<t seconds> <vision_start> <video_pad> x h*w/4 <vision_end>`;
  GLM-4.5V     per temporal patch `<image_start> <image> x h*w/4 <image_end> <second>`, all inside
               `<video_start> ... <video_end>`: only those span tokens tell the frames from images.

transformers' GLM-4.5V cannot take an image and a video in one forward (its video placeholder mask
is every image token), so that row's reference is assembled from its own parts: its tower's image
and video features at the placeholders its processor's token types name, its get_rope_index
positions, its decoder.
"""

import pytest
import torch
import transformers

from miles.models import from_hf_config, from_pretrained
from miles.models.families import get_family
from miles.models.vlm import mrope_positions
from test_glm4v_moe import GLM_4_5V
from test_glm4v_moe import _hf_config as glm_config
from test_qwen2_5_vl import _hf_config as qwen2_5_config
from test_qwen3_vl import _hf_config as qwen3_config
from vlm_checks import END, IMAGE, RTOL, START, VIDEO, rel_err, tiny_hf_model

V_START, V_END = 104, 105  # GLM-4.5V's video span tokens
TIME = [20, 21, 22]  # stand-ins for a timestamp's text tokens
IMAGE_GRID = torch.tensor([[1, 4, 4]])
VIDEO_GRIDS = torch.tensor([[2, 4, 6], [3, 2, 4]])  # (temporal patches, h, w): 4 and 6 frames
SECONDS = torch.tensor([2 / 3, 0.5])  # seconds per temporal patch (2 frames at 3 and 4 fps)

FAMILIES = {
    "qwen2_5_vl": (qwen2_5_config, transformers.Qwen2_5_VLForConditionalGeneration, 14),
    "qwen3_vl": (lambda: qwen3_config("qwen3_vl"), transformers.Qwen3VLForConditionalGeneration, 16),
    "qwen3_vl_moe": (lambda: qwen3_config("qwen3_vl_moe"), transformers.Qwen3VLMoeForConditionalGeneration, 16),
    "glm4v_moe": (glm_config, transformers.Glm4vMoeForConditionalGeneration, 14),
}


def _hf_config(family):
    cfg = FAMILIES[family][0]()
    if family == "glm4v_moe":
        cfg.video_start_token_id, cfg.video_end_token_id = V_START, V_END
    return cfg


def _video_span(family, grid):
    """The placeholder tokens of one video, as the family's processor writes them."""
    t, h, w = grid.tolist()
    n = h * w // 4
    if family == "qwen2_5_vl":
        return [START] + [VIDEO] * (t * n) + [END]
    if family == "glm4v_moe":
        frames = [tok for k in range(t) for tok in [START] + [IMAGE] * n + [END, TIME[k % 3]]]
        return [V_START] + frames + [V_END]
    return [tok for k in range(t) for tok in [TIME[k % 3], START] + [VIDEO] * n + [END]]


def _batch(family, patch):
    """Row 0: text, a 4-frame video, text. Row 1 (left-padded): text, an image, text, a 6-frame
    video, text. Returns (ids, mask, token types (0 text, 1 image, 2 video), model inputs)."""
    image = [START] + [IMAGE] * 4 + [END]
    rows = [[5, 6] + _video_span(family, VIDEO_GRIDS[0]) + [7, 8],
            [9] + image + [10, 11] + _video_span(family, VIDEO_GRIDS[1]) + [12]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    types = _token_types(family, ids)
    gen = torch.Generator().manual_seed(1)
    patch_dim = 3 * 2 * patch ** 2
    inputs = dict(pixel_values=torch.randn(int(IMAGE_GRID.prod(-1).sum()), patch_dim, generator=gen),
                  image_grid_thw=IMAGE_GRID,
                  pixel_values_videos=torch.randn(int(VIDEO_GRIDS.prod(-1).sum()), patch_dim, generator=gen),
                  video_grid_thw=VIDEO_GRIDS)
    if family == "qwen2_5_vl":
        inputs["second_per_grid_ts"] = SECONDS
    return ids, mask, types, inputs


def _token_types(family, ids):
    """transformers' mm_token_type_ids: its processors' rule (GLM: image tokens inside a video span)."""
    if family != "glm4v_moe":
        return (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    in_video = (ids == V_START).cumsum(-1) > (ids == V_END).cumsum(-1)
    return ((ids == IMAGE) & ~in_video).int() + 2 * ((ids == IMAGE) & in_video).int()


@torch.no_grad()
def _hf_reference(hf, family, ids, mask, types, inputs):
    """transformers' logits; for GLM-4.5V's image + video row, from its parts (module docstring)."""
    if family != "glm4v_moe":
        return hf(input_ids=ids, attention_mask=mask, mm_token_type_ids=types, **inputs).logits
    model = hf.model
    embeds = model.get_input_embeddings()(ids)
    image = torch.cat(model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output)
    video = torch.cat(model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]).pooler_output)
    embeds = embeds.masked_scatter((types == 1)[..., None], image).masked_scatter((types == 2)[..., None], video)
    positions = model.get_rope_index(ids, types, inputs["image_grid_thw"], inputs["video_grid_thw"], mask)[0]
    return hf(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).logits


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def loaded(request, tmp_path_factory):
    """(family, transformers model, ours loaded from its save)."""
    family = request.param
    hf = tiny_hf_model(FAMILIES[family][1], _hf_config(family))
    directory = tmp_path_factory.mktemp(family)
    hf.save_pretrained(directory)
    return family, hf, from_pretrained(directory).eval()


@torch.no_grad()
def test_logits_with_videos_equal_transformers(loaded):
    family, hf, ours = loaded
    ids, mask, types, inputs = _batch(family, FAMILIES[family][2])
    got = ours(ids, attention_mask=mask, **inputs)
    err = rel_err(got, _hf_reference(hf, family, ids, mask, types, inputs), mask)
    assert err < RTOL, f"{family}: logits with images and videos differ from transformers by {err:.3g} (relative)"
    # The video alone (row 0), transformers' own forward the reference for every family.
    video = {"pixel_values_videos": inputs["pixel_values_videos"][:int(VIDEO_GRIDS[0].prod())],
             "video_grid_thw": VIDEO_GRIDS[:1], **({"second_per_grid_ts": SECONDS[:1]} if family == "qwen2_5_vl" else {})}
    got = ours(ids[:1], attention_mask=mask[:1], **video)
    ref = hf(input_ids=ids[:1], attention_mask=mask[:1], mm_token_type_ids=types[:1], **video).logits
    err = rel_err(got, ref, mask[:1])
    assert err < RTOL, f"{family}: logits with a video differ from transformers by {err:.3g} (relative)"


def test_positions_equal_get_rope_index(loaded):
    family, hf, ours = loaded
    ids, mask, types, inputs = _batch(family, FAMILIES[family][2])
    theirs = hf.model.get_rope_index(ids, types, inputs["image_grid_thw"], inputs["video_grid_thw"],
                                     second_per_grid_ts=inputs.get("second_per_grid_ts"), attention_mask=mask)[0]
    mine = mrope_positions(ids, inputs["image_grid_thw"], ours.config, mask,
                           video_grid_thw=inputs["video_grid_thw"], second_per_grid_ts=inputs.get("second_per_grid_ts"))
    real = mask.bool()
    assert torch.equal(mine[:, real], theirs[:, real])
    if family == "qwen2_5_vl":  # the temporal spacing is really there: 4 tokens/s x 2/3 s -> 0, 2 (truncated)
        first_video = (ids[0] == VIDEO).nonzero()[0, 0]
        start = int(mine[1, 0, first_video])
        assert sorted(set((mine[0, 0][ids[0] == VIDEO] - start).tolist())) == [0, 2]


def test_glm_video_span_ids_are_kept(tmp_path):
    """GLM-4.5V's video start / end ids are read from config.json and written back."""
    cfg = from_hf_config(GLM_4_5V)
    assert (cfg.vision.video_start_token_id, cfg.vision.video_end_token_id) == (151341, 151342)
    written = get_family("glm4v_moe").to_hf_config(cfg, "bfloat16")
    assert (written["video_start_token_id"], written["video_end_token_id"]) == (151341, 151342)
    assert from_hf_config(written).vision == cfg.vision
