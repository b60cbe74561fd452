"""What `trainer=fsdp` (miles/trainer/fsdp_group.py) combines with, and the one thing only it runs
(trainer.num_ranks > 1), checked before anything starts (miles/validate.py runs it with the config's
own rules). Pure: nothing distributed is imported."""

from __future__ import annotations

from miles.config.schema import RunCfg, TrainerBackend
from miles.transport.protocol import TransportName


def fsdp_problems(cfg: RunCfg) -> list[str]:
    t = cfg.trainer
    if t.backend != TrainerBackend.fsdp:
        if t.num_ranks > 1:  # ranks are FSDP's: every other backend is one process
            return [f"trainer.num_ranks > 1 with trainer={t.backend} is not supported: use "
                    "trainer=fsdp (Megatron-core runs one GPU per run for now)"]
        return []
    problems = []
    gpus = cfg.hardware.gpus_per_node * cfg.hardware.num_nodes
    if cfg.hardware.device != "cpu" and t.num_ranks > gpus:
        problems.append(f"trainer.num_ranks={t.num_ranks} FSDP ranks take a GPU each, and hardware={cfg.hardware.name} "
                        f"has {gpus}: lower trainer.num_ranks")
    if not cfg.ray.enabled:
        problems.append("trainer=fsdp runs its ranks as Ray actors: set ray.enabled=true")
    # With LoRA a quantized training forward is QLoRA: the frozen base held quantized (fsdp_qlora.py).
    fake_quant = cfg.precision.train_quant.value != "none" and t.lora.rank == 0
    unsupported = {f"precision={cfg.precision.name} (fake-quantized training without trainer.lora)": fake_quant,
                   f"algo.routing_replay={cfg.algo.routing_replay}": cfg.algo.routing_replay != "none",
                   "true_on_policy=true": cfg.true_on_policy,
                   "precision.forward_weights=rollout": cfg.precision.forward_weights == "rollout"}
    problems += [f"trainer=fsdp does not support {what} yet: use trainer=torch"
                 for what, bad in unsupported.items() if bad]
    if cfg.rollout.weight_sync == TransportName.shared_memory:
        problems.append("rollout.weight_sync=shared_memory packs from one trainer process, not FSDP ranks: "
                        "set rollout.weight_sync=object_store")
    elif cfg.rollout.weight_sync == TransportName.broadcast:
        problems.append("rollout.weight_sync=broadcast sends from one trainer process, not FSDP ranks yet: "
                        "set rollout.weight_sync=object_store")
    if t.offload:
        problems.append("trainer.offload=true with trainer=fsdp is not supported yet (its checkpoints "
                        "need the shards on the device): set trainer.offload=false")
    return problems
