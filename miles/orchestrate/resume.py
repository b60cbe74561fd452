"""Resume checkpoints: everything a run needs to continue as if it had never stopped.

    <checkpoint.dir>/step_000004/
        model/       the trainer's policy, HF format (loadable with model.hf_checkpoint=...)
        trainer.pt   optimizer state, torch RNG of the trainer's process
        engine.pt    the engine's sampling generator, torch RNG of its process
        critic.pt    PPO only: the value model's weights and optimizer state, torch RNG (with several
                     LoRA adapters a critic each: critic-<adapter>.pt)
        driver.pt    Python / NumPy / torch RNG of the driver
        meta.json    step, data position (PromptSource.state), last eval, the run's flattened config;
                     written last

A checkpoint is written into a hidden temp dir and renamed into place, so `latest()` never sees a
half-written one. The frozen KL reference is not saved: it is the initial policy, rebuilt from the
same initial checkpoint, which the identity keys (model, algo, task, seed, warm start) pin down.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from miles.config.flat import flat_config
from miles.config.schema import RunCfg
from miles.config.errors import ConfigError

# A resumed run must train the same model on the same data with the same algorithm from the same
# initial weights; anything else (steps, lr, eval interval, tracking, ...) may change.
IDENTITY_PREFIXES = ("model.", "algo.", "task.", "warm_start.", "seed")
NOT_IDENTITY = ("warm_start.cache_dir", "task.eval_size")  # where the cache lives; the eval set's size
VOLATILE = ("output_dir", "checkpoint.dir")  # differ on every run; not worth a note
STEP_PREFIX = "step_"


def identity_diff(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    """'key: saved -> now' for every identity key that differs (absent keys included)."""
    keys = sorted(k for k in set(saved) | set(now) if k.startswith(IDENTITY_PREFIXES) and k not in NOT_IDENTITY)
    return [f"{k}: {saved.get(k, '<absent>')} -> {now.get(k, '<absent>')}" for k in keys if saved.get(k) != now.get(k)]


def writable_problem(path: Path, key: str) -> str | None:
    """None if `path` can be created and written to; else a message naming the config key."""
    probe = path / f".miles-write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as ex:
        return f"{key}={path} is not writable: {ex.strerror or ex}"
    return None


class CheckpointStore:
    def __init__(self, root: Path, keep_last: int, enabled: bool = True):
        self.root, self.keep_last, self.enabled = root, keep_last, enabled

    @classmethod
    def prepare(cls, cfg: RunCfg, run_dir: Path) -> "CheckpointStore":
        """Check, before anything is written, that the run can save what it must and that the
        checkpoint it would resume from belongs to this config; raise ConfigError (exit 2) if not."""
        d = cfg.debug
        # Without both components there is no complete state to save (debug modes).
        enabled = cfg.checkpoint.enabled and not (d.rollout_only or d.train_only)
        store = cls(Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints",
                    cfg.checkpoint.keep_last, enabled)
        dirs = [(run_dir, "hydra.run.dir")]
        if enabled:
            dirs.append((store.root, "checkpoint.dir"))
        if d.save_rollouts:
            dirs.append((Path(d.save_rollouts), "debug.save_rollouts"))
        problems = [p for path, key in dirs if (p := writable_problem(path, key))]
        if problems:
            raise ConfigError(problems)
        latest = store.latest()
        if latest is not None:
            meta = read_meta(latest)
            diff = identity_diff(meta["config"], flat_config(cfg))
            if diff:
                raise ConfigError([
                    f"checkpoint.dir={store.root} holds a checkpoint (step {meta['step']}) of a different "
                    f"model / algorithm / task; differing keys (checkpoint -> now):\n      " + "\n      ".join(diff)
                    + "\n    resume with the checkpoint's values, or set another checkpoint.dir (nothing was changed)"
                ])
            if meta["step"] > cfg.steps:
                raise ConfigError([f"checkpoint.dir={store.root} holds step {meta['step']}, past steps={cfg.steps}; "
                                   f"set steps >= {meta['step']} or another checkpoint.dir"])
        return store

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints (meta.json present), oldest first; temp dirs are never listed."""
        if not self.enabled or not self.root.is_dir():
            return []
        found = [p for p in self.root.glob(f"{STEP_PREFIX}*") if (p / "meta.json").is_file()]
        return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, write, meta: dict) -> Path:
        """`write(tmp_dir)` writes the component files; meta.json goes last, then one rename publishes
        the checkpoint. An existing checkpoint of the same step is replaced only after that."""
        final = self.root / f"{STEP_PREFIX}{step:06d}"
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        save_driver_rng(tmp / "driver.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
        if final.exists():
            old = self.root / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        for stale in self.checkpoints()[: -self.keep_last]:
            shutil.rmtree(stale)
        return final


def read_meta(path: Path) -> dict:
    return json.loads((path / "meta.json").read_text())


# ------------------------------------------------------------------------------ component state
# These run where the component lives (handle.apply): in-process, or inside its Ray actor.

def save_component_state(component, path: str, name: str) -> None:
    """A component with an optimizer (trainer, critic) saves its model and optimizer (a policy as
    an HF-format dir, `model/`; a value model inside its .pt); one with a sampling generator (the
    engine) saves that; each saves the torch RNG of its process. A trainer with a speculative draft
    (`draft` not None) adds its state, key "draft" (optimizer; a separate draft model's weights)."""
    from miles.models import CausalLM, save_pretrained

    if hasattr(component, "parts"):  # a component per adapter (miles.trainer.critic.Critics): a file each
        for key, part in component.parts.items():
            save_component_state(part, path, f"{name}-{key}")
        return
    if hasattr(component, "save_state"):  # a trainer (miles.trainer.protocol): model/ and its own files
        component.save_state(path)
        return
    state: dict = {"torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    if getattr(component, "optimizer", None) is not None:
        if isinstance(component.model, CausalLM):
            save_pretrained(component.model, Path(path) / "model")
        else:
            state["model"] = component.model.state_dict()
        state["optimizer"] = component.optimizer.state_dict()
    if getattr(component, "draft", None) is not None:
        state["draft"] = component.draft.state_dict()
    if getattr(component, "generator", None) is not None:
        state["generator"] = component.generator.get_state()
    torch.save(state, Path(path) / f"{name}.pt")


def load_component_state(component, path: str, name: str) -> None:
    from miles.models import from_pretrained

    if hasattr(component, "parts"):  # see save_component_state
        for key, part in component.parts.items():
            load_component_state(part, path, f"{name}-{key}")
        return
    if hasattr(component, "load_state"):  # a trainer (see save_component_state)
        component.load_state(path)
        return
    state = torch.load(Path(path) / f"{name}.pt", weights_only=True)
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    if "optimizer" in state:
        if "model" in state:
            component.model.load_state_dict(state["model"])
        else:
            saved = from_pretrained(Path(path) / "model", dtype=next(component.model.parameters()).dtype)
            component.model.load_state_dict(saved.state_dict())
        component.optimizer.load_state_dict(state["optimizer"])
    # A checkpoint without a draft's state (the draft enabled since): the draft starts afresh.
    if "draft" in state and getattr(component, "draft", None) is not None:
        component.draft.load_state_dict(state["draft"])
    if "generator" in state:
        component.generator.set_state(state["generator"])


def model_digest(component) -> str:
    """Checksum of the component's model weights (tests and logs compare runs by it)."""
    from miles.transport.checksum import checksum

    return checksum(component.model.state_dict())


# ------------------------------------------------------------------------------ driver RNG

def save_driver_rng(path: Path) -> None:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    torch.save({"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
                "torch": torch.get_rng_state()}, path)


def load_driver_rng(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
