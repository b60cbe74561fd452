"""Typed schema of the Miles config tree.

The dataclasses below are registered in Hydra's ConfigStore (`miles.config.store`); the YAML files
under `conf/` hold the values. Hydra merges each group file into its typed node, so an unknown key or
a value of the wrong type fails at composition time. `launch.py` converts the composed config once
with `OmegaConf.to_object`; every component below it receives the dataclass of its own section.
Cross-field rules live in `miles.config.rules` (run, with the components' own, by `miles.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from miles.choice import Choice
from miles.models.config import ArchConfig
from miles.transport.protocol import TransportName  # rollout.weight_sync: the transports' registry names them


class EngineName(Choice):
    """rollout=<name>: the rollout engine (conf/rollout/<name>.yaml carries its options)."""

    native = "native"  # ours: miles/rollout/native.py
    vllm = "vllm"  # vLLM's offline LLM in the engine's process (rollout.vllm.*)
    sglang = "sglang"  # an SGLang server over HTTP (rollout.sglang.*)


class TrainerBackend(Choice):
    """trainer=<name>: the trainer backend (conf/trainer/<name>.yaml)."""

    torch = "torch"  # one process
    fsdp = "fsdp"  # trainer.num_ranks FSDP2 ranks as Ray actors
    megatron = "megatron"  # Megatron-core on one GPU


class SpeculativeKind(Choice):
    """rollout.speculative.kind: the native engine's draft-and-verify decoding."""

    none = "none"
    mtp = "mtp"  # the model's MTP modules (model.mtp_layers > 0)
    draft_model = "draft_model"  # a small model (rollout.speculative.draft_model)


class SGLangWeightUpdate(Choice):
    """rollout.sglang.weight_update: how new weights reach the SGLang server."""

    disk = "disk"  # safetensors + /update_weights_from_disk
    tensor = "tensor"  # /update_weights_from_tensor (same host)


class ForwardWeights(Choice):
    """precision.forward_weights: what the training forward multiplies."""

    master = "master"  # the fp32 master weights, autocast to train_dtype at each matmul
    rollout = "rollout"  # the weights cast to rollout_dtype, as the engine holds them


class FP8Gemm(Choice):
    """precision.fp8_gemm: the kernel both sides multiply FP8 operands with (miles/precision/fp8_gemm.py)."""

    auto = "auto"  # DeepGEMM, then torch._scaled_mm, then the emulated GEMM: the first that passes the probe
    triton = "triton"  # the project's batch-invariant Triton GEMM: a row's bits independent of the row count
    scaled_mm = "scaled_mm"  # cuBLASLt's blockwise kernel (Hopper)
    deep_gemm = "deep_gemm"
    emulated = "emulated"  # dequantize, then F.linear (any device)


class FP8Scheme(Choice):
    """precision.fp8_scheme: what an FP8 recipe quantizes (docs/precision.md)."""

    w8a8 = "w8a8"  # weights in 128x128 blocks and activations in 1x128 tiles: FP8 tensor-core GEMMs
    w8a16 = "w8a16"  # FP8 weights, bf16 activations: half the weight bytes, bf16's train / rollout mismatch


class FP8Backward(Choice):
    """precision.fp8_backward: the dtype of the FP8 linears' backward GEMMs (docs/precision.md)."""

    bf16 = "bf16"  # dgrad and wgrad in the compute dtype, on the dequantized operands
    fp8 = "fp8"  # DeepSeek-V3's: output gradients and inputs in 1x128 tiles, the weight's 128x128 blocks


class TrackingBackend(Choice):
    """tracking.backend: where metrics and the run record go."""

    mlflow = "mlflow"


class DType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class AlgoName(str, Enum):
    """The preset's name; every name but sft runs the RL loop."""

    grpo = "grpo"
    dr_grpo = "dr_grpo"
    dapo = "dapo"
    gspo = "gspo"
    reinforce_pp = "reinforce_pp"
    reinforce_pp_baseline = "reinforce_pp_baseline"
    rloo = "rloo"
    cispo = "cispo"
    ppo = "ppo"
    opd = "opd"
    sft = "sft"


