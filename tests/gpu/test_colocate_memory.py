"""Colocation memory phases on CUDA: the engine's release_memory / resume_memory and the trainer's
offload / onload free what they say (device bytes measured against the bytes of the tensors), and a
colocated RL cycle (rollout, release, onload, train, offload, resume, sync) gives bit for bit the
samples and weights of the same cycle without any of it.

Skipped without a GPU (CI). On a GPU machine: `pytest -s tests/gpu/test_colocate_memory.py` (-s shows
the peak memory of each phase and the time of each call; needs torch, safetensors, tokenizers,
omegaconf: no Hydra, Ray or MLflow).
"""

import gc
import os
import socket
import time

import pytest
import torch

from miles.orchestrate import determinism

# cuBLAS reads its workspace setting when it first starts in the process: fixed, its reductions
# repeat (the bitwise comparisons below run the same GEMMs in two trainers).
os.environ.update(determinism.CUBLAS_ENV)

from miles.config.schema import AlgoCfg, AlgoName, DType, ModelCfg, PrecisionCfg, RolloutCfg, TrainerCfg  # noqa: E402
from miles.data.tokenizer import DEFAULT_ALPHABET  # noqa: E402
from miles.orchestrate.checkpoints import random_checkpoint  # noqa: E402
from miles.rollout.native import NativeEngine  # noqa: E402
from miles.transport.device import memory_stats  # noqa: E402
from miles.trainer.torch_trainer import TorchTrainer  # noqa: E402
from miles.transport.flat import FlatWeights  # noqa: E402
from miles.types import build_train_batch  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# ~93M parameters: 190 MB of bf16 engine weights, 370 MB of fp32 masters (+ as many gradients, twice
# as many AdamW moments); the slot cache of 128 slots x 64 columns is 134 MB in bf16.
MID = ModelCfg(name="mid", hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16, num_kv_heads=8,
               head_dim=64, max_position_embeddings=512)
ROLLOUT = RolloutCfg(max_new_tokens=40, max_prompt_len=16, max_running=128, sync_every=4, n_samples_per_prompt=4)
BF16 = PrecisionCfg(name="bf16", train_dtype=DType.bf16, rollout_dtype=DType.bf16)
TRAIN = TrainerCfg(lr=1e-4, global_batch_size=64, micro_batch_size=16)
PROMPTS = [f"{a}+{b}=" for a, b in zip(range(10, 90, 5), range(33, 99, 4))]  # 16 prompts x 4 = 64 samples
MB = 2**20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(random_checkpoint(MID, DEFAULT_ALPHABET, seed=0, out=tmp_path_factory.mktemp("ckpt") / "m"))


def engine(checkpoint):
    return NativeEngine(checkpoint, ROLLOUT, DType.bf16, device="cuda", seed=0)


def trainer(checkpoint):
    return TorchTrainer(checkpoint, AlgoCfg(name=AlgoName.grpo), TRAIN, BF16, device="cuda", max_response_len=40)


def generate(eng, step: int = 0):
    """64 sampled samples, per-group seeds: the same draws whatever ran before."""
    return eng.generate(PROMPTS, ["?"] * len(PROMPTS), n=4, seeds=[1000 * step + i for i in range(len(PROMPTS))])


def as_lists(samples):
    return [(s.response_ids, s.rollout_logprobs) for s in samples]


def batch_of(samples, pad_id):
    return build_train_batch(samples, torch.linspace(-1, 1, len(samples)), pad_id)


def timed(fn, *args, **kwargs) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def allocated() -> int:
    return memory_stats("cuda").allocated


