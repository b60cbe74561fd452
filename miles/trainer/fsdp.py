"""One rank of the FSDP2 trainer: the native TorchTrainer holding an `FSDPSharding` (its models sharded by
`fully_shard`).

    trainer = FSDPTrainer(rank, world_size, master_addr, master_port,
                          checkpoint_dir, algo, trainer_cfg, precision, device="cpu")
    # = TorchTrainer(checkpoint_dir, ..., parallel=FSDPSharding(rank, world_size, master_addr, master_port))
    metrics = trainer.train_rl(batch)   # every rank, at once, with the same global TrainBatch
    weights, digest = trainer.get_weights()   # rank 0: the full state dict; the others ({}, "")
    trainer.save_state(path); trainer.load_state(path)   # sharded (torch.distributed.checkpoint) + HF

miles.trainer.fsdp_group.FSDPGroup runs one per Ray actor. Everything TorchTrainer does (policy
losses, micro-batches, the chunked log-prob head, metrics) runs unchanged; FSDPSharding is its
Parallelism (miles/trainer/parallel.py), what the ranks change:
- Process group and sharding (`shard_models`): gloo on CPU, NCCL on CUDA; `fully_shard` on each
  decoder layer and on the root of the policy (and of the KL reference and the teacher), with
  param bf16 / reduce fp32 when precision.train_dtype is bf16. A process holds one process group:
  later trainers of the same rank in it (tests) reuse it.
- The batch (`plan`): every rank receives the whole global batch and trains on a contiguous range
  of its samples with about equal tokens. Losses keep the whole step's normalizer (TorchTrainer
  computes it from the whole batch), so the ranks' gradients add up to the 1-rank gradient: FSDP
  sums them (gradient divide factor 1) instead of averaging. Ranks with fewer micro-batches run
  idle ones (one token, no loss position) so that all meet in the same all-gathers and
  reduce-scatters.
- Whole-batch results (`sum_over_ranks`): log-probs of every row (each rank fills its own),
  metric sums and the grad norm over all shards (`clip_grad_norm`) are reduced over ranks, so
  every rank returns the same numbers as the 1-rank trainer.
- Colocation offload (`move_models`): the models move as modules (`module.to`), after which FSDP2
  re-points its sharded storage (FSDPParam.reset_sharded_param); host copies are pageable, not
  pinned. get_weights, save, save_state and load_state refuse while offloaded (they are
  collectives over device shards).
- Weights and state (`policy_state`, `save_policy`, `save_state`): gathered on rank 0's CPU; resume
  state is each rank's shards through torch.distributed.checkpoint.
- LoRA (trainer.lora.rank > 0): the frozen base is sharded as above; the adapters live outside the
  FSDP units (forward hooks, miles/models/lora.py), replicated on every rank, and `clip_grad_norm`
  sums their gradients over the ranks. Their optimizer state is replicated too: rank 0 saves it
  whole (LORA_OPTIMIZER) beside the base's shards.
- QLoRA (trainer.lora with precision=fp8 / int4_qat): the frozen base held quantized, its codes
  sharded as frozen parameters and gathered uncast (miles/trainer/fsdp_qlora.py).
Not yet: fake-quantizing recipes without LoRA (train_quant: `Recipe.forward` swaps whole weights), MoE routing
replay (its agreement metrics are per-rank ratios), an online speculative draft, in-process weights.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from miles.config.schema import DType
from miles.models import CausalLM, save_pretrained
from miles.models.hf_io import model_class
from miles.precision.recipe import NONE
from miles.trainer import fsdp_qlora
from miles.trainer import offload as off
from miles.trainer.packing import MicroBatch
from miles.trainer.parallel import TrainerParts
from miles.trainer.torch_trainer import TorchTrainer
from miles.types import TrainBatch

# LoRA: the adapters' optimizer state (replicated, the same on every rank), written by rank 0.
LORA_OPTIMIZER = "lora_optimizer.pt"


def token_balanced_bounds(loss_mask: torch.Tensor, parts: int) -> list[int]:
    """Sample bounds [0, b_1, ..., N] cutting the batch into `parts` contiguous ranges of about equal
    tokens; a sample counts the tokens up to its last loss target (what its packed forward
    computes), 0 without any. A range may be empty when there are fewer samples than parts."""
    mask = loss_mask > 0
    tokens = torch.where(mask.any(-1), mask.shape[1] - mask.flip(-1).int().argmax(-1), 0)
    cum = torch.cat([torch.zeros(1, dtype=torch.long), tokens.cumsum(0)]).double()
    bounds = [0]
    for r in range(1, parts):  # the sample boundary nearest to r / parts of the tokens
        nearest = int((cum - cum[-1] * r / parts).abs().argmin())
        bounds.append(max(bounds[-1], nearest))
    return bounds + [len(loss_mask)]


def shard(model: CausalLM, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
    """FSDP2 units: each decoder layer (its parameters gathered only around its own forward and
    backward), then the root (embedding, final norm, head)."""
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    for unit in [*model.layers, model]:
        # Each rank's loss is already its share of the whole step's loss: sum the ranks' gradients,
        # with a plain SUM (any other factor than the world size is NCCL's PREMUL_SUM, not in gloo).
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


class FSDPSharding:
    """FSDP2 over `world_size` ranks (this process: `rank`), which meet at master_addr:master_port."""

    shards_policy = True  # so no online speculative draft (TorchTrainer refuses it)
    in_process_weights = False  # no engine shares a rank's process
    routing_replay = False
    name = "the FSDP trainer"

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int):
        self.rank, self.world_size = rank, world_size
        self.writes = rank == 0
        self._init_method = f"tcp://{master_addr}:{master_port}"
        self.device = torch.device("cpu")

    def shard_models(self, trainer: TrainerParts) -> None:
        quantized_base = trainer.recipe.train_quant != NONE
        if quantized_base and trainer.lora is None:
            raise ValueError(f"the FSDP trainer does not fake-quantize yet (precision.train_quant="
                             f"{trainer.recipe.train_quant}): Recipe.forward replaces whole weights")
        if trainer.algo.routing_replay != "none":
            raise ValueError(f"the FSDP trainer has no MoE routing replay yet (algo.routing_replay="
                             f"{trainer.algo.routing_replay})")
        self.device = trainer.device
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", init_method=self._init_method,
                                    rank=self.rank, world_size=self.world_size)
        elif (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
            # A process holds one default group: a later trainer of the same ranks (tests) reuses it.
            raise RuntimeError(f"this process is rank {dist.get_rank()} of {dist.get_world_size()} already; "
                               f"an FSDP trainer cannot be rank {self.rank} of {self.world_size} in it")
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        # bf16: gathered parameters and the forward in bf16, gradients reduced and kept in fp32.
        mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                     if trainer.precision.train_dtype == DType.bf16 else MixedPrecisionPolicy())
        models = [m for m in (trainer.model, trainer.ref_model, trainer.teacher) if m is not None]
        if quantized_base:  # QLoRA (trainer.lora attached it quantized): its codes sharded, gathered uncast
            trainer.recipe = fsdp_qlora.prepare(models, trainer.recipe)
            mp_policy = fsdp_qlora.NO_CAST
        for model in models:
            shard(model, mesh, mp_policy)

    def plan(self, batch: TrainBatch, plan: Callable[[TrainBatch], list[MicroBatch]]) -> list[MicroBatch]:
        """This rank's micro-batches of `batch` (indices into the whole batch), as many as the rank
        with the most: the others are idle."""
        bounds = token_balanced_bounds(batch.loss_mask, self.world_size)
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        mine = [] if lo == hi else [replace(mb, index=mb.index + lo) for mb in plan(batch.slice(lo, hi))]
        most = torch.tensor(len(mine), device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return mine + [self._idle_micro_batch(batch.loss_mask.shape[1])] * (int(most) - len(mine))

    def _idle_micro_batch(self, width: int) -> MicroBatch:
        """A forward / backward of one token and no loss position: this rank's part of the collectives."""
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        return MicroBatch(index=empty, input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device),
                          src=empty, dst=empty, targets=empty, width=width,
                          adapter_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device))  # any adapter: no loss

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out)
        return out

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """The norm over every rank's gradient shards (a DTensor made whole), then the clip. LoRA's
        adapters are plain tensors outside the FSDP units, replicated on every rank: FSDP never
        reduces their gradients, so they are summed here first (each rank's loss is already its
        share of the step's), after which every rank holds the whole gradient and steps alike."""
        for p in params:
            if not isinstance(p, DTensor):
                if p.grad is None:  # all ranks meet in the all-reduce, with or without a gradient here
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
        params = [p for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def move_models(self, models: list[torch.nn.Module], device: torch.device, host: bool) -> None:
        """The sharded models as modules: nn.Module._apply moves each DTensor's local shard and
        FSDP2 then re-points its sharded storage at it (a `param.data` swap alone would leave FSDP
        all-gathering the old storage)."""
        for model in models:
            if off.FORCE_COPY:  # tests: fresh storage on the CPU, the re-pointing exercised
                model._apply(lambda t: t.clone())
            else:
                model.to("cpu" if host else device)

    def policy_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Collective: the policy's whole fp32 state dict on rank 0's CPU ({} on the other ranks)."""
        if fsdp_qlora.holds_quantized_base(model):  # the held base dequantized, as in one process
            return fsdp_qlora.gathered_state(model, self.writes)
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_policy(self, model: torch.nn.Module, path: str) -> None:
        """Collective: the policy as an HF-format dir, written by rank 0."""
        state = self.policy_state(model)
        if self.writes:
            with torch.device("meta"):  # the structure only; the gathered tensors become its weights
                whole = model_class(model.config)(model.config)  # VisionLM for a vision-language model
            whole.load_state_dict(state, assign=True)
            save_pretrained(whole, path)

    def save_state(self, trainer: TrainerParts, path: str) -> None:
        """Collective: resume state into the directory `path` (one every rank sees): the sharded policy
        and optimizer state in `trainer/` (torch.distributed.checkpoint; each rank writes its shards and
        its torch RNG), and the policy as an HF-format dir `model/` (rank 0). The KL reference and the
        teacher are frozen: rebuilt from their checkpoints, never saved. Not while offloaded (the
        trainer refuses it first: the collectives run over device shards)."""
        shards = Path(path) / "trainer"
        if trainer.lora is not None:  # the frozen base has no optimizer state; the adapters' is replicated
            dcp.save({"model": self._frozen_base(trainer.model)}, checkpoint_id=shards)
            if self.writes:
                torch.save(trainer.optimizer.state_dict(), shards / LORA_OPTIMIZER)
        else:
            model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=shards)
        torch.save(self._rng_state(), shards / f"rng_rank{self.rank}.pt")
        self.save_policy(trainer.model, str(Path(path) / "model"))

    def load_state(self, trainer: TrainerParts, path: str) -> None:
        """Collective: what `save_state` wrote, with as many ranks; training then continues exactly."""
        shards = Path(path) / "trainer"
        if trainer.lora is not None:  # the adapters themselves: TorchTrainer.load_state (adapter/)
            dcp.load({"model": self._frozen_base(trainer.model)}, checkpoint_id=shards)  # in place
            trainer.optimizer.load_state_dict(torch.load(shards / LORA_OPTIMIZER, weights_only=True))
        else:
            model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            dcp.load(state, checkpoint_id=shards)  # in place, into this rank's shards
            set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        rng = torch.load(shards / f"rng_rank{self.rank}.pt", weights_only=True)
        torch.set_rng_state(rng["torch_rng"])
        if "cuda_rng" in rng:
            torch.cuda.set_rng_state(rng["cuda_rng"])

    @staticmethod
    def _frozen_base(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """LoRA's frozen base as this rank's shards; under QLoRA its codes themselves (dcp loads them
        back in place: a resume never quantizes again)."""
        if fsdp_qlora.holds_quantized_base(model):
            return fsdp_qlora.base_shards(model)
        return get_model_state_dict(model)

    def _rng_state(self) -> dict[str, torch.Tensor]:
        state = {"torch_rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state()
        return state


class FSDPTrainer(TorchTrainer):
    """TorchTrainer built with an FSDPSharding: nothing of its own but the constructor (a class, so that
    the ranks' actors, check_trainer and the callers name it as they name the other trainers)."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, *args, **kwargs):
        """`rank` of `world_size` ranks, which meet at master_addr:master_port (rank 0's host and a
        port free there); the rest are TorchTrainer's arguments, the same on every rank."""
        self.rank, self.world_size = rank, world_size
        super().__init__(*args, parallel=FSDPSharding(rank, world_size, master_addr, master_port), **kwargs)
