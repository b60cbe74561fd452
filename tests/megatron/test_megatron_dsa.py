"""The DSA families through Megatron-core on the CPU (CUDA mapped to the CPU: tests/megatron/cuda_on_cpu.py):
DeepSeek-V3.2 (deepseek_v3_2_tiny) and GLM-5 (glm5_tiny, its last layer sharing layer 1's selection) as
megatron-core's MLASelfAttention with the project's DSA core attention (miles/trainer/megatron/dsa_attention.py:
the native lightning indexer, top-k, sparse attention), against the native trainer: fp32 log-probs with
sequences longer than the indexer's top-k (the selection drops keys) and within it (it keeps them all),
the first step, a recomputing backward, and R3 replay of the engine's selected keys."""

from dataclasses import replace

import pytest
import torch

from test_megatron_cuda import MEAN_TOL, _batch, _diff  # noqa: E402  (tests/gpu helpers)
from test_megatron_mla import _checkpoint
from test_megatron_trainer import _trainers, assert_round_trip_and_first_step

FAMILIES = ["deepseek_v3_2_tiny", "glm5_tiny"]  # both: index_topk 8, 3 layers (1 dense + 2 MoE)
# (prompt, response) tokens: 12 + 10..20 = 22..32 tokens per row, past index_topk = 8, so queries from
# position 8 on attend to 8 of their keys; 3 + 2..5 = 5..8 tokens: every query keeps all it sees.
REGIMES = {"above_topk": (12, 20), "within_topk": (3, 5)}
TOL = 1e-5  # fp32 log-probs, max over the loss positions


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("name", FAMILIES)
def test_logprobs_equal_the_native_trainer(name, regime, tmp_path, megatron_on_this_device, monkeypatch):
    """The log-probs equal the native trainer's; and the selection acts: with every visible key kept
    (dense MLA) they move past top-k, and not within it."""
    from miles.trainer.megatron.dsa_attention import DSACoreAttention

    mega, native = _trainers(_checkpoint(name, tmp_path), megatron_on_this_device)
    prompt, response = REGIMES[regime]
    above = regime == "above_topk"
    assert (prompt + response > mega.arch.dsa.index_topk) is above
    batch = _batch(mega.arch.vocab_size, prompt=prompt, response=response)
    got = mega.logprobs(batch)
    worst, mean = _diff(got, native.logprobs(batch), batch.loss_mask)
    monkeypatch.setattr(DSACoreAttention, "_keep", lambda self, x, qr, ctx: torch.ones((), dtype=torch.bool))
    dense, _ = _diff(mega.logprobs(batch), got, batch.loss_mask)
    print(f"\n{name} {regime}: max |dlogp| {worst:.3g}, mean {mean:.3g}; dense MLA moves them by {dense:.3g}")
    assert worst < TOL and mean < MEAN_TOL["fp32"], (worst, mean)
    assert (dense > 1e-3) if above else (dense < TOL), dense


