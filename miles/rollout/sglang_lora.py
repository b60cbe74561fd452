"""The SGLang engine's side of LoRA (trainer.lora.rank > 0; docs/lora.md): the trainer's adapters served
through SGLang's documented adapter API, the server's base weights never touched.

    server_args = {**server_lora_args(cfg.lora, shapes), ...}   # --enable-lora --max-lora-rank --lora-target-modules
    adapters = SGLangAdapters(engine._post_ok, cfg.lora, arch, root=weights_dir)
    adapters.load(synced, expected_checksum)      # per adapter: POST /load_lora_adapter {lora_name, lora_path},
                                                  # then /unload_lora_adapter {lora_name} of its previous version
    body["lora_path"] = adapters.lora_paths(ids, rows)   # in every /generate: each row's adapter (None: the base)

Each sync writes one PEFT adapter directory per adapter (miles/rollout/adapter_files.py) where the
server reads it (rollout.sglang.weights_dir; a temporary directory by default: the server must be on
this host's file system) and loads it under a new name; each adapter's previous version is unloaded
after its new one loaded (SGLang's unload waits for the requests that still use it). SGLang refuses
to load a name it already has ("LoRA with name ... already exists"), and a new name is a new
lora_id, which keys SGLang's radix cache, so no KV of the last version is reused.

Several adapters (trainer.lora.adapters): each is loaded under its own name ("miles-lora-<adapter>-
<number>") and /generate's `lora_path` is a list aligned with the batch's rows (each prompt's n rows
name its adapter), which SGLang serves in one batch (S-LoRA / punica kernels; a launched server gets
--max-loras-per-batch N, so every adapter fits one batch). A sync holds one version more than it
serves for a moment: a server started with --max-loaded-loras needs N + 1 at least.

The checked sync covers the payload (its checksum), the files the server reads (read back and
hashed as the trainer hashed the adapters) and the server's answers (each `loaded_adapters` names
the version just loaded at its path). SGLang has no endpoint that returns the adapter it holds
(/weights_checker hashes the model's parameters, not its LoRA memory pool), so what the server
computed from the files is not compared: that is the difference with vLLM's read-back
(miles/rollout/vllm_lora.py).

SGLang does not run on the machines this was written on: tests/unit/rollout/test_sglang_lora.py drives
this against the stand-in server (tests/unit/rollout/sglang_standin.py, NOT SGLang), which implements
the endpoints' schemas over the native engine's LoRA module.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from miles.config.schema import EngineName, LoRACfg, RunCfg
from miles.models.lora_peft import WEIGHTS_FILE
from miles.rollout.adapter_files import Adapter, AdapterVersions, target_leaves
from miles.rollout.vllm_lora import VLLM_LORA_FAMILIES
from miles.transport.checksum import WeightSyncError, checksum


def sglang_lora_problems(cfg: RunCfg) -> list[str]:
    """trainer.lora with rollout=sglang, checked before anything starts (miles/validate.py runs this
    with the config's rules): SGLang serves the adapters through its own LoRA support on the dense
    families whose projections it wraps as the project's adapters do, the list vLLM's serve too."""
    lora_on_sglang = cfg.trainer.lora.rank > 0 and cfg.rollout.engine == EngineName.sglang
    if not lora_on_sglang or cfg.model.family in VLLM_LORA_FAMILIES:
        return []
    return [f"trainer.lora with rollout=sglang serves adapters on the families {', '.join(VLLM_LORA_FAMILIES)} "
            f"(model family {cfg.model.family} is not one): use rollout=native or trainer.lora.rank=0"]


def server_lora_args(cfg: LoRACfg, shapes: dict) -> dict:
    """ServerArgs fields for dynamically loaded adapters of this rank on these projections (SGLang
    sizes its LoRA memory pool by them at launch); several adapters: a batch holds them all."""
    args = {"enable_lora": True, "max_lora_rank": cfg.rank, "lora_target_modules": target_leaves(shapes)}
    if cfg.adapters:
        args["max_loras_per_batch"] = len(cfg.adapters)
    return args


def command_line(args: dict) -> str:
    """ServerArgs fields as launch_server's flags (what an error tells the user to start a server with)."""
    words = []
    for key, value in args.items():
        words.append("--" + key.replace("_", "-"))
        if value is not True:
            words += map(str, value) if isinstance(value, list) else [str(value)]
    return " ".join(words)


def server_problems(info: dict, cfg: LoRACfg, shapes: dict, url: str) -> list[str]:
    """What a running server (its /server_info) lacks to serve this run's adapters."""
    flags = command_line(server_lora_args(cfg, shapes))
    if not info.get("enable_lora"):
        return [f"trainer.lora with rollout=sglang: the server at {url} runs without LoRA: start it with {flags}"]
    problems = []
    if info.get("max_lora_rank") is not None and int(info["max_lora_rank"]) < cfg.rank:
        problems.append(f"the server at {url} has --max-lora-rank {info['max_lora_rank']} < trainer.lora.rank="
                        f"{cfg.rank}: start it with {flags}")
    served = info.get("lora_target_modules")
    if served and "all" not in served and (missing := sorted(set(target_leaves(shapes)) - set(served))):
        problems.append(f"the server at {url} serves LoRA on {sorted(served)}, not {missing}: start it with {flags}")
    held = (len(cfg.adapters) or 1) + 1  # a sync loads an adapter's new version before unloading the last
    if info.get("max_loaded_loras") is not None and int(info["max_loaded_loras"]) < held:
        problems.append(f"the server at {url} has --max-loaded-loras {info['max_loaded_loras']}: a sync holds "
                        f"{held} adapter versions for a moment: start it with --max-loaded-loras {held} or more")
    return problems


class SGLangAdapters:
    def __init__(self, post_ok, cfg: LoRACfg, arch, root: str | None = None):
        """post_ok(path, body) -> the answer, raising on HTTP errors and success=false (SGLangEngine._post_ok)."""
        self.post_ok, self.cfg = post_ok, cfg
        self.versions = AdapterVersions(cfg, arch, root)
        self.shapes = self.versions.shapes

    def lora_paths(self, ids: list[int] | None, prompts: int, n: int) -> list[str | None] | None:
        """/generate's lora_path for prompt-major rows (n per prompt): each row's adapter; None
        before the first sync (no field: the base model)."""
        served = self.versions.served(ids, prompts)
        if all(a is None for a in served):
            return None
        return [None if a is None else a.name for a in served for _ in range(n)]

    def load(self, tensors: dict[str, torch.Tensor], expected_checksum: str | None) -> str:
        new = self.versions.write(tensors, expected_checksum)
        if expected_checksum is not None:
            try:
                self.check_files(new, expected_checksum)
            except BaseException:
                self.versions.retire(new)
                raise
        answers = []  # (version, its /load_lora_adapter answer)

        def load_one(adapter: Adapter) -> None:
            body = {"lora_name": adapter.name, "lora_path": str(adapter.path)}
            try:
                answer = self.post_ok("/load_lora_adapter", body)
            except RuntimeError as e:  # SGLangError
                if "already exists" not in str(e):
                    raise
                # Left on the server by an earlier engine of the run (a restarted engine numbers its
                # versions from 1 again): ours to replace (docs/lora.md: one run per server).
                self.post_ok("/unload_lora_adapter", {"lora_name": adapter.name})
                answer = self.post_ok("/load_lora_adapter", body)
            answers.append((adapter, answer))

        self.versions.swap(new, load_one,
                           lambda previous: self.post_ok("/unload_lora_adapter", {"lora_name": previous.name}))
        if expected_checksum is None:
            return ""
        for adapter, answer in answers:
            held = (answer.get("loaded_adapters") or {}).get(adapter.name)
            held = held.get("lora_path") if isinstance(held, dict) else held  # a name -> path map, or LoRARefs
            if held != str(adapter.path):
                raise WeightSyncError(f"/load_lora_adapter answered loaded_adapters={answer.get('loaded_adapters')}: "
                                      f"expected {adapter.name} -> {adapter.path}")
        return expected_checksum

    def check_files(self, new: list[Adapter], expected_checksum: str) -> None:
        """The adapter files, read back from disk as the server reads them, hold what the trainer sent
        (the payload's checksum, under the synced names)."""
        held = {}
        for prefix, adapter in zip(self.versions.prefixes, new):
            stored = load_file(str(adapter.path / WEIGHTS_FILE))
            held.update({prefix + name: stored[key] for name, key in adapter.keys.items()})
        if (digest := checksum(held)) != expected_checksum:
            raise WeightSyncError(f"the adapter files {[str(a.path / WEIGHTS_FILE) for a in new]} hold other values "
                                  f"than the trainer sent: {digest[:12]} != {expected_checksum[:12]}")

    def close(self) -> None:
        self.versions.close()
