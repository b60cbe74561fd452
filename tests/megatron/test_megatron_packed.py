"""Packed sequences on the Megatron-core trainer (trainer.pack_sequences): micro-batches of samples
packed into one THD sequence (megatron-core's PackedSeqParams, the project's core attention per
sample, megatron-core's THD RoPE restarting at each sample), on the CPU (CUDA mapped to the CPU:
cuda_on_cpu.py), fp32: the log-probs of the padded rows and of trainer=torch's packing, the first
step of the padded rows, R3 and several LoRA adapters in the packed layout, DSA falling back to rows.
tests/gpu/test_megatron_cuda.py compares packed and padded on CUDA (the variable-length kernel)."""

import dataclasses

import pytest
import torch

from test_megatron_cuda import _checkpoint, _diff, _varied_batch as varied_batch  # noqa: E402  (tests/gpu helpers)

MAX_TOKENS = 96  # several micro-batches of several samples each for the batch below
TOL = 1e-5


def _cfg(pack: bool, **changes):
    from miles.config.schema import TrainerCfg

    changes.setdefault("max_tokens_per_micro_batch", MAX_TOKENS)
    return TrainerCfg(lr=1e-4, global_batch_size=10, micro_batch_size=4, pack_sequences=pack, **changes)


def _megatron(ckpt, device, pack: bool = True, routing_replay: str = "none", **changes):
    from miles.config.schema import AlgoCfg, AlgoName, PrecisionCfg
    from miles.trainer.megatron.trainer import MegatronTrainer

    algo = AlgoCfg(name=AlgoName.grpo, routing_replay=routing_replay)
    return MegatronTrainer(ckpt, algo, _cfg(pack, **changes), PrecisionCfg(name="fp32"), device=device, threads=1,
                           reuse_forward_for_old=routing_replay == "none")


def _torch(ckpt, **changes):
    from miles.config.schema import AlgoCfg, AlgoName, PrecisionCfg
    from miles.trainer.torch_trainer import TorchTrainer

    return TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), _cfg(True, **changes), PrecisionCfg(name="fp32"),
                        device="cpu", threads=1)


def _padded(mega, batch, fn=None):
    """What `mega` gives for `batch` on padded rows (the plan switched off packing)."""
    mega.packs = False
    try:
        return (fn or mega.logprobs)(batch)
    finally:
        mega.packs = True


def _assert_packed_plan(mega, batch):
    plan = mega.plan(batch, mega.model)
    assert all(mb.cu_seqlens is not None and mb.input_ids.shape[0] == 1 for mb in plan)
    assert len(plan) > 1 and max(mb.num_samples for mb in plan) > 1, [mb.num_samples for mb in plan]


@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen3_moe_tiny", "deepseek_v3_tiny"])
def test_packed_logprobs_equal_padded_and_the_torch_trainers_packing(name, tmp_path, megatron_on_this_device):
    ckpt = _checkpoint(name, tmp_path)
    mega = _megatron(ckpt, megatron_on_this_device)
    batch = varied_batch(mega.arch.vocab_size)
    _assert_packed_plan(mega, batch)
    packed = mega.logprobs(batch)
    worst, _ = _diff(packed, _padded(mega, batch), batch.loss_mask)
    native, _ = _diff(packed, _torch(ckpt).logprobs(batch), batch.loss_mask)
    print(f"\n{name} packed: max |dlogp| vs padded {worst:.3g}, vs trainer=torch packed {native:.3g}")
    assert worst < TOL and native < TOL, (worst, native)


@pytest.mark.parametrize("name", ["qwen3_tiny", "deepseek_v3_tiny"])
def test_positions_restart_at_each_packed_sample(name, tmp_path, megatron_on_this_device, monkeypatch):
    """Packed at other offsets (other micro-batch sizes), the log-probs stay the padded ones. RoPE
    sees relative positions only, so what must hold is that they restart exactly at each sample's
    start: RoPE restarting one token late (cu_seqlens shifted by one) moves the log-probs, and the
    parity above would fail. That RoPE is the project's core attention's for the GQA families
    (miles/trainer/megatron/specs.py), megatron-core's THD RoPE for MLA."""
    from megatron.core.models.common.embeddings import rope_utils

    from miles.trainer.megatron import core_attention

    ckpt = _checkpoint(name, tmp_path)
    mega = _megatron(ckpt, megatron_on_this_device)
    batch = varied_batch(mega.arch.vocab_size, seed=1)
    padded = _padded(mega, batch)
    for tokens in (64, 160):
        mega.cfg = dataclasses.replace(mega.cfg, max_tokens_per_micro_batch=tokens)
        worst, _ = _diff(mega.logprobs(batch), padded, batch.loss_mask)
        assert worst < TOL, (tokens, worst)
    if mega.arch.mla is None:
        positions = core_attention.packed_positions

        def late_positions(starts, tokens):
            late = starts.clone()
            late[1:-1] += 1
            return positions(late, tokens)

        monkeypatch.setattr(core_attention, "packed_positions", late_positions)
    else:
        thd = rope_utils._apply_rotary_pos_emb_thd

        def one_late(t, cu_seqlens, freqs, **kwargs):
            late = cu_seqlens.clone()
            late[1:-1] += 1  # a sample may now be one token longer than the table: freqs[p] = p * freqs[1]
            longer = torch.arange(freqs.shape[0] + 1, dtype=freqs.dtype,
                                  device=freqs.device)[:, None, None, None] * freqs[1:2]
            return thd(t, late, longer, **kwargs)

        monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", one_late)
    moved, _ = _diff(mega.logprobs(batch), padded, batch.loss_mask)
    print(f"\n{name}: RoPE restarting one token late moves the log-probs by {moved:.3g}")
    assert moved > 10 * TOL, moved  # deepseek_v3_tiny's 8 rotary dims move least


