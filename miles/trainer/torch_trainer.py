"""Native torch trainer: AdamW, micro-batches with gradient accumulation, gradient clipping.

`train_rl` runs `algo.num_steps_per_rollout` optimizer steps of the configured policy loss on one
rollout batch; `train_sft` runs one NLL step; `kl_to_ref` gives the per-token KL that
`algo.kl_in_reward` subtracts from the reward. With a teacher (on-policy distillation) `train_rl`
adds the teacher's per-token reverse-KL advantages before the update. The old log-probs are
recomputed here, with the same micro-batches the update uses, so the first step of every rollout
has ppo_kl == 0 bit for bit.
Plain class: `miles.orchestrate` wraps it in a Ray actor, tests and the GPU machine call it directly.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from dataclasses import replace

import torch

from miles.algo.corrections import mis_mask, tis_weights
from miles.algo.distill import reverse_kl_advantages
from miles.algo.losses import entropy_from_logits, loss_normalizer, masked_sum, token_logprobs
from miles.algo.registry import KL_ESTIMATORS, POLICY_LOSSES, get
from miles.config.schema import AlgoCfg, DType, PrecisionCfg, TrainerCfg
from miles.models import from_pretrained, save_pretrained
from miles.orchestrate.weight_sync import TORCH_DTYPES, checksum, to_dtype
from miles.precision.recipe import Recipe
from miles.types import TrainBatch


class TorchTrainer:
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
    ):
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.algo, self.cfg, self.precision = algo, cfg, precision
        self.max_response_len = max_response_len  # the generation budget: loss_agg=constant divides by it
        self.device = torch.device(device)
        # Log-probs are those of the sampling distribution, softmax(logits / T), as the engine reports them.
        self.temperature = temperature if temperature > 0 else 1.0
        self.model = from_pretrained(checkpoint_dir, dtype=torch.float32).to(self.device)
        self.model.train()
        # The precision recipe: the forward sees the rollout's quantization (fp8 / int4_qat) and
        # weight sync carries the rollout format.
        self.recipe = Recipe.from_cfg(precision, self.model.config.num_layers)
        self.ref_model = None
        if algo.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        # The teacher may differ from the student in size, never in vocabulary (checked by the caller).
        self.teacher = None
        if teacher_dir is not None:
            teacher = from_pretrained(teacher_dir, dtype=torch.float32).to(self.device)
            self.teacher = teacher.eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            weight_decay=cfg.weight_decay,
        )

    # ----------------------------------------------------------------------------- forward passes
    def _autocast(self):
        if self.precision.train_dtype == DType.bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward_logprobs(self, model, mb: TrainBatch, with_entropy: bool = False):
        tokens = mb.tokens.to(self.device)
        with self._autocast():
            logits = self.recipe.forward(model, tokens[:, :-1])
        logp = token_logprobs(logits, tokens[:, 1:], self.temperature)
        entropy = entropy_from_logits(logits / self.temperature) if with_entropy else None
        return logp, entropy

    def _micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        size = self.cfg.micro_batch_size
        return [batch.slice(i, i + size) for i in range(0, len(batch), size)]

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs of tokens[:, 1:] under the current policy, computed micro-batch by micro-batch."""
        return torch.cat([self._forward_logprobs(self.model, mb)[0] for mb in self._micro_batches(batch)])

    @torch.no_grad()
    def kl_to_ref(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token KL estimate (`algo.kl_estimator`) of the current policy to the reference on the
        batch's tokens, [N, T-1], 0 outside the loss mask: what `algo.kl_in_reward` puts in the reward."""
        kl_fn = get(KL_ESTIMATORS, "KL estimator", self.algo.kl_estimator)
        kl = [
            kl_fn(self._forward_logprobs(self.model, mb)[0], self._forward_logprobs(self.ref_model, mb)[0])
            for mb in self._micro_batches(batch)
        ]
        return (torch.cat(kl) * batch.loss_mask.to(self.device)).cpu()

    # ----------------------------------------------------------------------------- optimizer steps
    def _step(self, micro_batches: list[tuple[TrainBatch, torch.Tensor, torch.Tensor | None]], loss_fn):
        """One optimizer step over the micro-batches; returns summed metrics and the grad norm.

        `loss_fn(mb, old_logp, ref_logp, masks)` gets the loss masks of the whole step, from which it
        derives its normalizer, so the micro-batch losses add up to the loss of the full step.
        """
        masks = [mb.loss_mask for mb, _, _ in micro_batches]
        sums: dict[str, float] = defaultdict(float)
        self.optimizer.zero_grad(set_to_none=True)
        for mb, old_logp, ref_logp in micro_batches:
            loss, metrics = loss_fn(mb, old_logp, ref_logp, masks)
            loss.backward()
            for k, v in metrics.items():
                sums[k] += float(v)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        sums["grad_norm"] = float(grad_norm)
        return sums

    def _rl_loss(self, mb: TrainBatch, old_logp, ref_logp, masks: list[torch.Tensor]):
        a = self.algo
        mask = mb.loss_mask.to(self.device)
        logp, entropy = self._forward_logprobs(self.model, mb, with_entropy=True)
        extra = {"dual_clip_c": a.dual_clip_c} if a.dual_clip_c is not None else {}
        pg_loss, metrics = get(POLICY_LOSSES, "policy loss", a.policy_loss)(
            logp, old_logp, mb.advantages.to(self.device), mask,
            loss_normalizer(masks, a.loss_agg, self.max_response_len),
            eps_clip=a.eps_clip, eps_clip_high=a.eps_clip_high, agg_mode=a.loss_agg, **extra,
        )
        # Entropy and KL are reported (and penalized) as token means, whatever the policy loss aggregation.
        normalizer = loss_normalizer(masks, "token_mean")
        entropy_term = masked_sum(entropy, mask) / normalizer
        loss = pg_loss - a.entropy_coef * entropy_term
        metrics["entropy"] = entropy_term.detach()
        if ref_logp is not None:
            kl = masked_sum(get(KL_ESTIMATORS, "KL estimator", a.kl_estimator)(logp, ref_logp), mask) / normalizer
            loss = loss + a.kl_coef * kl
            metrics["kl_ref"] = kl.detach()
        metrics["loss"] = loss.detach()
        return loss, metrics

    def _correct(self, batch: TrainBatch, old: torch.Tensor) -> tuple[TrainBatch, dict[str, float]]:
        """Mismatch corrections against the engine's log-probs: TIS scales advantages, MIS masks tokens.

        Scaling A by w > 0 equals scaling each token's clipped loss by w, since max(-Aw r, -Aw clip r)
        = w max(-A r, -A clip r).
        """
        a, metrics = self.algo, {}
        rollout, mask, adv = batch.rollout_logprobs.to(self.device), batch.loss_mask, batch.advantages
        if a.tis != "none":
            weights, m = tis_weights(old, rollout, mask, a.tis, a.tis_clip)
            adv = adv * weights.cpu()
            metrics.update({f"mismatch/{k}": float(v) for k, v in m.items()})
        if a.mis != "none":
            mask, m = mis_mask(old, rollout, mask, a.mis_low, a.mis_high, a.mis)
            mask = mask.cpu()
            metrics.update({f"mismatch/{k}": float(v) for k, v in m.items()})
        return replace(batch, advantages=adv, loss_mask=mask), metrics

    def _distill(self, batch: TrainBatch, student_logp: torch.Tensor) -> tuple[TrainBatch, dict[str, float]]:
        """On-policy distillation: add -opd_kl_coef * (logp_student - logp_teacher) per token to the
        advantages; `student_logp` is the old policy, the one that sampled the tokens."""
        with torch.no_grad():
            teacher_logp = [self._forward_logprobs(self.teacher, mb)[0] for mb in self._micro_batches(batch)]
        adv, m = reverse_kl_advantages(student_logp, torch.cat(teacher_logp), batch.loss_mask.to(self.device),
                                       self.algo.opd_kl_coef)
        return replace(batch, advantages=batch.advantages + adv.cpu()), {"train/reverse_kl": float(m["reverse_kl"])}

    def train_rl(self, batch: TrainBatch) -> dict[str, float]:
        """Policy update on one rollout batch. Metrics are means over the optimizer steps."""
        mbs = self._micro_batches(batch)
        # With the KL in the reward the loop has already charged it; the loss must not charge it again.
        kl_loss = self.ref_model is not None and not self.algo.kl_in_reward
        with torch.no_grad():
            old = [self._forward_logprobs(self.model, mb)[0] for mb in mbs]
            ref = [self._forward_logprobs(self.ref_model, mb)[0] if kl_loss else None for mb in mbs]
        mask = batch.loss_mask.to(self.device)
        old_all = torch.cat(old)
        mismatch = masked_sum((old_all - batch.rollout_logprobs.to(self.device)).abs(), mask) / mask.sum().clamp(min=1)
        if self.algo.use_rollout_logprobs:  # the engine's numbers define the old policy
            old = [mb.rollout_logprobs.to(self.device) for mb in mbs]
        distill_metrics = {}
        if self.teacher is not None:
            batch, distill_metrics = self._distill(batch, torch.cat(old))
        batch, correction_metrics = self._correct(batch, old_all)
        mbs = self._micro_batches(batch)

        per_step = len(mbs) // self.algo.num_steps_per_rollout
        totals: dict[str, float] = defaultdict(float)
        for s in range(self.algo.num_steps_per_rollout):
            chunk = slice(s * per_step, (s + 1) * per_step)
            step_metrics = self._step(list(zip(mbs[chunk], old[chunk], ref[chunk])), self._rl_loss)
            for k, v in step_metrics.items():
                totals[k] += v / self.algo.num_steps_per_rollout
        metrics = {f"train/{k}": v for k, v in totals.items()}
        metrics["mismatch/logprob_abs_diff"] = float(mismatch)
        return {**metrics, **correction_metrics, **distill_metrics}

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        """One NLL optimizer step on (prompt, response) sequences; loss_mask marks the targets."""

        def sft_loss(mb: TrainBatch, _old, _ref, masks: list[torch.Tensor]):
            logp, _ = self._forward_logprobs(self.model, mb)
            normalizer = loss_normalizer(masks, "token_mean")
            return get(POLICY_LOSSES, "policy loss", "nll")(logp, mb.loss_mask.to(self.device), normalizer)

        metrics = self._step([(mb, None, None) for mb in self._micro_batches(batch)], sft_loss)
        return {"train/loss": metrics["nll"], "train/grad_norm": metrics["grad_norm"]}

    # ----------------------------------------------------------------------------- weights
    def get_weights(self) -> tuple[dict[str, torch.Tensor], str]:
        """What weight sync carries, on CPU, with the checksum of what the engine must then hold:
        weights in the engine's dtype, or the recipe's rollout format (quantized from the fp32
        master weights) when the engine holds FP8 / INT4."""
        if self.recipe.rollout_quant == "none":
            weights = to_dtype(self.model.state_dict(), self.precision.rollout_dtype)
            return weights, checksum(weights)
        payload = self.recipe.sync_payload({k: v.detach().cpu() for k, v in self.model.state_dict().items()})
        return payload, self.recipe.expected_checksum(payload, self.model, TORCH_DTYPES[self.precision.rollout_dtype])

    def save(self, path: str) -> None:
        save_pretrained(self.model, path)
