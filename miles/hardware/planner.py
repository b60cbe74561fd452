"""Memory planner: does this run fit, per GPU, under which parallel layout — decided before launch.

    plan = make_plan(cfg)       # RunCfg -> Plan (layout chosen automatically where not given)
    plan.fits, plan.problems, plan.suggestions

Training is modelled as Megatron-style mixed precision with a distributed optimizer: dense weights
sharded by TP x PP, routed experts by EP x TP x PP (expert tensor parallel = TP, Megatron's default), AdamW state sharded over the data-parallel replicas
(or, with `trainer.offload_optimizer` on the torch trainer, its moments in host memory, the fp32
master on the device: miles/trainer/host_optimizer.py), activations per micro-batch (Korthikanti et al. 2022: 34 bytes x
hidden per token and layer with sequence parallelism and flash attention; only the layer inputs
are kept with recomputation) plus fp32 logits. A micro-batch has the tokens the trainer puts in
one (miles/trainer/packing.py), every sample at max_prompt_len + max_new_tokens: packed, up to
trainer.max_tokens_per_micro_batch; padded, micro_batch_size rows. A vision-language model adds
its vision tower (miles/hardware/vision_footprint.py): weights on both sides, gradients and optimizer
state when trained, the ViT's activations over the images of a micro-batch or of a generate call;
the image tokens themselves sit within max_prompt_len. Rollout: each engine of
`num_gpus_per_engine` GPUs holds all weights in the recipe's rollout format, a fixed workspace, and
a KV cache for as many sequences as fit. Colocated, the two phases take turns on the same GPUs as far as
`rollout.offload` / `trainer.offload` release the idle side's memory: the KV cache gets what the
trainer's resident state leaves, and the training peak plus what the engine keeps must fit; disaggregated,
each side has its own GPUs. On the CPU profile both live in the same RAM at once.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from miles.config.schema import (AlgoName, DType, EngineName, HardwareCfg, Quant, RunCfg, SpeculativeKind,
                                 TrainerBackend)
from miles.hardware.footprint import (ACT_BYTES_PER_HIDDEN, DTYPE_BYTES, ParamGroups, kv_bytes_per_token,
                                      param_groups, rollout_weight_bytes, state_bytes_per_sequence,
                                      dense_copy_bytes, train_bytes_per_param)
from miles.hardware.vision_footprint import (ImageTokens, image_tokens, rollout_vision_bytes,
                                             train_vision_bytes)
from miles.precision import dense_copy

GB = 1e9
ROLLOUT_WORKSPACE_GB = {"cuda": 4.0, "cpu": 0.5}  # decode activations, sampling buffers, CUDA graphs


@dataclass(frozen=True)
class TrainLayout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    offload: bool = False

    @property
    def model_parallel(self) -> bool:
        """Whether the model is split over devices (TP, PP, EP or CP > 1): no trainer backend runs that
        yet, so such a layout sizes a cluster (dry_run=true) and a launch refuses it."""
        return self.tp * self.pp * self.ep * self.cp > 1

    def describe(self, gpus: int) -> str:
        dp = gpus // (self.tp * self.pp * self.cp)
        text = f"TP={self.tp} PP={self.pp} EP={self.ep} CP={self.cp} DP={dp}"
        return text + (", optimizer state in host memory" if self.offload else "")


@dataclass(frozen=True)
class MicroBatchShape:
    tokens: int  # forward tokens of the largest micro-batch
    per_step: int  # micro-batches per optimizer step
    how: str  # how the trainer forms it, for the plan table


@dataclass
class Plan:
    fits: bool
    gpus: int  # devices in the job (1 on the CPU profile)
    capacity: float  # usable bytes per device (memory minus the margin)
    train_gpus: int
    rollout_gpus: int
    layout: TrainLayout
    train: dict[str, float]  # bytes per device by item
    gpus_per_engine: int
    rollout: dict[str, float]
    kv_sequences: int  # sequences one engine's KV cache holds
    sequences_per_engine: int  # sequences one engine must generate per step
    colocated: bool
    micro_batch: MicroBatchShape  # the training micro-batch the activations are sized for
    host_needed: float = 0.0  # bytes per node of host memory the plan needs
    host_capacity: float = 0.0
    offload: tuple[bool, bool] = (False, False)  # (rollout.offload, trainer.offload) as the plan decided them
    images: ImageTokens | None = None  # a vision-language model: one prompt's image tokens, and their source
    problems: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)

    @property
    def train_total(self) -> float:
        return sum(self.train.values())

    @property
    def rollout_total(self) -> float:
        return sum(self.rollout.values())


def _machine_ram() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _device_memory(hw: HardwareCfg) -> float:
    if hw.device == "cpu":
        return hw.memory_gb * GB or _machine_ram()
    return hw.memory_gb * GB or visible_gpu_memory()


def visible_gpu_memory() -> float:
    """Bytes of the first visible GPU (hardware.memory_gb: 0 on a GPU profile); 0 without one."""
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else 0.0


def model_arch(cfg: RunCfg):
    """The architecture the run will build: the checkpoint's config.json when one is given."""
    if cfg.model.hf_checkpoint:
        from miles.models import from_hf_config

        return from_hf_config(json.loads((Path(cfg.model.hf_checkpoint) / "config.json").read_text()))
    return cfg.model.arch(cfg.model.vocab_size or 1)


