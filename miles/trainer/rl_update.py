"""The RL update, written once for every trainer backend: the policy-gradient step on a rollout batch
(old log-probs, corrections, distillation, routing diagnostics, losses and their normalizers), the
SFT step, log-probs and the KL to the reference.

    update = RLUpdate(trainer)     # trainer: a PolicyBackend (TorchTrainer, FSDP ranks, MegatronTrainer)
    metrics = update.train_rl(batch)

What differs between backends is what the update calls on its `PolicyBackend`: how a batch becomes
micro-batches (`plan`), the forward to log-probs (`forward`) and the optimizer step (`step`), and how
ranks sum (`parallel`). The trainer holds an RLUpdate; no backend overrides another's methods.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from miles.algo.corrections import mis_mask, ratio_stats, tis_weights
from miles.algo.distill import reverse_kl_advantages
from miles.algo.losses import loss_normalizer, masked_sum
from miles.algo.registry import KL_ESTIMATORS, POLICY_LOSSES, get
from miles.trainer.packing import MicroBatch, batch_to, select, to_device
from miles.types import TrainBatch, keys_replay, routing_replay, stack_keys, stack_routing

if TYPE_CHECKING:
    from miles.config.schema import AlgoCfg
    from miles.models.lora import LoRA
    from miles.precision.recipe import Recipe
    from miles.trainer.draft import DraftTrainer
    from miles.trainer.parallel import Parallelism


class PolicyBackend(Protocol):
    """What the RL update needs of the trainer that holds it."""
    algo: AlgoCfg
    device: torch.device
    max_response_len: int | None  # the generation budget: loss_agg=constant divides by it
    reuse_forward_for_old: bool  # False: always a separate old-log-prob forward
    model: torch.nn.Module  # the policy, as `forward` takes it
    ref_model: torch.nn.Module | None  # the frozen KL reference (algo.kl_coef > 0)
    teacher: torch.nn.Module | None  # on-policy distillation's teacher
    lora: LoRA | None  # named adapters route samples and split the loss
    draft: DraftTrainer | None  # trained after the policy on the same batch
    recipe: Recipe  # its training cache is released after each update
    routing_layers: list[int]  # MoE layers (R3 / R2), in the routed-experts axis order
    key_layers: list[int]  # DSA indexer layers
    parallel: Parallelism  # sums over ranks; whether engine-routed batches are taken

    def plan(self, batch: TrainBatch, model) -> list[MicroBatch]:
        """This process's micro-batches of `batch` for `model`, on the device."""

    def forward(self, model, mb: MicroBatch, with_entropy: bool = False, replay: dict | None = None,
                record: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs, entropies or None) of mb's targets, [n, T-1], 0 off its loss positions."""

    def step(self, items: list[tuple], loss_fn: Callable, adapters: set[int] | None = None) -> dict[str, torch.Tensor]:
        """One optimizer step, a backward of `loss_fn(*item)` per item; summed metrics and the grad norm."""


