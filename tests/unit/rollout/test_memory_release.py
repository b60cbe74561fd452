"""NativeEngine.release_memory / resume_memory (colocation) on the CPU: what is freed is gone, comes
back, and the samples after release + resume (+ a sync where the weights were dropped) equal those
without the release; calls in any order are safe, and a call that needs what is released says which
call brings it back. Device memory figures: tests/gpu/test_colocate_memory.py."""

import contextlib
import sys
from dataclasses import replace

import pytest
import torch

from miles.config.rules import config_problems
from miles.config.schema import DType, ModelCfg, PrecisionCfg, Quant, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.models import from_pretrained
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout import pausable
from miles.rollout.native import NativeEngine
from miles.transport.flat import FlatWeights

TINY = ModelCfg(name="tiny", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, max_position_embeddings=64)
PROMPTS = ["1+2=", "35+47=", "9+9="]
SEEDS = [11, 12, 13]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(random_checkpoint(TINY, DEFAULT_ALPHABET, seed=0, out=tmp_path_factory.mktemp("m") / "m"))


def engine(ckpt, slots=True, **kw):
    cfg = RolloutCfg(max_new_tokens=6, max_prompt_len=8, max_running=4, sync_every=3, slot_decode=slots)
    return NativeEngine(ckpt, replace(cfg, **kw.pop("cfg", {})), seed=0, **kw)


def samples(engine):
    """Sampled (temperature 1) responses with per-group seeds: the same draws on every call."""
    out = engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=2, seeds=SEEDS)
    return [(s.response_ids, s.rollout_logprobs, s.finish_reason) for s in out]


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@pytest.mark.parametrize("slots", [True, False])
def test_release_then_resume_gives_the_same_samples(ckpt, slots):
    eng = engine(ckpt, slots)
    before = samples(eng)
    held = eng.held_bytes()
    assert held["weights"] == storage_bytes(eng.flat.buffer) > 0
    assert (held["kv_cache"] > 0) == slots
    eng.release_memory()
    assert eng.released == {"weights", "kv_cache"} and eng.held_bytes() == {"weights": 0, "kv_cache": 0}
    if slots:  # the slot cache and its per-slot state are gone
        assert not eng.slots.allocated and eng.slots.cache is None and eng.slots.tokens is None
    eng.release_memory()  # twice: a no-op
    eng.resume_memory()
    assert not eng.released and eng.held_bytes() == held
    if slots:
        assert eng.slots.allocated
    assert samples(eng) == before
    eng.resume_memory()  # twice: a no-op
    assert samples(eng) == samples(engine(ckpt, slots))  # and as a fresh engine's, call for call


def test_calls_while_released_name_the_call_that_brings_it_back(ckpt):
    eng = engine(ckpt)
    sync = FlatWeights(eng.flat.layout, eng.flat.buffer.clone())
    eng.release_memory(("kv_cache",))
    with pytest.raises(RuntimeError, match=r"kv_cache memory is released .*resume_memory\(\('kv_cache',\)\)"):
        eng.generate(PROMPTS, ["?"] * 3)
    eng.release_memory(("weights",))
    with pytest.raises(RuntimeError, match=r"weights and kv_cache .*resume_memory\(\('weights', 'kv_cache'\)\)"):
        eng.generate(PROMPTS, ["?"] * 3)
    with pytest.raises(RuntimeError, match=r"update_weights: .*resume_memory\(\('weights',\)\) first"):
        eng.update_weights(sync, sync.checksum())
    with pytest.raises(ValueError, match="unknown memory tag.*valid: weights, kv_cache"):
        eng.release_memory(("optimizer",))
    eng.resume_memory("weights")  # one tag as a string
    assert eng.update_weights(sync, sync.checksum()) == sync.checksum()  # a sync into resumed weights


