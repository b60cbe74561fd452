"""The vLLM engine's side of LoRA (trainer.lora.rank > 0; docs/lora.md): the trainer's adapters served
through vLLM's own LoRA support, the base weights never touched.

    llm = vllm.LLM(..., **llm_lora_args(cfg.lora))        # enable_lora, max_lora_rank, max_loras=1
    adapters = VLLMAdapters(llm, cfg.lora, arch)
    adapters.load(synced, expected_checksum)               # a new adapter version; the previous one dropped
    llm.generate(..., lora_request=adapters.request)       # None before the first sync: the base model

Each sync writes a PEFT adapter directory (miles/rollout/adapter_files.py) and hands vLLM a new
`LoRARequest(name, int_id, path)` through `LLMEngine.add_lora`, which loads it at once (vLLM's
worker: `LRUCacheWorkerLoRAManager.add_adapter` loads and activates it in a slot), then removes the
previous id. A new id and path per version, not `load_inplace` on one id: vLLM keys its prefix
cache by the adapter's name and path, so KV computed under the last version is never reused.

The checked sync reads back what vLLM computes with: the slot of the adapter in each LoRA layer
(`lora_a_stacked` [slots, 1, max_rank, in] / `lora_b_stacked` [slots, 1, out, max_rank], split back
from fused qkv / gate_up layers by the manager's `packed_modules`), against the sent tensors put the
way vLLM loads them: in its LoRA dtype, B scaled by alpha / rank (`LoRALayerWeights.optimize`), the
same torch ops, so equal bit for bit. TP = 1 only.

Families: vLLM's LoRA layers wrap the dense projections of the families below, which the project's
adapters target the same way; tests/vllm/test_vllm_lora.py measures qwen3 against the native engine.
"""

from __future__ import annotations

import torch

from miles.config.schema import EngineName, LoRACfg, RunCfg
from miles.rollout.adapter_files import Adapter, AdapterDirs, adapter_shapes, check_payload
from miles.transport.checksum import WeightSyncError

# vLLM 0.32's accepted max_lora_rank values (vllm/config/lora.py MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Families whose dense projections vLLM's LoRA layers serve as the project's adapters apply them
# (qkv / gate_up packed, o / down plain); MoE experts, MLA and the rest: rollout=native.
VLLM_LORA_FAMILIES = ("qwen3", "qwen2")


