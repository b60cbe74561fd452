"""What a vision-language model (a vision block: model=qwen2_5_vl_*, qwen3_vl_*, glm4_5v,
glm4v_moe_tiny) and the image tasks combine with, checked before anything starts (docs/vlm.md).
What is refused here is not wired for images yet; each message names the key to change. Rollout
engines with images: native (every family), sglang and vllm (Qwen2.5-VL; vLLM where torchvision
imports: miles/rollout/vllm_rules.py; docs/rollout.md)."""

from __future__ import annotations

import json
from pathlib import Path

from miles.config.schema import RunCfg, TaskKind

IMAGE_TASKS = (TaskKind.images, TaskKind.shape_count)


# Vision-language families rollout=sglang serves: Qwen2.5-VL, whose tower's layout in SGLang 0.5.23
# (qwen2_5_vl.py) the checked sync predicts (miles/rollout/sglang_engine.py sglang_vision_layout).
SGLANG_FAMILIES = ("qwen2_5_vl",)


def _checkpoint_config(cfg: RunCfg) -> dict | None:
    path = Path(cfg.model.hf_checkpoint or "") / "config.json"
    return json.loads(path.read_text()) if cfg.model.hf_checkpoint is not None and path.is_file() else None


def is_vlm(cfg: RunCfg) -> bool:
    """Whether the run's model has a vision tower (its config.json when model.hf_checkpoint is set)."""
    config = _checkpoint_config(cfg)
    return "vision_config" in config if config is not None else cfg.model.vision is not None


def family(cfg: RunCfg) -> str:
    """The model's family: its checkpoint's model_type, else the config's."""
    config = _checkpoint_config(cfg)
    return config.get("model_type", cfg.model.family) if config is not None else cfg.model.family


def vlm_problems(cfg: RunCfg) -> list[str]:
    t, r = cfg.task, cfg.rollout
    vlm = is_vlm(cfg)
    problems = []
    if t.kind in IMAGE_TASKS and not vlm:
        problems.append(f"task.kind={t.kind.value} has images, model={cfg.model.name} has no vision tower: "
                        "use a vision-language model (model=qwen2_5_vl_tiny, qwen3_vl_tiny, qwen3_vl_moe_tiny or "
                        "glm4v_moe_tiny, or a Qwen2.5-VL / Qwen3-VL / GLM-4.5V model.hf_checkpoint)")
    if t.kind == TaskKind.images and not t.train_file:
        problems.append("task.train_file must be set when task.kind=images")
    if t.kind == TaskKind.shape_count and t.train_size < 1:
        problems.append(f"task.train_size must be >= 1 (got {t.train_size})")
    if not vlm:
        return problems
    refused = [  # (refused, what to change)
        (r.engine == "sglang" and family(cfg) not in SGLANG_FAMILIES,
         f"rollout=sglang takes images for {', '.join(SGLANG_FAMILIES)} only (its tower's layout in SGLang is "
         f"what the checked sync predicts; {family(cfg)}'s is not): set rollout=native"),
        (r.slot_decode is True, "rollout.slot_decode=true: a VLM decodes on the padded path; set rollout.slot_decode=null"),
        (r.speculative.kind != "none", "rollout.speculative.kind must be none (no draft with images yet)"),
        # True on-policy is exact on the CPU (tests/integration/test_vlm_runs.py); a GPU decodes VLMs on the
        # padded path, not the slot layout its batch-invariant kernels need (miles/config/rules.py).
        (cfg.true_on_policy and cfg.hardware.device != "cpu",
         "true_on_policy=true on a GPU needs the slot decode, and VLMs decode padded: run it with hardware=cpu"),
        (cfg.trainer.backend not in ("torch", "fsdp"), f"trainer={cfg.trainer.backend.value} does not take images yet: set trainer=torch"),
        (bool(t.tools), "task.tools (multi-turn) does not carry images yet: set task.tools=[]"),
    ]
    # rollout=vllm's own limits with images are its rules' (miles/rollout/vllm_rules.py, run by miles/validate.py).
    return problems + [f"{cfg.model.name} is a vision-language model: {message}" for bad, message in refused if bad]
