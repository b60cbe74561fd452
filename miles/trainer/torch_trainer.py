"""Native torch trainer: AdamW, micro-batches with gradient accumulation, gradient clipping.

`train_rl` runs `algo.num_steps_per_rollout` optimizer steps of the configured policy loss on one
rollout batch; `train_sft` runs one NLL step; `kl_to_ref` gives the per-token KL that
`algo.kl_in_reward` subtracts from the reward. With a teacher (on-policy distillation) `train_rl`
adds the teacher's per-token reverse-KL advantages before the update.
Plain class: `miles.orchestrate` wraps it in a Ray actor, tests and the GPU machine call it directly.
The RL update itself (old log-probs, corrections, losses, metrics) is `RLUpdate`
(miles/trainer/rl_update.py), which every trainer backend holds; this class is its native backend:
the project's models, AdamW, and `plan` / `forward` / `step` below.

How a step runs (miles.trainer.packing / forward / chunked_ce):
- Micro-batches: with `trainer.pack_sequences` (families whose layers honour packed rows) samples
  are packed into rows, `trainer.max_tokens_per_micro_batch` tokens per forward, no padding
  computed; otherwise `trainer.micro_batch_size` padded samples. The losses see the padded layout
  either way, with the normalizer of the whole optimizer step, so both give the same update.
- The LM head runs at the loss positions only, in token chunks (the vocabulary-wide logits never
  exist whole); `trainer.recompute` recomputes each decoder layer in backward.
- Old log-probs: with one optimizer step per rollout and nothing that needs them before the
  update (no TIS / MIS, no teacher) they are the training forward's own, detached, so ppo_kl == 0
  exactly and the separate no-grad forward is saved. Otherwise they are recomputed first with the
  micro-batches the update uses, so the first step still has ppo_kl == 0 bit for bit.
- True on-policy (`true_on_policy`): the policy's forwards run batch-invariant kernels
  (miles/models/invariant.py) on padded rows, what the engine computes in its decode.
- bf16 autocast over fp32 master weights; AdamW fused (foreach for FSDP ranks on the CPU); metrics stay on
  the device until the end of the call, so no host sync per micro-batch. On CUDA the decoder's
  RMSNorm / RoPE / SwiGLU run compiled (miles/models/fused.py), as the engine's do: the same function
  on both sides whether or not an engine shares the process.
- Vision-language models: micro-batches carry each sample's images and mRoPE positions
  (miles/trainer/packing.py); `trainer.freeze_vision` keeps the vision tower out of the optimizer.
- `trainer.offload_optimizer`: AdamW's moments stay in pinned host memory and each step streams them
  through the device bucket by bucket, bit for bit the resident step (miles/trainer/host_optimizer.py).
- Colocation (`rollout.colocate`): `offload(tags)` parks the parameters (policy, reference, teacher)
  and the optimizer state in pinned host memory and drops the gradients while the engine has the
  GPU; `onload(tags)` brings them back, and training continues bit for bit (miles/trainer/offload.py).
- MoE routing replay (`algo.routing_replay`): r3 routes the policy's old-log-prob and update forwards
  (and its `kl_to_ref` / `logprobs`) by the experts the engine chose (`TrainBatch.routed_experts`,
  laid out per micro-batch as its input_ids); r2 records the old-log-prob pass's own routing and
  replays it in the update forwards (nothing to replay with one forward). The reference model and the
  teacher route by their own routers. Whenever the batch carries the engine's experts, one more
  no-grad forward by the policy's own router gives `mismatch/routing_agreement` (share of (loss
  position, MoE layer) whose top-k sets equal the engine's) and `mismatch/logprob_abs_diff_no_replay`.
- Speculative draft (`rollout.speculative`, kind mtp / draft_model, train_online): `self.draft`
  (miles/trainer/draft.py) takes one step of its own AdamW on the same batch after the policy update
  in `train_rl` (and `train_sft`), adding `spec/*` metrics. The policy's optimizer and grad clip never
  hold the MTP modules ("mtp.*"); a separate draft model offloads with the policy, its optimizer with
  the policy's, and syncs by `get_draft_weights`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import replace

import torch

from miles.config.schema import AlgoCfg, DType, PrecisionCfg, SpeculativeCfg, TrainerCfg
from miles.models import CausalLM, from_pretrained, fused, invariant, save_pretrained
from miles.transport.checksum import TORCH_DTYPES, checksum, to_dtype
from miles.precision.recipe import Recipe
from miles.trainer import lora as lora_side
from miles.trainer import offload as off
from miles.trainer.chunked_ce import CHUNK_TOKENS
from miles.trainer.draft import MTP_PREFIX, DraftTrainer
from miles.trainer.forward import enable_recompute, token_logprobs_of
from miles.trainer.host_optimizer import HostOptimizerState
from miles.trainer.packing import MicroBatch, plan_micro_batches
from miles.trainer.parallel import Parallelism, SingleProcess
from miles.trainer.rl_update import RLUpdate
from miles.transport.flat import FlatWeights, tensors_checksum
from miles.types import TrainBatch, index_layers, moe_layers


class TorchTrainer:
    # The speculative draft's trainer, or None.
    draft: DraftTrainer | None = None
    # trainer.lora.rank > 0: the adapters (miles/trainer/lora.py), the only parameters trained and synced.
    lora = None

    def __init__(
        self,
        checkpoint_dir: str,
        algo: AlgoCfg,
        cfg: TrainerCfg,
        precision: PrecisionCfg,
        temperature: float = 1.0,
        device: str = "cpu",
        threads: int | None = None,
        seed: int = 0,
        max_response_len: int | None = None,
        teacher_dir: str | None = None,
        logits_chunk_tokens: int = CHUNK_TOKENS,
        reuse_forward_for_old: bool = True,
        true_on_policy: bool = False,
        optimizer: str = "adamw",
        speculative: SpeculativeCfg | None = None,
        draft_dir: str | None = None,
        parallel: Parallelism | None = None,
    ):
        """`logits_chunk_tokens` (0: whole logits from the model's own head) and
        `reuse_forward_for_old` (False: always a separate old-log-prob forward) select the
        reference paths, for A/B checks and benchmarks: same numbers, more memory and time.
        `true_on_policy`: the policy's forwards run batch-invariant kernels on padded rows, the
        numerics the engine reproduces in its decode (miles/models/invariant.py).
        `optimizer`: "adamw" (trainer.adam_*), or "sgd" (plain SGD at trainer.lr, weight decay
        trainer.weight_decay), whose update is linear in the gradient: the tight reference for
        comparing backends (miles.trainer.fsdp against this trainer).
        `speculative` (rollout.speculative) with kind mtp / draft_model and train_online: the draft
        is trained on every batch (`self.draft`); kind draft_model loads it from `draft_dir`, an HF
        checkpoint with the policy's vocabulary.
        `parallel` (miles/trainer/parallel.py): how the trainer spreads over processes, SingleProcess by
        default; miles.trainer.fsdp's FSDPSharding makes this one FSDP2 rank."""
        self.parallel: Parallelism = parallel if parallel is not None else SingleProcess()
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.algo, self.cfg, self.precision = algo, cfg, precision
        self.true_on_policy = true_on_policy
        self.max_response_len = max_response_len  # the generation budget: loss_agg=constant divides by it
        self.device = torch.device(device)
        if self.device.type == "cuda":
            fused.enable()
        self.logits_chunk_tokens, self.reuse_forward_for_old = logits_chunk_tokens, reuse_forward_for_old
        # Log-probs are those of the sampling distribution, softmax(logits / T), as the engine reports them.
        self.temperature = temperature if temperature > 0 else 1.0
        self.model = from_pretrained(checkpoint_dir, dtype=torch.float32).to(self.device)
        self.model.fp32_residual = precision.fp32_residual  # under bf16 autocast (miles/models/causal_lm.py)
        self.model.train()
        # The precision recipe: the forward sees the rollout's quantization (fp8 / int4_qat) and
        # weight sync carries the rollout format.
        self.recipe = Recipe.from_cfg(precision, self.model.config.num_layers)
        # The MoE layers: the order of the moe_layers axis of routed experts (R3 / R2 replay).
        self.routing_layers = moe_layers(self.model.config)
        self.key_layers = index_layers(self.model.config)  # DSA: the indexer layers of selected keys
        if algo.routing_replay != "none" and not self.routing_layers:
            raise ValueError(f"algo.routing_replay={algo.routing_replay} needs an MoE model; "
                             f"{self.model.config.family} has no MoE layer")
        self.ref_model = None
        if algo.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        # The teacher may differ from the student in size, never in vocabulary (checked by the caller).
        self.teacher = None
        if teacher_dir is not None:
            teacher = from_pretrained(teacher_dir, dtype=torch.float32).to(self.device)
            teacher.fp32_residual = precision.fp32_residual
            self.teacher = teacher.eval().requires_grad_(False)
        if self.model.config.vision is not None and cfg.freeze_vision:  # trainer.freeze_vision: no gradient
            self.model.visual.requires_grad_(False)
        if cfg.lora.rank > 0:  # after the reference copy: the reference is the base model
            self.lora = lora_side.attach(self.model, cfg.lora, precision, seed, self.recipe,
                                         masters=self.true_on_policy)
            if self.ref_model is not None:
                lora_side.hold_reference(self.ref_model, self.recipe)
        if cfg.recompute:
            enable_recompute(self.model)
        trains_draft = (speculative is not None and speculative.kind != "none" and speculative.train_online)
        if trains_draft and self.parallel.shards_policy:
            raise ValueError(f"rollout.speculative.train_online=true (kind {speculative.kind}) trains the draft in "
                             f"one process; {self.parallel.name} shards the policy across ranks: set "
                             "rollout.speculative.train_online=false or trainer=torch")
        self.parallel.shard_models(self)  # before the optimizer takes the parameters
        # Fused AdamW: one kernel over all parameters (on the CPU too: 0.7 ms against foreach's 2.0 ms a
        # step for the 0.7M-parameter default model; values within 1e-8). FSDP's sharded (DTensor)
        # parameters keep foreach there, and SGD has no fused CPU kernel.
        fused_adam = self.device.type == "cuda" or (optimizer == "adamw" and not self.parallel.shards_policy)
        kernel = {"fused": True} if fused_adam else {"foreach": True}
        if optimizer == "adamw":
            self.optimizer = torch.optim.AdamW(
                self._policy_parameters(),
                lr=cfg.lr,
                betas=(cfg.adam_beta1, cfg.adam_beta2),
                weight_decay=cfg.weight_decay,
                **kernel,
            )
        elif optimizer == "sgd":
            self.optimizer = torch.optim.SGD(self._policy_parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                             **kernel)
        else:
            raise ValueError(f"unknown optimizer {optimizer!r}; valid: adamw, sgd")
        # trainer.offload_optimizer: the optimizer state in host memory, streamed through the device each step
        self.host_state = None
        if cfg.offload_optimizer:
            if self.parallel.shards_policy:
                raise ValueError(f"trainer.offload_optimizer=true streams one process's optimizer state; "
                                 f"{self.parallel.name} shards it across ranks: set trainer.offload_optimizer=false")
            self.host_state = HostOptimizerState(self.optimizer, self.device)
            self.host_state.park()
        # Colocation: the tags whose state is in host memory now ("params", "optimizer"), and where
        # each optimizer state tensor goes back to.
        self.offloaded: set[str] = set()
        self._optimizer_devices: list = []
        self.draft = self._build_draft(speculative, draft_dir) if trains_draft else None
        self.update = RLUpdate(self)  # train_rl, train_sft, logprobs, kl_to_ref over plan / forward / step

    def _build_draft(self, spec: SpeculativeCfg, draft_dir: str | None) -> DraftTrainer:
        """The draft's trainer: the policy's MTP modules (kind mtp), or the model in `draft_dir`."""
        common = dict(autocast=self._autocast, temperature=self.temperature, chunk_tokens=self.logits_chunk_tokens)
        if spec.kind == "mtp":
            hidden = functools.partial(self.recipe.forward, self.model, return_hidden=True)
            return DraftTrainer("mtp", self.model, self.cfg, spec.draft_lr, policy_hidden=hidden, **common)
        if spec.kind != "draft_model":
            raise ValueError(f"unknown rollout.speculative.kind {spec.kind!r}; valid: none, mtp, draft_model")
        if draft_dir is None:
            raise ValueError("rollout.speculative.kind=draft_model with train_online needs the draft's checkpoint "
                             "(TorchTrainer draft_dir: rollout.speculative.draft_model, resolved to an HF dir)")
        draft = DraftTrainer.from_checkpoint(draft_dir, self.cfg, spec.draft_lr, self.device, **common)
        if draft.model.config.vocab_size != self.model.config.vocab_size:
            raise ValueError(f"the draft model {draft_dir} has vocab_size {draft.model.config.vocab_size}, the "
                             f"policy {self.model.config.vocab_size}: the draft must share the policy's tokenizer")
        return draft

    def _policy_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the policy's optimizer and gradient clipping see: all but the MTP modules'
        ("mtp.*"), which only the draft's trainer updates (or none, without one), and a frozen vision
        tower's (trainer.freeze_vision); with LoRA the adapters only."""
        if self.lora is not None:
            return list(self.lora.parameters())
        frozen = (MTP_PREFIX, "visual.") if self.cfg.freeze_vision else (MTP_PREFIX,)
        return [p for name, p in self.model.named_parameters() if not name.startswith(frozen)]

    # ----------------------------------------------------------------------------- data parallelism
    # What the ranks change is `self.parallel`'s (miles/trainer/parallel.py): the identity in one process.
    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over the ranks that share this batch (each filled its own rows)."""
        return self.parallel.sum_over_ranks(t)

    def _clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the policy's gradients to `max_norm` in total; returns their norm before clipping."""
        return self.parallel.clip_grad_norm(self._policy_parameters(), max_norm)

    # ----------------------------------------------------------------------------- forward passes
    def _autocast(self):
        if self.precision.train_dtype == DType.bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def plan(self, batch: TrainBatch, model) -> list[MicroBatch]:
        """This process's micro-batches of `batch` (all of them in one process)."""
        dtype = torch.bfloat16 if self.precision.train_dtype == DType.bf16 else torch.float32
        # True on-policy: each sample in a row of its own from column 0, the layout of the engine's
        # cache (the CUDA kernels sum keys in blocks from column 0).
        cfg = replace(self.cfg, pack_sequences=False) if self.true_on_policy else self.cfg
        return self.parallel.plan(batch, lambda part: plan_micro_batches(part, model, cfg, self.device, dtype))

    def forward(self, model, mb: MicroBatch, with_entropy: bool = False, replay: dict | None = None,
                 record: dict | None = None):
        """(log-probs, entropies or None) of the micro-batch's targets, [n, T-1], 0 off its loss positions.
        replay / record: MoE routing to route by / to fill (layer -> experts in mb's input layout)."""
        if model is self.model and self.lora is not None and self.lora.adapter_names:
            if mb.adapter_ids is None:
                raise ValueError(f"trainer.lora.adapters={self.lora.adapter_names}: the batch does not name each "
                                 "sample's adapter (TrainBatch.adapter_ids, from Sample.adapter)")
            self.lora.route(mb.adapter_ids)  # each row's / token's adapter (kept for a recomputing backward)
        with self._autocast(), invariant.kernels(self.true_on_policy and model is self.model):
            return token_logprobs_of(model, self.recipe, mb, self.temperature, with_entropy, self.logits_chunk_tokens,
                                     routing_replay=replay, routing_record=record)

    # ----------------------------------------------------------------------------- the RL update (rl_update.py)
    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs of tokens[:, 1:] under the current policy at the loss mask's positions (0 elsewhere)."""
        self._require_onloaded("logprobs", (off.PARAMS,))
        return self.update.logprobs(batch)

    @torch.no_grad()
    def kl_to_ref(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token KL (`algo.kl_estimator`) of the policy to the reference, [N, T-1] on CPU."""
        self._require_onloaded("kl_to_ref", (off.PARAMS,))
        return self.update.kl_to_ref(batch)

    def train_rl(self, batch: TrainBatch) -> dict[str, float]:
        """Policy update on one rollout batch. Metrics are means over the optimizer steps."""
        self._require_onloaded("train_rl")
        return self.update.train_rl(batch)

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        """One NLL optimizer step on (prompt, response) sequences; loss_mask marks the targets."""
        self._require_onloaded("train_sft")
        return self.update.train_sft(batch)

    # ----------------------------------------------------------------------------- optimizer steps
    def step(self, items: list[tuple], loss_fn, adapters: set[int] | None = None) -> dict[str, torch.Tensor]:
        """One optimizer step, a backward per item (a micro-batch and what its loss needs); returns
        summed metrics and the grad norm, as device tensors. `loss_fn(*item)` divides by the
        normalizer of the whole step, so the micro-batch losses add up to the loss of the full step.
        Named LoRA adapters: each clipped on its own, only those in `adapters` (None: all) stepped."""
        sums: dict[str, torch.Tensor] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for item in items:
            loss, metrics = loss_fn(*item)
            loss.backward()
            for k, v in metrics.items():
                sums[k] = sums[k] + v.detach() if k in sums else v.detach()
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        if self.lora is not None and self.lora.adapter_names:
            present = set(range(self.lora.num_adapters)) if adapters is None else adapters
            norms = lora_side.clip_each_adapter(self.lora, self.parallel.clip_grad_norm, max_norm, present)
        else:
            norms = {"grad_norm": self._clip_grad_norm(max_norm)}  # already over every rank's shards
        if self.host_state is not None:
            self.host_state.step()
        else:
            self.optimizer.step()
        if sums:  # each rank's micro-batches' shares of the step's metrics, summed over ranks
            sums = dict(zip(sums, self._sum_over_ranks(torch.stack(list(sums.values())))))
        return {**sums, **norms}

    # ----------------------------------------------------------------------------- weights
    def get_weights(self, in_process: bool = False) -> tuple[dict[str, torch.Tensor] | FlatWeights, str]:
        """What weight sync carries, on CPU, with the checksum of what the engine must then hold:
        weights in the engine's dtype, or the recipe's rollout format (quantized from the fp32
        master weights) when the engine holds FP8 / INT4. `in_process` (the engine shares this
        process): plain weights as a FlatWeights on this trainer's device, the rollout format as
        tensors on it, each with a device checksum (miles/transport/flat.py).
        Not while the parameters are offloaded (a RuntimeError says to onload them). Ranks: rank 0
        returns the weights, the others ({}, "")."""
        self._require_onloaded("get_weights", (off.PARAMS,))
        if in_process and not self.parallel.in_process_weights:
            raise ValueError(f"{self.parallel.name} syncs weights through Ray only (in_process=False)")
        if self.lora is not None:  # the base never changes: only the adapters travel
            return lora_side.adapter_weights(self.lora, self.precision.rollout_dtype,
                                             self.device if in_process else None)
        state = self._policy_state()  # a collective on ranks
        if not self.parallel.writes:
            return {}, ""
        if in_process and self.recipe.rollout_quant == "none":
            # A new buffer each sync, kept by no one here: once the engine copied it, its memory (2 bytes a
            # parameter in bf16) goes back to the allocator for training and the KV cache.
            flat = FlatWeights.of(state, TORCH_DTYPES[self.precision.rollout_dtype], self.device)
            return flat, flat.checksum()
        if in_process:  # FP8 / INT4: quantized where the weights are, checked there (no host hop)
            payload = self.recipe.sync_payload(state)
            expected = self.recipe.expected_tensors(payload, self.model, TORCH_DTYPES[self.precision.rollout_dtype])
            return payload, tensors_checksum(expected)
        return self._weights_of(state)

    def _policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's tensors under the engines' (native) names (on ranks: gathered on rank 0)."""
        return self.parallel.policy_state(self.model)

    def _weights_of(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
        """(what weight sync carries, its checksum) for the policy's whole state dict `state`."""
        if self.recipe.rollout_quant == "none":
            weights = to_dtype(state, self.precision.rollout_dtype)
            return weights, checksum(weights)
        payload = self.recipe.sync_payload({k: v.detach().cpu() for k, v in state.items()})
        return payload, self.recipe.expected_checksum(payload, self.model, TORCH_DTYPES[self.precision.rollout_dtype])

    def save(self, path: str) -> None:
        """The policy as an HF-format dir (its MTP modules included); in one process it works while
        offloaded too (it reads the host copies); ranks gather it (collective), rank 0 writes."""
        if self.parallel.shards_policy:
            self._require_onloaded("save", (off.PARAMS,))
        if self.lora is not None and self.parallel.shards_policy:  # gathered on rank 0, merged there
            state = self.parallel.policy_state(self.model)
            if self.parallel.writes:
                lora_side.export_model_state(self.lora, state, self.model.config, path)
            return
        if self.lora is not None:  # the merged model (several adapters: the base), each adapter in PEFT's format
            lora_side.export_model(self.lora, self.model, path)
            return
        self.parallel.save_policy(self.model, path)

    def save_state(self, path: str) -> None:
        """Resume state into the directory `path` (protocol: miles/trainer/protocol.py): the HF-format
        policy `model/` and the optimizer's, the draft's and the RNG's state, as `self.parallel` keeps
        them (one process: `trainer.pt`, while offloaded too; FSDP ranks: their shards, collectively,
        onloaded)."""
        if self.parallel.shards_policy:
            self._require_onloaded("save_state")
        self.parallel.save_state(self, path)
        if self.lora is not None and self.parallel.writes:  # the frozen base is model/, the adapters beside it
            lora_side.save_adapter(self.lora, self.model, path, self.cfg.lora.dropout)

    def load_state(self, path: str) -> None:
        """What `save_state` wrote, into a trainer built with the same arguments (and ranks)."""
        if self.parallel.shards_policy:
            self._require_onloaded("load_state")
        self.parallel.load_state(self, path)
        if self.host_state is not None:  # load_state_dict put the optimizer state on the parameters' device
            self.host_state.park()
        if self.lora is not None:
            lora_side.load_adapter(self.lora, self.model, path)

    def _draft_model(self, what: str) -> CausalLM:
        if self.draft is None or not self.draft.owns_model:
            kind = "no draft" if self.draft is None else "the policy's MTP modules (in get_weights / save)"
            raise ValueError(f"{what}: needs a separate draft (rollout.speculative.kind=draft_model, train_online); "
                             f"this trainer trains {kind}")
        return self.draft.model

    def get_draft_weights(self, in_process: bool = False) -> tuple[dict[str, torch.Tensor], str]:
        """The draft model's weights (kind draft_model) in precision.rollout_dtype on CPU, with their
        checksum, for the engine's draft. `in_process` is accepted for get_weights' signature and
        changes nothing (the draft is small: no flat buffer). Not while the parameters are offloaded."""
        self._require_onloaded("get_draft_weights", (off.PARAMS,))
        weights = to_dtype(self._draft_model("get_draft_weights").state_dict(), self.precision.rollout_dtype)
        return weights, checksum(weights)

    def save_draft(self, path: str) -> None:
        """The draft model (kind draft_model) as an HF-format dir; works while offloaded too."""
        save_pretrained(self._draft_model("save_draft"), path)

    # ----------------------------------------------------------------------------- colocation offload
    def offload(self, tags=off.TRAINER_TAGS) -> None:
        """Free this trainer's device memory for the engine's turn: "grads" are dropped, "optimizer"
        state and "params" (policy, reference, teacher; the in-process sync buffer is dropped too,
        get_weights rebuilds it) move to pinned host memory; then the allocator's cached blocks go
        back to the driver. A tag already offloaded is skipped; nothing moves on the CPU."""
        tags = off.check_tags(tags, "offload")
        if off.GRADS in tags:
            for optimizer in self._all_optimizers():
                optimizer.zero_grad(set_to_none=True)  # read by no one after their step: not copied
        if off.OPTIMIZER in tags and off.OPTIMIZER not in self.offloaded:
            self._optimizer_devices = [moved for optimizer in self._all_optimizers()
                                       for moved in off.offload_optimizer(optimizer)]
            self.offloaded.add(off.OPTIMIZER)
        if off.PARAMS in tags and off.PARAMS not in self.offloaded:
            self.recipe.release_training_cache()
            self._move_models(host=True)
            self.offloaded.add(off.PARAMS)
        off.free_device_memory(self.device)

    def onload(self, tags=off.TRAINER_TAGS) -> None:
        """Bring back what `offload` moved (each tensor to the device it came from; "grads" come back
        with the next backward). A tag not offloaded is skipped."""
        tags = off.check_tags(tags, "onload")
        if off.PARAMS in tags and off.PARAMS in self.offloaded:
            self._move_models(host=False)
            self.offloaded.discard(off.PARAMS)
        if off.OPTIMIZER in tags and off.OPTIMIZER in self.offloaded:
            off.onload_optimizer(self._optimizer_devices)
            self._optimizer_devices = []
            self.offloaded.discard(off.OPTIMIZER)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _models(self) -> list[torch.nn.Module]:
        """The models whose parameters offload: policy (its MTP modules inside), reference, teacher,
        and a separate draft model."""
        draft = self.draft.model if self.draft is not None and self.draft.owns_model else None
        return [m for m in (self.model, self.ref_model, self.teacher, draft, self.lora) if m is not None]

    def _all_optimizers(self) -> list[torch.optim.Optimizer]:
        """The policy's optimizer, and the draft's."""
        return [self.optimizer] + ([self.draft.optimizer] if self.draft is not None else [])

    def _move_models(self, host: bool) -> None:
        """The models' parameters and buffers to host memory (`host`) or back to the device."""
        self.parallel.move_models(self._models(), self.device, host)

    def offload_bytes(self) -> dict[str, int]:
        """Device bytes that `offload` would free now, per tag (what is already offloaded counts 0):
        the models' parameters and buffers, the gradients, the optimizer state."""
        on_device = lambda ts: [t for t in ts if off.same_device(t.device, self.device)]  # noqa: E731
        params = [t for m in self._models() for t in (*m.parameters(), *m.buffers())]
        state = [v for o in self._all_optimizers() for s in o.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
        grads = [p.grad for m in self._models() for p in m.parameters() if p.grad is not None]
        return {off.PARAMS: off.state_bytes(on_device(params)),
                off.GRADS: off.state_bytes(on_device(grads)),
                off.OPTIMIZER: off.state_bytes(on_device(state))}

    def _require_onloaded(self, what: str, needed: tuple[str, ...] = (off.PARAMS, off.OPTIMIZER)) -> None:
        off.require_onloaded(self.offloaded, what, needed)