def vllm_lora_rank(rank: int) -> int | None:
    """The smallest max_lora_rank vLLM accepts that holds `rank` (None: none does)."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


def lora_unsupported(cfg: LoRACfg, family: str, tensor_parallel: int) -> list[str]:
    """What of trainer.lora vLLM cannot serve here, one actionable line each."""
    problems = []
    if family not in VLLM_LORA_FAMILIES:
        problems.append(f"trainer.lora with rollout=vllm serves adapters on the families {', '.join(VLLM_LORA_FAMILIES)} "
                        f"(model family {family} is not one): use rollout=native or trainer.lora.rank=0")
    if vllm_lora_rank(cfg.rank) is None:
        problems.append(f"trainer.lora.rank={cfg.rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}: "
                        "lower trainer.lora.rank or use rollout=native")
    if tensor_parallel != 1:
        problems.append("trainer.lora with rollout=vllm: the adapter read-back that checks each sync runs on one "
                        "GPU per engine: set rollout.num_gpus_per_engine=1 or rollout=native")
    return problems


def vllm_lora_problems(cfg: RunCfg) -> list[str]:
    """trainer.lora with rollout=vllm, checked before anything starts (miles/validate.py runs this
    with the config's rules; the engine checks the same when it is built)."""
    if cfg.trainer.lora.rank <= 0 or cfg.rollout.engine != EngineName.vllm:
        return []
    problems = lora_unsupported(cfg.trainer.lora, cfg.model.family, cfg.rollout.num_gpus_per_engine or 1)
    if cfg.trainer.lora.adapters:
        problems.append(f"trainer.lora.adapters={list(cfg.trainer.lora.adapters)} with rollout=vllm: this engine "
                        "serves the run's one adapter (one LoRARequest per sync), not several routed per prompt "
                        "yet: use rollout=native or trainer.lora.adapters=[]")
    return problems


def llm_lora_args(cfg: LoRACfg) -> dict:
    """vllm.LLM arguments for one adapter at a time (the run's current version)."""
    return {"enable_lora": True, "max_lora_rank": vllm_lora_rank(cfg.rank), "max_loras": 1}


class VLLMAdapters:
    def __init__(self, llm, cfg: LoRACfg, arch, dtype: torch.dtype):
        from vllm.lora.request import LoRARequest

        self._LoRARequest = LoRARequest
        self.llm, self.cfg, self.dtype = llm, cfg, dtype
        self.scaling = cfg.alpha / cfg.rank  # vLLM's PEFTHelper: lora_alpha / r (no rsLoRA)
        self.shapes = adapter_shapes(cfg, arch)
        self.dirs = AdapterDirs(cfg, arch)
        self.current: Adapter | None = None
        self.request = None  # the LoRARequest of every generate; None: the base model (B = 0 before the first sync)

    def load(self, tensors: dict[str, torch.Tensor], expected_checksum: str | None) -> str:
        """Serve these adapters from now on; with a checksum, verify the payload, then what vLLM holds."""
        check_payload(tensors, self.shapes, expected_checksum)
        adapter = self.dirs.write(tensors)
        request = self._LoRARequest(adapter.name, adapter.number, str(adapter.path))
        try:
            self.llm.llm_engine.add_lora(request)
        except BaseException:
            self.dirs.retire(adapter)
            raise
        previous, self.current, self.request = self.current, adapter, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.number)
            self.dirs.retire(previous)
        if expected_checksum is None:
            return ""
        self.check_held(tensors, adapter)
        return expected_checksum  # the payload's, and vLLM's slot equal to it tensor by tensor

    def check_held(self, tensors: dict[str, torch.Tensor], adapter: Adapter) -> None:
        held = self.llm.collective_rpc(read_lora_slot, args=(adapter.number,))[0]
        differ, missing = [], []
        for name, sent in tensors.items():
            module, _, leaf = adapter.keys[name].removeprefix("base_model.model.").partition(".lora_")
            got = held.get(f"{module}.lora_{leaf}")
            if got is None:
                missing.append(name)
                continue
            want = sent.detach().to("cpu", self.dtype)
            if leaf.startswith("B"):
                got = got[:, : self.cfg.rank]
                if self.scaling != 1:  # vLLM folds the scaling into B in its dtype, as here
                    want = want.clone().mul_(self.scaling)
            else:
                got = got[: self.cfg.rank]
            if not torch.equal(got, want):
                differ.append(name)
        if missing or differ:
            raise WeightSyncError(f"vLLM's LoRA slot differs from the synced adapters: {len(differ)} tensors differ "
                                  f"(e.g. {differ[:3]}), {len(missing)} not found in its LoRA layers "
                                  f"(e.g. {missing[:3]}); set rollout.check_weight_sync=false to serve unchecked")

    def close(self) -> None:
        self.dirs.close()


@torch.no_grad()
def read_lora_slot(worker, lora_id: int) -> dict[str, torch.Tensor]:
    """In vLLM's worker (collective_rpc): the A [max_rank, in] and B [out, max_rank] that adapter
    `lora_id` occupies in each linear LoRA layer, under the HF sub-module names (qkv_proj -> q, k, v)."""
    manager = worker.model_runner.lora_manager._adapter_manager
    slot = manager.lora_index_to_id.index(lora_id)
    out = {}
    for name, module in manager.modules.items():
        subs = manager.packed_modules.get(name) or [name]
        a_stacked, b_stacked = getattr(module, "lora_a_stacked", None), getattr(module, "lora_b_stacked", None)
        if not isinstance(a_stacked, tuple) or len(a_stacked) != len(subs):
            continue  # embeddings, heads: layers the project does not adapt
        for sub, a, b in zip(subs, a_stacked, b_stacked):
            out[f"{sub}.lora_A.weight"] = a[slot, 0].to("cpu", copy=True)
            out[f"{sub}.lora_B.weight"] = b[slot, 0].to("cpu", copy=True)
    return out
