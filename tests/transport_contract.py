"""The weight transport protocol's contract suite (miles/transport/protocol.py), written once and run
against every transport of `TransportName`, built through the registry (`build_transport`) as the run
builds it.

What the loops rely on, whichever transport they hold: it is a WeightTransport of its name; a checked
sync makes every engine hold, bit for bit, the trainer's current weights (the object-store checksum of
get_weights, computed independently in each engine's process), an unchecked one loads the same; a
payload corrupted on its way into an engine fails the checked sync with WeightSyncError; after the
actor behind an engine's handle was replaced (a restart), the next checked sync reaches the new one;
a sync splits into fetch / load exactly when the transport says `snapshots`. Each for every recipe
whose payload the transport carries (plain bf16, FP8 and INT4 rollouts: float8 codes, packed int4
bytes, fp32 scales), with one engine handle and with an EngineFleet of two.

Runners import these test functions into a module that defines a `contract` fixture (a Contract):
tests/unit/transport/test_transport_contract.py, in-process (members in threads), and through Ray
actors (marked slow) for the checked sync and the restart. The corrupted payload runs in-process
only: the corrupting engine is a class of this module, which Ray workers cannot import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

from miles.config.schema import AlgoCfg, AlgoName, DType, PrecisionCfg, Quant, RolloutCfg, TrainerCfg
from miles.rollout.native import NativeEngine
from miles.rollout.router import EngineFleet
from miles.trainer.torch_trainer import TorchTrainer
from miles.transport.checksum import WeightSyncError, checksum
from miles.transport.flat import FlatWeights
from miles.transport.protocol import TransportName, TransportOptions, WeightTransport, build_transport
from miles.types import build_train_batch

__all__ = [
    "Contract",
    "RECIPES",
    "test_is_a_weight_transport_of_its_name",
    "test_a_checked_sync_makes_every_engine_hold_the_trainers_weights",
    "test_an_unchecked_sync_loads_the_same_weights",
    "test_a_corrupted_payload_fails_with_weight_sync_error",
    "test_a_restarted_engine_is_reached_by_the_next_sync",
    "test_an_engine_that_dies_before_a_sync_is_restarted_and_that_sync_completes",
    "test_snapshots_split_a_sync_in_two",
]

MODEL = Path(__file__).resolve().parents[1] / "conf" / "model" / "qwen3_tiny.yaml"
PROMPTS = ["1+2=", "35+47=", "9*9=", "(12-3)*4="]
RECIPES = {"plain": Quant.none, "fp8": Quant.fp8, "int4": Quant.int4}
SMALL_BUCKET_MB = 0.01  # several broadcast buckets for the tiny model
# A member the transport failed to set up waits this long in a collective: a failure, not a hang.


def precision(quant: Quant) -> PrecisionCfg:
    return PrecisionCfg(name="test", train_dtype=DType.bf16, rollout_dtype=DType.bf16, rollout_quant=quant,
                        int4_group_size=32)


# Run where the component lives; lambdas, so that Ray pickles them by value (tests/ is no package).
held_checksum = lambda engine: (checksum(engine.model.state_dict()) if engine.recipe.rollout_quant == "none"  # noqa: E731
                                else engine.recipe.held_checksum(engine.model))


@dataclass
class Contract:
    """One transport under the suite. `spawn(cls, *args, **kwargs)`: a handle of a new component
    (LocalHandle in-process; RayHandle through Ray). `restart(handle)`: replace the component behind
    an engine handle by a fresh one from the same arguments, as RayHandle.restart does. `ray`: the
    handles are Ray actors."""
    name: TransportName
    ckpt: str
    spawn: Callable
    restart: Callable
    ray: bool = False


@dataclass
class Run:
    trainer: object
    engines: list  # the per-engine handles
    engine: object  # what the loop holds: the one handle, or an EngineFleet of them
    reference: NativeEngine  # generates the training batch
    transport: WeightTransport

    def step(self) -> str:
        """One optimizer step (every weight moves); the checksum the engines must then hold."""
        samples = self.reference.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=1.0)
        self.trainer.call("train_sft", build_train_batch(samples, torch.zeros(len(samples)), self.reference.pad_id))
        return self.trainer.call("get_weights")[1]

    def held(self) -> list[str]:
        return [e.apply(held_checksum) for e in self.engines]


def start(contract: Contract, quant: Quant = Quant.none, engines: int = 2, engine_cls: type = NativeEngine) -> Run:
    prec = precision(quant)
    # A large learning rate: one step moves every weight by more than a bf16 rounding step.
    trainer = contract.spawn(TorchTrainer, contract.ckpt, AlgoCfg(name=AlgoName.grpo), TrainerCfg(lr=1e-2), prec,
                             threads=1)
    handles = [contract.spawn(engine_cls, contract.ckpt, RolloutCfg(max_new_tokens=6), DType.bf16, "cpu", 1, 0, prec)
               for _ in range(engines)]
    engine = handles[0] if engines == 1 else EngineFleet(handles)
    components = SimpleNamespace(trainer=trainer, engine=engine)
    transport = build_transport(contract.name, components, TransportOptions(bucket_mb=SMALL_BUCKET_MB, timeout_s=60.0))
    reference = NativeEngine(contract.ckpt, RolloutCfg(max_new_tokens=6), DType.bf16, "cpu", 1, 0, prec)
    return Run(trainer, handles, engine, reference, transport)


# ----------------------------------------------------------------------------- the suite
def test_is_a_weight_transport_of_its_name(contract):
    run = start(contract, engines=1)
    try:
        assert isinstance(run.transport, WeightTransport)
        assert run.transport.name == contract.name and isinstance(run.transport.snapshots, bool)
    finally:
        run.transport.close()


@pytest.mark.parametrize("engines", [1, 2], ids=["one-engine", "fleet-of-2"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_checked_sync_makes_every_engine_hold_the_trainers_weights(contract, recipe, engines):
    run = start(contract, RECIPES[recipe], engines)
    try:
        for _ in range(2):  # what a first sync set up serves the next
            expected = run.step()
            assert expected not in run.held()
            seconds = run.transport.sync(check=True)
            assert seconds >= 0 and run.held() == [expected] * engines
    finally:
        run.transport.close()


@pytest.mark.parametrize("recipe", ["plain", "int4"])
def test_an_unchecked_sync_loads_the_same_weights(contract, recipe):
    run = start(contract, RECIPES[recipe])
    try:
        expected = run.step()
        run.transport.sync(check=False)
        assert run.held() == [expected, expected]
    finally:
        run.transport.close()


def _flip(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` with the top bit of its first element's last byte flipped (a float's sign)."""
    t = t.detach().clone()
    t.reshape(-1)[:1].view(torch.uint8)[-1].bitwise_xor_(0x80)
    return t