def test_any_order_of_partial_release_and_resume(ckpt):
    eng = engine(ckpt)
    before = samples(eng)
    # The cache back while the weights are still away, then the weights.
    eng.release_memory()
    eng.resume_memory(("kv_cache",))
    assert eng.slots.allocated and eng.released == {"weights"}
    eng.resume_memory(("weights",))
    assert samples(eng) == before
    # Only the weights leave (the cache and its slots stay), and come back.
    cache = eng.slots.cache
    eng.release_memory("weights")
    assert eng.slots.cache is cache
    eng.resume_memory("weights")
    assert samples(eng) == before
    # Only the cache leaves.
    eng.release_memory("kv_cache")
    eng.resume_memory()
    assert eng.slots.cache is not cache and samples(eng) == before


def test_dropped_weights_are_refilled_by_the_next_sync(ckpt):
    """keep_weights=False: no copy anywhere (the CPU buffer itself is freed); resume gives zeros, which
    the engine refuses to decode with until update_weights has filled them."""
    eng = engine(ckpt)
    before = samples(eng)
    flat_sync = FlatWeights(eng.flat.layout, eng.flat.buffer.clone())  # what a trainer would send
    state = {k: v.clone() for k, v in eng.model.state_dict().items()}
    params = dict(eng.model.named_parameters())
    eng.release_memory(keep_weights=False)
    assert storage_bytes(eng.flat.buffer) <= eng.flat.buffer.element_size()
    assert all(storage_bytes(p) <= p.element_size() for p in eng.model.parameters())
    eng.resume_memory()
    assert dict(eng.model.named_parameters()) == params  # the same Parameter objects, new storage
    assert all(p.untyped_storage().data_ptr() == eng.flat.buffer.untyped_storage().data_ptr()
               for p in eng.model.parameters())  # views of the new flat buffer again
    assert float(eng.flat.buffer.abs().sum()) == 0.0
    with pytest.raises(RuntimeError, match=r"without a host copy .*update_weights"):
        eng.generate(PROMPTS, ["?"] * 3)
    eng.update_weights(flat_sync, flat_sync.checksum())  # the in-process flat sync
    assert samples(eng) == before
    eng.release_memory("weights", keep_weights=False)
    eng.resume_memory("weights")
    eng.update_weights(state)  # the state-dict sync (Ray's object store path)
    assert samples(eng) == before


@pytest.mark.parametrize("keep", [True, False])
def test_quantized_rollout_weights_move_tensor_by_tensor(ckpt, keep):
    """An INT4 rollout holds no flat buffer: each parameter / payload buffer is released on its own."""
    int4 = PrecisionCfg(name="int4", train_quant=Quant.int4, rollout_quant=Quant.int4, int4_group_size=32)
    eng = engine(ckpt, slots=False, precision=int4)
    assert eng.flat is None
    before = samples(eng)
    payload = eng.recipe.sync_payload(from_pretrained(ckpt, dtype=torch.float32).state_dict())
    eng.release_memory(keep_weights=keep)
    if not keep:
        assert all(storage_bytes(t) <= t.element_size() for t in (*eng.model.parameters(), *eng.model.buffers()))
    eng.resume_memory()
    if not keep:
        with pytest.raises(RuntimeError, match="update_weights"):
            eng.generate(PROMPTS, ["?"] * 3)
        eng.update_weights(payload)
    assert samples(eng) == before


def test_bf16_engine_round_trip(ckpt):
    eng = engine(ckpt, dtype=DType.bf16)
    before = samples(eng)
    eng.release_memory()
    eng.resume_memory()
    assert samples(eng) == before


class StandInSaver:
    """torch_memory_saver's interface on the CPU (the library needs CUDA): regions record their tags;
    a pause is recorded, and the test wipes the contents a real pause would lose."""

    def __init__(self):
        self.calls = []

    @contextlib.contextmanager
    def region(self, tag):
        self.calls.append(("region", tag))
        yield

    def pause(self, tag):
        self.calls.append(("pause", tag))

    def resume(self, tag):
        self.calls.append(("resume", tag))


