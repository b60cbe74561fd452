"""Debug modes (`debug.*`): rollout and training apart, recorded rollouts, a tensor-level sync check.

    python launch.py debug.rollout_only=true debug.save_rollouts=rollouts/   # generate + reward only
    python launch.py debug.train_only=true debug.load_rollouts=rollouts/     # train on them, no engine
    python launch.py debug.load_rollouts=rollouts/                           # replay them, engine for eval
    python launch.py debug.compare_weights_tensorwise=true                            # name tensors a sync got wrong

A saved rollout batch is one JSON file per step, `step_000001.json`: the scored samples exactly as
the trainer received them (token ids, engine log-probs, rewards, groups; a vision-language prompt's
images once per group) and the rollout metrics.
`rollouts.json` beside them records the config they came from; replay refuses another model, task
or batch shape. Replaying the batches of a run reproduces its training bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, replace
from pathlib import Path

import torch

from miles.config.debug_rules import META, replay_config, step_file
from miles.config.schema import RunCfg
from miles.transport.checksum import TORCH_DTYPES, WeightSyncError
from miles.types import FinishReason, Sample, tensor_from_json, tensor_to_json


def save_batch(root: Path, step: int, samples: list[Sample], metrics: dict[str, float]) -> None:
    # A prompt's images once, under its group: its n samples share them (as the engine hands them out).
    images = {str(s.group): {k: tensor_to_json(v) if isinstance(v, torch.Tensor) else v for k, v in s.images.items()}
              for s in samples if s.images is not None}
    data = {"step": step, "metrics": metrics, "images": images,
            "samples": [{**asdict(replace(s, images=None)), "finish_reason": s.finish_reason.value,
                         "routed_experts": tensor_to_json(s.routed_experts),
                         "selected_keys": tensor_to_json(s.selected_keys)} for s in samples]}
    tmp = step_file(root, step).with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, step_file(root, step))  # a replay never reads a half-written batch


def load_batch(root: Path, step: int) -> tuple[list[Sample], dict[str, float]]:
    data = json.loads(step_file(root, step).read_text())
    images = {group: {k: tensor_from_json(v) if isinstance(v, dict) and "data" in v else v for k, v in saved.items()}
              for group, saved in data.get("images", {}).items()}
    samples = [Sample(**{**s, "finish_reason": FinishReason(s["finish_reason"]),
                         "routed_experts": tensor_from_json(s.get("routed_experts")),
                         "selected_keys": tensor_from_json(s.get("selected_keys")),
                         "images": images.get(str(s["group"]))}) for s in data["samples"]]
    return samples, data["metrics"]


def rollout_hook(cfg: RunCfg):
    """The loop's `collect` hook for debug.save_rollouts / debug.load_rollouts (None: generate as usual)."""
    from miles.orchestrate.loop import collect_rollout

    d = cfg.debug
    if d.load_rollouts:
        root = Path(d.load_rollouts)
        return lambda ctx, cfg, step: load_batch(root, step)
    if d.save_rollouts:
        root = Path(d.save_rollouts)
        root.mkdir(parents=True, exist_ok=True)
        (root / META).write_text(json.dumps(replay_config(cfg), indent=1))

        def collect_and_save(ctx, cfg, step):
            samples, metrics = collect_rollout(ctx, cfg)
            save_batch(root, step, samples, metrics)
            return samples, metrics

        return collect_and_save
    return None


# ------------------------------------------------------------------------------ debug.compare_weights_tensorwise

def _digests(tensors: dict) -> dict[str, str]:
    out = {}
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[name] = f"{t.dtype}|{tuple(t.shape)}|{hashlib.sha256(raw).hexdigest()[:16]}"
    return out


def engine_held_digests(engine) -> dict[str, str]:
    """Per tensor: what the engine holds (runs in the engine's process)."""
    if engine.recipe.rollout_quant == "none":
        return _digests(engine.model.state_dict())
    return _digests(engine.recipe.held_tensors(engine.model))


def trainer_expected_digests(trainer) -> dict[str, str]:
    """Per tensor: what the engine must hold after a sync of the trainer's current weights."""
    payload, _ = trainer.get_weights()
    if trainer.recipe.rollout_quant == "none":
        return _digests(payload)
    dtype = TORCH_DTYPES[trainer.precision.rollout_dtype]
    return _digests(trainer.recipe.expected_tensors(payload, trainer.model, dtype))


def check_sync_tensors(ctx) -> None:
    """The `after_sync` hook of debug.compare_weights_tensorwise: raise WeightSyncError naming every tensor
    whose dtype, shape or bytes differ between the engine and the trainer."""
    held = ctx.engine.apply(engine_held_digests)
    expected = ctx.trainer.apply(trainer_expected_digests)
    bad = [f"{name} (engine {held.get(name, 'missing')} vs trainer {expected.get(name, 'missing')})"
           for name in sorted(set(held) | set(expected)) if held.get(name) != expected.get(name)]
    if bad:
        raise WeightSyncError(f"{len(bad)} of {len(expected)} tensors differ after weight sync: " + "; ".join(bad[:8]))