def test_engine_release_frees_the_weights_and_the_cache(checkpoint):
    eng = engine(checkpoint)
    assert eng.slots is not None and eng.slots.captured
    before = as_lists(generate(eng))
    held = eng.held_bytes()
    # The tensors themselves: the flat bf16 buffer and every layer's slot keys / values.
    assert held["weights"] == eng.flat.buffer.numel() * 2
    kv = [t for layer in eng.slots.cache.layers for t in (layer.keys, layer.values)]
    assert held["kv_cache"] == sum(2 * t.numel() for t in kv)
    del kv
    assert held["weights"] > 150 * MB and held["kv_cache"] > 100 * MB
    resident = allocated()
    t_release = timed(eng.release_memory)
    freed = resident - allocated()
    print(f"\nengine: weights {held['weights'] / MB:.0f} MB, kv cache {held['kv_cache'] / MB:.0f} MB; "
          f"release_memory freed {freed / MB:.0f} MB in {t_release * 1e3:.1f} ms")
    assert freed >= held["weights"] + held["kv_cache"]
    assert memory_stats("cuda").reserved <= resident  # handed back to the driver (empty_cache)
    t_resume = timed(eng.resume_memory)
    assert eng.slots.captured and allocated() >= resident - 8 * MB  # graphs captured again
    print(f"engine: resume_memory (host copy back, graphs recaptured) {t_resume * 1e3:.1f} ms")
    assert as_lists(generate(eng)) == before  # bit for bit: ids and log-probs

    # Dropped weights (no host copy), refilled by an in-process sync.
    sync = FlatWeights(eng.flat.layout, eng.flat.buffer.clone())
    resident = allocated()
    t_release = timed(eng.release_memory, keep_weights=False)
    freed = resident - allocated()
    t_resume = timed(eng.resume_memory)
    t_sync = timed(eng.update_weights, sync, sync.checksum())
    print(f"engine: release_memory(keep_weights=False) freed {freed / MB:.0f} MB in {t_release * 1e3:.1f} ms; "
          f"resume_memory {t_resume * 1e3:.1f} ms; update_weights {t_sync * 1e3:.1f} ms")
    assert freed >= held["weights"] + held["kv_cache"]
    assert as_lists(generate(eng)) == before


