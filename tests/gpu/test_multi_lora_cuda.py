"""Several LoRA adapters on CUDA (trainer.lora.adapters): the slot decoder's captured graphs read each
slot's adapter from their persistent buffer, so a batch mixing two adapters decodes (greedy) the
tokens single-adapter engines decode for each group alone, and a second call that swaps the
prompts' adapters gets each swapped group's tokens, from the same graphs; a trainer step on a mixed
batch moves each adapter as a single-adapter step on its own samples (SGD: linear in the gradient).

Skipped without a GPU (CI). On a GPU machine: `pytest tests/gpu/test_multi_lora_cuda.py` (needs
torch, safetensors, tokenizers, omegaconf: no Hydra, Ray or MLflow).
"""

from dataclasses import replace

import pytest
import torch

from miles.config.schema import AlgoCfg, AlgoName, LoRACfg, ModelCfg, PrecisionCfg, RolloutCfg, TrainerCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.trainer.torch_trainer import TorchTrainer
from miles.types import build_train_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MODEL = ModelCfg(name="small", hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=64, max_position_embeddings=128)
ONE = LoRACfg(rank=8, alpha=16.0)
TWO = replace(ONE, adapters=["add", "mul"], adapter_key="adapter")
ROLLOUT = RolloutCfg(max_new_tokens=12, max_prompt_len=16, max_running=16, sync_every=4, temperature=0.0)
PROMPTS = [f"{a}+{b}=" for a, b in zip(range(10, 90, 10), range(33, 99, 8))]  # 8 prompts
ROUTES = [0, 1, 1, 0, 1, 0, 0, 1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(random_checkpoint(MODEL, DEFAULT_ALPHABET, seed=0, out=tmp_path_factory.mktemp("ckpt") / "m"))


@pytest.fixture(scope="module")
def adapters(checkpoint):
    """Both adapters with random A and B (as if trained): each changes what the model decodes."""
    engine = NativeEngine(checkpoint, ROLLOUT, device="cuda", lora=TWO)
    gen = torch.Generator().manual_seed(0)
    return {k: 0.3 * torch.randn(v.shape, generator=gen) for k, v in engine.lora.tensors().items()}


def _alone(checkpoint, adapters, name):
    engine = NativeEngine(checkpoint, ROLLOUT, device="cuda", lora=ONE)
    engine.update_weights({k.partition("/")[2]: v for k, v in adapters.items() if k.startswith(f"{name}/")})
    return engine


def test_captured_slot_graphs_route_each_slot_to_its_adapter(checkpoint, adapters):
    engine = NativeEngine(checkpoint, ROLLOUT, device="cuda", lora=TWO)
    engine.update_weights(adapters)
    assert engine.slots is not None and engine.slots.captured  # decode steps replay CUDA graphs
    labels = ["0"] * len(PROMPTS)
    for routes in (ROUTES, [1 - a for a in ROUTES]):  # the same graphs, the slots' adapters swapped
        mixed = engine.generate(PROMPTS, labels, n=2, adapters=routes)
        for k, name in enumerate(TWO.adapters):
            mine = [i for i, a in enumerate(routes) if a == k]
            ref = _alone(checkpoint, adapters, name).generate([PROMPTS[i] for i in mine], ["0"] * len(mine), n=2)
            got = [s for s in mixed if s.adapter == k]
            assert [s.response_ids for s in got] == [s.response_ids for s in ref]
            for s, r in zip(got, ref):
                torch.testing.assert_close(torch.tensor(s.rollout_logprobs), torch.tensor(r.rollout_logprobs),
                                           atol=1e-4, rtol=0)
    swapped = engine.generate(PROMPTS, labels, n=2, adapters=[1 - a for a in ROUTES])
    assert [s.response_ids for s in swapped] != [s.response_ids for s in engine.generate(PROMPTS, labels, n=2,
                                                                                         adapters=ROUTES)]


def test_a_mixed_step_on_cuda_is_each_adapter_alone(checkpoint, adapters):
    engine = NativeEngine(checkpoint, replace(ROLLOUT, temperature=1.0), device="cuda", seed=0, lora=TWO)
    engine.update_weights(adapters)
    samples = engine.generate(PROMPTS, ["0"] * len(PROMPTS), n=2, adapters=ROUTES)
    for i, s in enumerate(samples):
        s.reward = float(i % 3 == 0)
    batch = build_train_batch(samples, torch.tensor([1.0, -1.0] * len(PROMPTS)), engine.pad_id)
    cfg = TrainerCfg(lr=1e-2, global_batch_size=16, micro_batch_size=4, grad_clip=0.05)
    algo, fp32 = AlgoCfg(name=AlgoName.grpo), PrecisionCfg(name="fp32")
    two = TorchTrainer(checkpoint, algo, replace(cfg, lora=TWO), fp32, device="cuda", optimizer="sgd")
    two.lora.load(adapters)
    two.train_rl(batch)
    for k, name in enumerate(TWO.adapters):
        alone = TorchTrainer(checkpoint, algo, replace(cfg, lora=ONE), fp32, device="cuda", optimizer="sgd")
        alone.lora.load({key.partition("/")[2]: v for key, v in adapters.items() if key.startswith(f"{name}/")})
        rows = (batch.adapter_ids == k).nonzero().squeeze(1)
        alone.train_rl(replace(batch.slice(0, 0), **{f: getattr(batch, f)[rows] for f in
                                                     ("tokens", "loss_mask", "advantages", "rollout_logprobs",
                                                      "rewards")}))
        got = {key: v.detach() for key, v in two.lora.tensors(k).items()}
        diff = max(float((got[key] - v.detach()).abs().max()) for key, v in alone.lora.tensors().items())
        assert diff <= 1e-5, (name, diff)


def test_merged_adapter_decodes_as_unmerged_from_captured_graphs(checkpoint, adapters):
    """trainer.lora.merge_in_engine on CUDA: the merge writes into the weights the captured graphs
    read (in place), so after a second sync the same graphs decode the new adapter; fp32 engines, so
    the merged and unmerged engines' greedy tokens agree (bf16 would round W + BA once more)."""
    one = {k.partition("/")[2]: v for k, v in adapters.items() if k.startswith("add/")}
    other = {k.partition("/")[2]: v for k, v in adapters.items() if k.startswith("mul/")}
    merged = NativeEngine(checkpoint, ROLLOUT, device="cuda", lora=replace(ONE, merge_in_engine=True))
    labels = ["0"] * len(PROMPTS)
    for weights in (one, other):
        unmerged = NativeEngine(checkpoint, ROLLOUT, device="cuda", lora=ONE)
        unmerged.update_weights(weights)
        merged.update_weights(weights)
        assert merged.slots is not None and merged.slots.captured
        got = [s.response_ids for s in merged.generate(PROMPTS, labels, n=1)]
        assert got == [s.response_ids for s in unmerged.generate(PROMPTS, labels, n=1)]
