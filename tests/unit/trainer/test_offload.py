"""TorchTrainer.offload / onload (colocation) on the CPU: training after offload + onload is bit for bit
the training without it (AdamW, the KL reference too), the parameters stay the optimizer's objects,
calls that need what is offloaded say to onload it, and FSDP2's sharded parameters come back too.

On the CPU nothing needs to move; `offload.FORCE_COPY` makes every move a fresh copy, so that the
re-pointing a GPU offload does (parameter data, optimizer state, FSDP's sharded storage) runs here.
Device memory figures: tests/gpu/test_colocate_memory.py."""

import socket

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from miles.config.schema import AlgoCfg, AlgoName, PrecisionCfg, TrainerCfg
from miles.trainer import offload as off
from miles.transport.device import MemoryStats, memory_stats
from miles.trainer.torch_trainer import TorchTrainer

FP32 = PrecisionCfg(name="fp32")
CFG = TrainerCfg(lr=1e-2, global_batch_size=16, micro_batch_size=8)
ALGO = AlgoCfg(name=AlgoName.grpo, kl_coef=0.1)  # with a KL reference model, which offloads with the params


@pytest.fixture(params=[False, True], ids=["in-place", "force-copy"])
def force_copy(request, monkeypatch):
    monkeypatch.setattr(off, "FORCE_COPY", request.param)
    return request.param


def state_of(trainer) -> dict[str, torch.Tensor]:
    """Every parameter (policy, reference if any) and optimizer state tensor, cloned."""
    out = {f"p.{k}": v.detach().clone() for k, v in trainer.model.state_dict().items()}
    if trainer.ref_model is not None:
        out.update({f"ref.{k}": v.detach().clone() for k, v in trainer.ref_model.state_dict().items()})
    for i, p in enumerate(trainer.model.parameters()):
        out.update({f"opt.{i}.{k}": v.clone() for k, v in trainer.optimizer.state[p].items()})
    return out


def assert_bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]


def test_training_after_offload_and_onload_is_bitwise_the_same(ckpt, rollout_batch, force_copy):
    plain, offloaded = TorchTrainer(ckpt, ALGO, CFG, FP32), TorchTrainer(ckpt, ALGO, CFG, FP32)
    m_plain = [plain.train_rl(rollout_batch), plain.train_rl(rollout_batch)]
    first = offloaded.train_rl(rollout_batch)
    params = list(offloaded.model.parameters())
    pointers = [p.data_ptr() for p in params]
    steps = [offloaded.optimizer.state[p]["step"] for p in params]
    offloaded.offload()
    assert offloaded.offloaded == {"params", "optimizer"}
    assert all(p.grad is None for p in params)  # dropped, not copied
    offloaded.offload()  # twice: a no-op
    offloaded.onload()
    assert not offloaded.offloaded
    assert list(offloaded.model.parameters()) == params  # the same nn.Parameter objects ...
    assert offloaded.optimizer.param_groups[0]["params"] == params  # ... which the optimizer holds
    moved = [p.data_ptr() != q for p, q in zip(params, pointers)]
    assert all(moved) if force_copy else not any(moved)  # force-copy: every tensor was re-pointed
    assert all(offloaded.optimizer.state[p]["step"].device == s.device for p, s in zip(params, steps))
    offloaded.onload()  # twice: a no-op
    second = offloaded.train_rl(rollout_batch)
    assert [first, second] == m_plain
    assert m_plain[1]["train/kl_ref"] > 0.0  # the reference was used (and moved with the params)
    assert_bitwise(state_of(offloaded), state_of(plain))
    assert torch.equal(offloaded.kl_to_ref(rollout_batch), plain.kl_to_ref(rollout_batch))