def _seq_len(cfg: RunCfg) -> int:
    return cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens


def micro_batch_shape(cfg: RunCfg, arch) -> MicroBatchShape:
    """The largest micro-batch the trainer forms (miles/trainer/packing.py) when every sample is
    max_prompt_len + max_new_tokens long."""
    t, r = cfg.trainer, cfg.rollout
    seq = _seq_len(cfg)
    step = t.global_batch_size * seq  # no micro-batch holds more than its optimizer step
    # The families CausalLM.supports_packing lets pack; the others train padded whatever the config
    # says, as does true on-policy mode (its batch-invariant kernels run on padded rows).
    if cfg.true_on_policy or not (t.pack_sequences and arch.linear_attn is None and arch.dsa is None
                                  and arch.llama4 is None):
        tokens = t.micro_batch_size * seq
        how = f"micro-batch {t.micro_batch_size} x {seq:,} tokens, padded"
        return MicroBatchShape(tokens, max(1, step // tokens), how)
    # Packed: rows fill up to max_tokens_per_micro_batch (micro_batch_size is unused), but what cannot
    # be split gets a micro-batch of its own: a sample, or on the masked kernel with shared prompts a
    # prompt and all its responses, laid out in one row.
    if t.share_prompts and not _varlen(cfg, arch):
        unit = r.max_prompt_len + r.n_samples_per_prompt * r.max_new_tokens
        what = f"a prompt + its {r.n_samples_per_prompt} responses in one row (share_prompts)"
    else:
        unit, what = seq, "one sequence"
    tokens = min(step, max(t.max_tokens_per_micro_batch, unit))
    if tokens == step:
        how = f"packed: the whole step, {t.global_batch_size} x {seq:,} tokens"
    elif tokens > t.max_tokens_per_micro_batch:
        how = f"packed: {what}, {tokens:,} tokens (> max_tokens_per_micro_batch)"
    else:
        how = f"packed: {tokens:,} tokens (max_tokens_per_micro_batch) of {seq:,}-token sequences"
    return MicroBatchShape(tokens, max(1, step // tokens), how)


def _varlen(cfg: RunCfg, arch) -> bool:
    """Whether packed rows take the variable-length kernel (miles/models/packed.py uses_varlen and
    plan_micro_batches' GQA-only check), assuming FlashAttention is installed on a CUDA machine."""
    return (cfg.hardware.device == "cuda" and cfg.precision.train_dtype == DType.bf16 and arch.mla is None
            and arch.head_dim % 8 == 0 and arch.head_dim <= 256)


def train_usage(cfg: RunCfg, groups: ParamGroups, layout: TrainLayout, gpus: int) -> dict[str, float]:
    """Bytes per training device under `layout` on `gpus` devices."""
    arch, t, p = model_arch(cfg), cfg.trainer, cfg.precision
    w, g, o = train_bytes_per_param(p)
    tp, pp, ep, cp = layout.tp, layout.pp, layout.ep, layout.cp
    # With PP the embedding sits on the first stage and the head on the last: a stage holds one of them.
    embed = groups.embed / tp / (2 if pp > 1 and not arch.tie_word_embeddings else 1)
    # Experts are sharded by EP and, as Megatron-core does by default, by TP again inside each expert.
    dense, routed = groups.dense / (tp * pp), groups.routed / (ep * tp * pp)
    dp_dense, dp_expert = gpus // (tp * pp * cp), gpus // (ep * tp * pp)
    optimizer = (embed + dense) * o / dp_dense + routed * o / dp_expert
    if layout.offload:  # trainer.offload_optimizer: the 8 bytes of AdamW moments wait in host memory
        optimizer *= (o - 8) / o
    stage_layers = math.ceil(arch.num_layers / pp)
    micro = micro_batch_shape(cfg, arch)
    tokens = micro.tokens / cp
    act_scale = DTYPE_BYTES[p.train_dtype] / 2  # the constant is for 2-byte activations
    per_layer = tokens * arch.hidden_size * ACT_BYTES_PER_HIDDEN * act_scale / tp
    if t.recompute:  # keep each layer's input, recompute one layer at a time in backward
        layers_act = stage_layers * tokens * arch.hidden_size * 2 * act_scale / tp + per_layer
    else:
        layers_act = stage_layers * per_layer
    usage = {
        "weights": (embed + dense + routed) * w,
        "gradients": (embed + dense + routed) * g,
        "optimizer": optimizer,
        # 1F1B: the first stage holds up to PP micro-batches in flight.
        "activations": layers_act * min(pp, micro.per_step),
        "logits": tokens * arch.vocab_size * 4 * 2 / tp,  # fp32 logits and their gradient
    }
    tower = {}
    if arch.vision is not None:  # weights (+ gradients, optimizer when trained) and ViT activations
        tower = train_vision_bytes(cfg, arch, tp, dp_dense, max(1, micro.tokens // _seq_len(cfg)))
        if layout.offload:
            tower["optimizer"] = 0.0
        for item, value in tower.items():
            usage[item] = usage.get(item, 0.0) + value
    if cfg.algo.kl_coef > 0:  # frozen reference policy (tower included), sharded like the weights
        usage["reference"] = (embed + dense + routed) * w + tower.get("weights", 0.0)
    # The critic is a whole value model, fully trained under LoRA too (miles/trainer/critic.py): counted
    # as the policy's full fine-tuning.
    critic = usage["weights"] + usage["gradients"] + usage["optimizer"]
    if t.lora.rank > 0:  # LoRA: a frozen base in the training dtype; fp32 adapters with gradients and AdamW
        from miles.hardware.lora_footprint import lora_params, megatron_fp8_dense, quantized_base

        adapters = lora_params(arch, t.lora.rank, t.lora.target_modules, len(t.lora.adapters)) / (tp * pp)
        # QLoRA: the projections in the rollout format, the rest fp32 masters (Megatron: in the training
        # dtype, and under fp8 the fused weights whose blocks mix native blocks dense too:
        # miles/trainer/megatron/held_base.py).
        if p.train_quant != Quant.none:
            megatron = t.backend == TrainerBackend.megatron
            q_params, q_bytes = quantized_base(arch, p)
            if megatron and p.train_quant == Quant.fp8:
                dense_params, dense_bytes = megatron_fp8_dense(arch, p)
                q_params, q_bytes = q_params - dense_params, q_bytes - dense_bytes
            base = (embed + dense + routed - q_params / (tp * pp)) * (w if megatron else 4) + q_bytes / (tp * pp)
            usage["weights"] = base + tower.get("weights", 0.0)
            if "reference" in usage:  # the KL reference is held as the policy's base
                usage["reference"] = usage["weights"]
        elif cfg.true_on_policy:  # the base kept as the fp32 masters the engine runs (miles/trainer/lora.py)
            usage["weights"] = (embed + dense + routed) * 4 + tower.get("weights", 0.0)
        if t.backend == TrainerBackend.fsdp:  # each rank a shard of the frozen base (the codes too) and reference;
            for item in ("weights", "reference"):  # the adapters replicated (miles/trainer/fsdp_qlora.py)
                if item in usage:
                    usage[item] /= t.num_ranks
        usage["weights"] += adapters * 4
        usage["gradients"] = adapters * 4
        usage["optimizer"] = 0.0 if layout.offload else adapters * 8
    if cfg.algo.name == getattr(AlgoName, "ppo", None):  # the critic: a second trained model
        # Several LoRA adapters: a critic each (miles.trainer.critic.Critics).
        usage["critic"] = critic * (max(1, len(t.lora.adapters)) if t.lora.rank > 0 else 1)
    return usage


def rollout_usage(cfg: RunCfg, groups: ParamGroups, gpus_per_engine: int, capacity: float
                  ) -> tuple[dict[str, float], int, float]:
    """(bytes per rollout device by item, sequences the KV cache holds, KV bytes per sequence
    per device). The KV cache gets what weights, workspace (and a vision tower) leave of `capacity`."""
    arch, hw = model_arch(cfg), cfg.hardware
    # True on-policy: the engine holds the trainer's fp32 masters and caches keys in fp32 (run.py).
    precision = replace(cfg.precision, rollout_dtype=DType.fp32) if cfg.true_on_policy else cfg.precision
    weights = rollout_weight_bytes(groups, precision) / gpus_per_engine
    workspace = ROLLOUT_WORKSPACE_GB["cpu" if hw.device == "cpu" else "cuda"] * GB
    kv_dtype = DTYPE_BYTES[precision.rollout_dtype]
    per_seq = (kv_bytes_per_token(arch, kv_dtype) * _seq_len(cfg) + state_bytes_per_sequence(arch)) / gpus_per_engine
    usage = {"weights": weights, "workspace": workspace}
    if _engine_holds_copies(cfg, cfg.rollout.dense_weight_copies):
        usage["dense copies"] = dense_copy_bytes(groups, precision) / gpus_per_engine
    if arch.vision is not None:
        usage.update(rollout_vision_bytes(cfg, arch, gpus_per_engine))
    free = capacity - sum(usage.values())
    kv_sequences = max(0, int(free // per_seq)) if per_seq else 0
    return usage, kv_sequences, per_seq


def _layout_candidates(cfg: RunCfg, gpus: int) -> list[TrainLayout]:
    arch, t, hw = model_arch(cfg), cfg.trainer, cfg.hardware
    per_node = max(1, hw.gpus_per_node)
    powers = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    tps = [t.tp] if t.tp else [x for x in powers if x <= per_node and arch.num_heads % x == 0]
    pps = [t.pp] if t.pp else [x for x in powers if x <= arch.num_layers]
    experts = arch.moe.num_experts if arch.moe else 1
    eps = [t.ep] if t.ep else [x for x in powers if x <= experts and experts % x == 0]
    # Only the torch trainer streams its optimizer state from host memory (miles/trainer/host_optimizer.py).
    offloads = [t.offload_optimizer] if t.offload_optimizer is not None else \
        [False, True] if t.backend == TrainerBackend.torch and hw.device != "cpu" else [False]
    out = []
    for tp, pp, ep, offload in itertools.product(tps, pps, eps, offloads):
        if gpus % (tp * pp * t.cp) == 0 and gpus % (ep * tp * pp) == 0:
            out.append(TrainLayout(tp, pp, ep, t.cp, offload))
    return out


def host_bytes_per_node(cfg: RunCfg, usage: dict[str, float], layout: TrainLayout, gpus: int,
                        colocated: bool) -> float:
    """Host memory a node needs: colocated with `trainer.offload`, the trainer's persistent state
    (weights, optimizer, reference, critic; gradients are rebuilt every step) waits there during
    rollout; an offloaded optimizer lives there always."""
    per_gpu = _trainer_state_bytes(usage) if colocated and cfg.trainer.offload else 0.0
    if layout.offload:
        per_gpu += _optimizer_bytes(cfg, layout, gpus)
    return per_gpu * max(1, cfg.hardware.gpus_per_node)


def _optimizer_bytes(cfg: RunCfg, layout: TrainLayout, gpus: int) -> float:
    """What trainer.offload_optimizer keeps in host memory: the optimizer bytes that leave the device."""
    groups = param_groups(model_arch(cfg), cfg.precision)
    resident, offloaded = (train_usage(cfg, groups, replace(layout, offload=o), gpus) for o in (False, True))
    return resident["optimizer"] - offloaded["optimizer"]


def _choose_layout(cfg, groups, gpus, capacity, host_capacity, colocated) -> tuple[TrainLayout, dict[str, float], bool]:
    """The fitting layout a trainer backend runs first (no model parallelism: every backend holds the
    whole model in each process), then the least model parallelism; within those no offload first,
    then the smallest TP x PP, then the least memory. The least-memory layout when none fits."""
    scored = []
    for layout in _layout_candidates(cfg, gpus):
        usage = train_usage(cfg, groups, layout, gpus)
        host = host_bytes_per_node(cfg, usage, layout, gpus, colocated)
        scored.append((layout, usage, sum(usage.values()), host))
    if not scored:
        return TrainLayout(max(1, cfg.trainer.tp), max(1, cfg.trainer.pp), max(1, cfg.trainer.ep)), {}, False
    fitting = [s for s in scored if s[2] <= capacity and (not host_capacity or s[3] <= host_capacity)]
    if fitting:
        layout, usage, _, _ = min(fitting, key=lambda s: (s[0].model_parallel, s[0].offload, s[0].tp * s[0].pp, s[2]))
        return layout, usage, True
    layout, usage, _, _ = min(scored, key=lambda s: (s[2] > capacity, s[2]))
    return layout, usage, False


def _engine_candidates(cfg: RunCfg, rollout_gpus: int) -> list[int]:
    if cfg.rollout.num_gpus_per_engine:
        return [cfg.rollout.num_gpus_per_engine]
    return [g for g in (1, 2, 4, 8, 16, 32, 64, 128) if g <= rollout_gpus and rollout_gpus % g == 0]


def resolve_memory_choices(cfg: RunCfg) -> RunCfg:
    """`cfg` with the null memory keys decided by the plan: `rollout.dense_weight_copies` first
    (`_resolve_dense_copies`), then `rollout.offload` / `trainer.offload` and
    `trainer.offload_optimizer` (`_resolve_offload`)."""
    return _resolve_offload(_resolve_dense_copies(cfg))


def _resolve_dense_copies(cfg: RunCfg) -> RunCfg:
    """A null `rollout.dense_weight_copies` decided: on where the auto rule wants them (a native engine
    on CUDA of a weight-only recipe, more than 256 rows a rollout batch, not true on-policy:
    miles/precision/dense_copy.py `wanted`) and the run still fits with them, off otherwise. The
    copies buy speed with memory; they never make a run that fits without them not fit."""
    r = cfg.rollout
    if r.dense_weight_copies is not None:
        return cfg

    def choice(on: bool) -> RunCfg:
        return replace(cfg, rollout=replace(r, dense_weight_copies=on))

    with_copies = choice(True)
    fits = _engine_holds_copies(cfg, None) and _plan(_resolve_offload(with_copies), suggest=False).fits
    return with_copies if fits else choice(False)


def _engine_holds_copies(cfg: RunCfg, setting: bool | None) -> bool:
    """Whether the rollout engine holds dense copies under `setting` (as NativeEngine decides: never
    under true on-policy; miles/precision/dense_copy.py `wanted`)."""
    r, p = cfg.rollout, cfg.precision
    return r.engine == EngineName.native and not cfg.true_on_policy and dense_copy.wanted(
        setting, cfg.hardware.device, p.rollout_quant.value, p.fp8_scheme.value, r.batch_size * r.n_samples_per_prompt)


def _resolve_offload(cfg: RunCfg) -> RunCfg:
    """`cfg` with `rollout.offload` / `trainer.offload` decided where null: off on the CPU and when the
    sides do not take turns (disaggregated, asynchronous); on colocated GPUs the first of (neither,
    the engine, the trainer, both) whose plan fits, among what the backends can release. A null
    `trainer.offload_optimizer` is then the chosen layout's: on only where the plan needs it."""
    resolved = _resolve_turns(cfg)
    if resolved.trainer.offload_optimizer is None:
        needed = resolved.hardware.device != "cpu" and _plan(resolved, suggest=False).layout.offload
        resolved = replace(resolved, trainer=replace(resolved.trainer, offload_optimizer=needed))
    return resolved


def _resolve_turns(cfg: RunCfg) -> RunCfg:
    r, t = cfg.rollout.offload, cfg.trainer.offload
    if r is not None and t is not None:
        return cfg

    def choice(engine: bool, trainer: bool) -> RunCfg:
        return replace(cfg, rollout=replace(cfg.rollout, offload=engine), trainer=replace(cfg.trainer, offload=trainer))

    if cfg.hardware.device == "cpu" or not cfg.rollout.colocate or cfg.rollout.asynchronous:
        return choice(bool(r), bool(t))
    candidates = [choice(e, tr) for tr in ([t] if t is not None else [False, True])
                  for e in ([r] if r is not None else [False, True])]
    allowed = [c for c in candidates if _can_offload(c)] or candidates[:1]
    return next((c for c in allowed if _plan(c, suggest=False).fits), allowed[-1])


def _can_offload(cfg: RunCfg) -> bool:
    """Whether the backends release what `cfg` asks them to on a colocated, synchronous GPU run
    (as miles/config/rules.py's offload rules accept)."""
    r, t = cfg.rollout, cfg.trainer
    if t.offload and t.backend != TrainerBackend.torch:
        return False
    return not (r.offload and ((r.engine == EngineName.vllm and not r.vllm.enable_sleep_mode)
                               or (r.speculative.kind == SpeculativeKind.draft_model and r.speculative.train_online)))


def make_plan(cfg: RunCfg, suggest: bool = True) -> Plan:
    """The plan of `cfg` with its null memory keys decided (`resolve_memory_choices`); `Plan.offload`
    says how the sides take turns."""
    return _plan(resolve_memory_choices(cfg), suggest)


def _plan(cfg: RunCfg, suggest: bool = True) -> Plan:
    hw, r = cfg.hardware, cfg.rollout
    groups = param_groups(model_arch(cfg), cfg.precision)
    on_cpu = hw.device == "cpu"
    gpus = 1 if on_cpu else hw.num_nodes * hw.gpus_per_node
    capacity = _device_memory(hw) * (1 - hw.memory_margin)
    colocated = on_cpu or r.colocate
    rollout_gpus = gpus if colocated else (r.num_gpus or gpus // 2)
    train_gpus = gpus if colocated else gpus - rollout_gpus
    problems: list[str] = []
    if train_gpus < 1 or rollout_gpus < 1:
        problems.append(f"rollout.num_gpus={rollout_gpus} leaves {train_gpus} GPUs for training; "
                        f"disaggregated runs need both sides")
        train_gpus, rollout_gpus = max(1, train_gpus), max(1, rollout_gpus)

    sequences = r.batch_size * r.n_samples_per_prompt
    engine_options = []
    for g in _engine_candidates(cfg, rollout_gpus):
        usage, kv_seqs, _ = rollout_usage(cfg, groups, g, capacity)
        engine_options.append((g, usage, kv_seqs, math.ceil(sequences / max(1, rollout_gpus // g))))
    if rollout_gpus % engine_options[0][0]:
        problems.append(f"rollout.num_gpus_per_engine={engine_options[0][0]} must divide the {rollout_gpus} rollout GPUs")
    # Smallest engine whose KV cache holds its whole share of the batch, else the smallest that
    # holds at least one sequence, else (refused) the one asked for / the largest.
    full = [o for o in engine_options if o[2] >= o[3]]
    some = [o for o in engine_options if o[2] >= 1]
    g, rollout, kv_seqs, per_engine = (full or some or engine_options[-1:])[0]

    if on_cpu:
        # One process pair shares the RAM: no offload, both sides resident together.
        layout = TrainLayout()
        train = train_usage(cfg, groups, layout, 1)
        rollout_cap = capacity - sum(train.values())
        rollout, kv_seqs, _ = rollout_usage(cfg, groups, 1, rollout_cap)
    else:
        host_capacity = hw.host_memory_gb * GB * (1 - hw.memory_margin)
        layout, train, _ = _choose_layout(cfg, groups, train_gpus, capacity, host_capacity, colocated)
        if colocated:  # the trainer's state stays on the GPU during rollout unless trainer.offload
            rollout, kv_seqs, _ = rollout_usage(cfg, groups, g, capacity - _trainer_idle_bytes(cfg, train))
    plan = Plan(False, gpus, capacity, train_gpus, rollout_gpus, layout, train, g, rollout, kv_seqs,
                per_engine, colocated, micro_batch_shape(cfg, model_arch(cfg)), problems=problems,
                offload=(bool(r.offload), bool(cfg.trainer.offload)))
    arch = model_arch(cfg)
    if arch.vision is not None:
        plan.images = image_tokens(cfg, arch)
        if plan.images.merged > r.max_prompt_len:  # the KV cache and activations are sized by max_prompt_len
            problems.append(f"rollout.max_prompt_len={r.max_prompt_len} is shorter than one prompt's "
                            f"{plan.images.merged} image tokens ({plan.images.source}): raise it")
    if on_cpu and plan.train_total + plan.rollout_total > capacity or not on_cpu and plan.train_total > capacity:
        need = plan.train_total + (plan.rollout_total if on_cpu else 0)
        where = "this machine's RAM" if on_cpu else f"one of {train_gpus} GPUs at the best layout ({layout.describe(train_gpus)})"
        problems.append(f"training state does not fit: {need / GB:,.1f} GB needed on {where}, "
                        f"{capacity / GB:,.1f} GB usable")
    if colocated and not on_cpu and train:
        problems += _colocation_problems(cfg, plan)
    if kv_seqs < 1:
        unit = ("device" if on_cpu else "GPU") + ("s" if g > 1 else "")
        problems.append(f"one rollout engine's weights do not fit {g} {unit}: "
                        f"{plan.rollout_total * g / GB:,.1f} GB of weights + workspace, "
                        f"{capacity * g / GB:,.1f} GB usable, no room left for a KV cache")
    if not on_cpu:
        plan.host_needed = host_bytes_per_node(cfg, train, layout, train_gpus, colocated)
        plan.host_capacity = host_capacity
        if hw.host_memory_gb and plan.host_needed > plan.host_capacity:
            problems.append(f"host memory per node: {plan.host_needed / GB:,.0f} GB needed for offloaded "
                            f"state, {plan.host_capacity / GB:,.0f} GB usable")
    plan.fits = not problems
    if not plan.fits and suggest:
        plan.suggestions = _suggestions(cfg, plan)
    return plan


def _trainer_state_bytes(train: dict[str, float]) -> float:
    """Per GPU, the trainer's state that outlives a step (gradients are freed after each)."""
    return sum(train.get(k, 0.0) for k in ("weights", "optimizer", "reference", "critic"))


def _trainer_idle_bytes(cfg: RunCfg, train: dict[str, float]) -> float:
    """Per GPU, what the trainer keeps on a colocated GPU while the engine generates: its state, or
    nothing when `trainer.offload` moves it to host memory."""
    return 0.0 if cfg.trainer.offload else _trainer_state_bytes(train)


def _engine_idle_bytes(cfg: RunCfg, plan: Plan) -> float:
    """Per GPU, what the engine keeps while the trainer trains: its weights, workspace and the KV cache
    of the slots it decodes (miles/rollout/native.py sizes them so), or nothing with `rollout.offload`."""
    r = cfg.rollout
    if r.offload:
        return 0.0
    slots = min(plan.kv_sequences, max(r.max_running, r.n_samples_per_prompt))
    per_seq = rollout_usage(cfg, param_groups(model_arch(cfg), cfg.precision), plan.gpus_per_engine, 0.0)[2]
    return plan.rollout_total + slots * per_seq


def _colocation_problems(cfg: RunCfg, plan: Plan) -> list[str]:
    """Colocated, the sides take turns only as far as rollout.offload / trainer.offload release memory:
    the training peak plus what the engine keeps must fit, as the rollout's needs beside the trainer's
    state (the KV budget above) do."""
    engine_idle = _engine_idle_bytes(cfg, plan)
    if not engine_idle or plan.train_total + engine_idle <= plan.capacity:
        return []
    return [f"colocated, the engine keeps {engine_idle / GB:,.1f} GB (weights, KV cache) on the GPU while the "
            f"trainer needs {plan.train_total / GB:,.1f} GB: {plan.capacity / GB:,.1f} GB usable"]


def _activation_suggestions(cfg: RunCfg) -> list[str]:
    """The training state does not fit: recompute (if off), or else the largest micro-batch, halved
    from the configured one, that fits (with recompute when that helps too)."""
    t = cfg.trainer
    recomputed = replace(cfg, trainer=replace(t, recompute=True))
    if not t.recompute and _plan(recomputed, suggest=False).fits:
        return ["trainer.recompute=true (each layer's activations recomputed in backward)"]
    packed = micro_batch_shape(cfg, model_arch(cfg)).how.startswith("packed")
    key = "max_tokens_per_micro_batch" if packed else "micro_batch_size"
    bases = [(cfg, "")] if t.recompute else [(cfg, ""), (recomputed, " trainer.recompute=true")]
    size = getattr(t, key) // 2
    while size >= 1:
        for base, also in bases:
            smaller = replace(base, trainer=replace(base.trainer, **{key: size}))
            if _plan(smaller, suggest=False).fits:
                return [f"trainer.{key}={size}{also} (the largest halving of the micro-batch that fits)"]
        size //= 2
    return []


def _suggestions(cfg: RunCfg, plan: Plan) -> list[str]:
    """What to change: the smallest engine or node count that fits, or a lighter rollout format."""
    out = []
    hw = cfg.hardware
    if plan.kv_sequences < 1 and hw.device != "cpu":
        groups = param_groups(model_arch(cfg), cfg.precision)
        for g in (2, 4, 8, 16, 32, 64, 128):
            if g > plan.gpus_per_engine and plan.rollout_gpus % g == 0:
                if rollout_usage(cfg, groups, g, plan.capacity)[1] >= 1:
                    out.append(f"rollout.num_gpus_per_engine={g} (the smallest engine that holds the weights)")
                    break
        for recipe, quant in (("fp8", Quant.fp8), ("int4_qat", Quant.int4)):
            if cfg.precision.rollout_quant != quant:
                lighter = replace(cfg, precision=replace(cfg.precision, rollout_quant=quant))
                groups = param_groups(model_arch(lighter), lighter.precision)
                if rollout_usage(lighter, groups, plan.gpus_per_engine, plan.capacity)[1] >= 1:
                    out.append(f"precision={recipe} (its rollout weights fit the same engine)")
    if any(p.startswith("colocated") for p in plan.problems):
        for engine, trainer in ((True, False), (False, True), (True, True)):
            turns = replace(cfg, rollout=replace(cfg.rollout, offload=engine or cfg.rollout.offload),
                            trainer=replace(cfg.trainer, offload=trainer or cfg.trainer.offload))
            if turns != cfg and _can_offload(turns) and _plan(turns, suggest=False).fits:
                keys = [k for k, on in (("rollout.offload", engine), ("trainer.offload", trainer)) if on]
                out.append(" ".join(f"{k}=true" for k in keys) + " (the sides take turns on the GPU)")
                break
    if any(p.startswith("training state") for p in plan.problems):
        out += _activation_suggestions(cfg)
    if any(p.startswith(("training state", "host memory", "colocated")) for p in plan.problems):
        if hw.device == "cpu":
            out.append("a *_tiny model config (docs/models.md) or a GPU hardware profile")
        else:
            for nodes in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
                if nodes > hw.num_nodes:
                    bigger = replace(cfg, hardware=replace(hw, num_nodes=nodes))
                    if make_plan(bigger, suggest=False).fits:
                        out.append(f"hardware.num_nodes={nodes} (the smallest power of two that fits)")
                        break
    return out