@pytest.mark.parametrize("name", FAMILIES)
def test_weights_round_trip_and_the_first_step(name, tmp_path, megatron_on_this_device):
    """The GPTModel is megatron-core's MLA with the project's DSA core attention on every layer, an
    indexer on each that has its own (GLM-5's layer 2 shares layer 1's); get_weights returns the
    checkpoint bit for bit (indexers included), the first step is the native one (the indexers,
    frozen on both sides, do not move)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from miles.models.dsa import LightningIndexer
    from miles.trainer.megatron.dsa_attention import DSACoreAttention

    ckpt = _checkpoint(name, tmp_path)
    mega, native = _trainers(ckpt, megatron_on_this_device)
    kinds = [type(m) for m in mega.model.modules()]
    indexers = 3 - len(mega.arch.dsa.shared_layers)
    assert (kinds.count(MLASelfAttention), kinds.count(DSACoreAttention), kinds.count(LightningIndexer)) == (
        3, 3, indexers)
    after, moved = assert_round_trip_and_first_step(ckpt, mega, native)
    index_weights = [k for k in moved if ".indexer." in k]
    assert len(index_weights) == 5 * indexers
    assert all(torch.equal(after[k].cpu(), moved[k].cpu()) for k in index_weights)


def test_recomputing_backward_steps_as_the_native_trainer(tmp_path, megatron_on_this_device):
    """trainer.recompute: Megatron re-runs each layer in the backward, GLM-5's sharing layer reading its
    source's selection again (dsa_attention.DSASelection); the step is the native one."""
    from miles.config.schema import AlgoCfg, AlgoName, PrecisionCfg, TrainerCfg
    from miles.trainer.megatron.trainer import MegatronTrainer
    from miles.trainer.torch_trainer import TorchTrainer

    ckpt = _checkpoint("glm5_tiny", tmp_path)
    cfg = TrainerCfg(lr=1e-4, global_batch_size=8, micro_batch_size=4, pack_sequences=False)
    args = (ckpt, AlgoCfg(name=AlgoName.grpo), replace(cfg, recompute=True), PrecisionCfg(name="fp32"))
    mega = MegatronTrainer(*args, device=megatron_on_this_device, threads=1)
    native = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), cfg, PrecisionCfg(name="fp32"),
                          device=megatron_on_this_device, threads=1)
    assert mega.megatron_config.recompute_granularity == "full"
    batch = _batch(mega.arch.vocab_size)
    m, n = mega.train_rl(batch), native.train_rl(batch)
    assert m["train/loss"] == pytest.approx(n["train/loss"], rel=1e-4, abs=1e-6)
    assert m["train/grad_norm"] == pytest.approx(n["train/grad_norm"], rel=1e-3)


@pytest.mark.parametrize("scramble", [False, True])
def test_r3_replays_the_engine_selected_keys(scramble, tmp_path, megatron_on_this_device):
    """R3 on a DSA model: the engine's experts and selected keys (or keys it did not select: each
    query's earliest ones) give the native trainer's log-probs and first step; the diagnostics record
    Megatron's own selection (index agreement as the native trainer's)."""
    from test_megatron_routing import _engine_batch
    from test_megatron_routing import _trainers as _replaying_trainers

    ckpt = _checkpoint("glm5_tiny", tmp_path)
    mega, native = _replaying_trainers(ckpt, megatron_on_this_device, "r3")
    assert mega.key_layers == native.key_layers == [0, 1]
    batch = _engine_batch(ckpt, scramble=False)
    keys = batch.selected_keys
    assert keys.numel() and (keys >= 0).sum(-1).max() == mega.arch.dsa.index_topk  # rows past top-k
    if scramble:  # the first index_topk positions (-1 where fewer are visible): what the indexer would not keep
        first = torch.arange(keys.shape[-1]).expand_as(keys)
        visible = torch.arange(keys.shape[1])[None, :, None, None]
        batch = replace(batch, selected_keys=torch.where(first <= visible, first, -1).to(keys.dtype))
    worst, _ = _diff(mega.logprobs(batch), native.logprobs(batch), batch.loss_mask)
    plain = mega.logprobs(replace(batch, routed_experts=torch.zeros(0), selected_keys=torch.zeros(0)))
    moved, _ = _diff(mega.logprobs(batch), plain, batch.loss_mask)
    m, n = mega.train_rl(batch), native.train_rl(batch)
    print(f"\nglm5_tiny R3 scramble={scramble}: max |dlogp| {worst:.3g}, replay moves {moved:.3g}, "
          f"index agreement {m['mismatch/index_agreement']:.3g}")
    assert worst < TOL, worst
    assert (moved > 1e-3) if scramble else (moved < TOL), moved
    assert m["train/loss"] == pytest.approx(n["train/loss"], rel=1e-4, abs=1e-6)
    assert m["train/grad_norm"] == pytest.approx(n["train/grad_norm"], rel=1e-3)
    assert m["mismatch/index_agreement"] == n["mismatch/index_agreement"]
