"""The planner's vision tower (miles/hardware/vision_footprint.py) against hand-computed figures:
the tiny Qwen2.5-VL of the shape_count preset and the published Qwen2.5-VL-7B."""

import io

import pytest
from rich.console import Console

from miles.hardware.footprint import param_groups
from miles.hardware.planner import TrainLayout, make_plan, model_arch, rollout_usage, train_usage
from miles.hardware.report import plan_table
from miles.hardware.vision_footprint import image_tokens, tower_params

# qwen2_5_vl_tiny's tower (ViT width 32, MLP 64, 2 blocks, 14 px patches over 2 frames, 2 x 2 merge, decoder 64):
#   patch embedding 3 * 2 * 14 * 14 = 1,176 -> 32, no bias:                       37,632
#   per block: 2 RMSNorms 2 * 32; qkv 32 * 96 + 96; proj 32 * 32 + 32;
#              gate and up 2 * (32 * 64 + 64); down 64 * 32 + 32 = 10,592, x 2:   21,184
#   merger: RMSNorm 32; 128 -> 128 + 128; 128 -> 64 + 64:                         24,800
TINY_TOWER = 83_616
# An 84 x 84 px shape_count image: 6 x 6 patches of 14 px, 9 tokens after the 2 x 2 merge.
PATCHES, MERGED = 36, 9
VLM = ["+experiment=shape_count_vlm", "precision=bf16", "hardware=h100"]


def test_tiny_tower_and_image_tokens_by_hand(compose):
    cfg = compose(VLM)
    arch = model_arch(cfg)
    assert tower_params(arch) == TINY_TOWER
    images = image_tokens(cfg, arch)
    assert (images.patches, images.merged) == (PATCHES, MERGED)
    assert "84 x 84 px" in images.source and "shape_count" in images.source


@pytest.mark.parametrize("frozen", [True, False])
def test_train_side_counts_the_tower(compose, frozen):
    """bf16 (weights 2, fp32 gradients 4, AdamW + master 12 bytes), TP=2 on 8 GPUs: DP=4. The preset
    packs its step's 128 sequences of 84 tokens into micro-batches of trainer.max_tokens_per_micro_batch
    (8192) tokens: the largest holds 8192 // 84 = 97 sequences, 97 images of 36 patches."""
    cfg = compose(VLM + [f"trainer.freeze_vision={str(frozen).lower()}"])
    groups = param_groups(model_arch(cfg), cfg.precision)
    usage = train_usage(cfg, groups, TrainLayout(tp=2, pp=1, ep=1), gpus=8)
    decoder, tower = (groups.embed + groups.dense) / 2, TINY_TOWER / 2
    trained = 0 if frozen else tower
    assert usage["weights"] == (decoder + tower) * 2
    assert usage["gradients"] == (decoder + trained) * 4
    assert usage["optimizer"] == (decoder + trained) * 12 / 4
    patches = 8192 // 84 * PATCHES
    blocks = 1 if frozen else 2  # frozen: no autograd record, one block's activations at a time
    # 34 bytes x ViT width per patch and block in bf16, over TP; + two bool masks and a bf16 bias, patches^2.
    assert usage["vision activations"] == blocks * patches * 32 * 34 / 2 + patches ** 2 * (2 + 2)


