"""trainer=megatron with the collective weight transports and with a teacher, on the CPU (CUDA mapped
to the CPU: tests/megatron/cuda_on_cpu.py).

- `rollout.weight_sync=shared_memory` / `broadcast` (miles/transport/shared_memory.py, broadcast.py):
  after a training step a MegatronTrainer packs its policy (native names, `sync_state`) and native
  engines load it, checked. Each engine then holds exactly get_weights' tensors (the object store's
  payload, same checksum), and the log-probs it samples with equal the trainer's own forward of the
  sampled tokens. A flipped byte in the shared segment fails the check; an engine left unsynced is
  not within the tolerance (the comparison can fail).
- On-policy distillation (`algo.opd_kl_coef > 0`): the teacher is a frozen GPTModel (here of another
  family than the student, the vocabulary shared); the teacher's log-probs, `train/reverse_kl`, the
  loss and the grad norm equal trainer=torch's on the same batch.
"""

import pytest
import torch

from test_megatron_cuda import TOL, _batch, _checkpoint, _diff, _model_cfg  # noqa: E402  (tests/gpu helpers)

PROMPTS = ["1+2=", "35+47=", "9*9=", "(12-3)*4="]


def _precision():
    from miles.config.schema import DType, PrecisionCfg

    return PrecisionCfg(name="fp32", train_dtype=DType.fp32, rollout_dtype=DType.fp32)


def _trainer(ckpt: str, device: str, **algo):
    from miles.config.schema import AlgoCfg, AlgoName, TrainerCfg
    from miles.trainer.megatron.trainer import MegatronTrainer

    # lr 1e-2: one step moves every weight far from the checkpoint (an unsynced engine is far off)
    cfg = TrainerCfg(lr=1e-2, global_batch_size=8, micro_batch_size=4, pack_sequences=False)
    return MegatronTrainer(ckpt, AlgoCfg(name=AlgoName.grpo, **algo), cfg, _precision(), device=device, threads=1)


def _engine(ckpt: str):
    from miles.config.schema import DType, RolloutCfg
    from miles.rollout.native import NativeEngine

    return NativeEngine(ckpt, RolloutCfg(max_new_tokens=6), DType.fp32, "cpu", 1, 0, _precision())


def _sampled(engine):
    """The engine's samples of PROMPTS (temperature 1) as a batch: its log-probs in rollout_logprobs."""
    from miles.types import build_train_batch

    samples = engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=2, temperature=1.0)
    return build_train_batch(samples, torch.zeros(len(samples)), engine.pad_id)


def _assert_engine_holds_the_trainer(engine, mega):
    """The engine's weights are get_weights' bit for bit (same checksum), and the log-probs it samples
    with are the trainer's forward of those tokens."""
    from miles.transport.checksum import checksum

    weights, digest = mega.get_weights()
    held = engine.model.state_dict()
    assert set(weights) <= set(held)
    assert all(torch.equal(held[k].cpu(), weights[k].cpu()) for k in weights)
    assert checksum({k: held[k] for k in weights}) == digest
    batch = _sampled(engine)
    worst, _ = _diff(mega.logprobs(batch), batch.rollout_logprobs, batch.loss_mask)
    assert worst < TOL["fp32"], worst
    return batch


@pytest.fixture
def stepped(tmp_path, megatron_on_this_device):
    """A MegatronTrainer one RL step away from the checkpoint, and two engines still at it."""
    ckpt = _checkpoint("qwen3_tiny", tmp_path)
    mega = _trainer(ckpt, megatron_on_this_device)
    mega.train_rl(_batch(mega.arch.vocab_size))
    return ckpt, mega, [_engine(ckpt), _engine(ckpt)]


def test_sync_state_is_get_weights(stepped):
    """What the collective transports pack is what the object store sends (before the rollout cast)."""
    _, mega, _ = stepped
    weights, _ = mega.get_weights()
    state = mega.sync_state()
    assert list(state) == list(weights)
    assert all(torch.equal(state[k].cpu(), weights[k].cpu()) for k in weights)


def test_an_unsynced_engine_fails_the_comparison(stepped):
    """Negative control: the engine still at the checkpoint samples with other log-probs."""
    _, mega, engines = stepped
    batch = _sampled(engines[0])
    worst, _ = _diff(mega.logprobs(batch), batch.rollout_logprobs, batch.loss_mask)
    assert worst > 10 * TOL["fp32"], worst


def test_shared_memory_sync_gives_every_engine_the_trainers_weights(stepped):
    from miles.orchestrate.handles import LocalHandle
    from miles.transport.shared_memory import SharedMemoryWeightSync

    _, mega, engines = stepped
    sync = SharedMemoryWeightSync(LocalHandle(mega), [LocalHandle(e) for e in engines])
    try:
        assert sync.kind == ("cuda_ipc" if mega.device.type == "cuda" else "shared_memory")  # the trainer's device
        assert [s.name for s in sync.segment.bucket.slots] == sorted(mega.get_weights()[0])
        digest, _ = sync.sync(check=True)
        assert digest == mega.get_weights()[1]
        for engine in engines:
            _assert_engine_holds_the_trainer(engine, mega)
        # another step, another sync: the engines follow
        mega.train_rl(_batch(mega.arch.vocab_size, seed=1))
        assert sync.sync(check=True)[0] == mega.get_weights()[1] != digest
        _assert_engine_holds_the_trainer(engines[1], mega)
    finally:
        sync.close()


