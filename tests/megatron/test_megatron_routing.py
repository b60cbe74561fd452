"""MoE routing replay on the Megatron-core trainer (megatron-core's RouterReplay hooks), against the
native trainer on the same checkpoint and batch, on the CPU (CUDA mapped to the CPU: cuda_on_cpu.py):
R3 routes the policy's forwards by the engine's experts (also experts its own router would not pick),
R2 replays the old pass's own routing, and the routing diagnostics record Megatron's own choices."""

from dataclasses import replace

import pytest
import torch

from test_megatron_cuda import _checkpoint  # noqa: E402  (tests/gpu helpers)


def _trainers(ckpt: str, device: str, mode: str, **changes):
    from miles.config.schema import AlgoCfg, AlgoName, PrecisionCfg, TrainerCfg
    from miles.trainer.megatron.trainer import MegatronTrainer
    from miles.trainer.torch_trainer import TorchTrainer

    cfg = TrainerCfg(**{"lr": 1e-4, "global_batch_size": 8, "micro_batch_size": 4, "pack_sequences": False, **changes})
    algo = AlgoCfg(name=AlgoName.grpo, routing_replay=mode)
    args = (ckpt, algo, cfg, PrecisionCfg(name="fp32"))
    return (MegatronTrainer(*args, device=device, threads=1, reuse_forward_for_old=False),
            TorchTrainer(*args, device=device, threads=1, reuse_forward_for_old=False))


def _engine_batch(ckpt: str, scramble: bool):
    """8 samples of a recording native engine; `scramble`: the recorded experts replaced by others
    (each token's k experts shifted by one), which a router would not choose by itself."""
    from miles.config.schema import RolloutCfg
    from miles.rollout.native import NativeEngine
    from miles.types import build_train_batch

    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=8), record_routing=True)
    samples = engine.generate(["1+2=", "35+47=", "9*9=", "(12-3)*4="], ["?"] * 4, n=2)
    batch = build_train_batch(samples, torch.linspace(-1, 1, len(samples)), engine.pad_id)
    if scramble:
        experts = engine.model.config.moe.num_experts
        batch = replace(batch, routed_experts=(batch.routed_experts.long() + 1) % experts)
    return batch


@pytest.mark.parametrize("scramble", [False, True])
def test_r3_routes_like_the_native_trainer(scramble, tmp_path, megatron_on_this_device):
    """R3: the same log-probs and first step as the native trainer under the engine's experts; with
    experts the routers would not pick, the log-probs move away from unreplayed ones (the replay acts)."""
    ckpt = _checkpoint("qwen3_moe_tiny", tmp_path)
    mega, native = _trainers(ckpt, megatron_on_this_device, "r3")
    batch = _engine_batch(ckpt, scramble)
    got, want = mega.logprobs(batch).cpu(), native.logprobs(batch).cpu()
    mask = batch.loss_mask
    assert float(((got - want).abs() * mask).max()) < 1e-4
    plain = mega.logprobs(replace(batch, routed_experts=torch.zeros(0))).cpu()
    moved = float(((got - plain).abs() * mask).max())
    assert (moved > 1e-2) if scramble else (moved < 1e-4), moved
    m, n = mega.train_rl(batch), native.train_rl(batch)
    assert m["train/ppo_kl"] == 0.0
    assert m["train/loss"] == pytest.approx(n["train/loss"], rel=1e-4, abs=1e-6)
    assert m["train/grad_norm"] == pytest.approx(n["train/grad_norm"], rel=1e-3)
    # the diagnostics record Megatron's own routing: all agree with an fp32 engine, none with shifted experts
    agree = m["mismatch/routing_agreement"]
    assert agree == n["mismatch/routing_agreement"] and agree == (0.0 if scramble else 1.0), agree


def test_r2_replays_the_old_pass(tmp_path, megatron_on_this_device):
    """R2 (no engine record): the update forwards replay the old pass's own routing; the step equals
    the native trainer's."""
    ckpt = _checkpoint("qwen3_moe_tiny", tmp_path)
    mega, native = _trainers(ckpt, megatron_on_this_device, "r2")
    batch = replace(_engine_batch(ckpt, scramble=False), routed_experts=torch.zeros(0))
    m, n = mega.train_rl(batch), native.train_rl(batch)
    assert m["train/ppo_kl"] == 0.0
    assert m["train/loss"] == pytest.approx(n["train/loss"], rel=1e-4, abs=1e-6)
    assert m["train/grad_norm"] == pytest.approx(n["train/grad_norm"], rel=1e-3)


@pytest.mark.parametrize("mode", ["r3", "r2"])
@pytest.mark.parametrize("pack", [False, True])
def test_recompute_replays_in_backward_too(mode, pack, tmp_path, megatron_on_this_device):
    """trainer.recompute: Megatron's recomputation in backward routes by the replayed experts as the
    forward did (megatron-core's REPLAY_BACKWARD), so two steps equal the stored-activation steps
    exactly (without it the recomputed routers chose their own experts: R3's gradient differs, the
    negative control); the torch trainer, recomputing too, gives the same first step."""
    ckpt = _checkpoint("qwen3_moe_tiny", tmp_path)
    batch = _engine_batch(ckpt, scramble=True)
    stored, _ = _trainers(ckpt, megatron_on_this_device, mode, pack_sequences=pack)
    recomputing, native = _trainers(ckpt, megatron_on_this_device, mode, pack_sequences=pack, recompute=True)
    first = recomputing.train_rl(batch)
    assert first["train/grad_norm"] == pytest.approx(native.train_rl(batch)["train/grad_norm"], rel=1e-4)
    for m, r in ((stored.train_rl(batch), first), (stored.train_rl(batch), recomputing.train_rl(batch))):
        assert (m["train/loss"], m["train/grad_norm"]) == (r["train/loss"], r["train/grad_norm"])
    if mode == "r3":  # negative control: the layers recompute, the routers do not replay there
        naive, _ = _trainers(ckpt, megatron_on_this_device, mode, pack_sequences=pack, recompute=True)
        naive.cfg = replace(naive.cfg, recompute=False)
        assert naive.train_rl(batch)["train/grad_norm"] != first["train/grad_norm"]