def test_calls_while_offloaded(ckpt, rollout_batch, tmp_path, monkeypatch):
    monkeypatch.setattr(off, "FORCE_COPY", True)
    trainer = TorchTrainer(ckpt, ALGO, CFG, FP32)
    trainer.train_rl(rollout_batch)
    _, digest = trainer.get_weights(in_process=True)  # the in-process sync buffer
    weights, _ = trainer.get_weights()
    trainer.save(str(tmp_path / "resident"))
    # Only the optimizer state: the parameters still serve log-probs and weights, not training.
    trainer.offload("optimizer")
    assert torch.equal(trainer.logprobs(rollout_batch), trainer.logprobs(rollout_batch))
    with pytest.raises(RuntimeError, match=r"train_rl: .*optimizer are offloaded .*onload\(\('optimizer',\)\)"):
        trainer.train_rl(rollout_batch)
    trainer.offload()
    for call, args in [("train_rl", (rollout_batch,)), ("train_sft", (rollout_batch,)),
                       ("logprobs", (rollout_batch,)), ("kl_to_ref", (rollout_batch,)), ("get_weights", ())]:
        with pytest.raises(RuntimeError, match=rf"{call}: the trainer's params.* offloaded .*call onload\("):
            getattr(trainer, call)(*args)
    trainer.save(str(tmp_path / "offloaded"))  # save reads the host copies
    resident, offloaded = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("resident", "offloaded"))
    assert_bitwise(resident, offloaded)
    with pytest.raises(ValueError, match="unknown offload tag.*valid: params, grads, optimizer"):
        trainer.offload("kv_cache")
    trainer.onload(("params",))
    assert trainer.get_weights(in_process=True)[1] == digest
    assert_bitwise(trainer.get_weights()[0], weights)
    trainer.onload()
    trainer.train_rl(rollout_batch)


def test_teacher_offloads_with_the_params(ckpt, rollout_batch, monkeypatch):
    monkeypatch.setattr(off, "FORCE_COPY", True)
    algo = AlgoCfg(name=AlgoName.grpo, opd_kl_coef=1.0)
    plain = TorchTrainer(ckpt, algo, CFG, FP32, teacher_dir=ckpt)
    trainer = TorchTrainer(ckpt, algo, CFG, FP32, teacher_dir=ckpt)
    pointers = [p.data_ptr() for p in trainer.teacher.parameters()]
    trainer.offload()
    trainer.onload()
    assert all(p.data_ptr() != q for p, q in zip(trainer.teacher.parameters(), pointers))
    assert trainer.train_rl(rollout_batch) == plain.train_rl(rollout_batch)


def test_memory_stats_are_zero_on_the_cpu():
    assert memory_stats("cpu") == MemoryStats() and memory_stats("cpu", reset_peak=True).peak_gb == 0.0
    if not torch.cuda.is_available():
        assert memory_stats() == MemoryStats(0, 0, 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_offload_and_onload_on_one_gloo_rank(ckpt, rollout_batch, tmp_path, monkeypatch):
    """FSDP2 parameters are DTensors: the models move as modules and FSDP re-points its sharded
    storage (forced copies here, so a stale storage would train on the old weights: the second step
    would differ). The storages' addresses are not compared: the allocator may hand the freed ones out
    again."""
    from miles.trainer.fsdp import FSDPTrainer

    monkeypatch.setattr(off, "FORCE_COPY", True)

    def run(offload: bool):
        trainer = FSDPTrainer(0, 1, "127.0.0.1", free_port(), ckpt, ALGO, CFG, FP32)
        try:
            metrics = [trainer.train_rl(rollout_batch)]
            if offload:
                trainer.offload()
                for call in ("get_weights", "save_state"):
                    with pytest.raises(RuntimeError, match=rf"{call}: .*offloaded .*call onload"):
                        getattr(trainer, call)(*(() if call == "get_weights" else (str(tmp_path / "s"),)))
                trainer.onload()
            metrics.append(trainer.train_rl(rollout_batch))
            return metrics, trainer.get_weights()[0]
        finally:
            dist.destroy_process_group()

    (m_plain, w_plain), (m_off, w_off) = run(False), run(True)
    assert m_off == m_plain
    assert_bitwise(w_off, w_plain)


def test_the_trainer_keeps_no_sync_buffer(ckpt, rollout_batch):
    """The in-process sync's rollout-dtype copy of the weights is held by the sync alone: once the
    engine copied it, nothing keeps its memory (2 bytes a parameter in bf16); the next sync builds one
    with the new weights."""
    import gc
    import weakref

    trainer = TorchTrainer(ckpt, ALGO, CFG, FP32)
    first, digest = trainer.get_weights(in_process=True)
    gone = weakref.ref(first.buffer)
    del first
    gc.collect()
    assert gone() is None
    trainer.train_rl(rollout_batch)
    second, after = trainer.get_weights(in_process=True)
    assert after != digest
    assert_bitwise(second.views(), {k: v.float() for k, v in trainer.model.state_dict().items()})
