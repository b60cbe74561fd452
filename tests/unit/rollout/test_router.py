"""A fleet of engines behind one API: with per-group seeds N engines give the samples of one, in
prompt order whatever finishes first, and a Ray engine that dies mid-generate loses no sample and
comes back with the fleet's weights. Real engines on a tiny random checkpoint, real Ray actors."""

import os
import time
from dataclasses import replace

import pytest
import torch

from miles.config.schema import DType, LoRACfg, ModelCfg, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint
from miles.orchestrate.handles import LocalHandle, spawn
from miles.orchestrate.resume import model_digest
from miles.transport.checksum import checksum
from miles.rollout.native import NativeEngine
from miles.rollout.router import EngineFleet

TINY = ModelCfg(name="tiny", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, max_position_embeddings=128)
PROMPTS = [f"{a}+{b}=" for a, b in zip(range(10, 99, 7), range(99, 9, -7))][:9]
LABELS = [str(i) for i in range(len(PROMPTS))]
SEEDS = [1000 + 17 * i for i in range(len(PROMPTS))]
CFG = RolloutCfg(max_new_tokens=8, max_prompt_len=16, max_running=8, sync_every=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(random_checkpoint(TINY, DEFAULT_ALPHABET, seed=0, out=tmp_path_factory.mktemp("m") / "m"))


@pytest.fixture(scope="module")
def trainer_weights(ckpt):
    """Weights a trainer step could have produced (the checkpoint's, moved), and their checksum."""
    torch.manual_seed(0)
    state = NativeEngine(ckpt, CFG).model.state_dict()
    weights = {k: v + 0.02 * torch.randn_like(v) for k, v in state.items()}
    return weights, checksum(weights)


def tokens(samples):
    return [(s.prompt, s.group, s.response_ids) for s in samples]


def assert_same_samples(got, want, exact: bool):
    """Same prompts, groups and token ids; log-probs equal (exact) or within fp32 batch numerics:
    the same group in another batch may round its logits differently."""
    assert tokens(got) == tokens(want)
    for s, t in zip(got, want):
        if exact:
            assert s.rollout_logprobs == t.rollout_logprobs
        else:
            torch.testing.assert_close(torch.tensor(s.rollout_logprobs), torch.tensor(t.rollout_logprobs),
                                       atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- seeds in one engine


@pytest.mark.parametrize("slot_decode", [False, True])
def test_a_seeded_group_samples_the_same_in_any_batch_or_position(ckpt, slot_decode):
    engine = NativeEngine(ckpt, replace(CFG, slot_decode=slot_decode))
    assert (engine.slots is not None) == slot_decode
    n = 3  # 27 samples on 8 slots: the slot path admits, refills and compacts
    whole = engine.generate(PROMPTS, LABELS, n=n, seeds=SEEDS)
    order = [7, 2, 5]  # other neighbours, other positions, the engine's generator drawn in between
    engine.generate(PROMPTS[:2], LABELS[:2], n=n)
    part = engine.generate([PROMPTS[g] for g in order], [LABELS[g] for g in order], n=n,
                           seeds=[SEEDS[g] for g in order])
    for k, g in enumerate(order):
        want = [replace(s, group=k) for s in whole[g * n:(g + 1) * n]]
        assert_same_samples(part[k * n:(k + 1) * n], want, exact=False)
    # The seeds matter: other seeds give other samples (so the equality above is not vacuous).
    other = engine.generate(PROMPTS, LABELS, n=n, seeds=[s + 1 for s in SEEDS])
    assert tokens(other) != tokens(whole)


def test_both_decode_paths_draw_the_same_seeded_samples(ckpt):
    padded = NativeEngine(ckpt, replace(CFG, slot_decode=False)).generate(PROMPTS, LABELS, n=2, seeds=SEEDS)
    slots = NativeEngine(ckpt, replace(CFG, slot_decode=True)).generate(PROMPTS, LABELS, n=2, seeds=SEEDS)
    assert_same_samples(slots, padded, exact=False)


def test_seeds_must_match_the_prompts(ckpt):
    with pytest.raises(ValueError, match="one per prompt"):
        NativeEngine(ckpt, CFG).generate(PROMPTS, LABELS, n=2, seeds=SEEDS[:3])


# ---------------------------------------------------------------------------- in-process fleet


def test_two_in_process_engines_give_the_samples_of_one(ckpt, trainer_weights):
    weights, digest = trainer_weights
    one = EngineFleet([LocalHandle(NativeEngine(ckpt, CFG))], chunk_groups=2)
    two = EngineFleet([LocalHandle(NativeEngine(ckpt, CFG)) for _ in range(2)], chunk_groups=2)
    assert one.update_weights(weights, digest) == [digest]
    assert two.update_weights(weights, digest) == [digest, digest]
    assert two.apply_all(model_digest) == [digest, digest]
    a = one.call("generate", PROMPTS, LABELS, 3, None, None, seeds=SEEDS)
    b = two.call("generate", PROMPTS, LABELS, 3, None, None, seeds=SEEDS)
    assert [s.group for s in b] == [g for g in range(len(PROMPTS)) for _ in range(3)]
    assert_same_samples(b, a, exact=True)  # the same chunks: bit for bit, whichever engine ran them
    # And what one engine returns for the whole batch at once.
    reference = NativeEngine(ckpt, CFG)
    reference.update_weights(weights, digest)
    assert_same_samples(b, reference.generate(PROMPTS, LABELS, n=3, seeds=SEEDS), exact=False)
    # Token-id contexts (multi-turn calls) go through the same way.
    contexts = [s.prompt_ids + s.response_ids[:2] for s in b[::3]]
    by_ids = two.generate(PROMPTS, LABELS, n=1, max_new_tokens=4, prompt_ids=contexts, seeds=SEEDS)
    assert [s.prompt_ids for s in by_ids] == contexts
    assert_same_samples(by_ids, reference.generate(PROMPTS, LABELS, 1, None, 4, prompt_ids=contexts, seeds=SEEDS),
                        exact=False)


def test_each_prompt_takes_its_lora_adapter_to_the_engine_that_runs_it(ckpt):
    """Several LoRA adapters: a prompt's adapter id travels with it in its chunk, so two engines give
    the samples one engine gives for the mixed batch."""
    lora = LoRACfg(rank=4, alpha=8.0, adapters=["a", "b"], adapter_key="task")
    engines = [NativeEngine(ckpt, CFG, lora=lora) for _ in range(3)]
    gen = torch.Generator().manual_seed(0)
    adapters = {k: 0.3 * torch.randn(v.shape, generator=gen) for k, v in engines[0].lora.tensors().items()}
    routes = [i % 2 for i in range(len(PROMPTS))]
    fleet = EngineFleet([LocalHandle(e) for e in engines[:2]], chunk_groups=2)
    assert fleet.update_weights(adapters, checksum(adapters)) == [checksum(adapters)] * 2
    engines[2].update_weights(adapters)
    got = fleet.call("generate", PROMPTS, LABELS, 2, None, None, seeds=SEEDS, adapters=routes)
    assert [s.adapter for s in got] == [a for a in routes for _ in range(2)]
    assert_same_samples(got, engines[2].generate(PROMPTS, LABELS, n=2, seeds=SEEDS, adapters=routes), exact=False)


def test_an_in_process_engine_error_reaches_the_caller(ckpt):
    fleet = EngineFleet([LocalHandle(NativeEngine(ckpt, CFG)) for _ in range(2)])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        fleet.generate(PROMPTS, LABELS, n=1, max_new_tokens=500)


# ---------------------------------------------------------------------------- Ray actors


def probe_engine_class():
    """A NativeEngine with fault-injection knobs set through handle.apply. Defined in a function so
    Ray pickles it by value (workers cannot import this test module)."""

    class ProbeEngine(NativeEngine):
        delay = 0.0  # seconds to wait before each generate
        die = False  # exit the process on the next generate, as a crashed actor does
        seen: list = []

        def generate(self, prompts, *args, **kwargs):
            self.seen = self.seen + [list(prompts)]
            time.sleep(self.delay)
            if self.die:
                os._exit(1)
            return super().generate(prompts, *args, **kwargs)

    return ProbeEngine


@pytest.fixture(scope="module")
def ray_fleet(ckpt, ray_connection):
    """Two engine actors (one CPU each) on the module's Ray (tests/conftest.py)."""
    engines = [spawn(probe_engine_class(), True, ckpt, CFG, DType.fp32, "cpu", 1, 0) for _ in range(2)]
    yield EngineFleet(engines, log=lambda line: None)


def set_probe(handle, **knobs):
    handle.apply(lambda engine, values: engine.__dict__.update(values), knobs)


def seen(handle):
    return handle.apply(lambda engine: engine.seen)


@pytest.fixture
def reference(ckpt, trainer_weights):
    """One in-process engine with the trainer's weights: the samples the fleet must return."""
    engine = NativeEngine(ckpt, CFG)
    engine.update_weights(*trainer_weights)
    return engine.generate(PROMPTS, LABELS, n=2, seeds=SEEDS)


@pytest.mark.slow
def test_ray_engines_take_the_weights_and_give_the_samples_of_one(ray_fleet, trainer_weights, reference):
    weights, digest = trainer_weights
    assert ray_fleet.update_weights(weights, digest) == [digest, digest]
    assert ray_fleet.apply_all(model_digest) == [digest, digest]
    assert_same_samples(ray_fleet.generate(PROMPTS, LABELS, n=2, seeds=SEEDS), reference, exact=False)


@pytest.mark.slow
def test_ray_samples_come_in_prompt_order_when_the_first_chunk_finishes_last(ray_fleet, trainer_weights, reference):
    ray_fleet.update_weights(*trainer_weights)
    slow, fast = ray_fleet.engines
    set_probe(slow, delay=4.0, seen=[])
    set_probe(fast, seen=[])
    try:
        got = ray_fleet.generate(PROMPTS, LABELS, n=2, seeds=SEEDS)
    finally:
        set_probe(slow, delay=0.0)
    assert_same_samples(got, reference, exact=False)
    # Chunks of ceil(9 / (2 engines * 2)) = 3 groups: the slow engine took the first and, still
    # busy, nothing else; the fast one took the next two. So the first chunk came back last.
    assert seen(slow) == [PROMPTS[0:3]]
    assert seen(fast) == [PROMPTS[3:6], PROMPTS[6:9]]


@pytest.mark.slow
def test_an_engine_that_dies_mid_generate_loses_no_sample_and_comes_back_with_the_weights(
        ray_fleet, trainer_weights, reference):
    weights, digest = trainer_weights
    ray_fleet.update_weights(weights, digest)
    doomed, survivor = ray_fleet.engines
    old_actor = doomed.actor
    restarts = list(ray_fleet.restarts)
    set_probe(doomed, die=True, seen=[])
    set_probe(survivor, seen=[])
    got = ray_fleet.generate(PROMPTS, LABELS, n=2, seeds=SEEDS)
    assert_same_samples(got, reference, exact=False)  # every group once, in prompt order
    assert ray_fleet.restarts == [restarts[0] + 1, restarts[1]]
    assert doomed.actor is not old_actor
    # The new actor holds the fleet's last weights, not the checkpoint's.
    assert doomed.apply(model_digest) == digest
    # The dead engine's chunk was run again: the survivor ran it, or the restarted engine did.
    runs = seen(survivor) + seen(doomed)
    assert sorted(map(tuple, runs)) == sorted(tuple(PROMPTS[i:i + 3]) for i in (0, 3, 6))
    # The fleet goes on with both engines.
    assert_same_samples(ray_fleet.generate(PROMPTS, LABELS, n=2, seeds=SEEDS), reference, exact=False)


@pytest.mark.slow
def test_an_engine_killed_between_steps_is_restarted_by_the_next_weight_sync(ray_fleet, trainer_weights):
    import ray

    weights, digest = trainer_weights
    ray_fleet.update_weights(weights, digest)
    restarts = list(ray_fleet.restarts)
    ray.kill(ray_fleet.engines[1].actor, no_restart=True)
    ray_fleet.restarts_left, budget = 0, ray_fleet.restarts_left
    with pytest.raises(ray.exceptions.RayActorError):  # no restart left: the death is raised
        ray_fleet.update_weights(weights, digest)
    ray_fleet.restarts_left = budget
    assert ray_fleet.update_weights(weights, digest) == [digest, digest]
    assert ray_fleet.restarts == [restarts[0], restarts[1] + 1]
    assert ray_fleet.apply_all(model_digest) == [digest, digest]


@pytest.mark.slow
def test_a_ray_engine_error_is_raised_not_retried(ray_fleet):
    restarts = list(ray_fleet.restarts)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ray_fleet.generate(PROMPTS, LABELS, n=1, max_new_tokens=500)
    assert ray_fleet.restarts == restarts


@pytest.mark.slow
def test_an_engine_error_waits_out_the_other_engines_calls(ray_fleet):
    # The first error propagates only after every other running call ended (its error collected,
    # not left for Ray to report as "Unhandled error" after the real one).
    set_probe(ray_fleet.engines[1], delay=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(ValueError, match="max_position_embeddings"):
            ray_fleet.generate(PROMPTS[:2], LABELS[:2], n=1, max_new_tokens=500)
        assert time.monotonic() - start >= 1.0
    finally:
        set_probe(ray_fleet.engines[1], delay=0.0)
