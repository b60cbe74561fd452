"""Images through real vLLM (its CPU build's Qwen2.5-VL) against the native engine on the same fp32
weights of a tiny random Qwen2.5-VL: greedy outputs equal, sampled-token log-probs equal to the native
model's forward with the images (tolerance as tests/vllm/test_vllm_vs_native.py), before and after an
update of the decoder and the tower (checked by read-back), and after one of the tower alone (vLLM's
encoder cache must not serve old image features); a wrong checksum refused. Then 2 GRPO steps of the
visual task through launch.py (rollout=vllm, ray.enabled=false, the tower trained) with the trainer's
log-probs equal to vLLM's.

The tiny model's heads are 32 wide here (conf/model/qwen2_5_vl_tiny.yaml has 16): vLLM's CPU attention
takes head sizes 32, 64, ... only.

Needs torchvision that imports: vLLM 0.32's Qwen-VL models import transformers' torchvision image
processors. `make vllm-env` uninstalls PyPI's torchvision (a CUDA build: beside torch 2.13.0+cpu its C
ops do not load and `import torchvision` fails, "operator torchvision::nms does not exist"), so in
.venv-vllm this module skips, saying so. Run here with PyPI's torchvision 0.28.0 on PYTHONPATH and the
two op names it registers unguarded (nms, qnms) given a schema first (a sitecustomize.py); docs/rollout.md.
"""

import json
from pathlib import Path

import pytest
import torch

from vllm_tier import HAVE_VLLM, KV_CACHE_GB, NEEDS_VLLM

if not HAVE_VLLM:
    pytest.skip(NEEDS_VLLM, allow_module_level=True)

from miles.rollout.vllm_rules import torchvision_problem  # noqa: E402

TORCHVISION = torchvision_problem()
if TORCHVISION is not None:
    pytest.skip(TORCHVISION, allow_module_level=True)

pytestmark = pytest.mark.vllm