def test_trainer_offload_frees_params_grads_and_optimizer(checkpoint):
    eng = engine(checkpoint)
    batch = batch_of(generate(eng), eng.pad_id)
    del eng
    torch.cuda.empty_cache()
    plain, colocated = trainer(checkpoint), trainer(checkpoint)
    plain.train_rl(batch), colocated.train_rl(batch)  # gradients and AdamW moments exist now
    colocated.get_weights(in_process=True)  # the in-process sync buffer exists too
    need = colocated.offload_bytes()
    assert need["params"] > 350 * MB and need["grads"] == need["params"] and need["optimizer"] >= 2 * need["params"]
    resident = allocated()
    t_offload = timed(colocated.offload)
    freed = resident - allocated()
    print(f"\ntrainer: params {need['params'] / MB:.0f} MB, grads {need['grads'] / MB:.0f} MB, optimizer "
          f"{need['optimizer'] / MB:.0f} MB; offload freed {freed / MB:.0f} MB in {t_offload * 1e3:.1f} ms")
    assert freed >= sum(need.values())
    t_onload = timed(colocated.onload)
    print(f"trainer: onload {t_onload * 1e3:.1f} ms")
    assert all(p.is_cuda for p in colocated.model.parameters())
    assert all(v.device == p.device for p in colocated.model.parameters()
               for k, v in colocated.optimizer.state[p].items() if k != "step")
    m_plain, m_colocated = plain.train_rl(batch), colocated.train_rl(batch)  # fused AdamW: state on the device
    assert m_colocated == m_plain
    a, b = plain.model.state_dict(), colocated.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_colocated_cycle_equals_the_resident_cycle(checkpoint):
    """Two RL steps the way a colocated loop runs them, against the same steps with everything resident
    (run first, then freed): the same samples and log-probs at every step, the same weights at the
    end, bit for bit. Prints each phase's time, its peak and what stays allocated after it."""
    eng_ref, trainer_ref = engine(checkpoint), trainer(checkpoint)
    ref_samples = []
    for step in range(2):
        samples = generate(eng_ref, step)
        ref_samples.append(as_lists(samples))
        trainer_ref.train_rl(batch_of(samples, eng_ref.pad_id))
        eng_ref.update_weights(*trainer_ref.get_weights(in_process=True))
    ref_samples.append(as_lists(generate(eng_ref, 2)))
    ref_weights = {k: v.cpu() for k, v in trainer_ref.model.state_dict().items()}
    del eng_ref, trainer_ref, samples
    gc.collect()
    torch.cuda.empty_cache()

    start = allocated()
    eng, train = engine(checkpoint), trainer(checkpoint)
    train.offload()  # the trainer waits in host memory while the engine generates

    def phase(name, fn, *args, **kwargs):
        memory_stats("cuda", reset_peak=True)
        seconds = timed(fn, *args, **kwargs)
        stats = memory_stats("cuda")
        print(f"  {name:<36} {seconds * 1e3:8.1f} ms   peak {(stats.peak - start) / MB:6.0f} MB   "
              f"after {(stats.allocated - start) / MB:6.0f} MB")
        return stats

    print(f"\ncolocated cycle (device MB above the {start / MB:.0f} MB allocated before it):")
    idle = []  # allocated with both sides off the device, each step: nothing may pile up
    for step in range(2):
        out = {}
        phase("rollout (generate)", lambda: out.update(samples=generate(eng, step)))
        assert as_lists(out["samples"]) == ref_samples[step], step
        idle.append(phase("engine.release_memory(drop weights)", eng.release_memory, keep_weights=False).allocated)
        phase("trainer.onload", train.onload)
        phase("train_rl", train.train_rl, batch_of(out["samples"], eng.pad_id))
        phase("trainer.offload(grads, optimizer)", train.offload, ("grads", "optimizer"))
        phase("engine.resume_memory(weights)", eng.resume_memory, ("weights",))
        phase("sync (get_weights + update_weights)", lambda: eng.update_weights(*train.get_weights(in_process=True)))
        phase("trainer.offload(params)", train.offload, ("params",))
        phase("engine.resume_memory(kv_cache)", eng.resume_memory, ("kv_cache",))
    assert as_lists(generate(eng, 2)) == ref_samples[2]
    assert abs(idle[1] - idle[0]) <= 2 * MB, [i / MB for i in idle]
    train.onload()
    weights = train.model.state_dict()
    assert all(torch.equal(weights[k].cpu(), ref_weights[k]) for k in ref_weights)


def test_fsdp_offload_on_one_nccl_rank(checkpoint):
    """The FSDP2 trainer (DTensor parameters, one rank): offload frees its shards and optimizer state,
    and training after onload equals training without the offload, bit for bit."""
    import torch.distributed as dist

    from miles.trainer.fsdp import FSDPTrainer

    eng = engine(checkpoint)
    batch = batch_of(generate(eng), eng.pad_id)
    del eng
    torch.cuda.empty_cache()

    def run(offload: bool):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        fsdp = FSDPTrainer(0, 1, "127.0.0.1", port, checkpoint, AlgoCfg(name=AlgoName.grpo), TRAIN, BF16,
                           device="cuda", max_response_len=40)
        try:
            metrics = [fsdp.train_rl(batch)]
            if offload:
                need = fsdp.offload_bytes()
                resident = allocated()
                t_offload = timed(fsdp.offload)
                freed = resident - allocated()
                t_onload = timed(fsdp.onload)
                print(f"\nfsdp (1 rank): params {need['params'] / MB:.0f} MB, grads {need['grads'] / MB:.0f} MB, "
                      f"optimizer {need['optimizer'] / MB:.0f} MB; offload freed {freed / MB:.0f} MB in "
                      f"{t_offload * 1e3:.1f} ms, onload {t_onload * 1e3:.1f} ms")
                assert need["params"] > 350 * MB and freed >= sum(need.values())
            metrics.append(fsdp.train_rl(batch))
            return metrics, fsdp.get_weights()[0]
        finally:
            dist.destroy_process_group()

    (m_plain, w_plain), (m_off, w_off) = run(False), run(True)
    assert m_off == m_plain
    assert all(torch.equal(w_off[k], w_plain[k]) for k in w_plain)
