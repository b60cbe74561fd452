"""True on-policy mode on CUDA: the Triton batch-invariant matmul, and 20-step runs of the tiny dense and
MoE models in bf16 whose trainer and engine log-probs are equal bit for bit on every step.

Skipped without a GPU (CI). On a GPU machine: `pytest tests/gpu` (the runs need Hydra and OmegaConf;
MLflow is optional: the runs log to their local journal)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
STEPS = 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matmul_rows_do_not_depend_on_the_batch(dtype):
    from miles.models.invariant_triton import triton_matmul

    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(777, 1000, device="cuda", generator=gen).to(dtype)
    b = torch.randn(1000, 300, device="cuda", generator=gen).to(dtype)
    full = triton_matmul(a, b, torch.float32)
    for rows in (1, 3, 64, 65, 500):
        assert torch.equal(triton_matmul(a[:rows], b, torch.float32), full[:rows])
    # Zero terms past the end of K (masked keys) change nothing: K = 1000 vs K = 1000 + 96 zeros.
    padded_a = torch.cat((a, torch.zeros(777, 96, device="cuda", dtype=dtype)), dim=1)
    padded_b = torch.cat((b, torch.randn(96, 300, device="cuda", generator=gen).to(dtype)), dim=0)
    assert torch.equal(triton_matmul(padded_a, padded_b, torch.float32), full)
    # Batched with a broadcast weight, same rows again; and close to cuBLAS.
    batched = triton_matmul(a[:256].view(4, 64, 1000), b, torch.float32)
    assert torch.equal(batched.view(256, 300), full[:256])
    ref = a.float() @ b.float()
    assert (full - ref).abs().max().item() < (1e-3 if dtype == torch.float32 else 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matmul_tile_configs_do_not_change_the_bits(dtype):
    """The tile picked by M decides which program computes an element, never its sum: both tiles
    give every row the same bits, so rows of a large call (2048 rows: the wide tile) equal the same
    rows computed in a small one."""
    from miles.models import invariant_triton as it

    gen = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(2048, 1024, device="cuda", generator=gen).to(dtype)
    b = torch.randn(1024, 640, device="cuda", generator=gen).to(dtype)
    full = it.triton_matmul(a, b, torch.float32)
    for config in (it.SMALL_TILE, it.WIDE_TILE):
        assert torch.equal(it.triton_matmul(a, b, torch.float32, config), full), config
    assert torch.equal(it.triton_matmul(a[1500:1501], b, torch.float32), full[1500:1501])


@pytest.mark.parametrize("model, extra", [("qwen3_tiny", []), ("qwen3_moe_tiny", []),
                                         ("qwen3_tiny", ["trainer.lora.rank=8", "trainer.lr=3e-3"])],
                         ids=["qwen3_tiny", "qwen3_moe_tiny", "qwen3_tiny-lora"])
def test_true_on_policy_is_exact_on_cuda(compose, tmp_path, monkeypatch, model, extra):
    pytest.importorskip("hydra")
    from gpu_runs import run_inprocess

    monkeypatch.chdir(tmp_path)
    metrics = run_inprocess(compose, tmp_path, [
        f"model={model}", "hardware=gpu", "precision=bf16", "true_on_policy=true", f"steps={STEPS}", *extra,
        "warm_start.enabled=false", f"eval.interval={STEPS}", "task.eval_size=16", "rollout.batch_size=8",
        "trainer.global_batch_size=64", "trainer.micro_batch_size=32", "algo.entropy_coef=0.01"])
    diffs = [metrics[s]["mismatch/logprob_abs_diff"] for s in range(1, STEPS + 1)]
    assert diffs == [0.0] * STEPS, diffs
    assert metrics[1]["train/ppo_kl"] == 0.0


def test_true_on_policy_step_takes_the_eager_head_in_backward(compose, tmp_path, monkeypatch):
    """The chunked LM head's fused Triton passes stay off under the batch-invariant kernels, backward
    included: a true on-policy bf16 step (entropy bonus on) has the gradient of a trainer whose fused
    passes are off everywhere (up to the backward kernels' own run-to-run noise: attention's backward
    is not batch-invariant). The backward once took the fused pass after the mode had ended and read
    a logsumexp only the fused forward writes: gradients from uninitialized memory, which the runs
    above did not see (their mismatch compares forwards)."""
    pytest.importorskip("hydra")
    from miles.config.schema import AlgoCfg, AlgoName
    from miles.data.tokenizer import DEFAULT_ALPHABET
    from miles.orchestrate.checkpoints import random_checkpoint
    from miles.trainer import chunked_ce_triton
    from miles.trainer.torch_trainer import TorchTrainer
    from miles.types import TrainBatch

    cfg = compose(["model=qwen3_tiny", "hardware=gpu", "precision=bf16", "true_on_policy=true"])
    ckpt = str(random_checkpoint(cfg.model, DEFAULT_ALPHABET, seed=0, out=tmp_path / "ckpt"))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 20, (8, 24), generator=gen)
    mask = torch.zeros(8, 23)
    mask[:, 8:] = 1.0
    adv = (torch.randint(0, 2, (8, 1), generator=gen).float() * 2 - 1) * mask
    batch = TrainBatch(tokens=tokens, loss_mask=mask, advantages=adv, rollout_logprobs=torch.zeros_like(mask))

    def step():
        trainer = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo, entropy_coef=0.01), cfg.trainer, cfg.precision,
                               device="cuda", threads=1, true_on_policy=True)
        return trainer.train_rl(batch)

    metrics = step()
    monkeypatch.setattr(chunked_ce_triton, "applies", lambda logits: False)
    eager = step()
    assert metrics["train/loss"] == eager["train/loss"]  # the forward: batch-invariant, bit for bit
    assert metrics["train/grad_norm"] == pytest.approx(eager["train/grad_norm"], rel=1e-3)
