"""MemoryPhases (rollout.offload / trainer.offload) in the loop's order, on the CPU: the phases leave
each side where the schedule says (the engine released while the trainer trains, the trainer in host
memory while the engine generates), and two RL steps through them give the samples and weights of
the same steps with both sides resident, bit for bit. `offload.FORCE_COPY` makes every trainer move
a real copy and the engine drops its weights, so the reloads are exercised. The device peaks per
phase: tests/gpu/test_colocated_offload_run.py."""

import time
from types import SimpleNamespace

import pytest
import torch

from miles.algo.registry import ADVANTAGES, get
from miles.config.schema import AlgoCfg, AlgoName, ModelCfg, PrecisionCfg, RolloutCfg, TrainerCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint
from miles.orchestrate.colocate import MemoryPhases
from miles.orchestrate.handles import LocalHandle
from miles.rollout.native import NativeEngine
from miles.trainer import offload
from miles.trainer.torch_trainer import TorchTrainer
from miles.transport.object_store import ObjectStoreTransport
from miles.types import build_train_batch

TINY = ModelCfg(name="tiny", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, max_position_embeddings=64)
ROLLOUT = RolloutCfg(max_new_tokens=5, max_prompt_len=8, n_samples_per_prompt=4, max_running=16, slot_decode=True)
PROMPTS, LABELS, SEEDS = ["1+2=", "33+4=", "50+5=", "7+8="], ["3", "37", "55", "15"], [1, 2, 3, 4]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(random_checkpoint(TINY, DEFAULT_ALPHABET, seed=0, out=tmp_path_factory.mktemp("m") / "m"))


