"""What `trainer.lora` (rank > 0) combines with, checked before anything starts (docs/lora.md). What
the external engines' own LoRA support serves is theirs to say (miles/rollout/vllm_lora.py,
sglang_lora.py)."""

from __future__ import annotations

import re

from miles.config.schema import RunCfg, TaskKind

# An adapter's name is a directory of its own in checkpoints (adapter/<name>/) and a metric suffix.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def lora_problems(cfg: RunCfg) -> list[str]:
    lo, r = cfg.trainer.lora, cfg.rollout
    if lo.rank < 0:
        return [f"trainer.lora.rank must be >= 0 (got {lo.rank}; 0 turns LoRA off)"]
    if lo.rank == 0:
        if lo.adapters or lo.adapter_key or lo.merge_in_engine:
            return ["trainer.lora.adapters / adapter_key / merge_in_engine are about adapters to train: set "
                    "trainer.lora.rank > 0 (e.g. trainer.lora.rank=16)"]
        return []
    problems = adapter_problems(cfg)
    if lo.alpha <= 0:
        problems.append(f"trainer.lora.alpha must be > 0 (got {lo.alpha})")
    if not 0 <= lo.dropout < 1:
        problems.append(f"trainer.lora.dropout must be in [0, 1) (got {lo.dropout})")
    if not lo.target_modules:
        problems.append("trainer.lora.target_modules must name at least one projection (e.g. [q_proj, v_proj])")
    elif not cfg.model.problems():  # the model's module names, from a meta-device build (no memory)
        problems += _target_problems(cfg)
    if r.weight_sync != "object_store":
        problems.append(f"trainer.lora.rank={lo.rank}: rollout.weight_sync={r.weight_sync.value} carries the whole "
                        "flat state dict; the adapters travel through rollout.weight_sync=object_store")
    problems += _precision_problems(cfg)
    if r.speculative.kind != "none" and r.speculative.train_online:
        problems.append("trainer.lora.rank > 0 with rollout.speculative.train_online=true: the draft's trainer "
                        "updates model weights LoRA keeps frozen: set rollout.speculative.train_online=false")
    if cfg.algo.name == "sft":
        problems.append("trainer.lora applies to RL (algo=sft trains the full model): set trainer.lora.rank=0")
    if cfg.debug.compare_weights_tensorwise:
        problems.append("debug.compare_weights_tensorwise=true compares the engine's model weights with what the "
                        "trainer syncs, which under trainer.lora are the adapters only (the checked sync hashes "
                        "them): set debug.compare_weights_tensorwise=false")
    return problems + _merge_problems(cfg)


def _precision_problems(cfg: RunCfg) -> list[str]:
    """QLoRA (docs/lora.md): under a recipe that quantizes the training forward (fp8, int4_qat) the
    trainer holds the frozen base in the rollout's format, so the two must be one format. Recipes that
    quantize the rollout only (bf16_train_*_rollout) train over a bf16 base as without LoRA."""
    lo, p = cfg.trainer.lora, cfg.precision
    problems = []
    if p.train_quant.value != "none" and p.train_quant != p.rollout_quant:
        problems.append(f"trainer.lora.rank={lo.rank} with precision.train_quant={p.train_quant.value}: the trainer "
                        "holds the frozen base in the rollout's format, "
                        f"precision.rollout_quant={p.rollout_quant.value}: set "
                        f"precision.train_quant={p.rollout_quant.value} (or precision=fp8 / int4_qat)")
    if p.forward_weights != "master":
        problems.append(f"trainer.lora.rank={lo.rank} with precision.forward_weights={p.forward_weights.value} is not "
                        "built yet (LoRA holds the frozen base once, as the default forward reads it): set "
                        "precision.forward_weights=master")
    return problems


