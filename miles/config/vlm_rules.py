"""What a vision-language model (a vision block: model=qwen2_5_vl_*, qwen3_vl_*, glm4_5v,
glm4v_moe_tiny) and the image tasks combine with, checked before anything starts (docs/vlm.md).
What is refused here is not wired for images yet; each message names the key to change."""

from __future__ import annotations

import json
from pathlib import Path

from miles.config.schema import RunCfg, TaskKind

IMAGE_TASKS = (TaskKind.images, TaskKind.shape_count)


def is_vlm(cfg: RunCfg) -> bool:
    """Whether the run's model has a vision tower (its config.json when model.hf_checkpoint is set)."""
    path = Path(cfg.model.hf_checkpoint or "") / "config.json"
    if cfg.model.hf_checkpoint is not None and path.is_file():
        return "vision_config" in json.loads(path.read_text())
    return cfg.model.vision is not None


def vlm_problems(cfg: RunCfg) -> list[str]:
    t, r, a = cfg.task, cfg.rollout, cfg.algo
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
        (r.engine != "native", f"rollout={r.engine.value} does not take images yet: set rollout=native"),
        (r.num_engines > 1, "rollout.num_engines > 1 does not route images yet: set 1"),
        (r.slot_decode is True, "rollout.slot_decode=true: a VLM decodes on the padded path; set rollout.slot_decode=null"),
        (r.speculative.kind != "none", "rollout.speculative.kind must be none (no draft with images yet)"),
        (cfg.true_on_policy, "true_on_policy=true is not wired for the vision tower yet: set false"),
        (cfg.trainer.backend != "torch", f"trainer={cfg.trainer.backend.value} does not take images yet: set trainer=torch"),
        (bool(t.tools), "task.tools (multi-turn) does not carry images yet: set task.tools=[]"),
        (a.advantage == "gae", "algo.advantage=gae: the critic does not take images yet; use e.g. algo=grpo"),
        (a.opd_kl_coef > 0, "on-policy distillation with images is not wired yet: set algo.opd_kl_coef=0"),
        (cfg.debug.save_rollouts is not None or cfg.debug.load_rollouts is not None,
         "debug.save_rollouts / load_rollouts do not store images yet: set them to null"),
    ]
    return problems + [f"{cfg.model.name} is a vision-language model: {message}" for bad, message in refused if bad]
