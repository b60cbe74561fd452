"""The trainer's forward of one micro-batch: model -> hidden states at the loss positions -> log-probs.

    logp, entropy = token_logprobs_of(model, recipe, mb, temperature, with_entropy, chunk_tokens)
    # [n, T-1] fp32 in the padded loss layout of the micro-batch, 0 off the loss positions

The LM head runs only at the loss positions (prompt tokens need no log-probs) and, through
`chunked_ce`, never materializes the whole [tokens, vocab] logits. A recipe that would quantize
the output matrix (it never does with the shipped `keep_high_precision`) gets the model's own head
inside `Recipe.forward` instead, so its fake quantization is kept. A vision-language model gets the
micro-batch's images and mRoPE positions (miles/trainer/packing.py) as keyword inputs. `enable_recompute` makes each
decoder layer recompute its activations in backward.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from miles.algo.losses import entropy_from_logits, token_logprobs
from miles.models import CausalLM, invariant
from miles.models.packed import varlen_layout
from miles.precision.recipe import NONE, Recipe
from miles.trainer import held_weights
from miles.trainer.chunked_ce import CHUNK_TOKENS, hidden_logprobs
from miles.trainer.packing import MicroBatch


def gather_outputs(call: Callable[..., torch.Tensor], mb: MicroBatch, **kwargs) -> torch.Tensor:
    """`call(input_ids, **kwargs)` (a model: [R, L] -> [R, L, ...]) on the micro-batch's layout,
    kept at its loss positions only: [M, ...]."""
    if mb.segment_ids is not None:
        kwargs.update(position_ids=mb.position_ids, segment_ids=mb.segment_ids)
        if mb.branch_ids is not None:
            kwargs["branch_ids"] = mb.branch_ids
        with varlen_layout(mb.cu_seqlens, mb.max_seqlen):
            out = call(mb.input_ids, **kwargs)
    else:
        out = call(mb.input_ids, **kwargs)
    return out.flatten(0, 1).index_select(0, mb.src)


def head_outside(model: CausalLM, recipe: Recipe) -> bool:
    """Whether the output matrix the forward multiplies by is the master weight itself (so it may be
    applied outside `Recipe.forward`): true unless the recipe fake-quantizes it."""
    name = "embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    return recipe.train_quant == NONE or not recipe.quantizes(name, model.output_weight)


def token_logprobs_of(model: CausalLM, recipe: Recipe, mb: MicroBatch, temperature: float,
                      with_entropy: bool = False, chunk_tokens: int = CHUNK_TOKENS,
                      routing_replay: dict | None = None, routing_record: dict | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the targets (and entropies) of a micro-batch in its padded loss layout [n, T-1].
    chunk_tokens 0: the model's own head over every position, logits whole (the reference path).
    routing_replay / routing_record: MoE routing (layer -> experts [R, L, k] in the micro-batch's
    input layout) to route by / to fill, as `CausalLM.forward` takes them."""
    routing = {k: v for k, v in (("routing_replay", routing_replay), ("routing_record", routing_record))
               if v is not None}
    routing.update(mb.vision_inputs())  # a VLM's images and mRoPE positions
    if chunk_tokens > 0 and head_outside(model, recipe):
        hidden = gather_outputs(functools.partial(recipe.forward, model), mb, return_hidden=True, **routing)
        logp, entropy = hidden_logprobs(hidden, model.output_weight, mb.targets, temperature, with_entropy,
                                        chunk_tokens)
    else:
        logits = gather_outputs(functools.partial(recipe.forward, model), mb, **routing)
        logp = token_logprobs(logits, mb.targets, temperature)
        entropy = entropy_from_logits(logits.float() / temperature) if with_entropy else None
    return mb.scatter(logp), None if entropy is None else mb.scatter(entropy)


def enable_recompute(model: CausalLM) -> None:
    """Each decoder layer keeps only its input and recomputes the rest in backward (non-reentrant
    checkpoint). A precision recipe's forward (`Recipe.forward`) swaps its quantized or cast weights
    into the layers and patches the FP8 linears' forward only while it runs, and the recomputation
    runs later, in backward: so each layer's forward notes the parameters and forward patches its
    modules hold, and the recomputation runs with those again. It then computes on the same weights
    as the forward, and the gradients (taken on the forward's graph) reach the fp32 masters as without
    recompute."""
    for layer in model.layers:
        layer.forward = _Recomputed(layer, layer.forward)


class _Recomputed:
    def __init__(self, layer: torch.nn.Module, forward):
        self.layer, self.forward = layer, forward

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor:
        if not torch.is_grad_enabled():  # nothing to keep for a backward
            return self.forward(x, ctx)
        # The layer's own forward is this wrapper: only the modules inside it are noted. True on-policy's
        # batch-invariant kernels are a mode of the forward: the recomputation runs under it again.
        state = held_weights.held(m for m in self.layer.modules() if m is not self.layer)
        invariant_kernels = invariant.active()

        def run(x, ctx):
            with held_weights.holding(state), invariant.kernels(invariant_kernels and not invariant.active()):
                return self.forward(x, ctx)
        return checkpoint(run, x, ctx, use_reentrant=False)
