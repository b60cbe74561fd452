"""Features whose integration tests ran in-process only, run with Ray on too (issue 25, item 7): in a
Ray run the engine and the trainer are actors of their own processes, so what crosses between them is
pickled (routed experts, rollouts), each has its own torch threads and RNG, and a component may be
absent (debug modes). Their in-process tests stay where they are (test_true_on_policy.py,
test_debug_modes.py); here the same claims with Ray on, each against an in-process run where the claim
is an equality."""

import pytest

from ray_runs import WITH_AND_WITHOUT_RAY, run_with
from runs import TINY, file_digest, journal_metrics, without_timing

pytestmark = pytest.mark.slow
TRAIN_KEYS = ("train/", "mismatch/")


@pytest.fixture(scope="module")
def module_ray(ray_connection):
    """The module's Ray runs on one local Ray (tests/conftest.py `ray_connection`; ray_runs.run_with
    kills each run's actors): a start and a stop each were ~4-5 s of the module's ~35 s."""
    yield


def test_true_on_policy_is_bitwise_exact_with_ray(tmp_path, monkeypatch, compose, module_ray):
    """The trainer's log-probs equal the engine's bit for bit when the two are separate processes
    (each with its own threads and batch-invariant kernels), not only two objects of one process."""
    monkeypatch.chdir(tmp_path)
    run_with(compose, [*TINY, "eval.interval=100", "model=qwen3_moe_tiny", "true_on_policy=true", "steps=3",
                       "ray.hybrid=false"], tmp_path / "run", ray=True)
    metrics = journal_metrics(tmp_path / "run")
    assert [metrics[s]["mismatch/logprob_abs_diff"] for s in (1, 2, 3)] == [0.0, 0.0, 0.0]


@WITH_AND_WITHOUT_RAY
def test_r3_routing_replay_reaches_the_trainer(tmp_path, monkeypatch, compose, ray, request):
    """algo.routing_replay=r3: the engine's routed experts travel with the samples (through Ray's
    object store with Ray on) and the trainer replays them: every step logs the agreement of its own
    router with them (all of it on the first step: same weights, fp32) and a log-prob mismatch at
    fp32 rounding level. (No integration test ran R3 before, in either arrangement.)"""
    monkeypatch.chdir(tmp_path)
    if ray:
        request.getfixturevalue("module_ray")
    run_with(compose, [*TINY, "eval.interval=100", "model=qwen3_moe_tiny", "algo.routing_replay=r3", "steps=2"],
             tmp_path / "run", ray)
    metrics = journal_metrics(tmp_path / "run")
    for step in (1, 2):
        m = metrics[step]
        assert 0.0 <= m["mismatch/routing_agreement"] <= 1.0 and m["mismatch/logprob_abs_diff"] < 1e-4
    assert metrics[1]["mismatch/routing_agreement"] > 0.99


def test_debug_modes_with_ray_train_as_in_process(tmp_path, monkeypatch, compose, module_ray):
    """debug.rollout_only (no trainer actor) saves rollouts; debug.train_only (no engine actor) trains
    on them, with Ray on and in-process alike: the same metrics and the same weights, bit for bit."""
    monkeypatch.chdir(tmp_path)
    rollouts = tmp_path / "rollouts"
    run_with(compose, [*TINY, "steps=2", "debug.rollout_only=true", f"debug.save_rollouts={rollouts}"],
             tmp_path / "rollout_only", ray=True)
    assert not (tmp_path / "rollout_only" / "checkpoint").exists()
    assert not any(k.startswith("train/") for k in journal_metrics(tmp_path / "rollout_only")[1])
    for ray in (True, False):
        run_with(compose, [*TINY, "steps=2", "debug.train_only=true", f"debug.load_rollouts={rollouts}"],
                 tmp_path / f"train_only_{ray}", ray)

    def train_metrics(run_dir):
        return {s: {k: v for k, v in m.items() if k.startswith(TRAIN_KEYS)}
                for s, m in journal_metrics(run_dir).items() if s > 0}

    with_ray, in_process = tmp_path / "train_only_True", tmp_path / "train_only_False"
    assert train_metrics(with_ray) == train_metrics(in_process) and sorted(train_metrics(with_ray)) == [1, 2]
    assert file_digest(with_ray / "checkpoint/model.safetensors") == file_digest(
        in_process / "checkpoint/model.safetensors")