class CorruptingEngine(NativeEngine):
    """An engine whose incoming payload is damaged on its way in (one bit of its largest tensor),
    whatever carried it; copies, so a buffer the trainer shares stays whole."""

    def update_weights(self, weights, expected_checksum=None):
        if isinstance(weights, FlatWeights):
            weights = FlatWeights(weights.layout, _flip(weights.buffer))
        else:
            largest = max(weights, key=lambda n: weights[n].numel())
            weights = {**weights, largest: _flip(weights[largest])}
        return super().update_weights(weights, expected_checksum)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_corrupted_payload_fails_with_weight_sync_error(contract, recipe):
    if contract.ray:
        pytest.skip("the corrupting engine is a class of this module (in-process only)")
    run = start(contract, RECIPES[recipe], engines=2, engine_cls=CorruptingEngine)
    try:
        run.step()
        with pytest.raises(WeightSyncError, match="checksum"):
            run.transport.sync(check=True)
    finally:
        run.transport.close()


def test_a_restarted_engine_is_reached_by_the_next_sync(contract):
    run = start(contract)
    try:
        run.transport.sync(check=True)
        contract.restart(run.engines[1])  # a fresh engine: the checkpoint's weights, in no group
        expected = run.step()
        run.transport.sync(check=True)
        assert run.held() == [expected, expected]
        expected = run.step()  # and what the new setup made serves the next sync
        run.transport.sync(check=True)
        assert run.held() == [expected, expected]
    finally:
        run.transport.close()


def test_an_engine_that_dies_before_a_sync_is_restarted_and_that_sync_completes(contract):
    """The supervisor's handle (RestartingEngine) around a whole sync, as the loop holds it: the engine
    actor dies after the transport set up what it keeps (a segment, a group), its death is met inside
    the transport's own calls, and the sync ends with one restart and the new actor holding the
    trainer's weights (a stale call retried on the new actor failed the run and started it over)."""
    if not contract.ray:
        pytest.skip("an actor's death: through Ray only")
    import ray

    from miles.orchestrate.supervise import FaultBudget, RestartingEngine

    run = start(contract, engines=1)
    logged: list[str] = []
    engine = RestartingEngine(run.engine, FaultBudget(2, logged.append),
                              on_restart=lambda: pytest.fail("a sync's retry is the sync itself"))
    transport = build_transport(contract.name, SimpleNamespace(trainer=run.trainer, engine=engine),
                                TransportOptions(bucket_mb=SMALL_BUCKET_MB, timeout_s=60.0))
    try:
        transport.sync(check=True)
        ray.kill(run.engines[0].actor, no_restart=True)
        expected = run.step()
        engine.around_sync(lambda: transport.sync(check=True))
        assert run.held() == [expected]
        assert len(logged) == 1 and "the rollout engine actor died" in logged[0] and "retry 1/2" in logged[0]
    finally:
        transport.close()
        run.transport.close()


def test_snapshots_split_a_sync_in_two(contract):
    run = start(contract)
    try:
        if not run.transport.snapshots:
            assert not hasattr(run.transport, "fetch")  # a collective: the loop syncs with the engines idle
            return
        expected = run.step()
        snapshot = run.transport.fetch()
        assert expected not in run.held()  # nothing loaded yet
        run.transport.load(snapshot, check=True)
        assert run.held() == [expected, expected]
    finally:
        run.transport.close()