LOGPROB_ATOL = 2e-5  # as test_vllm_vs_native.py
CFG_KW = dict(max_new_tokens=6, max_prompt_len=80)  # 74-76 prompt tokens, 9 of them the image's
WIDER_HEADS = dict(num_heads=2, head_dim=32, mrope_section=[4, 6, 6])  # vLLM's CPU attention: head size >= 32
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A random tiny Qwen2.5-VL (conf/model/qwen2_5_vl_tiny.yaml, 32-wide heads), its prompt format and
    six encoded shape-count examples (prompt ids with the placeholders widened, pixels)."""
    from omegaconf import OmegaConf

    from miles.config.schema import ModelCfg
    from miles.data import shape_count
    from miles.data.prompt_format import PromptFormat
    from miles.data.tokenizer import TokenizerInfo
    from miles.data.vision_inputs import VisionInputs
    from miles.orchestrate.checkpoints import random_checkpoint

    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg),
                                                OmegaConf.load(ROOT / "conf" / "model" / "qwen2_5_vl_tiny.yaml"),
                                                WIDER_HEADS))
    examples = shape_count.examples(0, "train", 6)
    alphabet = "".join(sorted({c for e in examples for c in e.prompt + e.label}))
    path = str(random_checkpoint(model, alphabet, 0, tmp_path_factory.mktemp("qwen2_5_vl"), chat=True))
    tok = TokenizerInfo.load(path)
    fmt = PromptFormat(tok, apply_chat_template=False, vision=VisionInputs.load(path, tok))
    pairs = [fmt.encode(e) for e in examples]
    return path, [fmt(e) for e in examples], [ids for ids, _ in pairs], [im for _, im in pairs]


@pytest.fixture(scope="module")
def engines(vlm):
    from miles.config.schema import DType, RolloutCfg
    from miles.rollout.native import NativeEngine
    from miles.rollout.vllm_engine import VLLMEngine

    path = vlm[0]
    engine = VLLMEngine(path, RolloutCfg(**CFG_KW), DType.fp32, threads=2, seed=0, kv_cache_gb=KV_CACHE_GB)
    yield engine, NativeEngine(path, RolloutCfg(**CFG_KW), DType.fp32, threads=2, seed=0)
    engine.close()


def generate(engine, vlm, n, temperature, seeds=None):
    _, prompts, ids, images = vlm
    return engine.generate(prompts, ["?"] * len(prompts), n=n, temperature=temperature, prompt_ids=ids,
                           images=images, seeds=seeds)


def max_logprob_diff(engine, native, vlm, temperature):
    """Over vLLM's samples: |its log-probs - the native model's forward on prompt + response with the
    prompt's images| (samples that sampled an image or video token are left out: the forward would take
    it for a placeholder)."""
    from miles.algo.losses import token_logprobs

    images, vision = vlm[3], native.model.config.vision
    diffs = []
    for s in generate(engine, vlm, 3, temperature, seeds=list(range(len(images)))):
        if {vision.image_token_id, vision.video_token_id} & set(s.response_ids):
            continue
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = native.model(ids[:, :-1], pixel_values=images[s.group]["pixel_values"],
                                  image_grid_thw=images[s.group]["image_grid_thw"])
        ref = token_logprobs(logits, ids[:, 1:], temperature)[0][len(s.prompt_ids) - 1:]
        diffs.append((torch.tensor(s.rollout_logprobs) - ref).abs().max().item())
    assert len(diffs) >= 9, "too few samples without an image token to compare"
    return max(diffs)


def greedy(engine, vlm):
    samples = generate(engine, vlm, 2, 0.0)
    return [s.response_ids for s in samples], [s.rollout_logprobs for s in samples], [s.prompt_ids for s in samples]


def perturbed(state, seed, only=None, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) if only is None or k.startswith(only) else v.clone()
            for k, v in state.items()}


def assert_same_as_native(engine, native, vlm):
    (tokens, logprobs, prompts), (want_tokens, want_logprobs, want_prompts) = greedy(engine, vlm), greedy(native, vlm)
    assert tokens == want_tokens and prompts == want_prompts  # vLLM widened the placeholders as Miles did
    assert max(abs(a - b) for x, y in zip(logprobs, want_logprobs) for a, b in zip(x, y)) < LOGPROB_ATOL
    for temperature in (1.0, 0.7):
        assert max_logprob_diff(engine, native, vlm, temperature) < LOGPROB_ATOL
    return tokens


def test_images_equal_native_before_and_after_updates(engines, vlm):
    from miles.transport.checksum import WeightSyncError, checksum

    engine, native = engines
    base = {k: v.clone() for k, v in native.model.state_dict().items()}
    held = engine.held_weights()  # the tower read back too, under the project's names
    assert set(held) == set(base) and all(torch.equal(held[k], base[k]) for k in base)
    before = assert_same_as_native(engine, native, vlm)

    new = perturbed(base, 1)  # decoder and tower, as the trainer sends them with trainer.freeze_vision=false
    assert engine.update_weights(new, checksum(new)) == checksum(new)
    native.update_weights(new)
    after = assert_same_as_native(engine, native, vlm)
    assert after != before

    tower = perturbed(new, 2, only="visual.", scale=0.1)  # the same prompts and images: new features
    assert engine.update_weights(tower, checksum(tower)) == checksum(tower)
    native.update_weights(tower)
    assert assert_same_as_native(engine, native, vlm) != after

    with pytest.raises(WeightSyncError):
        engine.update_weights(new, "0" * 64)


def test_two_grpo_steps_of_the_visual_task(tmp_path):
    """launch.py (in-process, rollout=vllm): the trainer recomputes vLLM's log-probs with the images, every
    sync checked by read-back."""
    import subprocess
    import sys

    args = ["+experiment=shape_count_vlm", "rollout=vllm", "ray.enabled=false", "steps=2", "warm_start.enabled=false",
            "eval.interval=1", "task.eval_size=8", "task.train_size=64", "rollout.batch_size=2",
            "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=8", "trainer.micro_batch_size=8",
            "tracking.log_samples=0", "trainer.freeze_vision=false", f"rollout.vllm.kv_cache_gb={KV_CACHE_GB}",
            *[f"model.{k}={v}".replace(" ", "") for k, v in WIDER_HEADS.items()]]
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    metrics = {}
    for line in (run_dir / "mlflow" / "journal.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry["op"] == "metrics":
            metrics.setdefault(entry["step"], {}).update(entry["metrics"])
    for step in (1, 2):
        assert metrics[step]["mismatch/logprob_abs_diff"] < 1e-4, metrics[step]  # as test_vllm_launch.py
    assert metrics[1]["train/ppo_kl"] == 0.0
