"""The RL trainer on Megatron-core: the policy is a megatron `GPTModel`; the RL update is the one every
trainer holds (miles/trainer/rl_update.py), over this backend's plan / forward / step.

    trainer = MegatronTrainer(checkpoint_dir, algo, trainer_cfg, precision, device="cuda")
    metrics = trainer.train_rl(batch)        # the same losses, corrections, metrics as TorchTrainer
    weights, digest = trainer.get_weights()  # native (HF) names: object_store (and in-process) sync
    state = trainer.sync_state()             # the same tensors, for broadcast / shared_memory

What runs through Megatron-core: the model (`GPTModel` with the Transformer Engine spec when TE is
installed, the local spec otherwise; the config from miles.trainer.megatron.arch), its parameters in
bf16 (or fp32) with Megatron's DistributedDataParallel gradient buffers, and Megatron's distributed
optimizer (Adam with decoupled weight decay, fp32 main parameters, its gradient clipping, its grad
norm). What stays the project's: the micro-batches (packed or padded rows, see `plan`), the
log-probs from the final hidden states through the chunked LM head (`GPTModel.forward`'s
`output_processor` hands over the hidden states and the output matrix), the policy losses, KL, TIS /
MIS of `miles.algo`, the old-log-prob reuse (first-step ppo_kl == 0), and every metric name.

Weights: loaded from the HF-format checkpoint through `miles.models.from_pretrained` and mapped by
miles.trainer.megatron.weights; exported the same way back (`get_weights`, `save`). A KL reference is
a second, frozen GPTModel. `save_state` / `load_state` write and read the Megatron parameters, the
optimizers' state (fp32 main parameters, moments, step) and the RNG, for resume. MoE routing replay
(R3 / R2) goes through megatron-core's RouterReplay hooks, DSA's selected keys through the DSA core
attentions' shared DSASelection (miles/trainer/megatron/dsa_attention.py); colocation offload through
its buffers' storage (miles/trainer/megatron/offload.py). LoRA (trainer.lora.rank > 0): the native adapters hooked
onto Megatron's fused linears, the base frozen, DDP and the optimizer over the adapters only
(miles/trainer/megatron/lora.py); only the adapters travel, as with trainer=torch. QLoRA: the frozen base's
linears hold the engine's INT4 / FP8 codes (held_base.py), its round trip taken once at build (quant.py). FP8
(fp8_scheme w8a16): each forward multiplies the FP8 round trip of every quantized weight's native
parts, as trainer=torch does (quant.py `FP8Blocks`).

One process, one GPU: torch.distributed (NCCL) and Megatron's model-parallel groups are set up here
with every parallel size 1 unless the arguments say otherwise. Megatron-core runs on CUDA only (its
RoPE, RNG tracker and gradient buffers allocate there): tests/gpu runs this class on the H200, and
tests/megatron on the CPU with those CUDA calls mapped to the CPU (tests/megatron/cuda_on_cpu.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from pathlib import Path

import torch
import torch.nn.functional as F

from miles.config.schema import AlgoCfg, DType, PrecisionCfg, SpeculativeCfg, TrainerCfg
from miles.models import CausalLM, from_pretrained, fused, save_pretrained
from miles.models.lora import LoRA
from miles.precision.qlora import holds_quantized_base
from miles.precision.recipe import FP8, NONE, W8A16, Recipe
from miles.trainer import lora as lora_side
from miles.trainer import offload as off
from miles.trainer.chunked_ce import CHUNK_TOKENS, hidden_logprobs
from miles.trainer.held_weights import RecomputeNotes
from miles.trainer.megatron import require_megatron
from miles.trainer.megatron import lora as megatron_lora
from miles.trainer.megatron import multi_tensor
from miles.trainer.megatron.arch import megatron_spec
from miles.trainer.megatron.held_base import fp8_codes, hold_base, int4_codes
from miles.trainer.megatron.offload import MegatronOffload
from miles.trainer.megatron.quant import FP8Blocks, fake_quantized, fp8_round_trip, int4_base, quantized_rows
from miles.trainer.megatron.specs import decoder_block_spec, gpt_model_kwargs, transformer_config
from miles.trainer.megatron.weights import from_megatron, to_megatron
from miles.trainer.packing import MicroBatch, packed_micro_batches, padded_micro_batches
from miles.trainer.parallel import SingleProcess
from miles.trainer.rl_update import RLUpdate
from miles.transport.checksum import TORCH_DTYPES, checksum, to_dtype
from miles.transport.flat import FlatWeights, tensors_checksum
from miles.types import TrainBatch, index_layers, moe_layers


def _hidden_and_output_weight(hidden_states, output_layer, output_weight, **_):
    """GPTModel's output_processor: the final hidden states [S, B, H] and the output matrix [V, H]
    (the embedding when tied), instead of the whole-vocabulary logits."""
    return hidden_states, output_weight if output_weight is not None else output_layer.weight


def _router_replays(model) -> dict:
    """`model`'s MoE routers' RouterReplay hooks by the project's layer index (0-based)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return {router.layer_number - 1: router.router_replay for router in model.modules()
            if isinstance(router, TopKRouter) and router.router_replay is not None}


