"""The typed currency between components: what rollout produces and what the trainer consumes.

Routed experts (R3, `algo.routing_replay`): an int tensor [positions, moe_layers, top_k] per sample,
the experts each MoE layer chose for each token, in the compact `routing_dtype`. The moe_layers axis
lists the model's MoE layers in order (`moe_layers`); a sample's tensor covers its positions
[0, len(prompt_ids) + len(response_ids) - 1): every token the engine fed through the model, that is
every token whose hidden state reaches a loss position. The last response token was never an input
(nothing was sampled after it) and predicts nothing, so it has no routing.

Selected keys (R3 of DSA models): the key positions each DSA indexer layer kept for each query
position, an int tensor [positions, index_layers, index_topk] per sample over the same positions,
ascending, -1 where fewer keys were visible than index_topk. `index_layers` lists the layers with an
indexer of their own (GLM-5's shared layers reuse an earlier selection).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

import torch


class FinishReason(str, Enum):
    stop = "stop"  # an eos or stop token was sampled
    length = "length"  # rollout.max_new_tokens reached


@dataclass
class Sample:
    """One response to one prompt. `group` ties the n samples of one prompt together."""

    prompt: str
    label: str
    prompt_ids: list[int]
    response_ids: list[int]  # includes the stop token when one was sampled
    rollout_logprobs: list[float]  # log-prob of each response token under the engine, same length
    response: str = ""  # decoded response without special tokens
    finish_reason: FinishReason = FinishReason.length
    group: int = 0
    reward: float = 0.0
    # Multi-turn: 1 for each response token the model generated, 0 for tool observations it was
    # given (no loss, no advantage, rollout log-prob 0). Empty: every token is the model's.
    response_mask: list[int] = field(default_factory=list)
    # What the reward function gets as keyword info besides the prompt: the record's other fields
    # and, multi-turn, "trajectory" (the conversation as role / content messages).
    info: dict = field(default_factory=dict)
    # R3: the experts the engine's MoE layers chose, [P + R - 1, moe_layers, top_k] (see the module
    # docstring), or None when the engine did not record them.
    routed_experts: Optional[torch.Tensor] = None
    # R3 of DSA models: the keys the engine's indexers kept, [P + R - 1, index_layers, index_topk]
    # (see the module docstring), or None.
    selected_keys: Optional[torch.Tensor] = None
    # Speculative rollout (rollout.speculative): (verify steps, draft tokens accepted) of this sample.
    draft_stats: Optional[tuple[int, int]] = None
    # Vision-language prompts: {"pixel_values", "image_grid_thw"} of the prompt's images (the n
    # samples of a prompt hold the same tensors: pickled once), or None.
    images: Optional[dict] = None
    # Several LoRA adapters (trainer.lora.adapters): the number of the adapter that sampled this
    # response and that its loss trains; None in a run without named adapters.
    adapter: Optional[int] = None


@dataclass
class TrainBatch:
    """Right-padded token sequences of prompt + response, aligned for next-token prediction.

    Position t of the [N, T-1] tensors scores the prediction of tokens[:, t + 1].
    """

    tokens: torch.Tensor  # [N, T] long
    loss_mask: torch.Tensor  # [N, T-1] float, 1 where tokens[:, t+1] is a response token
    advantages: torch.Tensor  # [N, T-1] float, per-sequence advantage on its response tokens
    rollout_logprobs: torch.Tensor  # [N, T-1] float, engine log-probs on response tokens (0 elsewhere)
    rewards: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [N]
    # PPO only (empty otherwise): the critic's values at rollout time and its GAE targets, [N, T-1].
    values: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    returns: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    # R3 (empty without): the engine's experts [N, T, moe_layers, top_k] per token, laid out as
    # `tokens`; positions without a record (each sample's last token, padding) hold expert 0,
    # which no loss position depends on.
    routed_experts: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    # R3 of DSA models (empty without): the engine's selected keys [N, T, index_layers, index_topk],
    # laid out as `tokens`; -1 where nothing was recorded.
    selected_keys: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    # Vision-language prompts (empty without): per sample its Sample.images (a dict or None), a list
    # because samples hold images of different sizes; the trainer's micro-batches take them along.
    images: list = field(default_factory=list)
    # Several LoRA adapters (empty without): [N] long, each sample's adapter (Sample.adapter).
    adapter_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def slice(self, start: int, end: int) -> "TrainBatch":
        def rows(t: torch.Tensor) -> torch.Tensor:
            return t[start:end] if len(t) else t  # optional fields stay empty

        return TrainBatch(
            tokens=self.tokens[start:end],
            loss_mask=self.loss_mask[start:end],
            advantages=self.advantages[start:end],
            rollout_logprobs=self.rollout_logprobs[start:end],
            rewards=rows(self.rewards),
            values=rows(self.values),
            returns=rows(self.returns),
            routed_experts=rows(self.routed_experts),
            selected_keys=rows(self.selected_keys),
            images=rows(self.images),
            adapter_ids=rows(self.adapter_ids),
        )


def build_train_batch(samples: list[Sample], advantages: torch.Tensor, pad_id: int) -> TrainBatch:
    """Pack samples into a right-padded TrainBatch. `advantages` is per sample, shape [N]."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    # Rows as padded Python lists, one tensor each: a tensor per sample cost ~1 ms a 64-sample batch.
    # The response token at sequence index p + j is predicted at position p + j - 1.
    tokens, mask, rollout_lp = [], [], []
    for s in samples:
        p, r = len(s.prompt_ids), len(s.response_ids)
        tail = width - p - r
        tokens.append(s.prompt_ids + s.response_ids + [pad_id] * tail)
        mask.append([0.0] * (p - 1) + (s.response_mask or [1.0] * r) + [0.0] * tail)
        rollout_lp.append([0.0] * (p - 1) + (s.rollout_logprobs or [0.0] * r) + [0.0] * tail)
    tokens = torch.tensor(tokens, dtype=torch.long)
    mask = torch.tensor(mask, dtype=torch.float32)
    rollout_lp = torch.tensor(rollout_lp, dtype=torch.float32)
    adv = advantages.to(torch.float32).unsqueeze(1) * mask
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return TrainBatch(tokens=tokens, loss_mask=mask, advantages=adv, rollout_logprobs=rollout_lp, rewards=rewards,
                      routed_experts=_batch_record(samples, width, "routed_experts", 0),
                      selected_keys=_batch_record(samples, width, "selected_keys", -1),
                      images=[s.images for s in samples] if any(s.images is not None for s in samples) else [],
                      adapter_ids=_adapter_ids(samples))