@pytest.mark.parametrize("name, recompute", [("qwen3_tiny", False), ("qwen3_moe_tiny", False),
                                             ("deepseek_v3_tiny", False), ("qwen3_moe_tiny", True)])
def test_first_step_packed_equals_padded(name, recompute, tmp_path, megatron_on_this_device):
    """recompute: Megatron's full recompute re-runs each layer on the packed layout in the backward."""
    ckpt = _checkpoint(name, tmp_path)
    packed = _megatron(ckpt, megatron_on_this_device, recompute=recompute)
    padded = _megatron(ckpt, megatron_on_this_device, pack=False)
    batch = varied_batch(packed.arch.vocab_size)
    m, n = packed.train_rl(batch), padded.train_rl(batch)
    print(f"\n{name} (recompute={recompute}) first step: loss {m['train/loss']:.8g} / {n['train/loss']:.8g}, "
          f"grad norm {m['train/grad_norm']:.8g} / {n['train/grad_norm']:.8g}")
    assert m["train/loss"] == pytest.approx(n["train/loss"], rel=TOL, abs=1e-7)
    assert m["train/grad_norm"] == pytest.approx(n["train/grad_norm"], rel=TOL)
    a, b = packed.get_weights()[0], padded.get_weights()[0]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 2.5e-4  # Adam: at most a near-zero gradient's sign


def test_r3_replays_and_records_in_the_packed_layout(tmp_path, megatron_on_this_device):
    """R3 (the engine's experts shifted by one, which the routers would not pick): the packed forward
    routes by them as the padded one does, and records Megatron's own choices the same way."""
    from test_megatron_routing import _engine_batch

    ckpt = _checkpoint("qwen3_moe_tiny", tmp_path)
    mega = _megatron(ckpt, megatron_on_this_device, routing_replay="r3", max_tokens_per_micro_batch=40)
    batch = _engine_batch(ckpt, scramble=True)
    _assert_packed_plan(mega, batch)
    got = mega.logprobs(batch)
    worst, _ = _diff(got, _padded(mega, batch), batch.loss_mask)
    plain = mega.logprobs(dataclasses.replace(batch, routed_experts=torch.zeros(0)))
    moved, _ = _diff(got, plain, batch.loss_mask)
    assert worst < TOL and moved > 1e-2, (worst, moved)
    padded = _megatron(ckpt, megatron_on_this_device, pack=False, routing_replay="r3")
    m, n = mega.train_rl(batch), padded.train_rl(batch)
    assert m["train/loss"] == pytest.approx(n["train/loss"], rel=TOL, abs=1e-7)
    assert m["train/grad_norm"] == pytest.approx(n["train/grad_norm"], rel=TOL)
    assert m["mismatch/routing_agreement"] == n["mismatch/routing_agreement"] == 0.0


def test_r2_replays_the_old_pass_in_the_packed_layout(tmp_path, megatron_on_this_device):
    """R2: the old pass records the routing in the packed layout and the update forwards replay it."""
    ckpt = _checkpoint("qwen3_moe_tiny", tmp_path)
    packed = _megatron(ckpt, megatron_on_this_device, routing_replay="r2")
    padded = _megatron(ckpt, megatron_on_this_device, pack=False, routing_replay="r2")
    batch = varied_batch(packed.arch.vocab_size)
    m, n = packed.train_rl(batch), padded.train_rl(batch)
    assert m["train/ppo_kl"] == 0.0
    assert m["train/loss"] == pytest.approx(n["train/loss"], rel=TOL, abs=1e-7)
    assert m["train/grad_norm"] == pytest.approx(n["train/grad_norm"], rel=TOL)


def test_several_lora_adapters_route_each_packed_token(tmp_path, megatron_on_this_device):
    """Two adapters (expert adapters too) on a mixed batch: packed, each token goes through its
    sample's adapter: the padded rows' log-probs and trainer=torch's packed ones; swapping the
    adapters moves them (the route acts)."""
    from miles.config.schema import LoRACfg
    from test_megatron_lora import TARGETS, _randomize

    ckpt = _checkpoint("qwen3_moe_tiny", tmp_path)
    lora = LoRACfg(rank=4, alpha=8.0, target_modules=TARGETS["qwen3_moe_tiny"], adapters=["a", "b"])
    mega, native = _megatron(ckpt, megatron_on_this_device, lora=lora), _torch(ckpt, lora=lora)
    _randomize(mega.lora, native.lora)
    plain = varied_batch(mega.arch.vocab_size)
    mixed = dataclasses.replace(plain, adapter_ids=torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1, 0]))
    _assert_packed_plan(mega, mixed)
    got = mega.logprobs(mixed)
    worst, _ = _diff(got, _padded(mega, mixed), plain.loss_mask)
    native_worst, _ = _diff(got, native.logprobs(mixed), plain.loss_mask)
    swapped, _ = _diff(mega.logprobs(dataclasses.replace(plain, adapter_ids=1 - mixed.adapter_ids)), got,
                       plain.loss_mask)
    print(f"\ntwo adapters packed: max |dlogp| vs padded {worst:.3g}, vs trainer=torch {native_worst:.3g}")
    assert worst < TOL and native_worst < TOL and swapped > 1e-2, (worst, native_worst, swapped)


def test_dsa_trains_padded_rows(tmp_path, megatron_on_this_device):
    """DSA's core attention takes whole rows from position 0: packing falls back to padded rows."""
    mega = _megatron(_checkpoint("deepseek_v3_2_tiny", tmp_path), megatron_on_this_device)
    batch = varied_batch(mega.arch.vocab_size)
    assert not mega.packs and all(mb.cu_seqlens is None for mb in mega.plan(batch, mega.model))