def _dsa_selection(model):
    """The DSASelection `model`'s DSA core attentions share, or None (no DSA layer)."""
    from miles.trainer.megatron.dsa_attention import DSACoreAttention

    return next((m.selection for m in model.modules() if isinstance(m, DSACoreAttention)), None)


def _distinct(experts: torch.Tensor) -> torch.Tensor:
    """[n, T, k] experts with the tokens whose k are not distinct (padding: the engine recorded nothing
    there, zeros) given experts 0..k-1: Megatron's dispatcher sends each token to k different experts,
    and padding comes after every sample's own tokens, so under the causal mask it moves no log-prob."""
    k = experts.shape[-1]
    repeated = (experts.sort(-1).values.diff(dim=-1) == 0).any(-1)
    return torch.where(repeated[..., None], torch.arange(k, device=experts.device), experts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compiled_fusions(device: torch.device) -> bool:
    """Whether the decoder's elementwise ops run compiled (torch.compile): on CUDA, as trainer=torch's."""
    return device.type == "cuda"


def _fused_adamw(optimizer) -> None:
    """Without Transformer Engine or Apex, megatron-core steps torch's AdamW with its default
    multi-tensor (foreach) kernels: several passes over parameters, gradients and moments. The
    native trainer's fused AdamW makes one; set before the first step creates the state."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        for group in (optimizer.defaults, *optimizer.param_groups):
            group.update(fused=True, foreach=False)


def init_parallel(device: torch.device, tp: int = 1, ep: int = 1, seed: int = 0) -> None:
    """torch.distributed (NCCL, this process alone unless launched as ranks) and Megatron's
    model-parallel groups, once per process; Megatron's CUDA RNG tracker, seeded."""
    if device.type != "cuda":
        raise ValueError(f"trainer=megatron runs on CUDA only (device={device}): use trainer=torch")
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = os.environ.get("MASTER_PORT") or str(_free_port())
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


class MegatronTrainer:
    # What the RL update reads of its backend (rl_update.PolicyBackend), None unless configured.
    teacher = None
    lora = None
    draft = None
    _teacher_dsa = False

    def __init__(
        self,
        checkpoint_dir: str,
        algo: AlgoCfg,
        cfg: TrainerCfg,
        precision: PrecisionCfg,
        temperature: float = 1.0,
        device: str = "cuda",
        threads: int | None = None,
        seed: int = 0,
        max_response_len: int | None = None,
        teacher_dir: str | None = None,
        logits_chunk_tokens: int = CHUNK_TOKENS,
        reuse_forward_for_old: bool = True,
        true_on_policy: bool = False,
        speculative: SpeculativeCfg | None = None,
        draft_dir: str | None = None,
    ):
        """TorchTrainer's arguments (miles/trainer/torch_trainer.py); refused here (validation refuses
        them first): true on-policy, FP8 training with FP8 GEMMs (fp8_scheme w8a8; w8a16 trains,
        quant.py; so does its QLoRA), forward_weights=rollout, an online-trained speculative draft, a
        CPU device; with cfg.lora.rank > 0, the Transformer Engine spec."""
        require_megatron()
        drafts = speculative is not None and speculative.kind != "none" and speculative.train_online
        unsupported = {"true_on_policy": true_on_policy,
                       "rollout.speculative.train_online=true": drafts}
        if bad := [what for what, on in unsupported.items() if on]:
            raise ValueError(f"trainer=megatron does not support {', '.join(bad)}: use trainer=torch")
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.algo, self.cfg, self.precision = algo, cfg, precision
        self.parallel = SingleProcess()  # one process: Megatron's own groups are all of size 1
        self.max_response_len = max_response_len
        self.logits_chunk_tokens, self.reuse_forward_for_old = logits_chunk_tokens, reuse_forward_for_old
        self.temperature = temperature if temperature > 0 else 1.0
        self.device = torch.device(device)
        init_parallel(self.device, max(cfg.tp, 1), max(cfg.ep, 1), seed)
        self.compiled = compiled_fusions(self.device)
        if self.compiled:  # the core attention's RoPE compiled, as the torch trainer's (models/fused.py)
            fused.enable()

        native = from_pretrained(checkpoint_dir, dtype=torch.float32)
        self.arch = native.config
        self.recipe = Recipe.from_cfg(precision, self.arch.num_layers)
        self.fp8 = self.recipe.train_quant == FP8  # w8a16: the forward's weights are FP8 round trips (quant.py)
        if (self.fp8 and self.recipe.fp8_scheme != W8A16) or self.recipe.forward_dtype is not None:
            raise ValueError(f"trainer=megatron does not train precision={precision.name} (w8a8's FP8 GEMMs in the "
                             "forward need Transformer Engine; forward_weights=rollout is the torch trainer's): "
                             "use trainer=torch")
        if self.fp8:  # the forward's FP8 weights, freed with the recipe's training cache
            self.recipe.fp8_cache = FP8Blocks()
        self.bf16 = precision.train_dtype == DType.bf16
        self.te = _has_transformer_engine()
        state = to_megatron(native.state_dict(), self.arch, te=self.te)
        self._native_names = list(native.state_dict())  # get_weights' order: the native model's
        rows = quantized_rows(native.state_dict(), self.recipe, self.arch, self.te)
        qlora = cfg.lora.rank > 0 and holds_quantized_base(self.recipe)
        native_state, fp32_state = native.state_dict(), state  # QLoRA quantizes these (held_base.py)
        if qlora and self.fp8:  # the frozen base (policy and KL reference): its FP8 round trip, once, from fp32
            state = {**state, **fp8_round_trip(state, list(rows), self.recipe, self.arch, self.te)}
        elif qlora:  # the frozen base (policy and KL reference) rounded once, from the fp32 checkpoint
            state = int4_base(state, rows, self.recipe)
        self._qat_rows = {} if qlora else rows  # what each forward quantizes (INT4 QAT, FP8 w8a16)
        with torch.device("meta"):  # the native structure: which Linear layers a quantized engine holds
            self._skeleton = CausalLM(self.arch)
        shapes = {name: t.shape for name, t in native.state_dict().items()}
        del native
        policy = self._build(state)
        if cfg.lora.rank > 0:  # before DDP: its buffers and the optimizer then hold the adapters only
            self.lora = self._attach_lora(policy, shapes, seed)
        if qlora:  # the base's linears hold the engine's codes (held_base.py), computed once for both models
            codes = (fp8_codes(native_state, rows, self.recipe, self.arch, self.te, state, self.device) if self.fp8
                     else int4_codes(fp32_state, rows, self.recipe, self.device))
            group = None if self.fp8 else self.recipe.group
            hold_base(policy, codes, group)
        self.model = self._ddp(policy)
        # Each forward swaps in round trips (INT4 QAT, FP8 w8a16): the recomputation needs them again.
        swaps = self.recipe.train_quant != NONE and bool(self._qat_rows)
        self._recompute_notes = RecomputeNotes(policy.decoder.layers) if cfg.recompute and swaps else None
        self.ref_model = self._build(state).eval().requires_grad_(False) if algo.kl_coef > 0 else None
        if qlora and self.ref_model is not None:  # the KL reference is the frozen base: held the same way
            hold_base(self.ref_model, codes, group, copy=True)
        self._teacher_rows: dict[str, torch.Tensor] = {}
        if teacher_dir is not None:  # after the policy's _build: megatron_config stays the policy's
            self.teacher = self._build_teacher(teacher_dir)
        self.routing_layers, self.key_layers = moe_layers(self.arch), index_layers(self.arch)
        # DSA's core attention takes whole rows from position 0 only (dsa_attention.py): padded rows there
        self.packs = cfg.pack_sequences and self.arch.dsa is None
        # DSA: each GPTModel's selection state (dsa_attention.DSASelection), where R3 replay / record go
        self._dsa = {id(m): _dsa_selection(m) for m in (self.model, self.ref_model, self.teacher) if m is not None}
        if algo.routing_replay != "none" and not self.routing_layers:
            raise ValueError(f"algo.routing_replay={algo.routing_replay} needs an MoE model; "
                             f"{self.arch.family} has no MoE layer")
        self.optimizer = self._megatron_optimizer()
        # the frozen models (KL reference, teacher) move together, as the torch trainer's reference and teacher
        frozen = [m for m in (self.ref_model, self.teacher) if m is not None]
        self.offloading = MegatronOffload(self.model, torch.nn.ModuleList(frozen) if frozen else None,
                                          self._optimizers(), self.device)
        self._masks: dict[int, torch.Tensor] = {}
        self.update = RLUpdate(self)

    # ----------------------------------------------------------------------------- building
    def _build(self, state: dict[str, torch.Tensor], arch=None):
        """A GPTModel of `arch` (default: the policy's, whose config becomes `self.megatron_config`)
        on this GPU holding `state` (Megatron names)."""
        from megatron.core.models.gpt import GPTModel

        arch = arch or self.arch
        spec = megatron_spec(arch, self.bf16, self.cfg.recompute, max(self.cfg.tp, 1), max(self.cfg.ep, 1))
        kwargs = dict(spec.transformer, params_dtype=getattr(torch, spec.transformer["params_dtype"]))
        # MoE: megatron-core's RouterReplay hooks, idle unless a forward replays or records (R3 / R2,
        # the routing diagnostics against the engine's experts)
        kwargs["moe_enable_routing_replay"] = arch.moe is not None
        # megatron-core's SwiGLU fusion is torch.compile with a written-out backward (no Apex or TE):
        # on CUDA, as the native trainer's compiled silu_mul; the CPU keeps the eager glu
        kwargs["bias_activation_fusion"] = self.compiled
        config = transformer_config(spec.config_class, **kwargs, activation_func=F.silu, perform_initialization=False)
        if arch is self.arch:
            self.megatron_config = config
        layers = decoder_block_spec(config, self.te, spec.layer_spec)
        model = GPTModel(config, layers, **gpt_model_kwargs(spec.model, self.te, spec.layer_spec)).to(self.device)
        dtype = kwargs["params_dtype"]
        missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
        missing = [k for k in missing if not k.endswith("._extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"Megatron GPTModel vs mapped weights: missing {missing[:4]}, unexpected {unexpected[:4]}")
        return model

    def _build_teacher(self, teacher_dir: str):
        """On-policy distillation's teacher: a frozen GPTModel of the teacher checkpoint's own
        architecture (a mapped family; size free, vocabulary the student's: checked by the caller, as
        for trainer=torch), in the training dtype like the KL reference. Under INT4 QAT its forward is
        fake-quantized by the same recipe, as trainer=torch's `Recipe.forward` quantizes its teacher."""
        from miles.trainer.megatron.arch import problems

        native = from_pretrained(teacher_dir, dtype=torch.float32)
        arch = native.config
        if bad := problems(arch):
            raise ValueError(f"algo.teacher_checkpoint={teacher_dir}: " + "; ".join(bad))
        if arch.vocab_size != self.arch.vocab_size:
            raise ValueError(f"algo.teacher_checkpoint={teacher_dir}: vocabulary {arch.vocab_size}, the student's "
                             f"{self.arch.vocab_size}; the teacher must share the student's tokenizer")
        self._teacher_dsa, self._teacher_arch = arch.dsa is not None, arch
        state = to_megatron(native.state_dict(), arch, te=self.te)
        self._teacher_rows = quantized_rows(native.state_dict(), self.recipe, arch, self.te)
        del native
        return self._build(state, arch).eval().requires_grad_(False)

    def _ddp(self, model):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                                   overlap_grad_reduce=False)
        return DistributedDataParallel(self.megatron_config, ddp_config, model)

    def _megatron_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        c = self.cfg
        config = OptimizerConfig(optimizer="adam", lr=c.lr, min_lr=c.lr, weight_decay=c.weight_decay,
                                 adam_beta1=c.adam_beta1, adam_beta2=c.adam_beta2, adam_eps=1e-8,
                                 # inf: no clipping, and the norm is still computed (0 would skip both)
                                 clip_grad=c.grad_clip if c.grad_clip > 0 else float("inf"), bf16=self.bf16,
                                 params_dtype=torch.bfloat16 if self.bf16 else torch.float32,
                                 use_distributed_optimizer=True)
        multi_tensor.install()  # the gradient norm and scale without a host sync per tensor
        optimizer = get_megatron_optimizer(config, [self.model])
        for o in getattr(optimizer, "chained_optimizers", [optimizer]):
            _fused_adamw(o.optimizer)
        return optimizer

    def _attach_lora(self, gpt, shapes: dict, seed: int) -> LoRA:
        """The native LoRA module (trainer=torch's names, shapes, seeded init) over the meta skeleton,
        its fp32 adapters on this device, hooked onto `gpt`'s fused linears (megatron/lora.py)."""
        lo = self.cfg.lora
        if self.te:
            raise ValueError("trainer.lora on trainer=megatron needs the local spec: Transformer Engine's linears fuse "
                             "the input norm, so an adapter cannot see the projection's input; use trainer=torch")
        lora = LoRA(self._skeleton, lo.rank, lo.alpha, lo.dropout, lo.target_modules, dtype=torch.float32, seed=seed,
                    adapters=lo.adapters, device=self.device)
        megatron_lora.attach(gpt, lora, megatron_lora.adapter_rows(shapes, lora, self.arch, self.te),
                            recompute=self.cfg.recompute)
        return lora

    # ----------------------------------------------------------------------------- forward
    def plan(self, batch: TrainBatch, model) -> list[MicroBatch]:
        """Packed (`self.packs`): trainer=torch's variable-length plan, each micro-batch one row of at
        most trainer.max_tokens_per_micro_batch tokens (attention costs sum len_i^2 however long the
        row is), which the forward hands GPTModel as one THD sequence of samples. Otherwise padded
        rows of trainer.micro_batch_size samples, each from column 0, its padding after it."""
        if len(batch.images):
            raise ValueError(f"trainer=megatron trains text models; the batch carries images ({self.arch.family}): "
                             "use trainer=torch")
        # a DSA teacher reads padded rows, as a DSA policy does
        if self.packs and not (model is self.teacher and self._teacher_dsa):
            tokens = self.cfg.max_tokens_per_micro_batch
            plan = packed_micro_batches(batch, tokens, tokens)
        else:
            plan = padded_micro_batches(batch, self.cfg.micro_batch_size)
        return [mb.to(self.device) for mb in plan]

    def _causal_mask(self, length: int) -> torch.Tensor:
        """[1, 1, L, L] bool, True above the diagonal (the positions a query must not see)."""
        if length not in self._masks:
            ones = torch.ones(length, length, dtype=torch.bool, device=self.device)
            self._masks[length] = torch.triu(ones, diagonal=1)[None, None]
        return self._masks[length]

    def forward(self, model, mb: MicroBatch, with_entropy: bool = False, replay: dict | None = None,
                record: dict | None = None):
        """(log-probs, entropies or None) of the micro-batch's targets, [n, T-1]: GPTModel to the final
        hidden states, then the chunked LM head at the loss positions (as TorchTrainer's forward).
        replay / record: MoE routing (layer -> experts [R, L, k] in mb's input layout) to route by /
        to fill, through megatron-core's RouterReplay hooks.
        Packed rows (mb.cu_seqlens) go in as THD: the [R, L] rows flattened to one sequence of tokens
        [1, R * L], megatron-core's PackedSeqParams bounding each sample (and each row's padded tail)
        by mb.cu_seqlens; attention stays within a sample and its RoPE restarts at each sample's start
        (the project's core attention rotates for GQA families, megatron-core's THD RoPE for MLA), no
        [L, L] mask. Padded rows: [R, L] under the causal mask."""
        packed = None
        if mb.cu_seqlens is not None:
            from megatron.core.packed_seq_params import PackedSeqParams

            # one tensor for q and kv: the core attention then need not compare them (a host sync)
            packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
                                     max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)
            inputs, positions, mask = mb.input_ids.reshape(1, -1), mb.position_ids.reshape(1, -1), None
        else:
            rows, length = mb.input_ids.shape
            inputs, mask = mb.input_ids, self._causal_mask(length)
            positions = torch.arange(length, device=self.device).expand(rows, length)
        if model is self.model and self.lora is not None and self.lora.num_adapters > 1:
            if mb.adapter_ids is None:
                raise ValueError(f"trainer.lora.adapters={self.lora.adapter_names}: the batch does not name each "
                                 "sample's adapter (TrainBatch.adapter_ids, from Sample.adapter)")
            # padded: [rows, 1], each row's adapter; THD: [1, tokens], each token's (megatron/lora.py lays it out)
            self.lora.route(mb.adapter_ids if packed is None else mb.adapter_ids.reshape(1, -1))
        rows = self._teacher_rows if model is self.teacher else self._qat_rows
        prefix = "module." if model is self.model else ""
        if self.fp8 and rows:  # none for a QLoRA policy: its base is the round trip already
            arch = self._teacher_arch if model is self.teacher else self.arch
            fake_quant = self.recipe.fp8_cache.weights(model, rows, self.recipe, arch, self.te, prefix)
        else:
            fake_quant = fake_quantized(model, rows, self.recipe, prefix)
        dsa = self._dsa.get(id(model))
        if dsa is not None:  # DSA's ("keys", layer) entries, in mb's row layout as the core attention reads them;
            dsa.replay, dsa.record = replay, record  # replay stays for a recomputing backward of this micro-batch
        # A training forward under trainer.recompute: its layers run again in backward.
        recomputed = self.cfg.recompute and model is self.model and torch.is_grad_enabled()
        noting = recomputed and self._recompute_notes is not None
        try:
            with self._routing(model, mb.input_ids.shape, packed is not None, replay, record, recomputed), \
                    self._recompute_notes.training_forward() if noting else contextlib.nullcontext():
                hidden, weight = torch.func.functional_call(
                    model, fake_quant, (inputs, positions, mask),
                    {"output_processor": _hidden_and_output_weight, "packed_seq_params": packed}, strict=False)
        finally:
            if dsa is not None:
                dsa.record = None
        hidden = hidden.transpose(0, 1).reshape(mb.input_ids.numel(), -1).index_select(0, mb.src)
        logp, entropy = hidden_logprobs(hidden, weight, mb.targets, self.temperature, with_entropy,
                                        self.logits_chunk_tokens)
        return mb.scatter(logp), None if entropy is None else mb.scatter(entropy)

    @contextlib.contextmanager
    def _routing(self, model, shape: torch.Size, packed: bool, replay: dict | None, record: dict | None,
                 recomputed: bool = False):
        """Route `model`'s MoE layers by `replay` and / or write their choices into `record` for one
        forward of input rows `shape` (R, L). Padded, GPTModel's tokens run sequence-major ([L, R]
        flattened), the project's row-major ([R, L]): transposed both ways. Packed (THD), GPTModel's
        one sequence is the rows flattened row-major: reshaped only. `recomputed` (trainer.recompute,
        a training forward): the routers keep the replayed experts for the recomputation in backward
        (megatron-core's REPLAY_BACKWARD, consumed there, cleared at the next forward)."""
        if replay is None and record is None:
            yield
            return
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        rows, length = shape
        hooks = _router_replays(model)
        for layer, hook in hooks.items():
            hook.clear_indices()
            if replay is not None:
                experts = _distinct(replay[layer].to(self.device, torch.long))
                hook.set_target_indices((experts if packed else experts.transpose(0, 1)).reshape(rows * length, -1))
                hook.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            else:
                hook.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            yield
            if record is not None:
                for layer, hook in hooks.items():
                    if replay is not None:
                        record[layer] = replay[layer].to(self.device)
                    else:
                        chosen = hook.get_recorded_indices()
                        record[layer] = (chosen.reshape(rows, length, -1) if packed
                                         else chosen.reshape(length, rows, -1).transpose(0, 1))
        finally:
            for hook in hooks.values():
                if recomputed and replay is not None:
                    hook.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
                else:
                    hook.clear_indices()
                    hook.clear_router_replay_action()

    # ----------------------------------------------------------------------------- optimizer step
    def step(self, items: list[tuple], loss_fn, adapters: set[int] | None = None) -> dict[str, torch.Tensor]:
        """One optimizer step (`adapters`: the named LoRA adapters present, see _step_each_adapter), as TorchTrainer's: a backward per item
        into Megatron's gradient buffers, then their reduction and the distributed optimizer's clipped step."""
        from megatron.core.distributed import finalize_model_grads

        sums: dict[str, torch.Tensor] = {}
        self.offloading.restore_grads()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        for item in items:
            loss, metrics = loss_fn(*item)
            loss.backward()
            for k, v in metrics.items():
                sums[k] = sums[k] + v.detach() if k in sums else v.detach()
        finalize_model_grads([self.model])
        # fp8: the forward's FP8 weights are the old weights' (the optimizer writes the parameters
        # through DDP's buffers, whose writes their version counters need not see)
        self.recipe.release_training_cache()
        if self._recompute_notes is not None:  # every backward has run
            self._recompute_notes.clear()
        if self.cfg.recompute and self.algo.routing_replay != "none":  # the recomputations' replayed experts
            for hook in _router_replays(self.model).values():
                hook.clear_indices()
                hook.clear_router_replay_action()
        if self.lora is not None and self.lora.num_adapters > 1:
            return {**sums, **self._step_each_adapter(adapters)}
        _, grad_norm, _ = self.optimizer.step()
        sums["grad_norm"] = torch.as_tensor(grad_norm, device=self.device, dtype=torch.float32)
        if self.lora is not None and self.lora.adapter_names:  # one named adapter: its norm is the norm
            sums[f"grad_norm/{self.lora.adapter_names[0]}"] = sums["grad_norm"]
        return sums

    @torch.no_grad()
    def _step_each_adapter(self, present: set[int] | None) -> dict[str, torch.Tensor]:
        """Several LoRA adapters, as trainer=torch steps them: each adapter's gradient (in DDP's
        buffer, `main_grad`) clipped on its own (`lora_side.clip_each_adapter`), then the distributed
        optimizer's step, with the gradient of an adapter that had no sample in the step taken away
        so that Adam skips it (no moment decay, no weight decay). Megatron's own step would clip all
        adapters as one and step them all."""
        params = list(self.lora.parameters())
        for p in params:  # the clip reads and scales .grad: DDP's buffer views
            p.grad = p.main_grad
        present = set(range(self.lora.num_adapters)) if present is None else present
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norms = lora_side.clip_each_adapter(self.lora, self.parallel.clip_grad_norm, max_norm, present)
        skipped = {id(p) for k in range(self.lora.num_adapters) if k not in present
                   for p in self.lora.adapter_parameters(k)}
        for p in params:
            p.grad = None
        for o in self._optimizers():
            o.prepare_grads()  # main_grad -> the optimizer's shards' .grad (fp32 adapters: no main copy)
            for model_group, shard_group in zip(o.model_fp32_groups, o.shard_fp32_groups):
                for model_param, shard in zip(model_group, shard_group):
                    if id(model_param) in skipped:
                        shard.grad = None
            o.step_with_ready_grads()
        return norms

    # ----------------------------------------------------------------------------- the RL update (rl_update.py)
    def train_rl(self, batch: TrainBatch) -> dict[str, float]:
        off.require_onloaded(self.offloading.offloaded, "train_rl")
        return self.update.train_rl(batch)

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        off.require_onloaded(self.offloading.offloaded, "train_sft")
        return self.update.train_sft(batch)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        off.require_onloaded(self.offloading.offloaded, "logprobs", (off.PARAMS,))
        return self.update.logprobs(batch)

    @torch.no_grad()
    def kl_to_ref(self, batch: TrainBatch) -> torch.Tensor:
        off.require_onloaded(self.offloading.offloaded, "kl_to_ref", (off.PARAMS,))
        return self.update.kl_to_ref(batch)

    # ----------------------------------------------------------------------------- weights, state
    def get_weights(self, in_process: bool = False) -> tuple[dict[str, torch.Tensor] | FlatWeights, str]:
        """The policy in precision.rollout_dtype under the native names with its checksum; `in_process`:
        as a FlatWeights on this device (one buffer kept across syncs), checked there."""
        off.require_onloaded(self.offloading.offloaded, "get_weights", (off.PARAMS,))
        if self.lora is not None:  # the base never changes: only the adapters travel (as trainer=torch's)
            return lora_side.adapter_weights(self.lora, self.precision.rollout_dtype,
                                             self.device if in_process else None)
        state = self._policy_state()
        dtype = TORCH_DTYPES[self.precision.rollout_dtype]
        if self.recipe.rollout_quant != NONE and in_process:  # quantized where the weights are, checked there
            payload = self.recipe.sync_payload(state)
            return payload, tensors_checksum(self.recipe.expected_tensors(payload, self._skeleton, dtype))
        if self.recipe.rollout_quant != NONE:
            payload = self.recipe.sync_payload({k: v.detach().cpu() for k, v in state.items()})
            return payload, self.recipe.expected_checksum(payload, self._skeleton, dtype)
        if in_process:
            flat = FlatWeights.of(state, dtype, self.device)  # kept by no one here, as TorchTrainer's
            return flat, flat.checksum()
        weights = to_dtype(state, self.precision.rollout_dtype)
        return weights, checksum(weights)

    def sync_state(self) -> dict[str, torch.Tensor]:
        """What the collective transports (rollout.weight_sync=broadcast / shared_memory) pack for a
        plain recipe: the policy's tensors under the native names, on this device in the training
        dtype; they cast into the rollout dtype while packing (miles/transport/broadcast.py
        `sender_tensors`). The same tensors as get_weights, so the same checksum."""
        off.require_onloaded(self.offloading.offloaded, "sync_state", (off.PARAMS,))
        if self.lora is not None:  # config validation refuses it first (miles/config/lora_rules.py)
            raise ValueError("trainer.lora: the adapters travel through rollout.weight_sync=object_store only")
        return self._policy_state()

    def get_draft_weights(self, in_process: bool = False) -> tuple[dict[str, torch.Tensor], str]:
        raise ValueError("get_draft_weights: trainer=megatron trains no speculative draft "
                         "(rollout.speculative.train_online=true needs trainer=torch)")

    def save_draft(self, path: str) -> None:
        raise ValueError("save_draft: trainer=megatron trains no speculative draft "
                         "(rollout.speculative.train_online=true needs trainer=torch)")

    def _policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's tensors in native names (what the engines load), on this GPU, in the native
        model's order."""
        state = from_megatron(megatron_lora.without_adapters(self.model.module.state_dict()), self.arch, te=self.te)
        return {name: state[name] for name in self._native_names}

    def save(self, path: str) -> None:
        """The policy as an HF-format dir. LoRA: the merged model (W + alpha / rank * B A), the adapter
        in PEFT's format in `adapter/` beside it, as trainer=torch exports."""
        if self.lora is not None:
            lora_side.export_model_state(self.lora, self._policy_state(), self.arch, path)
            return
        self._save_base(path)

    def _save_base(self, path: str) -> None:
        with torch.device("meta"):  # the structure only; the mapped tensors become its weights
            model = CausalLM(self.arch)
        model.load_state_dict({k: v.float() for k, v in self._policy_state().items()}, assign=True)
        save_pretrained(model, path)

    def _optimizers(self) -> list:
        """The distributed optimizers behind `self.optimizer` (one per parameter kind: dense, experts)."""
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])

    def save_state(self, path: str) -> None:
        """The Megatron parameters, each optimizer's state (its torch optimizer's moments and step, and
        its fp32 main parameters) and the RNG into the directory `path`, for `load_state`. This rank's
        shards as they are (one rank here): Megatron's own `save_parameter_state` drops the torch
        optimizer's per-parameter `step` when neither Apex nor Transformer Engine is installed. And the
        policy as an HF-format dir `model/` (protocol: miles/trainer/protocol.py)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        self._save_base(str(Path(path) / "model"))  # LoRA: the frozen base, the adapters beside it (and in megatron.pt)
        if self.lora is not None:
            lora_side.save_adapter(self.lora, self._skeleton, path, self.cfg.lora.dropout)
        optimizers = [{"inner": o.optimizer.state_dict(),
                       "main": [p.detach().clone() for g in o.optimizer.param_groups for p in g["params"]]}
                      for o in self._optimizers()]
        torch.save({"model": self.model.module.state_dict(), "optimizers": optimizers,
                    "torch_rng": torch.get_rng_state(), "cuda_rng": torch.cuda.get_rng_state()},
                   Path(path) / "megatron.pt")

    def load_state(self, path: str) -> None:
        """What `save_state` wrote; training then continues as if never stopped."""
        state = torch.load(Path(path) / "megatron.pt", weights_only=False, map_location=self.device)
        self.recipe.release_training_cache()
        self.model.module.load_state_dict(state["model"], strict=False)
        for opt, saved in zip(self._optimizers(), state["optimizers"], strict=True):
            opt.optimizer.load_state_dict(saved["inner"])
            params = [p for g in opt.optimizer.param_groups for p in g["params"]]
            with torch.no_grad():
                for p, value in zip(params, saved["main"], strict=True):
                    p.copy_(value)
        torch.set_rng_state(state["torch_rng"].cpu())
        torch.cuda.set_rng_state(state["cuda_rng"].cpu())

    # ----------------------------------------------------------------------------- colocation
    def offload(self, tags=off.TRAINER_TAGS) -> None:
        """Free this trainer's device memory for the engine's turn (miles/trainer/megatron/offload.py)."""
        self.recipe.release_training_cache()  # fp8: the forward's FP8 weights (rebuilt after onload)
        self.offloading.offload(tags)

    def onload(self, tags=off.TRAINER_TAGS) -> None:
        self.offloading.onload(tags)

    def offload_bytes(self) -> dict[str, int]:
        return self.offloading.bytes()


@functools.cache
def _has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True
