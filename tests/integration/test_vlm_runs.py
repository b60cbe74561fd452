"""Vision-language runs through launch.py (tiny Qwen2.5-VL, docs/vlm.md):

- 2 GRPO steps of the visual task, in-process and with Ray actors: the trainer recomputes the
  engine's log-probs with the images (mismatch ~1e-7 in fp32), the first step's ppo_kl is 0, and
  the final checkpoint is a Qwen2.5-VL one with its image processor;
- LoRA with images: the decoder's adapters train and sync, exported for PEFT;
- video records (frame directories) through the same run;
- image prompt files (task.kind=images): a missing image exits 2 naming the file and the line;
- true on-policy with images: exactly 0.0 mismatch (the vision tower under the invariant kernels too);
- PPO with images: the critic's value model takes them too and trains; distillation from a VLM
  teacher: the teacher reads the images too;
- combinations not wired for images exit 2 naming the key;
- the preset learns (learning tier): held-out accuracy at the last step +0.15 over the warm start's (the
  step-0 eval, so the gain is RL's), within 15 minutes including the warm start.
"""

import json
import time
from pathlib import Path

import pytest

from launch_cli import run_launch
from runs import journal_metrics

pytestmark = pytest.mark.slow

TINY = ["+experiment=shape_count_vlm", "steps=2", "warm_start.enabled=false", "eval.interval=1",
        "task.eval_size=8", "task.train_size=64", "rollout.batch_size=2", "rollout.n_samples_per_prompt=4",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=8", "tracking.log_samples=0"]


# With Ray on: test_an_engine_fleet_with_images_on_ray below does it in make test; the one-engine case
# is in the extended tier.
@pytest.mark.parametrize("ray", ["false", pytest.param("true", marks=pytest.mark.extended)], ids=["in_process", "ray"])
def test_two_steps_with_images(tmp_path, ray):
    proc = run_launch([*TINY, f"ray.enabled={ray}"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    metrics = journal_metrics(run_dir)
    for step in (1, 2):
        assert metrics[step]["mismatch/logprob_abs_diff"] < 1e-5, metrics[step]
        assert "eval/shape_count/accuracy" in metrics[step]
    assert metrics[1]["train/ppo_kl"] == 0.0
    final = run_dir / "checkpoint"
    assert json.loads((final / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    assert (final / "preprocessor_config.json").is_file()


@pytest.mark.no_ray
def test_lora_on_a_vlm_trains_the_decoder_adapters_with_images(tmp_path):
    """trainer.lora with images (in-process): the engine's adapted log-probs with the images equal the
    trainer's after each sync, and the run exports the decoder's adapter in PEFT's format under
    transformers' module names (tests/unit/models/test_vlm_lora.py: PEFT loads it on the model)."""
    proc = run_launch([*TINY, "ray.enabled=false", "trainer.lora.rank=8", "trainer.lr=3e-3"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    metrics = journal_metrics(run_dir)
    for step in (1, 2):
        assert metrics[step]["mismatch/logprob_abs_diff"] < 1e-5, metrics[step]
    config = json.loads((run_dir / "checkpoint" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and all(t.startswith("model.language_model.layers.") for t in config["target_modules"])


def test_an_engine_fleet_with_images_on_ray(tmp_path):
    """rollout.num_engines=2 with images: each prompt's pixels travel with its chunk to the engine actor
    that runs it (tests/unit/rollout/test_vlm_rollout.py: a fleet's samples are one engine's)."""
    proc = run_launch([*TINY, "ray.enabled=true", "rollout.num_engines=2"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    metrics = journal_metrics(run_dir)
    assert all(metrics[step]["mismatch/logprob_abs_diff"] < 1e-5 for step in (1, 2))


def _video_records(directory) -> str:
    """8 records, each a 4-frame video (a red square moving left or right) and a question."""
    from PIL import Image, ImageDraw

    records = []
    for i in range(8):
        clip = directory / "clips" / f"{i:02d}"
        clip.mkdir(parents=True)
        for f in range(4):
            frame = Image.new("RGB", (56, 56), "white")
            x = 8 + 10 * f if i % 2 else 38 - 10 * f
            ImageDraw.Draw(frame).rectangle([x, 20, x + 12, 32], fill="red")
            frame.save(clip / f"frame_{f}.png")
        content = [{"type": "video", "video": f"clips/{i:02d}", "fps": 2}, {"type": "text", "text": "Which way?"}]
        records.append({"prompt": [{"role": "user", "content": content}], "label": "right" if i % 2 else "left"})
    path = directory / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.no_ray
def test_two_steps_with_videos(tmp_path):
    """Video records (frame directories) through the native engine and the torch trainer, in-process:
    the trainer recomputes the engine's log-probs with the videos (tests/unit/rollout/
    test_vlm_video_rollout.py checks both against transformers)."""
    data = _video_records(tmp_path / "data")
    proc = run_launch([*TINY, "ray.enabled=false", "task.kind=images", f"task.train_file={data}",
                       f"task.eval_file={data}"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    metrics = journal_metrics(run_dir)
    for step in (1, 2):
        assert metrics[step]["mismatch/logprob_abs_diff"] < 1e-5, metrics[step]
    assert metrics[1]["train/ppo_kl"] == 0.0


@pytest.mark.no_ray
@pytest.mark.parametrize("model, precision", [pytest.param("qwen2_5_vl_tiny", "fp32", marks=pytest.mark.extended),
                                              ("qwen3_vl_moe_tiny", "bf16")])
def test_true_on_policy_with_images_is_exact(tmp_path, model, precision):
    """true_on_policy=true: the vision tower runs under the batch-invariant kernels on both sides
    too, so the log-probs of the sampled tokens are the engine's bit for bit on every step (0.0; the
    same runs without the mode measured 4.5e-8 - 8.2e-8)."""
    proc = run_launch([*TINY, "ray.enabled=false", f"model={model}", f"precision={precision}", "true_on_policy=true",
                       "steps=3", "eval.interval=100", "algo.entropy_coef=0.01"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    metrics = journal_metrics(run_dir)
    assert [metrics[s]["mismatch/logprob_abs_diff"] for s in (1, 2, 3)] == [0.0, 0.0, 0.0]
    assert all(metrics[s]["train/grad_norm"] > 0 for s in (1, 2))


@pytest.mark.no_ray
def test_ppo_with_images_fits_the_critic(tmp_path):
    """algo=ppo (GAE) through launch.py: the critic's value model forwards the images too
    (tests/unit/rollout/test_vlm_rollout.py checks that its values depend on them): it gets a gradient
    at every step, and the values GAE uses move off the zero-initialised head's after the first fit."""
    proc = run_launch([*TINY, "ray.enabled=false", "algo=ppo", "steps=3", "eval.interval=100"], cwd=tmp_path,
                      timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    metrics = journal_metrics(run_dir)
    assert all(metrics[s]["critic/grad_norm"] > 0 for s in (1, 2, 3))
    assert metrics[1]["critic/value_mean"] == 0.0 and metrics[2]["critic/value_mean"] != 0.0


@pytest.mark.no_ray
def test_distillation_from_a_vision_language_teacher_reads_the_images(tmp_path):
    """algo=opd with a VLM teacher: the teacher's forward takes each sample's images as the student's
    does, so a teacher with the student's own weights gives a reverse KL of exactly 0.0 (a forward
    without the images would not)."""
    from omegaconf import OmegaConf

    from miles.config.schema import ModelCfg
    from miles.data import shape_count
    from miles.orchestrate.checkpoints import random_checkpoint

    conf = Path(__file__).resolve().parents[2] / "conf" / "model" / "qwen2_5_vl_tiny.yaml"
    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(conf)))
    examples = shape_count.examples(0, "train", 64) + shape_count.examples(0, "eval", 8, train_size=64)
    alphabet = "".join(sorted({c for e in examples for c in e.prompt + e.label}))
    ckpt = random_checkpoint(model, alphabet, 0, tmp_path / "ckpt", chat=True)
    proc = run_launch([*TINY, "ray.enabled=false", "algo=opd", f"algo.teacher_checkpoint={ckpt}",
                       f"model.hf_checkpoint={ckpt}", "eval.interval=100"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    metrics = journal_metrics(run_dir)
    assert [metrics[s]["train/reverse_kl"] for s in (1, 2)] == [0.0, 0.0]


@pytest.mark.no_ray
def test_missing_image_exits_2_with_file_and_line(tmp_path):
    from miles.data.shape_count import split_scenes, write_split

    path = write_split(tmp_path / "data", split_scenes(0, "train", 3), "train")
    (tmp_path / "data" / "train" / "00001.png").unlink()
    proc = run_launch(["+experiment=shape_count_vlm", "task.kind=images", f"task.train_file={path}",
                       "ray.enabled=false", "warm_start.enabled=false"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "train.jsonl, line 2" in proc.stderr and "00001.png" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("override, expected", [
    ("rollout=vllm", "rollout=vllm does not take images yet: set rollout=native"),
    ("true_on_policy=true hardware=gpu", "true_on_policy=true on a GPU needs the slot decode, and VLMs decode padded"),
    ("model=qwen3_tiny", "task.kind=shape_count has images, model=qwen3_tiny has no vision tower"),
])
@pytest.mark.no_ray
def test_unsupported_combinations_exit_2(tmp_path, override, expected):
    proc = run_launch(["+experiment=shape_count_vlm", *override.split(), "dry_run=true"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert expected in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.learning
def test_preset_learns_within_15_minutes(tmp_path):
    start = time.perf_counter()
    proc = run_launch(["+experiment=shape_count_vlm", "ray.enabled=false", f"warm_start.cache_dir={tmp_path / 'c'}"],
                      cwd=tmp_path, timeout=1800)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    accuracy = {s: m["eval/shape_count/accuracy"] for s, m in journal_metrics(run_dir).items()
                if "eval/shape_count/accuracy" in m}
    assert elapsed < 15 * 60, elapsed
    assert accuracy[max(accuracy)] >= accuracy[0] + 0.15, accuracy