@pytest.fixture
def paused_engine(ckpt, monkeypatch):
    saver = StandInSaver()
    monkeypatch.setattr(pausable, "load", lambda enabled, device: pausable.PausableMemory(saver, device)
                        if enabled else None)
    return engine(ckpt, cfg={"memory_saver": True}), saver


def test_memory_saver_pauses_weights_and_cache_at_their_addresses(paused_engine, monkeypatch):
    """rollout.memory_saver: the flat buffer and the slot cache are allocated in their regions and
    paused, not freed: the same tensors (addresses) come back, the graphs are never dropped, and what
    a pause loses (the contents) is refilled by the sync (weights) or zeroed (cache)."""
    eng, saver = paused_engine
    assert saver.calls == [("region", "weights"), ("region", "kv_cache")]
    before = samples(eng)
    flat_sync = FlatWeights(eng.flat.layout, eng.flat.buffer.clone())
    buffer, cache, tokens = eng.flat.buffer, eng.slots.cache, eng.slots.tokens
    monkeypatch.setattr(eng.slots, "drop_graphs", lambda: pytest.fail("a pause keeps the graphs"))
    eng.release_memory(keep_weights=False)
    assert saver.calls[2:] == [("pause", "kv_cache"), ("pause", "weights")]
    assert eng.held_bytes() == {"weights": 0, "kv_cache": 0}
    buffer.fill_(float("nan"))  # what the GPU loses at a pause
    for layer in cache.layers:
        for t in layer.tensors():
            t.fill_(float("nan"))
    eng.resume_memory()
    assert saver.calls[4:] == [("resume", "weights"), ("resume", "kv_cache")]
    assert eng.flat.buffer is buffer and eng.slots.cache is cache and eng.slots.tokens is tokens
    assert all(float(t.abs().sum()) == 0.0 for layer in cache.layers for t in layer.tensors())
    with pytest.raises(RuntimeError, match=r"without a host copy .*update_weights"):
        eng.generate(PROMPTS, ["?"] * 3)
    eng.update_weights(flat_sync, flat_sync.checksum())
    assert samples(eng) == before


def test_memory_saver_with_kept_weights_copies_them_back(paused_engine):
    """keep_weights=True (LoRA engines, or a caller that wants no sync): a host copy before the pause,
    copied back into the same buffer at resume."""
    eng, _ = paused_engine
    before, buffer = samples(eng), eng.flat.buffer
    eng.release_memory()
    buffer.fill_(float("nan"))
    eng.resume_memory()
    assert eng.flat.buffer is buffer and samples(eng) == before


def test_memory_saver_refuses_where_it_cannot_work(monkeypatch):
    with pytest.raises(ValueError, match=r"rollout.memory_saver=true pauses CUDA memory.*memory_saver=false"):
        pausable.load(True, torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "torch_memory_saver", None)  # not installed
    with pytest.raises(RuntimeError, match=r"needs torch_memory_saver .*pip install torch_memory_saver"):
        pausable.load(True, torch.device("cuda"))
    assert pausable.load(False, torch.device("cuda")) is None


@pytest.mark.parametrize("overrides, refused", [
    ([], "hardware.device=cpu"),
    (["hardware=gpu", "rollout=vllm"], "rollout=vllm"),
    (["hardware=gpu", "precision=fp8"], "precision=fp8"),
])
def test_memory_saver_is_refused_by_name_where_it_pauses_nothing(compose, overrides, refused):
    problems = [p for p in config_problems(compose(["rollout.memory_saver=true", *overrides]))
                if p.startswith("rollout.memory_saver=true")]
    assert len(problems) == 1 and refused in problems[0], problems


def test_memory_saver_takes_a_bf16_gpu_run(compose):
    assert not [p for p in config_problems(compose(["rollout.memory_saver=true", "hardware=gpu", "precision=bf16"]))
                if "memory_saver" in p]
