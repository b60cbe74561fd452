"""The external engines' side of a LoRA sync (trainer.lora.rank > 0; docs/lora.md): the trainer's
adapters become one PEFT adapter directory per sync, which vLLM (a LoRARequest) and SGLang
(/load_lora_adapter) load by path.

    dirs = AdapterDirs(cfg.lora, arch, root=None)      # a temporary directory (or under root: one the server reads)
    adapter = dirs.write(synced)                       # Adapter(name "miles-lora-1", number 1, path, keys)
    dirs.check_files(adapter, expected_checksum)       # what the engine reads is what the trainer sent
    dirs.retire(previous)                              # once the engine serves `adapter`
    dirs.close()

    versions = AdapterVersions(cfg.lora, arch, root)   # every adapter of the run (trainer.lora.adapters)
    versions.swap(versions.write(synced, digest), load, unload)   # new versions in, the previous ones out
    versions.served(ids, prompts)                      # each prompt's current version (check_adapter_ids)

Each sync gets a new name, number and directory, never the previous ones: both engines key their
prefix / radix caches by the adapter (vLLM by name and path, SGLang by the id of each load), so a
new version can never be served from KV computed under the last one, and the engine loads the new
adapter before it lets go of the old (no moment without one).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from miles.config.schema import LoRACfg
from miles.models.lora import ADAPTER_SEPARATOR
from miles.models.lora_peft import WEIGHTS_FILE, write_peft
from miles.transport.checksum import WeightSyncError, checksum

NAME_PREFIX = "miles-lora-"


@dataclass(frozen=True)
class Adapter:
    name: str  # the engine's name for this version ("miles-lora-<number>")
    number: int  # 1, 2, ...: vLLM's lora_int_id (> 0)
    path: Path
    keys: dict[str, str]  # the synced tensor's name -> its name in the file


def adapter_shapes(cfg: LoRACfg, arch) -> dict[str, tuple[int, ...]]:
    """The tensors a sync must carry, by name (miles/models/lora.py's), with their shapes; from a
    meta-device build of the model (no memory)."""
    from miles.models import CausalLM
    from miles.models.lora import find_targets

    with torch.device("meta"):
        model = CausalLM(arch)
    shapes = {}
    for name, linear in find_targets(model, cfg.target_modules):
        shapes[f"{name}.lora_A.weight"] = (cfg.rank, linear.in_features)
        shapes[f"{name}.lora_B.weight"] = (linear.out_features, cfg.rank)
    return shapes


def target_leaves(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The adapted projections' own names (q_proj, down_proj, ...), as servers list target modules."""
    return sorted({name.partition(".lora_")[0].rpartition(".")[2] for name in shapes})


def check_payload(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
                  expected_checksum: str | None) -> None:
    """The sync carries exactly this run's adapters and, with a checksum, the trainer's values."""
    missing, unexpected = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"LoRA sync: the tensors do not match this engine's adapters: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]} (trainer.lora.rank / target_modules differ?)")
    wrong = [f"{k} {tuple(t.shape)} != {shapes[k]}" for k, t in tensors.items() if tuple(t.shape) != shapes[k]]
    if wrong:
        raise ValueError(f"LoRA sync: wrong shapes: {wrong[:3]}")
    if expected_checksum is not None and (sent := checksum(tensors)) != expected_checksum:
        raise WeightSyncError(f"the adapters reached the engine different from what the trainer sent: "
                              f"{sent[:12]} != {expected_checksum[:12]}")


class AdapterDirs:
    """Versioned PEFT adapter directories under `root` (None: a temporary directory of its own,
    removed with this object)."""

    def __init__(self, cfg: LoRACfg, arch, root: str | None = None):
        self.cfg, self.arch = cfg, arch
        self.root = Path(tempfile.mkdtemp(prefix="miles-lora-", dir=root))
        self.count = 0
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.root), True)

    def write(self, tensors: dict[str, torch.Tensor]) -> Adapter:
        self.count += 1
        path = self.root / f"v{self.count}"
        keys = write_peft(tensors, self.cfg.rank, self.cfg.alpha, self.arch, path)
        return Adapter(f"{NAME_PREFIX}{self.count}", self.count, path, keys)

    @staticmethod
    def check_files(adapter: Adapter, expected_checksum: str) -> None:
        """The adapter file, read back from disk as the engine reads it, holds what the trainer sent
        (its checksum, under the synced names)."""
        stored = load_file(str(adapter.path / WEIGHTS_FILE))
        held = checksum({name: stored[key] for name, key in adapter.keys.items()})
        if held != expected_checksum:
            raise WeightSyncError(f"the adapter file {adapter.path / WEIGHTS_FILE} holds other values than the "
                                  f"trainer sent: {held[:12]} != {expected_checksum[:12]}")

    @staticmethod
    def retire(adapter: Adapter | None) -> None:
        if adapter is not None:
            shutil.rmtree(adapter.path, ignore_errors=True)

    def close(self) -> None:
        self._finalizer()