class Quant(str, Enum):
    none = "none"
    fp8 = "fp8"  # e4m3, 128x128 weight blocks / 1x128 activation tiles (DeepSeek-V3, SGLang)
    int4 = "int4"  # W4A16 symmetric group quantization


class TaskKind(str, Enum):
    arithmetic = "arithmetic"  # built-in synthetic task (seeded, exact-match reward, held-out split)
    file = "file"  # user prompt data in JSONL / Parquet
    images = "images"  # JSONL / Parquet records whose prompt holds image parts (vision-language models)
    shape_count = "shape_count"  # built-in visual task: count the shapes of one colour (seeded images)


@dataclass
class ModelCfg(ArchConfig):
    """conf/model/*.yaml: the architecture (every ArchConfig field, feature blocks included) plus
    the config's name and an optional checkpoint whose config.json replaces the sizes."""

    name: str = MISSING
    hf_checkpoint: Optional[str] = None

    def __post_init__(self) -> None:
        pass  # `validate()` reports ArchConfig.problems() with every other config error

    def arch(self, vocab_size: int, **token_ids) -> ArchConfig:
        """The ArchConfig of these sizes; vocab_size 0 in the YAML means the tokenizer's size."""
        values = {f.name: getattr(self, f.name) for f in fields(ArchConfig)}
        return ArchConfig(**{**values, "vocab_size": self.vocab_size or vocab_size, **token_ids})


@dataclass
class AlgoCfg:
    name: AlgoName = MISSING
    advantage: str = "grpo"
    policy_loss: str = "ppo_clip"
    norm_adv_by_std: bool = True
    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    num_steps_per_rollout: int = 1
    loss_agg: str = "token_mean"
    dual_clip_c: Optional[float] = None
    # the engine's log-probs are the old policy (PPO's ratio and clip against the behaviour policy);
    # None: true with rollout.asynchronous and max_staleness > 0 (batches from a policy behind)
    use_rollout_logprobs: Optional[bool] = None
    tis: str = "none"
    tis_clip: float = 2.0
    mis: str = "none"
    mis_low: float = 0.5
    mis_high: float = 2.0
    dynamic_sampling: bool = False
    max_draws: int = 4
    overlong_buffer: int = 0
    reward_clip: Optional[float] = None
    kl_in_reward: bool = False
    gamma: float = 1.0
    lam: float = 0.95
    opd_kl_coef: float = 0.0
    teacher_checkpoint: Optional[str] = None
    # MoE routing replay: none; r3 = the trainer routes by the experts the rollout engine chose
    # (recorded per token in the rollout); r2 = the update forwards route as the old-log-prob pass did.
    routing_replay: str = "none"


@dataclass
class CriticCfg:
    """The PPO value model; used when `algo.advantage` needs one (gae)."""

    lr: float = 1e-3
    value_clip: Optional[float] = 0.2
    warmup_steps: int = 0
    updates_per_step: int = 1


@dataclass
class PrecisionCfg:
    name: str = MISSING
    train_dtype: DType = DType.fp32
    rollout_dtype: DType = DType.fp32
    train_quant: Quant = Quant.none
    rollout_quant: Quant = Quant.none
    int4_group_size: int = 128
    # Regexes (re.search on parameter names) of tensors never quantized; miles.precision's defaults.
    keep_high_precision: List[str] = field(
        default_factory=lambda: ["embed_tokens", "lm_head", "norm", r"(^|\.)(gate|router)\.weight$",
                                 "shared_expert_gate", "conv1d", r"^visual\.", "weights_proj"])
    keep_first_layers: int = 0
    keep_last_layers: int = 0
    # What the training forward multiplies: "master" (the fp32 master weights, autocast to train_dtype
    # at each matmul) or "rollout" (the weights cast to rollout_dtype, as the engine holds them).
    forward_weights: ForwardWeights = ForwardWeights.master
    # Under a bf16 train_dtype: the residual stream (embeddings, residual adds, the norms' inputs) in
    # fp32 (true), or in bf16 as the engine's bf16 weights compute it (false: Megatron's default too).
    fp32_residual: bool = False
    # The FP8 GEMM of the engine and of the fp8 training forward (one choice: both sides run it).
    fp8_gemm: FP8Gemm = FP8Gemm.auto
    # FP8 weights with FP8 (w8a8) or bf16 (w8a16) activations, on both sides (fp8 recipes only).
    fp8_scheme: FP8Scheme = FP8Scheme.w8a8
    # The FP8 linears' backward GEMMs: bf16 (the compute dtype) or fp8 (fp8 training recipes only).
    fp8_backward: FP8Backward = FP8Backward.bf16


