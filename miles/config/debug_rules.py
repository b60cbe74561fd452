"""What the debug modes (`debug.*`, miles/orchestrate/debug.py) combine with, checked before anything
starts, and the layout of saved rollout batches that the check reads."""

from __future__ import annotations

import json
from pathlib import Path

from miles.config.flat import flat_config
from miles.config.schema import AlgoName, RunCfg

META = "rollouts.json"
# A replayed batch must fit the model (token ids), the task (rewards) and the batch invariant.
REPLAY_KEYS = ("model.", "task.", "rollout.batch_size", "rollout.n_samples_per_prompt", "seed")


def step_file(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}.json"


def replay_config(cfg: RunCfg) -> dict[str, str]:
    return {k: v for k, v in flat_config(cfg).items() if k.startswith(REPLAY_KEYS) and k != "model.hf_checkpoint"}


def debug_problems(cfg: RunCfg) -> list[str]:
    """Config problems of the debug modes (called by config_problems())."""
    d, out = cfg.debug, []
    if d.rollout_only and d.train_only:
        out.append("debug.rollout_only and debug.train_only exclude each other")
    if d.train_only and not d.load_rollouts:
        out.append("debug.train_only needs debug.load_rollouts=<dir> (batches saved by debug.save_rollouts)")
    if d.rollout_only and d.load_rollouts:
        out.append("debug.rollout_only generates its rollouts; drop debug.load_rollouts")
    if d.save_rollouts and d.load_rollouts:
        out.append("debug.save_rollouts and debug.load_rollouts exclude each other")
    if cfg.algo.name == AlgoName.sft and (d.rollout_only or d.train_only or d.save_rollouts or d.load_rollouts):
        out.append("debug.rollout_only / train_only / save_rollouts / load_rollouts apply to RL, not algo=sft")
    if d.load_rollouts:
        root = Path(d.load_rollouts)
        if not (root / META).is_file():
            out.append(f"debug.load_rollouts={root} holds no saved rollouts ({META} missing)")
        else:
            saved = json.loads((root / META).read_text())
            diff = [f"{k}: {saved.get(k)} -> {v}" for k, v in replay_config(cfg).items() if saved.get(k) != v]
            if diff:
                out.append(f"debug.load_rollouts={root} was saved with another config (saved -> now): " + "; ".join(diff))
            missing = [s for s in range(1, cfg.steps + 1) if not step_file(root, s).is_file()]
            if missing:
                out.append(f"debug.load_rollouts={root} has no batch for steps {missing[0]}..{missing[-1]} "
                           f"(steps={cfg.steps}); lower steps")
    return out
