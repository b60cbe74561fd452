"""The SGLang engine's side of LoRA (trainer.lora.rank > 0; docs/lora.md): the trainer's adapters served
through SGLang's documented adapter API, the server's base weights never touched.

    server_args = {**server_lora_args(cfg.lora, shapes), ...}   # --enable-lora --max-lora-rank --lora-target-modules
    adapters = SGLangAdapters(engine._post_ok, cfg.lora, arch, root=weights_dir)
    adapters.load(synced, expected_checksum)      # POST /load_lora_adapter {lora_name, lora_path}, then
                                                  # /unload_lora_adapter {lora_name} of the previous version
    body["lora_path"] = [adapters.name] * rows    # in every /generate (None before the first sync: the base)

Each sync writes a PEFT adapter directory (miles/rollout/adapter_files.py) where the server reads it
(rollout.sglang.weights_dir; a temporary directory by default: the server must be on this host's
file system) and loads it under a new name; the previous version is unloaded after the new one
loaded (SGLang's unload waits for the requests that still use it). SGLang refuses to load a name
it already has ("LoRA with name ... already exists"), and a new name is a new lora_id, which keys
SGLang's radix cache, so no KV of the last version is reused.

The checked sync covers the payload (its checksum), the files the server reads (read back and
hashed as the trainer hashed the adapters) and the server's answer (`loaded_adapters` names this
version at this path). SGLang has no endpoint that returns the adapter it holds (/weights_checker
hashes the model's parameters, not its LoRA memory pool), so what the server computed from the files
is not compared: that is the difference with vLLM's read-back (miles/rollout/vllm_lora.py).

SGLang does not run on the machines this was written on: tests/unit/rollout/test_sglang_lora.py drives
this against the stand-in server (tests/unit/rollout/sglang_standin.py, NOT SGLang), which implements
the endpoints' schemas over the native engine's LoRA module.
"""

from __future__ import annotations

import torch

from miles.config.schema import EngineName, LoRACfg, RunCfg
from miles.rollout.adapter_files import Adapter, AdapterDirs, adapter_shapes, check_payload, target_leaves
from miles.rollout.vllm_lora import VLLM_LORA_FAMILIES
from miles.transport.checksum import WeightSyncError


def sglang_lora_problems(cfg: RunCfg) -> list[str]:
    """trainer.lora with rollout=sglang, checked before anything starts (miles/validate.py runs this
    with the config's rules): SGLang serves the adapters through its own LoRA support on the dense
    families whose projections it wraps as the project's adapters do, the list vLLM's serve too."""
    lora_on_sglang = cfg.trainer.lora.rank > 0 and cfg.rollout.engine == EngineName.sglang
    if not lora_on_sglang:
        return []
    problems = []
    if cfg.model.family not in VLLM_LORA_FAMILIES:
        problems.append(f"trainer.lora with rollout=sglang serves adapters on the families "
                        f"{', '.join(VLLM_LORA_FAMILIES)} (model family {cfg.model.family} is not one): use "
                        "rollout=native or trainer.lora.rank=0")
    if cfg.trainer.lora.adapters:
        problems.append(f"trainer.lora.adapters={list(cfg.trainer.lora.adapters)} with rollout=sglang: this engine "
                        "serves the run's one adapter (one lora_path for every row), not several routed per "
                        "prompt yet: use rollout=native or trainer.lora.adapters=[]")
    return problems


def server_lora_args(cfg: LoRACfg, shapes: dict) -> dict:
    """ServerArgs fields for dynamically loaded adapters of this rank on these projections (SGLang
    sizes its LoRA memory pool by them at launch)."""
    return {"enable_lora": True, "max_lora_rank": cfg.rank, "lora_target_modules": target_leaves(shapes)}


def server_problems(info: dict, cfg: LoRACfg, shapes: dict, url: str) -> list[str]:
    """What a running server (its /server_info) lacks to serve this run's adapters."""
    flags = (f"--enable-lora --max-lora-rank {cfg.rank} --lora-target-modules {' '.join(target_leaves(shapes))}")
    if not info.get("enable_lora"):
        return [f"trainer.lora with rollout=sglang: the server at {url} runs without LoRA: start it with {flags}"]
    problems = []
    if info.get("max_lora_rank") is not None and int(info["max_lora_rank"]) < cfg.rank:
        problems.append(f"the server at {url} has --max-lora-rank {info['max_lora_rank']} < trainer.lora.rank="
                        f"{cfg.rank}: start it with {flags}")
    served = info.get("lora_target_modules")
    if served and "all" not in served and (missing := sorted(set(target_leaves(shapes)) - set(served))):
        problems.append(f"the server at {url} serves LoRA on {sorted(served)}, not {missing}: start it with {flags}")
    return problems


class SGLangAdapters:
    def __init__(self, post_ok, cfg: LoRACfg, arch, root: str | None = None):
        """post_ok(path, body) -> the answer, raising on HTTP errors and success=false (SGLangEngine._post_ok)."""
        self.post_ok, self.cfg = post_ok, cfg
        self.shapes = adapter_shapes(cfg, arch)
        self.dirs = AdapterDirs(cfg, arch, root)
        self.current: Adapter | None = None

    @property
    def name(self) -> str | None:
        """The adapter every /generate row names; None before the first sync (the base model)."""
        return self.current.name if self.current is not None else None

    def load(self, tensors: dict[str, torch.Tensor], expected_checksum: str | None) -> str:
        check_payload(tensors, self.shapes, expected_checksum)
        adapter = self.dirs.write(tensors)
        try:
            if expected_checksum is not None:
                self.dirs.check_files(adapter, expected_checksum)
            answer = self.post_ok("/load_lora_adapter", {"lora_name": adapter.name, "lora_path": str(adapter.path)})
        except BaseException:
            self.dirs.retire(adapter)
            raise
        previous, self.current = self.current, adapter
        if previous is not None:
            self.post_ok("/unload_lora_adapter", {"lora_name": previous.name})
            self.dirs.retire(previous)
        if expected_checksum is None:
            return ""
        held = (answer.get("loaded_adapters") or {}).get(adapter.name)
        held = held.get("lora_path") if isinstance(held, dict) else held  # a name -> path map, or LoRARefs
        if held != str(adapter.path):
            raise WeightSyncError(f"/load_lora_adapter answered loaded_adapters={answer.get('loaded_adapters')}: "
                                  f"expected {adapter.name} -> {adapter.path}")
        return expected_checksum

    def close(self) -> None:
        self.dirs.close()