def _adapter_ids(samples: list[Sample]) -> torch.Tensor:
    """Each sample's adapter as [N] long; empty when no sample names one (a run without named adapters)."""
    routed = [s.adapter for s in samples if s.adapter is not None]
    if not routed:
        return torch.zeros(0, dtype=torch.long)
    if len(routed) < len(samples):
        raise ValueError(f"only {len(routed)} of {len(samples)} samples name their LoRA adapter: a batch of "
                         "several adapters routes every sample")
    return torch.tensor(routed, dtype=torch.long)


def _batch_record(samples: list[Sample], width: int, name: str, fill: int) -> torch.Tensor:
    """The samples' per-position records `name` (routed experts, selected keys) as one
    [N, width, ...] tensor (`fill` where a sample has none: its last token, padding); empty when no
    sample carries any."""
    recorded = [getattr(s, name) for s in samples if getattr(s, name) is not None]
    if not recorded:
        return torch.zeros(0)
    what = name.replace("_", " ")
    if len(recorded) < len(samples):
        raise ValueError(f"only {len(recorded)} of {len(samples)} samples carry {what}: a batch "
                         "mixes recording and non-recording rollouts")
    first = recorded[0]
    out = torch.full((len(samples), width, *first.shape[1:]), fill, dtype=first.dtype)
    for i, s in enumerate(samples):
        covered = len(s.prompt_ids) + len(s.response_ids) - 1
        if getattr(s, name).shape[0] != covered:
            raise ValueError(f"sample {i}: {what} cover {getattr(s, name).shape[0]} positions, "
                             f"its prompt + response has {covered} inputs")
        out[i, :covered] = getattr(s, name)
    return out


# ------------------------------------------------------------------------------ routed experts (R3)

def routing_dtype(num_experts: int) -> torch.dtype:
    """Compact dtype of expert ids: uint8 up to 256 experts, int16 beyond."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def moe_layers(config) -> list[int]:
    """Indices of an ArchConfig's MoE layers: the order of the moe_layers axis of routed experts."""
    return [i for i in range(config.num_layers) if config.is_moe_layer(i)]


def stack_routing(record: dict, layers: list[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A forward's `routing_record` (layer -> experts [..., k]) as one tensor [..., moe_layers, k]."""
    out = torch.stack([record[layer] for layer in layers], dim=-2)
    return out if dtype is None else out.to(dtype)


def routing_replay(routing: torch.Tensor, layers: list[int]) -> dict:
    """[..., moe_layers, k] -> the `routing_replay` dict a forward takes (layer -> [..., k])."""
    return {layer: routing[..., j, :] for j, layer in enumerate(layers)}


def index_layers(config) -> list[int]:
    """DSA layers with an indexer of their own: the order of the index_layers axis of selected keys."""
    if config.dsa is None:
        return []
    linear = config.linear_attn
    return [i for i in range(config.num_layers) if i not in config.dsa.shared_layers
            and not (linear is not None and linear.is_linear_layer(i))]


def keys_dtype(max_positions: int) -> torch.dtype:
    """Compact dtype of key positions (and -1): int16 below 32768 positions, int32 beyond."""
    return torch.int16 if max_positions < 2 ** 15 else torch.int32


def stack_keys(record: dict, layers: list[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A forward's record of selected keys (("keys", layer) -> [..., index_topk]) as [..., index_layers, index_topk]."""
    out = torch.stack([record[("keys", layer)] for layer in layers], dim=-2)
    return out if dtype is None else out.to(dtype)


def keys_replay(keys: torch.Tensor, layers: list[int]) -> dict:
    """[..., index_layers, index_topk] -> the entries a forward's `routing_replay` takes for DSA."""
    return {("keys", layer): keys[..., j, :] for j, layer in enumerate(layers)}


def tensor_to_json(tensor: torch.Tensor | None) -> dict | None:
    """A tensor (routed experts, selected keys, a prompt's images) in a JSON-able form
    (debug.save_rollouts): dtype, shape, base64 bytes."""
    if tensor is None:
        return None
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "data": base64.b64encode(raw).decode("ascii")}


def tensor_from_json(data: dict | None) -> torch.Tensor | None:
    """Inverse of `tensor_to_json`."""
    if data is None:
        return None
    raw = bytearray(base64.b64decode(data["data"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    return flat.view(getattr(torch, data["dtype"])).reshape(data["shape"]).clone()
