"""The vLLM engine's side of LoRA (trainer.lora.rank > 0; docs/lora.md): the trainer's adapters served
through vLLM's own LoRA support, the base weights never touched.

    llm = vllm.LLM(..., **llm_lora_args(cfg.lora))        # enable_lora, max_lora_rank, max_loras = N adapters
    adapters = VLLMAdapters(llm, cfg.lora, arch, dtype)
    adapters.load(synced, expected_checksum)               # a new version of every adapter; the previous dropped
    llm.generate(..., lora_request=adapters.route(ids))    # each prompt's adapter (None before the first sync)

Each sync writes one PEFT adapter directory per adapter (miles/rollout/adapter_files.py) and hands
vLLM a new `LoRARequest(name, int_id, path)` for each through `LLMEngine.add_lora`, which loads it at
once (vLLM's worker: `LRUCacheWorkerLoRAManager.add_adapter` loads and activates it in a slot), then
removes that adapter's previous id. A new id and path per version, not `load_inplace` on one id:
vLLM keys its prefix cache by the adapter's name and path, so KV computed under the last version is
never reused.

Several adapters (trainer.lora.adapters, the payload's "<adapter>/<module>..." tensors): vLLM holds
one slot per adapter (`max_loras` = N), `generate` passes one request per prompt (vLLM's
`lora_request` list, aligned with the prompts; a prompt's n samples share its request), and vLLM's
punica kernels apply each row's adapter in one batch.
A fleet (rollout.num_engines > 1, ray.enabled: one VLLMEngine actor each) holds all adapters on every
engine: each sync loads them into every actor, the router sends each chunk's adapter ids with its prompts
(miles/rollout/router.py; tests/vllm/test_vllm_fleet_lora.py).

The checked sync reads back what vLLM computes with: the slot of every adapter in each LoRA layer
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
from miles.rollout.adapter_files import Adapter, AdapterVersions
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
    return lora_unsupported(cfg.trainer.lora, cfg.model.family, cfg.rollout.num_gpus_per_engine or 1)


def llm_lora_args(cfg: LoRACfg) -> dict:
    """vllm.LLM arguments: a GPU slot per adapter, and room in vLLM's adapter cache for one more
    version than that (a sync loads an adapter's new version before it removes the previous one;
    without the room vLLM's LRU would evict a version on its own)."""
    slots = len(cfg.adapters) or 1
    return {"enable_lora": True, "max_lora_rank": vllm_lora_rank(cfg.rank), "max_loras": slots,
            "max_cpu_loras": slots + 1}


class VLLMAdapters:
    def __init__(self, llm, cfg: LoRACfg, arch, dtype: torch.dtype):
        from vllm.lora.request import LoRARequest

        self._LoRARequest = LoRARequest
        self.llm, self.cfg, self.dtype = llm, cfg, dtype
        self.scaling = cfg.alpha / cfg.rank  # vLLM's PEFTHelper: lora_alpha / r (no rsLoRA)
        self.versions = AdapterVersions(cfg, arch)
        self.shapes = self.versions.shapes

    def request(self, adapter: Adapter | None):
        """vLLM's request for this version (None: the base model, B = 0 before the first sync)."""
        return None if adapter is None else self._LoRARequest(adapter.name, adapter.number, str(adapter.path))

    def route(self, ids: list[int] | None, prompts: int):
        """generate's lora_request: one request per prompt (its adapter's current version)."""
        return [self.request(a) for a in self.versions.served(ids, prompts)]

    def load(self, tensors: dict[str, torch.Tensor], expected_checksum: str | None) -> str:
        """Serve these adapters from now on; with a checksum, verify the payload, then what vLLM holds."""
        new = self.versions.write(tensors, expected_checksum)
        engine = self.llm.llm_engine
        self.versions.swap(new, lambda a: engine.add_lora(self.request(a)),
                           lambda previous: engine.remove_lora(previous.number))
        if expected_checksum is None:
            return ""
        self.check_held(tensors)
        return expected_checksum  # the payload's, and vLLM's slots equal to it tensor by tensor

    def check_held(self, tensors: dict[str, torch.Tensor]) -> None:
        """Every adapter's slot in vLLM's LoRA layers against its part of the synced payload."""
        current = self.versions.current
        held = self.llm.collective_rpc(read_lora_slots, args=([a.number for a in current],))[0]
        wrong = []
        for adapter, part, slot in zip(current, self.versions.split(tensors), held):
            differ, missing = self.compare(part, adapter, slot)
            if missing or differ:
                wrong.append(f"{adapter.name}: {len(differ)} tensors differ (e.g. {differ[:3]}), {len(missing)} not "
                             f"found in its LoRA layers (e.g. {missing[:3]})")
        if wrong:
            raise WeightSyncError(f"vLLM's LoRA slots differ from the synced adapters: {'; '.join(wrong)}; set "
                                  "rollout.check_weight_sync=false to serve unchecked")

    def compare(self, tensors: dict[str, torch.Tensor], adapter: Adapter, held: dict[str, torch.Tensor] | None
                ) -> tuple[list[str], list[str]]:
        """(names that differ, names not found) of one adapter's tensors against its slot (None: in no slot)."""
        if held is None:
            return [], sorted(tensors)
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
        return differ, missing

    def close(self) -> None:
        self.versions.close()


@torch.no_grad()
def read_lora_slots(worker, lora_ids: list[int]) -> list[dict[str, torch.Tensor] | None]:
    """In vLLM's worker (collective_rpc): for each adapter id, the A [max_rank, in] and B [out, max_rank]
    it occupies in each linear LoRA layer, under the HF sub-module names (qkv_proj -> q, k, v); None
    for an id in no slot."""
    manager = worker.model_runner.lora_manager._adapter_manager
    return [_read_slot(manager, manager.lora_index_to_id.index(i)) if i in manager.lora_index_to_id else None
            for i in lora_ids]


def _read_slot(manager, slot: int) -> dict[str, torch.Tensor]:
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
