"""Native torch trainer: AdamW, micro-batches with gradient accumulation, gradient clipping.

`train_rl` runs `algo.num_steps_per_rollout` optimizer steps of the configured policy loss on one
rollout batch; `train_sft` runs one NLL step; `kl_to_ref` gives the per-token KL that
`algo.kl_in_reward` subtracts from the reward. With a teacher (on-policy distillation) `train_rl`
adds the teacher's per-token reverse-KL advantages before the update.
Plain class: `miles.orchestrate` wraps it in a Ray actor, tests and the GPU machine call it directly.

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
- bf16 autocast over fp32 master weights; AdamW fused on CUDA (foreach elsewhere); metrics stay on
  the device until the end of the call, so no host sync per micro-batch.
- Vision-language models: micro-batches carry each sample's images and mRoPE positions
  (miles/trainer/packing.py); `trainer.freeze_vision` keeps the vision tower out of the optimizer.
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
from collections import defaultdict
from dataclasses import replace

import torch

from miles.algo.corrections import mis_mask, ratio_stats, tis_weights
from miles.algo.distill import reverse_kl_advantages
from miles.algo.losses import loss_normalizer, masked_sum
from miles.algo.registry import KL_ESTIMATORS, POLICY_LOSSES, get
from miles.config.schema import AlgoCfg, DType, PrecisionCfg, SpeculativeCfg, TrainerCfg
from miles.models import CausalLM, from_pretrained, invariant, save_pretrained
from miles.transport.checksum import TORCH_DTYPES, checksum, to_dtype
from miles.precision.recipe import NONE, Recipe
from miles.trainer import lora as lora_side
from miles.trainer import offload as off
from miles.trainer.chunked_ce import CHUNK_TOKENS
from miles.trainer.draft import MTP_PREFIX, DraftTrainer
from miles.trainer.forward import enable_recompute, token_logprobs_of
from miles.trainer.packing import MicroBatch, batch_to, plan_micro_batches, select, to_device
from miles.trainer.parallel import Parallelism, SingleProcess
from miles.transport.flat import FlatLayout, FlatWeights, tensors_checksum
from miles.types import (TrainBatch, index_layers, keys_replay, moe_layers, routing_replay, stack_keys,
                         stack_routing)


class TorchTrainer:
    # The speculative draft's trainer, or None (subclasses that build themselves, MegatronTrainer, have none).
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
        self.logits_chunk_tokens, self.reuse_forward_for_old = logits_chunk_tokens, reuse_forward_for_old
        # Log-probs are those of the sampling distribution, softmax(logits / T), as the engine reports them.
        self.temperature = temperature if temperature > 0 else 1.0
        self.model = from_pretrained(checkpoint_dir, dtype=torch.float32).to(self.device)
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
            self.teacher = teacher.eval().requires_grad_(False)
        if self.model.config.vision is not None and cfg.freeze_vision:  # trainer.freeze_vision: no gradient
            self.model.visual.requires_grad_(False)
        if cfg.lora.rank > 0:  # after the reference copy: the reference is the base model
            self.lora = lora_side.attach(self.model, cfg.lora, precision, seed, self.recipe)
            if self.ref_model is not None:
                lora_side.hold_reference(self.ref_model, self.recipe)
        if cfg.recompute:
            if self.recipe.train_quant != NONE:
                raise ValueError("trainer.recompute=true does not combine with a fake-quantizing precision "
                                 f"recipe (train_quant={self.recipe.train_quant}) yet")
            enable_recompute(self.model)
        trains_draft = (speculative is not None and speculative.kind != "none" and speculative.train_online)
        if trains_draft and self.parallel.shards_policy:
            raise ValueError(f"rollout.speculative.train_online=true (kind {speculative.kind}) trains the draft in "
                             f"one process; {self.parallel.name} shards the policy across ranks: set "
                             "rollout.speculative.train_online=false or trainer=torch")
        self.parallel.shard_models(self)  # before the optimizer takes the parameters
        kernel = {"fused": True} if self.device.type == "cuda" else {"foreach": True}
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
        self._flat_sync: FlatWeights | None = None  # in-process weight sync buffer (get_weights)
        # Colocation: the tags whose state is in host memory now ("params", "optimizer"), and where
        # each optimizer state tensor goes back to.
        self.offloaded: set[str] = set()
        self._optimizer_devices: list = []
        self.draft = self._build_draft(speculative, draft_dir) if trains_draft else None

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

    def _plan(self, batch: TrainBatch, model) -> list[MicroBatch]:
        """This process's micro-batches of `batch` (all of them in one process)."""
        dtype = torch.bfloat16 if self.precision.train_dtype == DType.bf16 else torch.float32
        # True on-policy: each sample in a row of its own from column 0, the layout of the engine's
        # cache (the CUDA kernels sum keys in blocks from column 0).
        cfg = replace(self.cfg, pack_sequences=False) if self.true_on_policy else self.cfg
        return self.parallel.plan(batch, lambda part: plan_micro_batches(part, model, cfg, self.device, dtype))

    def _forward(self, model, mb: MicroBatch, with_entropy: bool = False, replay: dict | None = None,
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

    def _engine_replay(self, mb: MicroBatch) -> dict | None:
        """R3: the engine's experts (and DSA selected keys) of the micro-batch as a routing_replay
        (None in other modes)."""
        if self.algo.routing_replay != "r3" or mb.routing is None:
            return None
        replay = routing_replay(mb.routing, self.routing_layers)
        if mb.selected_keys is not None:
            replay.update(keys_replay(mb.selected_keys, self.key_layers))
        return replay

    @torch.no_grad()
    def _full_logprobs(self, model, batch: TrainBatch, plan: list[MicroBatch] | None = None) -> torch.Tensor:
        """Log-probs [N, T-1] of a whole batch on the device (rows in the batch's order)."""
        out = torch.zeros(batch.loss_mask.shape, device=self.device)
        for mb in plan if plan is not None else self._plan(batch, model):
            replay = self._engine_replay(mb) if model is self.model else None
            out.index_copy_(0, mb.index, self._forward(model, mb, replay=replay)[0])
        return self._sum_over_ranks(out)  # every rank's rows

    @torch.no_grad()
    def _routing_diagnostics(self, plans: list[list[MicroBatch]], bounds: list[int], rollout: torch.Tensor,
                             mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The policy by its own router against the engine's recorded experts (device scalars):
        `mismatch/routing_agreement`, the share of (loss position, MoE layer) whose top-k expert sets
        are equal, `mismatch/logprob_abs_diff_no_replay`, the log-prob mismatch without replay, and
        for DSA models `mismatch/index_agreement`, the share whose indexers kept the same keys."""
        agree, keys_agree = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        diff = torch.zeros((), device=self.device)
        total = keys_total = 0
        for s, plan in enumerate(plans):
            for mb in plan:
                record: dict = {}
                lp = self._forward(self.model, mb, record=record)[0]
                rows = mb.index + bounds[s]
                diff += masked_sum((lp - rollout[rows]).abs(), mask[rows])
                own = stack_routing(record, self.routing_layers).flatten(0, 1).index_select(0, mb.src)
                engine = mb.routing.flatten(0, 1).index_select(0, mb.src).long()
                agree += (own.sort(-1).values == engine.sort(-1).values).all(-1).sum()
                total += own.shape[0] * own.shape[1]
                if mb.selected_keys is not None:  # both sides list kept positions ascending, -1 after
                    own = stack_keys(record, self.key_layers).flatten(0, 1).index_select(0, mb.src)
                    engine = mb.selected_keys.flatten(0, 1).index_select(0, mb.src).to(own.dtype)
                    keys_agree += (own == engine).all(-1).sum()
                    keys_total += own.shape[0] * own.shape[1]
        out = {"mismatch/routing_agreement": agree / max(total, 1),
               "mismatch/logprob_abs_diff_no_replay": diff / mask.sum().clamp(min=1.0)}
        if keys_total:
            out["mismatch/index_agreement"] = keys_agree / keys_total
        return out

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs of tokens[:, 1:] under the current policy at the loss mask's positions (0 elsewhere)."""
        self._require_onloaded("logprobs", (off.PARAMS,))
        return self._full_logprobs(self.model, batch)

    @torch.no_grad()
    def kl_to_ref(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token KL estimate (`algo.kl_estimator`) of the current policy to the reference on the
        batch's tokens, [N, T-1], 0 outside the loss mask: what `algo.kl_in_reward` puts in the reward."""
        self._require_onloaded("kl_to_ref", (off.PARAMS,))
        kl_fn = get(KL_ESTIMATORS, "KL estimator", self.algo.kl_estimator)
        plan = self._plan(batch, self.model)
        kl = kl_fn(self._full_logprobs(self.model, batch, plan), self._full_logprobs(self.ref_model, batch, plan))
        return (kl * batch.loss_mask.to(self.device)).cpu()

    # ----------------------------------------------------------------------------- optimizer steps
    def _step(self, items: list[tuple], loss_fn, adapters: set[int] | None = None) -> dict[str, torch.Tensor]:
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
        self.optimizer.step()
        if sums:  # each rank's micro-batches' shares of the step's metrics, summed over ranks
            sums = dict(zip(sums, self._sum_over_ranks(torch.stack(list(sums.values())))))
        return {**sums, **norms}

    def _rl_loss(self, samples: TrainBatch, logp, entropy, old_logp, ref_logp, normalizers: dict[str, float]):
        """Policy loss (+ entropy bonus, + KL to the reference) of one micro-batch's samples [n, T-1]."""
        a = self.algo
        mask = samples.loss_mask
        extra = {"dual_clip_c": a.dual_clip_c} if a.dual_clip_c is not None else {}
        pg_loss, metrics = get(POLICY_LOSSES, "policy loss", a.policy_loss)(
            logp, old_logp, samples.advantages, mask, normalizers[a.loss_agg],
            eps_clip=a.eps_clip, eps_clip_high=a.eps_clip_high, agg_mode=a.loss_agg, **extra,
        )
        # Entropy and KL are reported (and penalized) as token means, whatever the policy loss aggregation.
        entropy_term = masked_sum(entropy, mask) / normalizers["token_mean"]
        loss = pg_loss - a.entropy_coef * entropy_term if a.entropy_coef else pg_loss
        metrics["entropy"] = entropy_term.detach()
        if ref_logp is not None:
            kl_fn = get(KL_ESTIMATORS, "KL estimator", a.kl_estimator)
            kl = masked_sum(kl_fn(logp, ref_logp), mask) / normalizers["token_mean"]
            loss = loss + a.kl_coef * kl
            metrics["kl_ref"] = kl.detach()
        metrics["loss"] = loss.detach()
        return loss, metrics

    def _adapters_rl_loss(self, samples: TrainBatch, logp, entropy, old_logp, ref_logp,
                          normalizers: dict[int, dict[str, float]]):
        """Named LoRA adapters: each adapter's `_rl_loss` over its own samples with its own step's
        normalizers (`normalizers[k]`), summed. Adapter k's parameters see only its own term (its rows
        route through no other adapter), so its gradient is that of a single-adapter step on its samples.
        Metrics: `<m>/<adapter>`, and `<m>` the adapters' values weighted by their share of the step's
        loss_agg normalizer (with loss_agg=token_mean the batch's token mean)."""
        agg = self.algo.loss_agg
        total = sum(n[agg] for n in normalizers.values())
        loss, metrics = 0.0, {}
        for k, norms in normalizers.items():
            mine = replace(samples, loss_mask=samples.loss_mask * (samples.adapter_ids == k)[:, None])
            adapter_loss, adapter_metrics = self._rl_loss(mine, logp, entropy, old_logp, ref_logp, norms)
            loss = loss + adapter_loss
            for key, v in adapter_metrics.items():
                metrics[f"{key}/{self.lora.adapter_names[k]}"] = v
                metrics[key] = metrics.get(key, 0.0) + v * (norms[agg] / total)
        return loss, metrics

    def _normalizers(self, loss_mask: torch.Tensor) -> dict[str, float]:
        """The step's normalizers, from its (host) loss mask."""
        modes = {self.algo.loss_agg, "token_mean"}
        return {m: loss_normalizer([loss_mask], m, self.max_response_len) for m in modes}

    def _adapter_normalizers(self, batch: TrainBatch) -> dict[int, dict[str, float]] | None:
        """Named LoRA adapters: the normalizers of each adapter's samples in this step (the adapters
        present only); None without named adapters."""
        if self.lora is None or not self.lora.adapter_names:
            return None
        if len(batch.adapter_ids) != len(batch):
            raise ValueError(f"trainer.lora.adapters={self.lora.adapter_names}: the batch does not name each "
                             "sample's adapter (TrainBatch.adapter_ids, from Sample.adapter)")
        return {k: self._normalizers(batch.loss_mask[batch.adapter_ids == k])
                for k in sorted(set(batch.adapter_ids.tolist()))}

    def _correct(self, batch: TrainBatch, old: torch.Tensor) -> tuple[TrainBatch, dict[str, float]]:
        """Mismatch corrections against the engine's log-probs: TIS scales advantages, MIS masks tokens.

        Scaling A by w > 0 equals scaling each token's clipped loss by w, since max(-Aw r, -Aw clip r)
        = w max(-A r, -A clip r). Also `mismatch/ratio_{mean,std,min,max}` of pi_old / pi_rollout over
        the loss tokens, before MIS (train_rl logs them from the training forward when it runs no
        separate old pass).
        """
        a, metrics = self.algo, {}
        rollout, mask, adv = batch.rollout_logprobs.to(self.device), batch.loss_mask, batch.advantages
        stats = ratio_stats(old, rollout, mask.to(self.device))
        metrics.update({f"mismatch/{k}": float(v) for k, v in stats.items()})
        if a.tis != "none":
            weights, m = tis_weights(old, rollout, mask.to(self.device), a.tis, a.tis_clip)
            adv = adv * weights.cpu()
            metrics.update({f"mismatch/{k}": float(v) for k, v in m.items()})
        if a.mis != "none":
            mask, m = mis_mask(old, rollout, mask.to(self.device), a.mis_low, a.mis_high, a.mis)
            mask = mask.cpu()
            metrics.update({f"mismatch/{k}": float(v) for k, v in m.items()})
        return replace(batch, advantages=adv, loss_mask=mask), metrics

    def _distill(self, batch: TrainBatch, student_logp: torch.Tensor) -> tuple[TrainBatch, dict[str, float]]:
        """On-policy distillation: add -opd_kl_coef * (logp_student - logp_teacher) per token to the
        advantages; `student_logp` is the old policy, the one that sampled the tokens."""
        teacher_logp = self._full_logprobs(self.teacher, batch)
        adv, m = reverse_kl_advantages(student_logp, teacher_logp, batch.loss_mask.to(self.device),
                                       self.algo.opd_kl_coef)
        return replace(batch, advantages=batch.advantages + adv.cpu()), {"train/reverse_kl": float(m["reverse_kl"])}

    def train_rl(self, batch: TrainBatch) -> dict[str, float]:
        """Policy update on one rollout batch. Metrics are means over the optimizer steps."""
        self._require_onloaded("train_rl")
        if len(batch.routed_experts) and not self.parallel.routing_replay:
            raise ValueError(f"{self.parallel.name} takes no routed experts yet: its routing agreement "
                             "metrics are not reduced over ranks")
        a = self.algo
        rollout_batch = batch  # the draft trains on the batch as it came (before corrections)
        engine_routing = len(batch.routed_experts) > 0
        if a.routing_replay == "r3" and not engine_routing:
            raise ValueError("algo.routing_replay=r3 but the rollout batch carries no routed experts "
                             "(Sample.routed_experts): the engine must be built with record_routing=True")
        n_steps = a.num_steps_per_rollout
        bounds = [round(s * len(batch) / n_steps) for s in range(n_steps + 1)]
        # Planned from the batch as it came: MIS may drop loss tokens later, which only zeroes them.
        plans = [self._plan(batch.slice(bounds[s], bounds[s + 1]), self.model) for s in range(n_steps)]
        # With the KL in the reward the loop has already charged it; the loss must not charge it again.
        kl_loss = self.ref_model is not None and not a.kl_in_reward
        ref = [[self._forward(self.ref_model, mb)[0] if kl_loss else None for mb in plan] for plan in plans]
        one_forward = (self.reuse_forward_for_old and n_steps == 1 and self.teacher is None
                       and a.tis == "none" and a.mis == "none")
        rollout, mask = to_device(batch.rollout_logprobs, self.device), to_device(batch.loss_mask, self.device)
        routing_metrics = self._routing_diagnostics(plans, bounds, rollout, mask) if engine_routing else {}
        # What each micro-batch's policy forwards route by: r3 the engine's experts, r2 the old pass's
        # own (recorded below), None their router.
        replays = [[self._engine_replay(mb) for mb in plan] for plan in plans]
        # Summed micro-batch by micro-batch in both paths, so that they give the same number.
        mismatch = torch.zeros((), device=self.device)
        extra: dict[str, float] = {}
        old = None
        fused_old = torch.zeros(batch.loss_mask.shape, device=self.device) if one_forward else None
        if not one_forward:
            old = torch.zeros(batch.loss_mask.shape, device=self.device)
            with torch.no_grad():
                for s, plan in enumerate(plans):
                    for k, mb in enumerate(plan):
                        rows = mb.index + bounds[s]
                        record = {} if a.routing_replay == "r2" else None
                        lp = self._forward(self.model, mb, replay=replays[s][k], record=record)[0]
                        if record is not None:  # R2: the update forwards replay this pass's routing
                            replays[s][k] = record
                        mismatch += masked_sum((lp - rollout[rows]).abs(), mask[rows])
                        old.index_copy_(0, rows, lp)
            old = self._sum_over_ranks(old)  # every rank's rows: corrections and metrics see the whole batch
            policy_old = rollout if a.use_rollout_logprobs else old  # the engine's numbers define the old policy
            if self.teacher is not None:
                batch, m = self._distill(batch, policy_old)
                extra.update(m)
            batch, m = self._correct(batch, old)
            extra.update(m)
            old = policy_old
        dev = batch_to(batch, self.device)

        totals: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.device))
        for s, plan in enumerate(plans):
            normalizers = self._normalizers(batch.loss_mask[bounds[s]:bounds[s + 1]])
            per_adapter = self._adapter_normalizers(batch.slice(bounds[s], bounds[s + 1]))

            def loss_fn(mb: MicroBatch, ref_logp, replay, offset=bounds[s], normalizers=normalizers,
                        per_adapter=per_adapter):
                nonlocal mismatch
                rows = mb.index + offset
                samples = select(dev, rows)
                logp, entropy = self._forward(self.model, mb, with_entropy=True, replay=replay)
                if old is None:  # one forward: the old policy is this very forward
                    mismatch += masked_sum((logp.detach() - samples.rollout_logprobs).abs(), mask[rows])
                    old_logp = samples.rollout_logprobs if a.use_rollout_logprobs else logp.detach()
                    fused_old.index_copy_(0, rows, logp.detach())
                else:
                    old_logp = old[rows]
                if per_adapter is not None:
                    return self._adapters_rl_loss(samples, logp, entropy, old_logp, ref_logp, per_adapter)
                return self._rl_loss(samples, logp, entropy, old_logp, ref_logp, normalizers)

            present = None if per_adapter is None else set(per_adapter)
            for k, v in self._step(list(zip(plan, ref[s], replays[s])), loss_fn, present).items():
                totals[k] += v / n_steps
        if one_forward:  # the training forward's log-probs are the old policy's: the ratios cost no forward
            stats = ratio_stats(self._sum_over_ranks(fused_old), rollout, mask)
            extra.update({f"mismatch/{k}": float(v) for k, v in stats.items()})
        names = [f"train/{k}" for k in totals] + ["mismatch/logprob_abs_diff", *routing_metrics]
        mismatch = self._sum_over_ranks(mismatch) / max(float(batch.loss_mask.sum()), 1.0)
        values = torch.stack([*totals.values(), mismatch, *routing_metrics.values()]).tolist()
        out = {**dict(zip(names, values)), **extra}
        if self.draft is not None:  # after the update: toward the policy that samples the next rollout
            out.update(self.draft.train(rollout_batch))
        self.recipe.release_training_cache()  # stale after the update; its memory is the engine's now
        return out

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        """One NLL optimizer step on (prompt, response) sequences; loss_mask marks the targets."""
        self._require_onloaded("train_sft")
        dev = batch_to(batch, self.device)
        normalizer = loss_normalizer([batch.loss_mask], "token_mean")

        def sft_loss(mb: MicroBatch):
            logp, _ = self._forward(self.model, mb)
            return get(POLICY_LOSSES, "policy loss", "nll")(logp, select(dev, mb.index).loss_mask, normalizer)

        metrics = self._step([(mb,) for mb in self._plan(batch, self.model)], sft_loss)
        loss, grad_norm = torch.stack([metrics["nll"], metrics["grad_norm"]]).tolist()
        out = {"train/loss": loss, "train/grad_norm": grad_norm}
        if self.draft is not None:  # the warm start pretrains the draft with the policy
            out.update(self.draft.train(batch))
        self.recipe.release_training_cache()
        return out

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
            if self._flat_sync is None:
                layout = FlatLayout.of(state, TORCH_DTYPES[self.precision.rollout_dtype])
                self._flat_sync = FlatWeights.like(layout, self.device)
            self._flat_sync.fill_from(state)
            return self._flat_sync, self._flat_sync.checksum()
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
            self._flat_sync = None
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
        missing = tuple(t for t in needed if t in self.offloaded)
        if missing:
            raise RuntimeError(f"{what}: the trainer's {' and '.join(missing)} are offloaded to host memory "
                               f"(colocation): call onload({missing}) first")
