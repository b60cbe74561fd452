"""PPO critic: a value model trained on GAE returns with the clipped value loss.

The value model is a separate network: the policy's architecture loaded from the policy's initial
checkpoint (so it starts from the SFT features, not from scratch), its LM head unused, and a fresh
linear head on the final hidden states, the way verl and OpenRLHF build theirs. `values(batch)`
scores a rollout batch before any update (GAE needs them); `train(batch)` fits `batch.returns`,
clipping around `batch.values`. Plain class, like the trainer: `miles.orchestrate` spawns it as a
Ray actor or calls it in-process.

With several LoRA adapters (`trainer.lora.adapters`) `Critics` holds one TorchCritic per adapter, as
separate policies would have, behind the same `values` / `train` calls: each sample is scored and
fitted by its own adapter's critic (routed by `TrainBatch.adapter_ids`).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from miles.algo.losses import loss_normalizer, masked_sum
from miles.algo.value import explained_variance, value_loss
from miles.config.schema import CriticCfg, DType, PrecisionCfg, TrainerCfg
from miles.models import CausalLM, from_pretrained
from miles.trainer.forward import enable_recompute, gather_outputs
from miles.trainer.packing import MicroBatch, batch_to, plan_micro_batches, select
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

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """kwargs: CausalLM.forward's layout arguments (position_ids, segment_ids for packed rows)."""
        return self.value_head(self.body(input_ids, return_hidden=True, **kwargs)).squeeze(-1).float()


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
        """`trainer` supplies the micro-batch layout (packing, sizes), recompute and the optimizer
        settings other than the lr."""
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.cfg, self.trainer_cfg, self.precision = cfg, trainer, precision
        self.num_steps_per_rollout = num_steps_per_rollout
        self.device = torch.device(device)
        self.model = ValueModel(from_pretrained(checkpoint_dir, dtype=torch.float32)).to(self.device).train()
        self.model.body.fp32_residual = self.precision.fp32_residual  # as the policy's (torch_trainer.py)
        if self.model.body.config.vision is not None and trainer.freeze_vision:  # as the policy's tower
            self.model.body.visual.requires_grad_(False)
        if trainer.recompute:
            enable_recompute(self.model.body)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.lr,
            betas=(trainer.adam_beta1, trainer.adam_beta2),
            weight_decay=trainer.weight_decay,
            **({"fused": True} if self.device.type == "cuda" else {"foreach": True}),
        )

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        """Values [n, T-1] aligned with the trainer's log-probs: position t is the state after
        tokens[: t + 1], in which tokens[t + 1] is chosen (0 off the loss positions). A
        vision-language model's forward takes the micro-batch's images."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision.train_dtype == DType.bf16):
            return mb.scatter(gather_outputs(self.model, mb, **mb.vision_inputs()))

    def _plan(self, batch: TrainBatch) -> list[MicroBatch]:
        dtype = torch.bfloat16 if self.precision.train_dtype == DType.bf16 else torch.float32
        return plan_micro_batches(batch, self.model.body, self.trainer_cfg, self.device, dtype)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's values of a rollout batch, [N, T-1] on CPU, 0 outside the loss mask."""
        values = torch.zeros(batch.loss_mask.shape, device=self.device)
        for mb in self._plan(batch):
            values.index_copy_(0, mb.index, self._values(mb))
        return values.cpu() * batch.loss_mask

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """`critic.updates_per_step` passes over the batch, each split into `num_steps_per_rollout`
        optimizer steps like the policy's (at most one a sample: an adapter's share of a batch,
        `Critics`, can be smaller). Metrics are means over the optimizer steps, except
        `value_mean` and `explained_var`, which judge the values GAE used (before this update)."""
        n_steps = min(self.num_steps_per_rollout, len(batch))
        bounds = [round(s * len(batch) / n_steps) for s in range(n_steps + 1)]
        plans = [self._plan(batch.slice(bounds[s], bounds[s + 1])) for s in range(n_steps)]
        dev = batch_to(batch, self.device)
        max_norm = self.trainer_cfg.grad_clip if self.trainer_cfg.grad_clip > 0 else float("inf")
        # Device tensors until the end: no host sync per micro-batch.
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.device))
        steps = self.cfg.updates_per_step * n_steps
        for _ in range(self.cfg.updates_per_step):
            for s, plan in enumerate(plans):
                normalizer = loss_normalizer([batch.loss_mask[bounds[s]:bounds[s + 1]]], "token_mean")
                self.optimizer.zero_grad(set_to_none=True)
                for mb in plan:
                    samples = select(dev, mb.index + bounds[s])
                    loss, metrics = value_loss(self._values(mb), samples.values, samples.returns, samples.loss_mask,
                                               normalizer, self.cfg.value_clip)
                    loss.backward()
                    for k, v in metrics.items():
                        sums[k] += v.detach() / steps
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
                self.optimizer.step()
                sums["grad_norm"] += grad_norm / steps
        metrics = dict(zip(sums, torch.stack(list(sums.values())).tolist()))
        return {**{f"critic/{k}": v for k, v in metrics.items()}, **judged_values(batch)}


def judged_values(batch: TrainBatch) -> dict[str, float]:
    """How good the values GAE used were (`batch.values`, before this step's update)."""
    mask = batch.loss_mask
    return {"critic/value_mean": float(masked_sum(batch.values, mask) / mask.sum().clamp(min=1)),
            "critic/explained_var": float(explained_variance(batch.values, batch.returns, mask))}


class Critics:
    """One TorchCritic per named LoRA adapter (`parts`, by name, in the adapters' order). A step's
    samples are routed by `batch.adapter_ids` (the adapter's number); a critic with no sample in the
    batch is not called, so its weights and optimizer state stay as they were. Checkpoints keep a
    file per part (miles/orchestrate/resume.py)."""

    def __init__(self, adapters: list[str], *args, **kwargs):
        """`args` / `kwargs`: TorchCritic's, the same for every adapter's critic."""
        self.names = list(adapters)
        self.parts = {name: TorchCritic(*args, **kwargs) for name in self.names}

    def _routes(self, batch: TrainBatch) -> list[tuple[str, torch.Tensor]]:
        """(adapter name, its rows of `batch`) for each adapter present."""
        if len(batch.adapter_ids) != len(batch):
            raise ValueError(f"a critic per adapter ({self.names}): the batch does not name each sample's "
                             "adapter (TrainBatch.adapter_ids, from Sample.adapter)")
        return [(self.names[k], (batch.adapter_ids == k).nonzero().squeeze(1))
                for k in sorted(set(batch.adapter_ids.tolist()))]

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        values = torch.zeros(batch.loss_mask.shape)
        for name, rows in self._routes(batch):
            values[rows] = self.parts[name].values(select(batch, rows))
        return values

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """Each present adapter's critic trains on its own samples. Metrics: `critic/<m>/<adapter>`,
        and `critic/<m>` the adapters' values weighted by their loss tokens, except `value_mean` and
        `explained_var`, which judge the whole batch's values (each sample's from its own critic)."""
        metrics: dict[str, float] = {}
        tokens: dict[str, float] = {}
        for name, rows in self._routes(batch):
            for key, v in self.parts[name].train(select(batch, rows)).items():
                metrics[f"{key}/{name}"] = v
            tokens[name] = float(batch.loss_mask[rows].sum())
        total = sum(tokens.values()) or 1.0
        for key in dict.fromkeys(k.rsplit("/", 1)[0] for k in metrics):  # in the parts' order
            metrics[key] = sum(metrics[f"{key}/{name}"] * n for name, n in tokens.items()) / total
        return {**metrics, **judged_values(batch)}