def test_a_corrupted_shared_segment_fails_the_check(stepped):
    from miles.orchestrate.handles import LocalHandle
    from miles.transport.checksum import WeightSyncError
    from miles.transport.shared_memory import SharedMemoryWeightSync, buffer_of

    _, mega, engines = stepped
    sync = SharedMemoryWeightSync(LocalHandle(mega), [LocalHandle(engines[0])])
    try:
        digest = sync.pack(check=True)
        slot = sync.segment.bucket.slots[0]
        buffer_of(mega)[slot.offset + 3].bitwise_xor_(0x80)  # the sign of the first fp32 element
        with pytest.raises(WeightSyncError):
            sync.load(digest)
    finally:
        sync.close()


def test_broadcast_sync_gives_every_engine_the_trainers_weights(stepped):
    from miles.orchestrate.handles import LocalHandle
    from miles.transport.broadcast import BroadcastWeightSync

    _, mega, engines = stepped
    # small buckets: several collectives, a tensor split from its fused Megatron weight in each
    sync = BroadcastWeightSync(LocalHandle(mega), [LocalHandle(e) for e in engines], backend="gloo",
                               bucket_mb=0.05, timeout_s=60)
    try:
        assert len(sync.plan) > 1
        digest, _ = sync.sync(check=True)
        assert digest == mega.get_weights()[1]
        for engine in engines:
            _assert_engine_holds_the_trainer(engine, mega)
    finally:
        sync.close()


def test_the_loop_builds_both_transports_over_a_megatron_trainer(stepped):
    """build_transport (the loop's path: miles/transport/protocol.py) over the trainer's handle."""
    from types import SimpleNamespace

    from miles.orchestrate.handles import LocalHandle
    from miles.transport.protocol import TransportOptions, build_transport

    _, mega, engines = stepped
    for name, engine in zip(["shared_memory", "broadcast"], engines):
        handle = LocalHandle(engine)
        components = SimpleNamespace(trainer=LocalHandle(mega), engine=SimpleNamespace(members=[handle]))
        transport = build_transport(name, components, TransportOptions(bucket_mb=1.0, timeout_s=60))
        try:
            transport.sync(check=True)
        finally:
            transport.close()
        _assert_engine_holds_the_trainer(engine, mega)


# ----------------------------------------------------------------------------- on-policy distillation
def _opd_trainers(tmp_path, device, teacher: str, pack: bool = False, precision=None):
    from miles.config.schema import AlgoCfg, AlgoName, TrainerCfg
    from miles.data.tokenizer import DEFAULT_ALPHABET
    from miles.orchestrate.checkpoints import random_checkpoint
    from miles.trainer.megatron.trainer import MegatronTrainer
    from miles.trainer.torch_trainer import TorchTrainer

    student = _checkpoint("qwen3_tiny", tmp_path)
    teacher_dir = str(random_checkpoint(_model_cfg(teacher), DEFAULT_ALPHABET, seed=7, out=tmp_path / "teacher"))
    cfg = TrainerCfg(lr=1e-4, global_batch_size=8, micro_batch_size=4, pack_sequences=pack,
                     max_tokens_per_micro_batch=96)
    algo = AlgoCfg(name=AlgoName.grpo, opd_kl_coef=0.5)
    kwargs = dict(device=device, threads=1, teacher_dir=teacher_dir)
    precision = precision or _precision()
    return (MegatronTrainer(student, algo, cfg, precision, **kwargs),
            TorchTrainer(student, algo, cfg, precision, **kwargs), student)


# a teacher of another family than the qwen3 student: MoE, q/k/v biases, and (the student packed) DSA,
# whose teacher forward takes padded rows while the student's are packed
@pytest.mark.parametrize("teacher, pack", [("qwen3_moe_tiny", False), ("qwen2_5_tiny", False),
                                           ("deepseek_v3_2_tiny", True)])
