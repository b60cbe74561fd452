"""What `trainer.lora` (rank > 0) combines with, checked before anything starts (docs/lora.md). What
the external engines' own LoRA support serves is theirs to say (miles/rollout/vllm_lora.py,
sglang_lora.py)."""

from __future__ import annotations

from miles.config.schema import RunCfg


def lora_problems(cfg: RunCfg) -> list[str]:
    lo, t, r, p = cfg.trainer.lora, cfg.trainer, cfg.rollout, cfg.precision
    if lo.rank < 0:
        return [f"trainer.lora.rank must be >= 0 (got {lo.rank}; 0 turns LoRA off)"]
    if lo.rank == 0:
        return []
    problems = []
    if lo.alpha <= 0:
        problems.append(f"trainer.lora.alpha must be > 0 (got {lo.alpha})")
    if not 0 <= lo.dropout < 1:
        problems.append(f"trainer.lora.dropout must be in [0, 1) (got {lo.dropout})")
    if not lo.target_modules:
        problems.append("trainer.lora.target_modules must name at least one projection (e.g. [q_proj, v_proj])")
    elif not cfg.model.problems():  # the model's module names, from a meta-device build (no memory)
        problems += _target_problems(cfg)
    if t.backend == "megatron":
        problems.append(f"trainer.lora.rank={lo.rank} runs on trainer=torch or trainer=fsdp: Megatron-core's LoRA "
                        "needs its Transformer Engine layers, which this backend does not build; set trainer=torch, "
                        "trainer=fsdp or trainer.lora.rank=0")
    if r.weight_sync != "object_store":
        problems.append(f"trainer.lora.rank={lo.rank}: rollout.weight_sync={r.weight_sync.value} carries the whole "
                        "flat state dict; the adapters travel through rollout.weight_sync=object_store")
    if p.train_quant.value != "none" or p.rollout_quant.value != "none" or p.forward_weights != "master":
        problems.append(f"trainer.lora.rank={lo.rank} does not combine with precision={p.name} yet (a frozen base "
                        "quantized QLoRA-style is not built): use precision=fp32 or bf16")
    if cfg.true_on_policy:
        problems.append("trainer.lora.rank > 0 with true_on_policy=true: the adapters' matmuls are not yet checked "
                        "bit for bit between the engine's decode and the trainer: set true_on_policy=false")
    if r.speculative.kind != "none" and r.speculative.train_online:
        problems.append("trainer.lora.rank > 0 with rollout.speculative.train_online=true: the draft's trainer "
                        "updates model weights LoRA keeps frozen: set rollout.speculative.train_online=false")
    if cfg.algo.name == "sft":
        problems.append("trainer.lora applies to RL (algo=sft trains the full model): set trainer.lora.rank=0")
    return problems


def _target_problems(cfg: RunCfg) -> list[str]:
    import torch

    from miles.models import CausalLM
    from miles.models.lora import candidate_names, find_targets

    with torch.device("meta"):  # vocab_size 0 (the tokenizer's) sizes nothing LoRA adapts
        model = CausalLM(cfg.model.arch(cfg.model.vocab_size or 1))
    if find_targets(model, cfg.trainer.lora.target_modules):
        return []
    return [f"trainer.lora.target_modules={list(cfg.trainer.lora.target_modules)} matches no projection of "
            f"model={cfg.model.name}; its decoder projections: {', '.join(candidate_names(model))}"]