@dataclass
class HardwareCfg:
    name: str = MISSING
    device: str = "cpu"
    num_nodes: int = 1
    gpus_per_node: int = 0
    cpu_threads: int = 2
    memory_gb: float = 0.0  # per GPU; 0 on the CPU profile: this machine's RAM
    host_memory_gb: float = 0.0  # CPU RAM per node (offload target); 0: this machine's RAM
    intra_node_gbps: float = 0.0
    inter_node_gbps: float = 0.0
    peak_tflops_bf16: float = 0.0
    peak_tflops_fp8: float = 0.0
    peak_tflops_fp4: float = 0.0
    precisions: List[str] = field(default_factory=lambda: ["fp32", "bf16"])
    memory_margin: float = 0.1


@dataclass
class SandboxCfg:
    """Limits of one sandboxed run of model-written code (the code reward, the python tool)."""

    wall_time_s: float = 10.0  # killed after this long, whatever it does
    cpu_time_s: int = 5  # RLIMIT_CPU
    memory_mb: int = 512  # RLIMIT_AS
    max_processes: int = 16  # RLIMIT_NPROC: the box's own processes (holds as root too)
    max_file_mb: int = 16  # RLIMIT_FSIZE: the largest file it may write
    max_output_chars: int = 4096  # stdout / stderr kept
    isolation: str = "bwrap"  # bwrap (the box, docs/sandbox.md) | none (no box: accepts the risk, warns)


@dataclass
class TaskCfg:
    name: str = MISSING
    kind: TaskKind = TaskKind.arithmetic
    num_digits: int = 2
    ops: str = "+"
    eval_fraction: float = 0.1
    eval_size: int = 256
    train_size: int = 2000  # kind=shape_count: training images (the held-out split shares none)
    train_file: Optional[str] = None
    eval_file: Optional[str] = None
    prompt_key: str = "prompt"
    label_key: str = "label"
    reward: str = "exact_match"
    reward_timeout_s: float = 10.0  # a reward call running longer scores 0 (counted in rollout/reward_errors)
    apply_chat_template: bool = False  # prompts as a user turn through the tokenizer's chat template
    system_prompt: Optional[str] = None  # with apply_chat_template: a system turn first
    label_extractor: str = "plain"  # plain | gsm8k (text after "####") | boxed (last \\boxed{...})
    shuffle: bool = True  # kind=file: a fresh seeded order every epoch (false: file order)
    reward_url: Optional[str] = None  # reward=remote: the HTTP endpoint that scores batches of samples
    tools: List[str] = field(default_factory=list)  # multi-turn: registered tool names or dotted paths
    sandbox: SandboxCfg = field(default_factory=lambda: SandboxCfg())  # code reward and python tool limits


@dataclass
class SGLangCfg:
    """rollout=sglang: an SGLang server driven over its HTTP API (miles/rollout/sglang_engine.py, docs/rollout.md)."""
    url: Optional[str] = None  # a running server; null: launch `python -m sglang.launch_server`
    server_args: Dict[str, Any] = field(default_factory=dict)  # more ServerArgs fields when launching
    weight_update: SGLangWeightUpdate = SGLangWeightUpdate.disk  # disk: safetensors + /update_weights_from_disk; tensor: /update_weights_from_tensor
    weights_dir: Optional[str] = None  # weight_update=disk: a directory the server can read (null: a temp dir)
    weight_session: bool = True  # begin / end_weight_update around updates (SGLang >= 0.5.21)
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 3600.0