def run_steps(ckpt, offloaded: bool, steps: int = 2):
    engine = NativeEngine(ckpt, ROLLOUT, seed=0)
    trainer = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), TrainerCfg(lr=1e-2, global_batch_size=16,
                                                                          micro_batch_size=8), PrecisionCfg(name="fp32"))
    ctx = SimpleNamespace(engine=LocalHandle(engine), trainer=LocalHandle(trainer),
                          after_sync=lambda ctx: None, draft_sync=False)
    ctx.transport = ObjectStoreTransport(ctx)
    cfg = SimpleNamespace(hardware=SimpleNamespace(device="cuda"),  # the phases act on GPUs only
                          rollout=SimpleNamespace(offload=offloaded, check_weight_sync=True, asynchronous=False),
                          trainer=SimpleNamespace(offload=offloaded))
    phases = MemoryPhases(ctx, cfg)
    phases.start()
    drawn = []
    for step in range(steps):
        assert trainer.offloaded == ({"params", "optimizer"} if offloaded else set())
        samples = engine.generate(PROMPTS, LABELS, n=4, seeds=[s + 10 * step for s in SEEDS])
        drawn.append([(s.response_ids, s.rollout_logprobs) for s in samples])
        turn = phases.train_turn()
        assert ("perf/train_turn_s" in turn) is offloaded and turn.get("perf/train_turn_s", 0) >= 0
        assert engine.released == ({"weights", "kv_cache"} if offloaded else set())
        assert not trainer.offloaded
        rewards = torch.tensor([float(len(s.response_ids) % 2) for s in samples])
        adv = get(ADVANTAGES, "a", "grpo")(rewards, torch.tensor([s.group for s in samples]))
        trainer.train_rl(build_train_batch(samples, adv, engine.pad_id))
        _, moved = phases.sync()
        assert ("perf/sync_turn_s" in moved) is offloaded and moved.get("perf/sync_turn_s", 0) >= 0
        assert not engine.released
    trainer.onload()
    return drawn, {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_two_steps_through_the_phases_equal_the_resident_steps(ckpt, monkeypatch):
    monkeypatch.setattr(offload, "FORCE_COPY", True)
    resident_samples, resident_weights = run_steps(ckpt, offloaded=False)
    samples, weights = run_steps(ckpt, offloaded=True)
    assert samples == resident_samples
    assert samples[0] != samples[1]  # the second step sampled from the trained weights (and other seeds)
    assert all(torch.equal(weights[k], resident_weights[k]) for k in weights)


class _PartOfProcess:
    """A Ray-side handle (in_process False) whose component lives in process `pid`: the engine and
    the trainer of one HybridWorker (ray.hybrid) share one; actors of their own do not."""
    in_process = False

    def __init__(self, pid: int, peak: int):
        self.pid, self.peak = pid, peak

    def same_process(self, other) -> bool:
        return isinstance(other, _PartOfProcess) and other.pid == self.pid

    def apply(self, fn, *args):
        return self.peak


@pytest.mark.parametrize("pids, expected_gb", [((1, 1), 3.0), ((1, 2), 6.0)], ids=["one_actor", "two_actors"])
def test_phase_memory_reads_a_shared_process_once(pids, expected_gb):
    """One process, one allocator: its peak counts once, not once per component in it."""
    from miles.orchestrate.colocate import phase_memory

    engine, trainer = (_PartOfProcess(pid, 3 * 2**30) for pid in pids)
    assert phase_memory(SimpleNamespace(engine=engine, trainer=trainer)) == expected_gb


class _Recording:
    """A component handle that logs its calls into `log`."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def call(self, method, *args, **kwargs):
        self.log.append(f"{self.name}.{method}")


def test_each_phase_window_opens_when_its_phase_begins(monkeypatch):
    """The train window opens after the engine released its memory, the rollout window after the sync:
    a window opened earlier starts at the other phase's allocation (on an H100 the 4B step's train
    peak read the rollout's 68 GB)."""
    import miles.orchestrate.colocate as colocate

    log = []
    peaks = iter(range(1, 10))

    def window(ctx):
        log.append("window")
        return float(next(peaks))

    monkeypatch.setattr(colocate, "phase_memory", window)
    monkeypatch.setattr(colocate, "sync_weights", lambda ctx, check: log.append("sync") or 0.5)
    ctx = SimpleNamespace(engine=_Recording("engine", log), trainer=_Recording("trainer", log))
    cfg = SimpleNamespace(hardware=SimpleNamespace(device="cuda"),
                          rollout=SimpleNamespace(offload=True, check_weight_sync=False, asynchronous=False),
                          trainer=SimpleNamespace(offload=True))
    phases = MemoryPhases(ctx, cfg)
    phases.start()
    turn = phases.train_turn()
    assert turn.pop("perf/train_turn_s") >= 0 and turn == {"perf/peak_mem_rollout_gb": 2.0}  # 1: start()'s window
    seconds, metrics = phases.sync()
    parts = [metrics.pop(f"perf/sync_turn_{part}_s") for part in ("trainer", "weights", "cache")]
    assert metrics.pop("perf/sync_turn_s") == pytest.approx(sum(parts)) and min(parts) >= 0
    assert seconds == 0.5 and metrics == {"perf/peak_mem_train_gb": 4.0, "perf/peak_mem_sync_gb": 5.0}
    assert log == ["trainer.offload", "window",  # start: the first rollout window
                   "window", "engine.release_memory", "trainer.onload", "window",  # train_turn
                   "window", "trainer.offload", "engine.resume_memory", "sync", "trainer.offload",
                   "engine.resume_memory", "window"]  # sync, then the next rollout window


def test_sync_turn_names_the_slow_move(monkeypatch):
    """Each move around the sync is timed on its own: an engine whose cache (and graph capture) takes
    0.2 s shows it in `perf/sync_turn_cache_s`, not in the trainer's or the weights' share."""
    import miles.orchestrate.colocate as colocate

    class SlowCache(_Recording):
        def call(self, method, *args, **kwargs):
            if args == (("kv_cache",),):
                time.sleep(0.2)

    monkeypatch.setattr(colocate, "sync_weights", lambda ctx, check: 0.0)
    ctx = SimpleNamespace(engine=SlowCache("engine", []), trainer=_Recording("trainer", []))
    cfg = SimpleNamespace(hardware=SimpleNamespace(device="cuda"),
                          rollout=SimpleNamespace(offload=True, check_weight_sync=False, asynchronous=True),
                          trainer=SimpleNamespace(offload=True))
    _, metrics = MemoryPhases(ctx, cfg).sync()
    assert metrics["perf/sync_turn_cache_s"] >= 0.2
    assert metrics["perf/sync_turn_trainer_s"] < 0.1 and metrics["perf/sync_turn_weights_s"] < 0.1