@pytest.mark.parametrize("hybrid", [True, False], ids=["one_actor", "two_actors"])
def test_ray_run_trains_as_in_process(tmp_path, monkeypatch, compose, module_ray, hybrid):
    """With Ray on, the engine and the trainer in one actor (ray.hybrid: the default where it
    applies, the weights copied inside it) or in actors of their own (the weights through the object
    store): the run logs the metrics of an in-process run and ends with its weights, bit for bit."""
    import miles.orchestrate.run as run_module

    monkeypatch.chdir(tmp_path)
    spawned, spawn = [], run_module.spawn

    def recording(cls, use_ray, *args, **kwargs):
        if use_ray:
            spawned.append(cls.__name__)
        return spawn(cls, use_ray, *args, **kwargs)

    monkeypatch.setattr(run_module, "spawn", recording)
    overrides = [*TINY, "steps=3", "eval.interval=3", "checkpoint.enabled=false"]
    run_with(compose, [*overrides, f"ray.hybrid={str(hybrid).lower()}"], tmp_path / "ray", ray=True)
    run_with(compose, overrides, tmp_path / "in_process", ray=False)
    assert spawned == (["HybridWorker"] if hybrid else ["NativeEngine", "TorchTrainer"])
    with_ray, in_process = journal_metrics(tmp_path / "ray"), journal_metrics(tmp_path / "in_process")
    assert sorted(with_ray) == [0, 1, 2, 3] and without_timing(with_ray) == without_timing(in_process)
    assert all(with_ray[s]["perf/weight_sync_s"] > 0 for s in (1, 2, 3))
    assert file_digest(tmp_path / "ray/checkpoint/model.safetensors") == file_digest(
        tmp_path / "in_process/checkpoint/model.safetensors")


def test_compiled_cpu_engine_in_a_ray_actor_samples_as_the_eager_one(tmp_path, monkeypatch, compose, module_ray):
    """rollout.compile_cpu=true with Ray on (the default arrangement): the engine compiles inside its
    actor, samples what the eager in-process engine samples (the same rewards and response lengths,
    step by step) and stays at fp32's mismatch with the trainer across its weight syncs."""
    monkeypatch.chdir(tmp_path)
    overrides = [*TINY, "steps=2", "eval.interval=100", "checkpoint.enabled=false"]
    run_with(compose, [*overrides, "rollout.compile_cpu=true"], tmp_path / "ray", ray=True)
    run_with(compose, overrides, tmp_path / "eager", ray=False)
    compiled, eager = journal_metrics(tmp_path / "ray"), journal_metrics(tmp_path / "eager")
    for step in (1, 2):
        for key in ("rollout/reward_mean", "rollout/response_len_mean"):
            assert compiled[step][key] == eager[step][key], (step, key)
        assert compiled[step]["mismatch/logprob_abs_diff"] < 1e-5


def test_actors_run_at_nice_zero_not_rays_fifteen(module_ray):
    """Ray's workers default to nice 15: beside one busy nice-0 process, the Ray step of the default
    experiment took 15x the in-process step (docs/benchmarks.md); start_ray asks for nice 0."""
    import os

    import ray

    from miles.orchestrate.handles import spawn

    class Probe:
        def nice(self):
            return os.nice(0)

    handle = spawn(Probe, True)
    try:
        assert handle.call("nice") == 0
    finally:
        ray.kill(handle.actor, no_restart=True)