def _merge_problems(cfg: RunCfg) -> list[str]:
    """trainer.lora.merge_in_engine: one adapter in the native engine's own weights."""
    lo = cfg.trainer.lora
    if not lo.merge_in_engine:
        return []
    problems = []
    if lo.adapters:
        problems.append(f"trainer.lora.merge_in_engine=true with trainer.lora.adapters={list(lo.adapters)}: several "
                        "adapters share one base, which cannot hold them all merged: set trainer.lora.merge_in_engine=false")
    if cfg.rollout.engine != "native":
        problems.append(f"trainer.lora.merge_in_engine=true merges in the native engine's weights; "
                        f"rollout={cfg.rollout.engine.value} applies adapters its own way: set "
                        "trainer.lora.merge_in_engine=false or rollout=native")
    if cfg.precision.rollout_quant.value != "none":
        problems.append(f"trainer.lora.merge_in_engine=true with precision={cfg.precision.name}: the engine holds the "
                        f"base quantized ({cfg.precision.rollout_quant.value}), which cannot hold W + alpha / rank * "
                        "B A exactly (each sync would round the sum to the quantized grid): set "
                        "trainer.lora.merge_in_engine=false (the adapters applied unmerged)")
    if cfg.true_on_policy:
        problems.append("trainer.lora.merge_in_engine=true with true_on_policy=true: the engine's W + alpha / rank * "
                        "B A rounds other sums than the trainer's unmerged adapters (1e-7 apart, not 0): set "
                        "trainer.lora.merge_in_engine=false")
    return problems


def _target_problems(cfg: RunCfg) -> list[str]:
    import torch

    from miles.models import CausalLM
    from miles.models.lora import candidate_names, find_expert_targets, find_targets

    lo = cfg.trainer.lora
    with torch.device("meta"):  # vocab_size 0 (the tokenizer's) sizes nothing LoRA adapts
        model = CausalLM(cfg.model.arch(cfg.model.vocab_size or 1))
    experts = find_expert_targets(model, lo.target_modules)
    if not experts and not find_targets(model, lo.target_modules):
        return [f"trainer.lora.target_modules={list(lo.target_modules)} matches no projection of "
                f"model={cfg.model.name}; its decoder projections: {', '.join(candidate_names(model))}"]
    # An entry naming experts that selects nothing would leave them silently unadapted (PEFT only
    # refuses a list that matches nothing at all).
    problems = [f"trainer.lora.target_modules entry {entry!r} names MoE experts, and model={cfg.model.name} has no "
                "stacked experts or projection it selects: drop it from trainer.lora.target_modules"
                for entry in lo.target_modules if "experts" in entry
                and not find_expert_targets(model, [entry]) and not find_targets(model, [entry])]
    if experts and cfg.rollout.engine != "native":
        problems.append(f"trainer.lora.target_modules adapts MoE experts ({experts[0][0]}, ...), which "
                        f"rollout={cfg.rollout.engine.value} does not load as LoRA here: set rollout=native or drop "
                        "the experts from trainer.lora.target_modules")
    if experts and lo.dropout > 0:
        problems.append(f"trainer.lora.dropout={lo.dropout} with MoE expert adapters: PEFT's adapters on stacked "
                        "tensors (target_parameters, the saved format) take no dropout: set trainer.lora.dropout=0")
    return problems



def adapter_problems(cfg: RunCfg) -> list[str]:
    """Several adapters (trainer.lora.adapters): their names, the record field that routes prompts to
    them, and what does not serve or train them per prompt yet."""
    lo, r = cfg.trainer.lora, cfg.rollout
    names = list(lo.adapters)
    if not names:
        if lo.adapter_key:
            return [f"trainer.lora.adapter_key={lo.adapter_key!r} routes prompts to trainer.lora.adapters, which "
                    "is empty: name the adapters (e.g. trainer.lora.adapters=[add,mul]) or unset adapter_key"]
        return []
    problems = [f"trainer.lora.adapters: {name!r} is not a valid adapter name (letters, digits, '_', '.', '-', "
                "starting with a letter or digit: it names a directory)"
                for name in names if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name)]
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        problems.append(f"trainer.lora.adapters names {repeated} more than once: each adapter once")
    if len(names) > 1 and not lo.adapter_key:
        problems.append(f"trainer.lora.adapters={names} needs trainer.lora.adapter_key: the prompt record field "
                        "whose value names each prompt's adapter (e.g. trainer.lora.adapter_key=adapter)")
    if lo.adapter_key and cfg.task.kind != TaskKind.file:  # image records keep no other fields yet
        problems.append(f"trainer.lora.adapter_key={lo.adapter_key!r} routes by a prompt record's field; "
                        f"task.kind={cfg.task.kind.value} has no record fields: use a prompt file (task.kind=file, "
                        "task.train_file) whose records carry the field")
    return problems
