"""What a layer's modules hold during a forward, noted and put back for its recomputation.

Activation checkpointing re-runs a layer in backward, and the recomputation must multiply the
weights the forward multiplied. A precision recipe swaps its weights in only while its forward runs
(`Recipe.forward`'s functional_call and FP8 linear patches, Megatron's round-tripped weights), so a
recomputation after that forward has ended would see the fp32 masters: the layer's forward notes each
module's parameters and instance-level forward patch (`held`), and the recomputation runs inside
`holding(...)` of that note. Used by trainer=torch's non-reentrant checkpoint per layer
(miles/trainer/forward.py) and, through `RecomputeNotes`, by Megatron's reentrant full recompute.
"""

from __future__ import annotations

import contextlib

import torch

_NO_PATCH = object()  # the module's class forward (no instance-level patch)

State = list[tuple[torch.nn.Module, dict, object]]


def held(modules) -> State:
    """(module, its parameters, its instance-level forward or _NO_PATCH) of each module, as now."""
    return [(m, dict(m._parameters), m.__dict__.get("forward", _NO_PATCH)) for m in modules]


@contextlib.contextmanager
def holding(state: State):
    """The modules hold `state` inside the block and what they held before after it."""
    before = held(m for m, _, _ in state)
    _put(state)
    try:
        yield
    finally:
        _put(before)


def _put(state: State) -> None:
    for module, params, forward in state:
        module._parameters.clear()
        module._parameters.update(params)
        if forward is _NO_PATCH:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = forward


class RecomputeNotes:
    """Megatron's full recompute (a reentrant checkpoint per layer: the layer runs once without grad,
    then again inside the backward) for `layers` whose weights a forward swaps in: inside
    `training_forward()`, each layer's forward notes what its modules hold; a call inside a backward
    (the recomputation) runs with that note. `clear()` drops the notes (the trainer does when its step
    ends: they hold the forward's swapped-in tensors)."""

    def __init__(self, layers):
        self.noting = False
        self._layers = [_Noted(self, layer, layer.forward) for layer in layers]
        for noted in self._layers:
            noted.layer.forward = noted

    @contextlib.contextmanager
    def training_forward(self):
        self.noting = True
        try:
            yield
        finally:
            self.noting = False

    def clear(self) -> None:
        for noted in self._layers:
            noted.state = None


class _Noted:
    def __init__(self, notes: RecomputeNotes, layer: torch.nn.Module, forward):
        self.notes, self.layer, self.forward, self.state = notes, layer, forward, None

    def __call__(self, *args, **kwargs):
        if torch._C._current_graph_task_id() == -1:  # a forward, not a recomputation in backward
            if self.notes.noting:
                self.state = held(m for m in self.layer.modules() if m is not self.layer)
            return self.forward(*args, **kwargs)
        if self.state is None:
            raise RuntimeError("a layer is recomputed whose forward was not noted: run the training forward inside "
                               "RecomputeNotes.training_forward()")
        with holding(self.state):
            return self.forward(*args, **kwargs)