def check_adapter_ids(names: list[str], ids: list[int] | None, prompts: int) -> None:
    """generate's `adapters` (NativeEngine's rule): an engine of named adapters (trainer.lora.adapters)
    needs one id per prompt, an engine without takes none."""
    if not names:
        if ids is not None:
            raise ValueError("generate: adapters given to an engine without named LoRA adapters "
                             "(trainer.lora.adapters)")
        return
    if ids is None or len(ids) != prompts:
        got = "none" if ids is None else len(ids)
        raise ValueError(f"generate: one LoRA adapter id per prompt (trainer.lora.adapters={names}), got {got} "
                         f"for {prompts} prompts")
    if bad := sorted({a for a in ids if not 0 <= a < len(names)}):
        raise ValueError(f"generate: adapter ids {bad} out of range for {len(names)} adapters")


class AdapterVersions:
    """The adapter versions an external engine serves, one per adapter of the run (trainer.lora.adapters'
    order; the run's one adapter without names): each sync writes every adapter as a PEFT directory
    of its own, under a name and number no earlier version had. Shared by vLLM and SGLang."""

    def __init__(self, cfg: LoRACfg, arch, root: str | None = None):
        self.names = list(cfg.adapters)
        # Each adapter's tensors in the sync's payload: "<adapter>/<module>..." (LoRA.tensors()); unnamed: as is.
        self.prefixes = [f"{name}{ADAPTER_SEPARATOR}" for name in self.names] or [""]
        one = adapter_shapes(cfg, arch)
        self.shapes = {prefix + k: shape for prefix in self.prefixes for k, shape in one.items()}
        self.dirs = AdapterDirs(cfg, arch, root)
        self.current: list[Adapter | None] = [None] * len(self.prefixes)  # None: not synced yet (the base model)

    def split(self, tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """The payload as one dict per adapter, under the module names its PEFT file maps."""
        return [{k[len(p):]: t for k, t in tensors.items() if k.startswith(p)} for p in self.prefixes]

    def write(self, tensors: dict[str, torch.Tensor], expected_checksum: str | None) -> list[Adapter]:
        """Check the payload (miles/rollout/adapter_files.py) and write each adapter's new version."""
        check_payload(tensors, self.shapes, expected_checksum)
        written = []
        try:
            for k, part in enumerate(self.split(tensors)):
                adapter = self.dirs.write(part)
                if self.names:  # the engine's logs and errors say which adapter a version is
                    adapter = replace(adapter, name=f"{NAME_PREFIX}{self.names[k]}-{adapter.number}")
                written.append(adapter)
        except BaseException:
            self.retire(written)
            raise
        return written

    def swap(self, new: list[Adapter], load, unload) -> None:
        """Serve `new`, adapter by adapter: load(version), then unload(previous) and its
        directory removed, so no adapter is ever without a version and the engine holds at most one
        version more than it serves. A failed load raises with `current` saying what is served
        (the adapters before it swapped) and the versions not loaded removed."""
        for k, adapter in enumerate(new):
            try:
                load(adapter)
            except BaseException:
                self.retire(new[k:])
                raise
            previous, self.current[k] = self.current[k], adapter
            if previous is not None:
                unload(previous)
                self.dirs.retire(previous)

    def served(self, ids: list[int] | None, prompts: int) -> list[Adapter | None]:
        """Each prompt's current version (ids: its adapter, check_adapter_ids; None: the run's one)."""
        check_adapter_ids(self.names, ids, prompts)
        return [self.current[k] for k in ids] if self.names else [self.current[0]] * prompts

    def retire(self, adapters: list[Adapter]) -> None:
        for adapter in adapters:
            self.dirs.retire(adapter)

    def close(self) -> None:
        self.dirs.close()