@dataclass
class VLLMCfg:
    """rollout=vllm: vLLM's offline LLM in the engine's process (miles/rollout/vllm_engine.py, docs/rollout.md).
    vLLM's max_num_seqs is rollout.max_running and its tensor_parallel_size rollout.num_gpus_per_engine
    (one key each; the engine reads them from the rollout section)."""
    kv_cache_gb: float = 1.0  # CPU KV cache, allocated at start
    enforce_eager: bool = True  # no torch.compile / graph capture
    max_model_len: Optional[int] = None  # null: rollout.max_prompt_len + max_new_tokens, capped by the model
    enable_prefix_caching: bool = True
    serve_threads: Optional[int] = 1  # torch threads while vLLM works (null: hardware.cpu_threads)
    gpu_memory_utilization: float = 0.5  # CUDA only
    enable_sleep_mode: bool = False  # CUDA only: release / resume_memory through LLM.sleep / wake_up
    llm_args: Dict[str, Any] = field(default_factory=dict)  # more vllm.LLM arguments


@dataclass
class SpeculativeCfg:
    """rollout.speculative: draft-and-verify decoding in the native engine (miles/rollout/spec_decode.py,
    docs/speculative.md); the draft is fine-tuned on each step's rollouts by the trainer."""
    kind: SpeculativeKind = SpeculativeKind.none  # none | mtp (the model's MTP modules, model.mtp_layers > 0) | draft_model (a small model)
    num_tokens: int = 3  # draft tokens proposed per verify step (k)
    train_online: bool = True  # train the draft on every RL step's rollouts (false: a frozen draft)
    # AdamW learning rate of the draft's online training; null: the kind's measured default (draft_lr)
    lr: Optional[float] = None
    # kind=draft_model: a model config name (conf/model/, warm-started on the task as the policy is)
    # or an HF checkpoint directory with the policy's tokenizer
    draft_model: Optional[str] = None

    @property
    def draft_lr(self) -> float:
        """`lr`, or per kind what the 200-step CPU runs measured best (docs/benchmarks.md): 1e-3 for
        MTP modules, 1e-4 for a draft model (1e-3 upsets a warm-started one at its first update)."""
        return self.lr if self.lr is not None else {"mtp": 1.0e-3}.get(self.kind, 1.0e-4)


