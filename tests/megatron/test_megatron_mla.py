"""The MLA families through Megatron-core on the CPU (CUDA mapped to the CPU: tests/megatron/cuda_on_cpu.py):
DeepSeek-V3's MLA (q LoRA, YaRN, interleaved rope pairs) built from megatron-core's MLASelfAttention with
the project's core attention, dense layers and the DeepSeek MoE (sigmoid router, correction bias, expert
groups, routed scaling, a shared expert): log-probs equal to the native trainer's, get_weights the
checkpoint's tensors bit for bit, and the first step the native one."""

import dataclasses

import pytest
import torch

from test_megatron_cuda import MEAN_TOL, TOL, _batch, _diff, _model_cfg  # noqa: E402  (tests/gpu helpers)
from test_megatron_trainer import _trainers, assert_project_norms, assert_round_trip_and_first_step


def _checkpoint(name: str, tmp_path, seed: int = 0, **moe_changes) -> str:
    """A random checkpoint of conf/model/<name>.yaml with `moe_changes`, its routers' correction
    biases random too (a fresh model's are zeros, which would leave them untested)."""
    from miles.data.tokenizer import DEFAULT_ALPHABET
    from miles.models import from_pretrained, save_pretrained
    from miles.orchestrate.checkpoints import random_checkpoint

    cfg = _model_cfg(name)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe_changes))
    out = random_checkpoint(cfg, DEFAULT_ALPHABET, seed=seed, out=tmp_path / name)
    model = from_pretrained(out, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if key.endswith("e_score_correction_bias"):
                tensor.copy_(torch.rand(tensor.shape, generator=gen) * 0.5)
    save_pretrained(model, out)
    return str(out)


CASES = {  # deepseek_v3_tiny: 1 dense + 2 MoE layers, 8 experts in 4 groups, top-2 of 2 groups
    "dense": dict(first_k_dense=3),  # every layer dense: MLA alone
    "moe": {},
    "moe_ungrouped": dict(n_group=1, topk_group=1),
}


@pytest.mark.parametrize("case, dtype", [(case, "fp32") for case in CASES] + [("moe", "bf16")])
def test_logprobs_equal_the_native_trainer(case, dtype, tmp_path, megatron_on_this_device):
    """fp32: equal within fp32 rounding. bf16: Megatron's bf16 parameters against the native fp32
    weights under autocast differ by design, within the H200 tier's bf16 bounds."""
    ckpt = _checkpoint("deepseek_v3_tiny", tmp_path, **CASES[case])
    mega, native = _trainers(ckpt, megatron_on_this_device, dtype=dtype)
    batch = _batch(mega.arch.vocab_size)
    worst, mean = _diff(mega.logprobs(batch), native.logprobs(batch), batch.loss_mask)
    print(f"\ndeepseek_v3_tiny {case} {dtype}: max |dlogp| {worst:.3g}, mean {mean:.3g}")
    assert worst < TOL[dtype] and mean < MEAN_TOL[dtype], (worst, mean)


def test_weights_round_trip_and_the_first_step(tmp_path, megatron_on_this_device):
    """The GPTModel is megatron-core's MLA with the project's core attention and router; get_weights
    returns the checkpoint's tensors (correction biases included) bit for bit; the first step has
    ppo_kl == 0 and the native trainer's loss, grad norm and updated weights (Adam, fp32)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from miles.trainer.megatron.core_attention import SDPACoreAttention
    from miles.trainer.megatron.router import GroupLimitedRouter

    ckpt = _checkpoint("deepseek_v3_tiny", tmp_path)
    mega, native = _trainers(ckpt, megatron_on_this_device)
    kinds = [type(m) for m in mega.model.modules()]
    assert (kinds.count(MLASelfAttention), kinds.count(SDPACoreAttention), kinds.count(GroupLimitedRouter)) == (3, 3, 2)
    assert_project_norms(mega.model, layers=3, per_layer=4)  # input, pre-MLP, the q and kv latents
    after, moved = assert_round_trip_and_first_step(ckpt, mega, native)
    assert all(torch.equal(after[k].cpu(), moved[k].cpu()) for k in moved if k.endswith("e_score_correction_bias"))


@pytest.mark.parametrize("case", ["moe", "dense"])
def test_glm4_7_flash_logprobs_equal_the_native_trainer(case, tmp_path, megatron_on_this_device):
    """GLM-4.7-Flash: decoder norms' eps 1e-5, latent norms' 1e-6 (the spec's latent_norm_eps), v head dim
    24 = qk head dim, no expert groups."""
    changes = {"first_k_dense": 3} if case == "dense" else {}
    mega, native = _trainers(_checkpoint("glm4_7_flash_tiny", tmp_path, **changes), megatron_on_this_device)
    norms = {m.eps for name, m in mega.model.module.named_modules() if name.endswith(("q_layernorm", "kv_layernorm"))}
    assert norms == {1e-6} and mega.megatron_config.layernorm_epsilon == 1e-5
    batch = _batch(mega.arch.vocab_size)
    worst, mean = _diff(mega.logprobs(batch), native.logprobs(batch), batch.loss_mask)
    print(f"\nglm4_7_flash_tiny {case} fp32: max |dlogp| {worst:.3g}, mean {mean:.3g}")
    assert worst < TOL["fp32"] and mean < MEAN_TOL["fp32"], (worst, mean)


@pytest.mark.parametrize("scramble", [False, True])
def test_r3_replays_the_engine_experts_through_the_group_limited_router(scramble, tmp_path,
                                                                        megatron_on_this_device):
    """R3 through the project's router: the engine's experts (or experts shifted by one, many outside
    the groups the router would keep) give the native trainer's log-probs, step and routing agreement."""
    from test_megatron_routing import _engine_batch
    from test_megatron_routing import _trainers as _replaying_trainers

    ckpt = _checkpoint("deepseek_v3_tiny", tmp_path)
    mega, native = _replaying_trainers(ckpt, megatron_on_this_device, "r3")
    batch = _engine_batch(ckpt, scramble)
    worst, _ = _diff(mega.logprobs(batch), native.logprobs(batch), batch.loss_mask)
    assert worst < TOL["fp32"], worst
    m, n = mega.train_rl(batch), native.train_rl(batch)
    assert m["train/loss"] == pytest.approx(n["train/loss"], rel=1e-4, abs=1e-6)
    assert m["train/grad_norm"] == pytest.approx(n["train/grad_norm"], rel=1e-3)
    agree = m["mismatch/routing_agreement"]
    print(f"\nR3 scramble={scramble}: max |dlogp| {worst:.3g}, routing agreement {agree}")
    assert agree == n["mismatch/routing_agreement"]
