"""PPO critic: a value model trained on GAE returns with the clipped value loss.

The value model is a separate network: the policy's architecture loaded from the policy's initial
checkpoint (so it starts from the SFT features, not from scratch), its LM head unused, and a fresh
linear head on the final hidden states, the way verl and OpenRLHF build theirs. `values(batch)`
scores a rollout batch before any update (GAE needs them); `train(batch)` fits `batch.returns`,
clipping around `batch.values`. Plain class, like the trainer: `miles.orchestrate` spawns it as a
Ray actor or calls it in-process.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch import nn

from miles.algo.losses import loss_normalizer, masked_sum
from miles.algo.value import explained_variance, value_loss
from miles.config.schema import CriticCfg, DType, PrecisionCfg, TrainerCfg
from miles.models import CausalLM, from_pretrained
from miles.types import TrainBatch


class ValueModel(nn.Module):
    """A CausalLM body with a scalar head: input_ids [B, T] -> values [B, T] (float32)."""

    def __init__(self, body: CausalLM):
        super().__init__()
        self.body = body
        self.value_head = nn.Linear(body.config.hidden_size, 1)
        # Zero init: every value starts at 0, so the first advantages are the plain returns rather
        # than returns minus a random baseline.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # CausalLM returns logits only; its final norm's output is the hidden state the LM head reads.
        hidden: list[torch.Tensor] = []
        hook = self.body.norm.register_forward_hook(lambda _module, _args, out: hidden.append(out))
        try:
            self.body(input_ids)
        finally:
            hook.remove()
        return self.value_head(hidden[0]).squeeze(-1).float()


class TorchCritic:
    def __init__(
        self,
        checkpoint_dir: str,
        cfg: CriticCfg,
        trainer: TrainerCfg,
        precision: PrecisionCfg,
        num_steps_per_rollout: int = 1,
        device: str = "cpu",
        threads: int | None = None,
        seed: int = 0,
    ):
        """`trainer` supplies the micro-batch size and the optimizer settings other than the lr."""
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.cfg, self.trainer_cfg, self.precision = cfg, trainer, precision
        self.num_steps_per_rollout = num_steps_per_rollout
        self.device = torch.device(device)
        self.model = ValueModel(from_pretrained(checkpoint_dir, dtype=torch.float32)).to(self.device).train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.lr,
            betas=(trainer.adam_beta1, trainer.adam_beta2),
            weight_decay=trainer.weight_decay,
        )

    def _values(self, mb: TrainBatch) -> torch.Tensor:
        """Values [b, T-1] aligned with the trainer's log-probs: position t is the state after
        tokens[: t + 1], in which tokens[t + 1] is chosen."""
        autocast = (
            torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
            if self.precision.train_dtype == DType.bf16
            else contextlib.nullcontext()
        )
        with autocast:
            return self.model(mb.tokens[:, :-1].to(self.device))

    def _micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        size = self.trainer_cfg.micro_batch_size
        return [batch.slice(i, i + size) for i in range(0, len(batch), size)]

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's values of a rollout batch, [N, T-1] on CPU, 0 outside the loss mask."""
        values = torch.cat([self._values(mb) for mb in self._micro_batches(batch)])
        return values.cpu() * batch.loss_mask

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """`critic.updates_per_step` passes over the batch, each split into `num_steps_per_rollout`
        optimizer steps like the policy's. Metrics are means over the optimizer steps, except
        `value_mean` and `explained_var`, which judge the values GAE used (before this update)."""
        mbs = self._micro_batches(batch)
        per_step = len(mbs) // self.num_steps_per_rollout
        max_norm = self.trainer_cfg.grad_clip if self.trainer_cfg.grad_clip > 0 else float("inf")
        sums: dict[str, float] = defaultdict(float)
        steps = self.cfg.updates_per_step * self.num_steps_per_rollout
        for _ in range(self.cfg.updates_per_step):
            for s in range(self.num_steps_per_rollout):
                chunk = mbs[s * per_step : (s + 1) * per_step]
                normalizer = loss_normalizer([mb.loss_mask for mb in chunk], "token_mean")
                self.optimizer.zero_grad(set_to_none=True)
                for mb in chunk:
                    loss, metrics = value_loss(
                        self._values(mb), mb.values.to(self.device), mb.returns.to(self.device),
                        mb.loss_mask.to(self.device), normalizer, self.cfg.value_clip,
                    )
                    loss.backward()
                    for k, v in metrics.items():
                        sums[k] += float(v) / steps
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
                self.optimizer.step()
                sums["grad_norm"] += float(grad_norm) / steps
        mask = batch.loss_mask
        sums["value_mean"] = float(masked_sum(batch.values, mask) / mask.sum().clamp(min=1))
        sums["explained_var"] = float(explained_variance(batch.values, batch.returns, mask))
        return {f"critic/{k}": v for k, v in sums.items()}