@dataclass
class RolloutCfg:
    engine: EngineName = EngineName.native  # set by the group file rollout=<engine>, never by hand
    batch_size: int = 64
    n_samples_per_prompt: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_tokens: List[str] = field(default_factory=list)
    check_weight_sync: bool = True
    max_prompt_len: int = 64
    num_gpus_per_engine: int = 0
    colocate: bool = True
    num_gpus: int = 0
    slot_decode: Optional[bool] = None  # continuous batching over a static slot cache (null: on CUDA)
    cuda_graphs: bool = True  # slot decode: replay the decode step from CUDA graphs (no MoE layers)
    max_running: int = 512  # slot decode: sequences decoded at once (capped by the planner's KV budget)
    sync_every: int = 8  # slot decode: decode steps between host checks (finished rows, refills)
    compile: bool = True  # CUDA: fuse the decoder's elementwise ops with torch.compile (miles/models/fused.py)
    fuse_projections: bool = False  # CUDA: q / k / v and gate / up as one GEMM each (miles/models/fused_projections.py)
    # Weight-only quantized engines (fp8 w8a16, int4): each layer also holds its weight dequantized, for
    # calls of > 256 rows (cuBLAS instead of the weight-only kernels; the same numbers). None: on CUDA when
    # batch_size x n_samples_per_prompt > 256 and the memory plan fits with them (miles/precision/dense_copy.py,
    # miles/hardware/planner.py `resolve_memory_choices`); the memory plan counts the copies.
    dense_weight_copies: Optional[bool] = None
    # Colocated CUDA engine: plain weights and slot cache through torch_memory_saver, back at the same addresses
    # after a release, so the decode graphs are not captured again (miles/rollout/pausable.py).
    memory_saver: bool = False
    compile_cpu: bool = False  # CPU: the engine's whole decoder forward through torch.compile (Inductor's C++ kernels)
    max_turns: int = 1  # multi-turn: model turns per trajectory (tool calls answered in between)
    max_tool_response_tokens: int = 256  # multi-turn: a tool's observation is cut to this many tokens
    num_engines: int = 1  # rollout engines; > 1: a fleet behind a router, samples as one engine gives (router.py)
    # object_store: weights through Ray's object store (in-process runs copy them directly);
    # broadcast: over a gloo / NCCL group of the trainer and every engine, in buckets (transport/broadcast.py);
    # shared_memory: colocated on one node, one buffer the engines map (/dev/shm, or CUDA IPC on a GPU)
    weight_sync: TransportName = TransportName.object_store
    weight_sync_bucket_mb: float = 64.0  # rollout.weight_sync=broadcast: bytes per collective
    # Generate the next steps' batches while the trainer trains (miles/orchestrate/rollout_ahead.py);
    # not `async`: a Python keyword cannot name a dataclass field.
    asynchronous: bool = False
    # GPU, colocated: the engine releases its weights and KV cache while the trainer trains (colocate.py);
    # None: when the memory plan needs it (miles/hardware/planner.py `resolve_memory_choices`)
    offload: Optional[bool] = None
    max_staleness: int = 1  # asynchronous: a batch's policy is at most this many steps behind the trainer
    # The chosen external engine's options: present only with rollout=vllm / rollout=sglang (their group
    # files add them), None otherwise, so a run carries the options of its own engine only.
    vllm: Optional[VLLMCfg] = None
    sglang: Optional[SGLangCfg] = None
    speculative: SpeculativeCfg = field(default_factory=SpeculativeCfg)