def test_rollout_side_counts_the_tower_and_the_eval_call(compose):
    """The engine holds the tower in bf16 and runs it once over a generate call's prompts: the
    eval's 200 held-out images at once (more than the step's 16 prompts)."""
    cfg = compose(VLM)
    groups = param_groups(model_arch(cfg), cfg.precision)
    usage, kv_seqs, per_seq = rollout_usage(cfg, groups, gpus_per_engine=1, capacity=10e9)
    assert usage["vision weights"] == TINY_TOWER * 2
    patches = 200 * PATCHES
    assert usage["vision activations"] == patches * 32 * 34 + patches ** 2 * (2 + 2)
    assert kv_seqs == int((10e9 - sum(usage.values())) // per_seq)


def test_a_text_model_plans_as_before(compose):
    plan = make_plan(compose(["model.vocab_size=100", "precision=bf16", "hardware=h100"]))
    assert plan.images is None
    assert "vision activations" not in plan.train and "vision weights" not in plan.rollout


def test_image_files_are_bounded_by_the_prompt_length(compose):
    cfg = compose(VLM + ["task.kind=images", "task.train_file=data/train.jsonl", "rollout.max_prompt_len=200"])
    images = image_tokens(cfg, model_arch(cfg))
    assert (images.patches, images.merged) == (200 * 4, 200)
    assert "rollout.max_prompt_len=200" in images.source


def test_prompt_length_below_the_image_tokens_is_refused(compose):
    plan = make_plan(compose(VLM + ["rollout.max_prompt_len=8"]))
    assert not plan.fits
    assert any(p.startswith("rollout.max_prompt_len=8 is shorter than one prompt's 9 image tokens")
               for p in plan.problems), plan.problems


def test_the_plan_table_says_where_the_image_size_comes_from(compose):
    cfg = compose(VLM)
    out = io.StringIO()
    Console(file=out, width=250).print(plan_table(cfg, make_plan(cfg)))
    text = out.getvalue()
    assert "vision activations" in text and "shape_count's size" in text
    assert f"the vision tower's {TINY_TOWER:,} parameters included (frozen" in text


# Qwen2.5-VL-7B's tower from its config.json (depth 32, width 1280, MLP 3420, 16 heads, out 3584):
#   patch embedding 1,176 * 1,280:                                                           1,505,280
#   per block: norms 2 * 1,280; qkv 1,280 * 3,840 + 3,840; proj 1,280^2 + 1,280;
#              gate and up 2 * (1,280 * 3,420 + 3,420); down 3,420 * 1,280 + 1,280
#              = 19,702,200, x 32:                                                         630,470,400
#   merger: RMSNorm 1,280; 5,120 -> 5,120 + 5,120; 5,120 -> 3,584 + 3,584:                   44,574,464
FULL_TOWER = 676_550_144


def test_full_size_tower_by_hand(compose):
    cfg = compose(["model=qwen2_5_vl_7b", "task=shape_count", "precision=bf16", "hardware=h100"])
    arch = model_arch(cfg)
    assert tower_params(arch) == FULL_TOWER
    # The decoder the planner already counted plus the tower: the published 8.29B.
    assert param_groups(arch, cfg.precision).total + FULL_TOWER == 8_292_166_656
    plan = make_plan(cfg)
    assert plan.fits, plan.problems
    assert plan.rollout["vision weights"] == FULL_TOWER * 2 / plan.gpus_per_engine
    trained = make_plan(compose(["model=qwen2_5_vl_7b", "task=shape_count", "precision=bf16", "hardware=h100",
                                 f"trainer.tp={plan.layout.tp}", f"trainer.pp={plan.layout.pp}",
                                 f"trainer.offload_optimizer={str(plan.layout.offload).lower()}",
                                 "trainer.freeze_vision=false"]))
    shard = FULL_TOWER / plan.layout.tp
    assert trained.train["gradients"] - plan.train["gradients"] == pytest.approx(shard * 4)


def test_image_files_are_measured_by_their_largest_prompt(compose, tmp_path):
    """task.kind=images with a readable file: the largest prompt's patches through the tiny tower's
    processor (14 px patches, 2 x 2 merge, 2 frames per temporal patch): an 84 x 84 image is 6 x 6 = 36
    patches; a 56 x 56 image 4 x 4 = 16 and a 4-frame 56 x 56 video 2 x 4 x 4 = 32, 48 in that
    prompt, the largest: 12 tokens after the merge."""
    import json

    from PIL import Image

    Image.new("RGB", (84, 84)).save(tmp_path / "big.png")
    Image.new("RGB", (56, 56)).save(tmp_path / "small.png")
    (tmp_path / "clip").mkdir()
    for f in range(4):
        Image.new("RGB", (56, 56)).save(tmp_path / "clip" / f"{f}.png")
    user = lambda *parts: [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}]  # noqa: E731
    records = [{"prompt": user({"type": "image", "image": "big.png"}), "label": "1"},
               {"prompt": user({"type": "image", "image": "small.png"}, {"type": "video", "video": "clip", "fps": 2}),
                "label": "2"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = compose(VLM + ["task.kind=images", f"task.train_file={path}"])
    images = image_tokens(cfg, model_arch(cfg))
    assert (images.patches, images.merged) == (48, 12)
    assert "the largest of train.jsonl's 2 prompts" in images.source
