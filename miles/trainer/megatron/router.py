"""DeepSeek-V3's group-limited routing as a megatron-core router (the MoE spec's `router` submodule).

megatron-core 0.19.2 ranks the expert groups by the sum of their top `topk / group_topk` scores;
DeepSeek-V3 (HF, vLLM, SGLang and miles.models.moe.route) by the sum of their top two. The two agree
at DeepSeek-V3's own sizes (top-8 of 4 groups) and nowhere else (the tiny model's top-2 of 2 groups:
0.1 nats apart). This router keeps megatron-core's TopKRouter (its gate, its correction-bias buffer,
its RouterReplay hooks, its sigmoid scores, renormalization and routed scaling) and only chooses
the groups itself: the experts of the groups a token may not use get -inf in the selection bias, so
they are never selected, while the weights stay the unbiased scores of the chosen experts.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router import TopKRouter


class GroupLimitedRouter(TopKRouter):
    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False):
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        refused = {"a score function other than sigmoid": config.moe_router_score_function != "sigmoid",
                   "load balancing": config.moe_router_load_balancing_type != "none",
                   "a z-loss": bool(config.moe_z_loss_coeff),
                   "token dropping (capacity factor)": config.moe_expert_capacity_factor is not None,
                   "the fused router": config.moe_router_fusion}
        if bad := [what for what, on in refused.items() if on]:
            raise NotImplementedError(f"GroupLimitedRouter does not implement {', '.join(bad)}")
        self.groups, self.group_topk = config.moe_router_num_groups, config.moe_router_group_topk

    def _selection_bias(self, logits: torch.Tensor) -> torch.Tensor:
        """[tokens, experts] fp32: the correction bias, and -inf on the experts of the groups a token
        may not route to (groups ranked by their two best biased scores)."""
        with torch.no_grad():
            choice = torch.sigmoid(logits.float())
            bias = torch.zeros_like(choice) if self.expert_bias is None else self.expert_bias.float().expand_as(choice)
            grouped = (choice + bias).view(logits.shape[0], self.groups, -1)
            strength = grouped.topk(2, dim=-1).values.sum(-1)
            best = strength.topk(self.group_topk, dim=-1).indices
            keep = torch.zeros_like(strength, dtype=torch.bool).scatter_(1, best, True)
            outside = torch.zeros_like(strength).masked_fill_(~keep, float("-inf"))
            return bias + outside.repeat_interleave(grouped.shape[-1], dim=1)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        logits = logits.view(-1, self.config.num_moe_experts)
        probs, routing_map = topk_routing_with_score_function(
            logits, self.topk, scaling_factor=self.config.moe_router_topk_scaling_factor,
            score_function="sigmoid", expert_bias=self._selection_bias(logits), router_replay=self.router_replay)
        # the parent's bookkeeping of tokens per expert (what Megatron's bias update would read)
        self._apply_expert_bias(routing_map, padding_mask=None if padding_mask is None else padding_mask.reshape(-1))
        return probs, routing_map