class RLUpdate:
    def __init__(self, trainer: PolicyBackend):
        self.t = trainer

    def _engine_replay(self, mb: MicroBatch) -> dict | None:
        """R3: the engine's experts (and DSA selected keys) of the micro-batch as a routing_replay
        (None in other modes)."""
        if self.t.algo.routing_replay != "r3" or mb.routing is None:
            return None
        replay = routing_replay(mb.routing, self.t.routing_layers)
        if mb.selected_keys is not None:
            replay.update(keys_replay(mb.selected_keys, self.t.key_layers))
        return replay

    @torch.no_grad()
    def full_logprobs(self, model, batch: TrainBatch, plan: list[MicroBatch] | None = None) -> torch.Tensor:
        """Log-probs [N, T-1] of a whole batch on the device (rows in the batch's order)."""
        out = torch.zeros(batch.loss_mask.shape, device=self.t.device)
        for mb in plan if plan is not None else self.t.plan(batch, model):
            replay = self._engine_replay(mb) if model is self.t.model else None
            out.index_copy_(0, mb.index, self.t.forward(model, mb, replay=replay)[0])
        return self.t.parallel.sum_over_ranks(out)  # every rank's rows

    @torch.no_grad()
    def _routing_diagnostics(self, plans: list[list[MicroBatch]], bounds: list[int], rollout: torch.Tensor,
                             mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The policy by its own router against the engine's recorded experts (device scalars):
        `mismatch/routing_agreement`, the share of (loss position, MoE layer) whose top-k expert sets
        are equal, `mismatch/logprob_abs_diff_no_replay`, the log-prob mismatch without replay, and
        for DSA models `mismatch/index_agreement`, the share whose indexers kept the same keys."""
        agree, keys_agree = torch.zeros((), device=self.t.device), torch.zeros((), device=self.t.device)
        diff = torch.zeros((), device=self.t.device)
        total = keys_total = 0
        for s, plan in enumerate(plans):
            for mb in plan:
                record: dict = {}
                lp = self.t.forward(self.t.model, mb, record=record)[0]
                rows = mb.index + bounds[s]
                diff += masked_sum((lp - rollout[rows]).abs(), mask[rows])
                own = stack_routing(record, self.t.routing_layers).flatten(0, 1).index_select(0, mb.src)
                engine = mb.routing.flatten(0, 1).index_select(0, mb.src).long()
                agree += (own.sort(-1).values == engine.sort(-1).values).all(-1).sum()
                total += own.shape[0] * own.shape[1]
                if mb.selected_keys is not None:  # both sides list kept positions ascending, -1 after
                    own = stack_keys(record, self.t.key_layers).flatten(0, 1).index_select(0, mb.src)
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
        return self.full_logprobs(self.t.model, batch)

    @torch.no_grad()
    def kl_to_ref(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token KL estimate (`algo.kl_estimator`) of the current policy to the reference on the
        batch's tokens, [N, T-1], 0 outside the loss mask: what `algo.kl_in_reward` puts in the reward."""
        kl_fn = get(KL_ESTIMATORS, "KL estimator", self.t.algo.kl_estimator)
        plan = self.t.plan(batch, self.t.model)
        kl = kl_fn(self.full_logprobs(self.t.model, batch, plan), self.full_logprobs(self.t.ref_model, batch, plan))
        return (kl * batch.loss_mask.to(self.t.device)).cpu()


    def _rl_loss(self, samples: TrainBatch, logp, entropy, old_logp, ref_logp, normalizers: dict[str, float]):
        """Policy loss (+ entropy bonus, + KL to the reference) of one micro-batch's samples [n, T-1]."""
        a = self.t.algo
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
        agg = self.t.algo.loss_agg
        total = sum(n[agg] for n in normalizers.values())
        loss, metrics = 0.0, {}
        for k, norms in normalizers.items():
            mine = replace(samples, loss_mask=samples.loss_mask * (samples.adapter_ids == k)[:, None])
            adapter_loss, adapter_metrics = self._rl_loss(mine, logp, entropy, old_logp, ref_logp, norms)
            loss = loss + adapter_loss
            for key, v in adapter_metrics.items():
                metrics[f"{key}/{self.t.lora.adapter_names[k]}"] = v
                metrics[key] = metrics.get(key, 0.0) + v * (norms[agg] / total)
        return loss, metrics

    def _normalizers(self, loss_mask: torch.Tensor) -> dict[str, float]:
        """The step's normalizers, from its (host) loss mask."""
        modes = {self.t.algo.loss_agg, "token_mean"}
        return {m: loss_normalizer([loss_mask], m, self.t.max_response_len) for m in modes}

    def _adapter_normalizers(self, batch: TrainBatch) -> dict[int, dict[str, float]] | None:
        """Named LoRA adapters: the normalizers of each adapter's samples in this step (the adapters
        present only); None without named adapters."""
        if self.t.lora is None or not self.t.lora.adapter_names:
            return None
        if len(batch.adapter_ids) != len(batch):
            raise ValueError(f"trainer.lora.adapters={self.t.lora.adapter_names}: the batch does not name each "
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
        a, metrics = self.t.algo, {}
        rollout, mask, adv = batch.rollout_logprobs.to(self.t.device), batch.loss_mask, batch.advantages
        stats = ratio_stats(old, rollout, mask.to(self.t.device))
        metrics.update({f"mismatch/{k}": float(v) for k, v in stats.items()})
        if a.tis != "none":
            weights, m = tis_weights(old, rollout, mask.to(self.t.device), a.tis, a.tis_clip)
            adv = adv * weights.cpu()
            metrics.update({f"mismatch/{k}": float(v) for k, v in m.items()})
        if a.mis != "none":
            mask, m = mis_mask(old, rollout, mask.to(self.t.device), a.mis_low, a.mis_high, a.mis)
            mask = mask.cpu()
            metrics.update({f"mismatch/{k}": float(v) for k, v in m.items()})
        return replace(batch, advantages=adv, loss_mask=mask), metrics

    def _distill(self, batch: TrainBatch, student_logp: torch.Tensor) -> tuple[TrainBatch, dict[str, float]]:
        """On-policy distillation: add -opd_kl_coef * (logp_student - logp_teacher) per token to the
        advantages; `student_logp` is the old policy, the one that sampled the tokens."""
        teacher_logp = self.full_logprobs(self.t.teacher, batch)
        adv, m = reverse_kl_advantages(student_logp, teacher_logp, batch.loss_mask.to(self.t.device),
                                       self.t.algo.opd_kl_coef)
        return replace(batch, advantages=batch.advantages + adv.cpu()), {"train/reverse_kl": float(m["reverse_kl"])}

    def train_rl(self, batch: TrainBatch) -> dict[str, float]:
        """Policy update on one rollout batch. Metrics are means over the optimizer steps."""
        if len(batch.routed_experts) and not self.t.parallel.routing_replay:
            raise ValueError(f"{self.t.parallel.name} takes no routed experts yet: its routing agreement "
                             "metrics are not reduced over ranks")
        a = self.t.algo
        rollout_batch = batch  # the draft trains on the batch as it came (before corrections)
        engine_routing = len(batch.routed_experts) > 0
        if a.routing_replay == "r3" and not engine_routing:
            raise ValueError("algo.routing_replay=r3 but the rollout batch carries no routed experts "
                             "(Sample.routed_experts): the engine must be built with record_routing=True")
        n_steps = a.num_steps_per_rollout
        bounds = [round(s * len(batch) / n_steps) for s in range(n_steps + 1)]
        # Planned from the batch as it came: MIS may drop loss tokens later, which only zeroes them.
        plans = [self.t.plan(batch.slice(bounds[s], bounds[s + 1]), self.t.model) for s in range(n_steps)]
        # With the KL in the reward the loop has already charged it; the loss must not charge it again.
        kl_loss = self.t.ref_model is not None and not a.kl_in_reward
        ref = [[self.t.forward(self.t.ref_model, mb)[0] if kl_loss else None for mb in plan] for plan in plans]
        one_forward = (self.t.reuse_forward_for_old and n_steps == 1 and self.t.teacher is None
                       and a.tis == "none" and a.mis == "none")
        rollout, mask = to_device(batch.rollout_logprobs, self.t.device), to_device(batch.loss_mask, self.t.device)
        routing_metrics = self._routing_diagnostics(plans, bounds, rollout, mask) if engine_routing else {}
        # What each micro-batch's policy forwards route by: r3 the engine's experts, r2 the old pass's
        # own (recorded below), None their router.
        replays = [[self._engine_replay(mb) for mb in plan] for plan in plans]
        # Summed micro-batch by micro-batch in both paths, so that they give the same number.
        mismatch = torch.zeros((), device=self.t.device)
        extra: dict[str, float] = {}
        old = None
        fused_old = torch.zeros(batch.loss_mask.shape, device=self.t.device) if one_forward else None
        if not one_forward:
            old = torch.zeros(batch.loss_mask.shape, device=self.t.device)
            with torch.no_grad():
                for s, plan in enumerate(plans):
                    for k, mb in enumerate(plan):
                        rows = mb.index + bounds[s]
                        record = {} if a.routing_replay == "r2" else None
                        lp = self.t.forward(self.t.model, mb, replay=replays[s][k], record=record)[0]
                        if record is not None:  # R2: the update forwards replay this pass's routing
                            replays[s][k] = record
                        mismatch += masked_sum((lp - rollout[rows]).abs(), mask[rows])
                        old.index_copy_(0, rows, lp)
            old = self.t.parallel.sum_over_ranks(old)  # every rank's rows: corrections and metrics see the whole batch
            policy_old = rollout if a.use_rollout_logprobs else old  # the engine's numbers define the old policy
            if self.t.teacher is not None:
                batch, m = self._distill(batch, policy_old)
                extra.update(m)
            batch, m = self._correct(batch, old)
            extra.update(m)
            old = policy_old
        dev = batch_to(batch, self.t.device)

        totals: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.t.device))
        for s, plan in enumerate(plans):
            normalizers = self._normalizers(batch.loss_mask[bounds[s]:bounds[s + 1]])
            per_adapter = self._adapter_normalizers(batch.slice(bounds[s], bounds[s + 1]))

            def loss_fn(mb: MicroBatch, ref_logp, replay, offset=bounds[s], normalizers=normalizers,
                        per_adapter=per_adapter):
                nonlocal mismatch
                rows = mb.index + offset
                samples = select(dev, rows)
                logp, entropy = self.t.forward(self.t.model, mb, with_entropy=True, replay=replay)
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
            for k, v in self.t.step(list(zip(plan, ref[s], replays[s])), loss_fn, present).items():
                totals[k] += v / n_steps
        if one_forward:  # the training forward's log-probs are the old policy's: the ratios cost no forward
            stats = ratio_stats(self.t.parallel.sum_over_ranks(fused_old), rollout, mask)
            extra.update({f"mismatch/{k}": float(v) for k, v in stats.items()})
        names = [f"train/{k}" for k in totals] + ["mismatch/logprob_abs_diff", *routing_metrics]
        mismatch = self.t.parallel.sum_over_ranks(mismatch) / max(float(batch.loss_mask.sum()), 1.0)
        values = torch.stack([*totals.values(), mismatch, *routing_metrics.values()]).tolist()
        out = {**dict(zip(names, values)), **extra}
        if self.t.draft is not None:  # after the update: toward the policy that samples the next rollout
            out.update(self.t.draft.train(rollout_batch))
        self.t.recipe.release_training_cache()  # stale after the update; its memory is the engine's now
        return out

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        """One NLL optimizer step on (prompt, response) sequences; loss_mask marks the targets."""
        dev = batch_to(batch, self.t.device)
        normalizer = loss_normalizer([batch.loss_mask], "token_mean")

        def sft_loss(mb: MicroBatch):
            logp, _ = self.t.forward(self.t.model, mb)
            return get(POLICY_LOSSES, "policy loss", "nll")(logp, select(dev, mb.index).loss_mask, normalizer)

        metrics = self.t.step([(mb,) for mb in self.t.plan(batch, self.t.model)], sft_loss)
        loss, grad_norm = torch.stack([metrics["nll"], metrics["grad_norm"]]).tolist()
        out = {"train/loss": loss, "train/grad_norm": grad_norm}
        if self.t.draft is not None:  # the warm start pretrains the draft with the policy
            out.update(self.t.draft.train(batch))
        self.t.recipe.release_training_cache()
        return out