@dataclass
class LoRACfg:
    """trainer.lora: low-rank adapters on the policy's projections, the base frozen (docs/lora.md)."""

    rank: int = 0  # 0: off (full fine-tuning)
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, training forwards only
    # Names ("q_proj": that module in every layer) or regular expressions over the module names
    # ("layers\.[0-3]\..*_proj"); nn.Linear projections of the decoder layers.
    target_modules: List[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # Several adapters over one frozen base (docs/lora.md, "Several adapters"): their names, each
    # prompt routed to the one its record's `adapter_key` field names. Empty: the run's one adapter.
    adapters: List[str] = field(default_factory=list)
    adapter_key: str = ""  # the record field that names a prompt's adapter (needed with 2+ adapters)
    # The native engine adds the adapters into its base weights at each sync (decode without adapter
    # GEMMs) instead of applying them unmerged; one adapter, rollout=native (docs/lora.md).
    merge_in_engine: bool = False


@dataclass
class TrainerCfg:
    backend: TrainerBackend = TrainerBackend.torch  # set by the group file trainer=<backend>, never by hand
    num_ranks: int = 1  # the trainer's processes, each a rank of one batch; > 1 with trainer=fsdp only
    lr: float = 5e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    global_batch_size: int = 512
    micro_batch_size: int = 128
    grad_clip: float = 1.0
    tp: int = 0
    pp: int = 0
    ep: int = 0
    cp: int = 1
    recompute: bool = False
    offload_optimizer: Optional[bool] = None
    offload: Optional[bool] = None  # GPU, colocated: parameters, gradients, optimizer state in host memory during rollout; None: when the plan needs it
    pack_sequences: bool = True  # several samples per row, no padding computed (families that support it)
    max_tokens_per_micro_batch: int = 8192  # packed rows: tokens per forward / backward
    share_prompts: bool = True  # packed rows on the masked kernel: a prompt's tokens computed once for its n samples
    lora: LoRACfg = field(default_factory=LoRACfg)  # rank > 0: train adapters, not the policy's weights
    freeze_vision: bool = True  # vision-language models: the vision tower is not trained (false: it is)


@dataclass
class EvalCfg:
    interval: int = 25
    max_new_tokens: int = 8


@dataclass
class WarmStartCfg:
    enabled: bool = True
    from_checkpoint: bool = False  # SFT model.hf_checkpoint too (a base model), not only a random init
    target_accuracy: float = 0.3
    check_interval: int = 25
    steps: int = 1500
    lr: float = 2e-3
    batch_size: int = 64
    cache_dir: str = ".cache/miles"


@dataclass
class TrackingCfg:
    backend: TrackingBackend = TrackingBackend.mlflow
    uri: Optional[str] = None
    experiment: str = "miles"
    run_name: Optional[str] = None
    log_samples: int = 16
    flush_timeout_s: float = 60.0  # at the end, how long to wait for an unreachable server (miles.tracking.journal)


@dataclass
class CheckpointCfg:
    """Resume checkpoints (miles.orchestrate.resume); the final HF checkpoint is written regardless."""

    enabled: bool = True  # False: no resume checkpoints (benchmarks of models whose state fills the disk)
    dir: Optional[str] = None  # None: <run dir>/checkpoints
    interval: int = 0  # steps between checkpoints; 0: only at the end and on SIGINT / SIGTERM
    keep_last: int = 2


@dataclass
class DebugCfg:
    """Debug modes (miles.orchestrate.debug)."""

    rollout_only: bool = False
    train_only: bool = False
    save_rollouts: Optional[str] = None
    load_rollouts: Optional[str] = None
    # after every sync compare the engine's and the trainer's weights tensor by tensor (dtype, shape,
    # SHA-256) and name those that differ; rollout.check_weight_sync is the cheap per-sync checksum
    compare_weights_tensorwise: bool = False


@dataclass
class FaultCfg:
    max_retries: int = 3  # component failures one run survives (miles.orchestrate.supervise)


@dataclass
class RayCfg:
    enabled: bool = True
    address: Optional[str] = None
    num_cpus: Optional[int] = None
    hybrid: Optional[bool] = None  # engine and trainer in one actor (miles/config/hybrid_rules.py); null: where it applies
    # the actors' scheduling priority on a Ray that Miles starts (Ray's own default, 15, lets any
    # busy process preempt the workers; docs/scale-out.md); null: Ray's default
    worker_niceness: Optional[int] = 0


@dataclass
class RunCfg:
    model: ModelCfg = MISSING
    algo: AlgoCfg = MISSING
    precision: PrecisionCfg = MISSING
    hardware: HardwareCfg = MISSING
    task: TaskCfg = MISSING
    rollout: RolloutCfg = MISSING
    trainer: TrainerCfg = MISSING
    tracking: TrackingCfg = MISSING
    critic: CriticCfg = field(default_factory=CriticCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    warm_start: WarmStartCfg = field(default_factory=WarmStartCfg)
    ray: RayCfg = field(default_factory=RayCfg)
    checkpoint: CheckpointCfg = field(default_factory=CheckpointCfg)
    debug: DebugCfg = field(default_factory=DebugCfg)
    fault: FaultCfg = field(default_factory=FaultCfg)
    steps: int = 200
    seed: int = 0
    dry_run: bool = False
    deterministic: bool = False  # deterministic kernels + seeded RNGs in every process (miles.orchestrate.determinism)
    # The trainer's and the engine's log-probs equal bit for bit (batch-invariant kernels on both sides,
    # miles/models/invariant.py): mismatch/logprob_abs_diff is exactly 0. Slower; see docs/precision.md.
    true_on_policy: bool = False
    output_dir: Optional[str] = None  # filled by launch.py from Hydra's run dir