def test_opd_equals_the_torch_trainers(teacher, pack, tmp_path, megatron_on_this_device):
    mega, native, _ = _opd_trainers(tmp_path, megatron_on_this_device, teacher, pack)
    assert mega.teacher is not None and not any(p.requires_grad for p in mega.teacher.parameters())
    batch = _batch(mega.arch.vocab_size)
    batch.rollout_logprobs = native.logprobs(batch)  # the engine's numbers: the student's own
    t_mega = mega.update.full_logprobs(mega.teacher, batch)
    t_native = native.update.full_logprobs(native.teacher, batch)
    worst, _ = _diff(t_mega, t_native, batch.loss_mask)
    assert worst < TOL["fp32"], worst
    # the teacher is not the student: the distillation term is not 0
    assert _diff(t_mega, mega.logprobs(batch), batch.loss_mask)[0] > 0.1
    teacher_before = {k: p.detach().clone() for k, p in mega.teacher.named_parameters()}
    m, n = mega.train_rl(batch), native.train_rl(batch)
    assert abs(m["train/reverse_kl"]) > 1e-3
    assert m["train/reverse_kl"] == pytest.approx(n["train/reverse_kl"], rel=1e-4, abs=1e-6)
    assert m["train/loss"] == pytest.approx(n["train/loss"], rel=1e-4, abs=1e-6)
    assert m["train/grad_norm"] == pytest.approx(n["train/grad_norm"], rel=1e-3)
    assert all(torch.equal(p, teacher_before[k]) for k, p in mega.teacher.named_parameters())  # frozen


def test_opd_under_int4_qat_quantizes_the_teacher_as_the_torch_trainer(tmp_path, megatron_on_this_device):
    """trainer=torch's Recipe.forward fake-quantizes every model it runs, the teacher too; so does
    Megatron's forward (the teacher's own quantized rows). Without them the teacher moves > 1e-3."""
    from miles.config.schema import DType, PrecisionCfg, Quant

    int4 = PrecisionCfg(name="int4_qat", train_dtype=DType.fp32, rollout_dtype=DType.fp32, train_quant=Quant("int4"),
                        rollout_quant=Quant("int4"), int4_group_size=32)
    mega, native, _ = _opd_trainers(tmp_path, megatron_on_this_device, "qwen3_tiny", precision=int4)
    batch = _batch(mega.arch.vocab_size)
    batch.rollout_logprobs = native.logprobs(batch)
    t_mega = mega.update.full_logprobs(mega.teacher, batch)
    assert _diff(t_mega, native.update.full_logprobs(native.teacher, batch), batch.loss_mask)[0] < TOL["fp32"]
    rows, mega._teacher_rows = mega._teacher_rows, {}
    assert _diff(mega.update.full_logprobs(mega.teacher, batch), t_mega, batch.loss_mask)[0] > 1e-3
    mega._teacher_rows = rows
    m, n = mega.train_rl(batch), native.train_rl(batch)
    assert m["train/reverse_kl"] == pytest.approx(n["train/reverse_kl"], rel=1e-4, abs=1e-6)
    assert m["train/loss"] == pytest.approx(n["train/loss"], rel=1e-4, abs=1e-6)


def test_opd_changes_the_update(tmp_path, megatron_on_this_device):
    """Negative control: without the teacher the same step has another loss (the term acts)."""
    mega, _, student = _opd_trainers(tmp_path, megatron_on_this_device, "qwen3_tiny")
    plain = _trainer(student, megatron_on_this_device)
    plain.cfg.lr = mega.cfg.lr
    batch = _batch(mega.arch.vocab_size)
    batch.rollout_logprobs = mega.logprobs(batch)
    assert abs(mega.train_rl(batch)["train/loss"] - plain.train_rl(batch)["train/loss"]) > 1e-4


def test_teacher_offloads_with_the_reference(tmp_path, megatron_on_this_device):
    from miles.trainer import offload as off

    mega, _, _ = _opd_trainers(tmp_path, megatron_on_this_device, "qwen3_tiny")
    batch = _batch(mega.arch.vocab_size)
    before = mega.update.full_logprobs(mega.teacher, batch)
    mega.offload(off.TRAINER_TAGS)
    mega.onload(off.TRAINER_TAGS)
    assert torch.equal(mega.update.full_logprobs(mega.teacher, batch), before)
    assert mega.offload_bytes()[off.PARAMS] >= sum(p.numel() * p.element_size() for p in mega.teacher.parameters())


# ----------------------------------------------------------------------------- validation
MEGATRON_GPU = ["trainer=megatron", "hardware=h200", "hardware.gpus_per_node=1", "dry_run=true"]


def test_validation_accepts_the_transports_and_a_teacher(compose):
    from miles.trainer.megatron.rules import megatron_problems
    from miles.validate import validate

    assert validate(compose([*MEGATRON_GPU, "rollout.weight_sync=shared_memory"])) == []
    assert validate(compose([*MEGATRON_GPU, "algo=opd"])) == []
    assert validate(compose([*MEGATRON_GPU, "algo.opd_kl_coef=0.5", "precision=int4_qat"])) == []
    # what stays refused is refused for every trainer, by the config's own rules, not Megatron's
    for overrides, message in [(["rollout.weight_sync=broadcast"], "set rollout.weight_sync=object_store"),
                               (["rollout.weight_sync=shared_memory", "trainer.lora.rank=8"],
                                "the adapters travel through rollout.weight_sync=object_store")]:
        cfg = compose([*MEGATRON_GPU, *overrides])
        assert any(message in p for p in validate(cfg)), validate(cfg)
        assert megatron_problems(cfg) == []
