"""Speculative rollout on CUDA: the slot layout with CUDA graphs (spec_slots.py) and the padded path
with an MTP draft give plain greedy decoding's tokens; sampled tokens carry the target's log-probs.

Skipped without a GPU (CI). fp32, where greedy ties are as unlikely as on the CPU.
"""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from miles.algo.losses import token_logprobs
from miles.config.schema import DType, ModelCfg, RolloutCfg, SpeculativeCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.rollout.spec_slots import SlotSpeculativeDecoder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TARGET = ModelCfg(name="qwen3_small", hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
                  num_kv_heads=4, head_dim=32, max_position_embeddings=256)
DRAFT = ModelCfg(name="qwen3_draft", hidden_size=64, intermediate_size=192, num_layers=1, num_heads=2,
                 num_kv_heads=1, head_dim=32, max_position_embeddings=256)
# The zoo's GLM-4.5 (GQA + MoE) with its MTP layer.
MTP = OmegaConf.to_object(OmegaConf.merge(
    OmegaConf.structured(ModelCfg), OmegaConf.load(Path(__file__).resolve().parents[2] / "conf/model/glm4_moe_tiny.yaml"),
    {"mtp_layers": 1, "max_position_embeddings": 256}))
PROMPTS = [f"{a}+{b}=" for a, b in zip(range(10, 90, 7), range(33, 99, 5))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {name: str(random_checkpoint(cfg, DEFAULT_ALPHABET, seed, root / name))
            for name, cfg, seed in (("target", TARGET, 0), ("draft", DRAFT, 1), ("mtp", MTP, 0))}


def engine(path, draft=None, **rollout):
    cfg = RolloutCfg(max_new_tokens=32, max_prompt_len=16, max_running=24, **rollout)
    return NativeEngine(path, cfg, DType.fp32, device="cuda", seed=0, draft_dir=draft)


def greedy(e, n=2):
    return e.generate(PROMPTS, ["?"] * len(PROMPTS), n=n, temperature=0.0)


@pytest.mark.parametrize("k", [1, 3])
def test_slot_speculation_with_graphs_equals_plain_greedy(checkpoints, k):
    plain = engine(checkpoints["target"])
    spec = engine(checkpoints["target"], checkpoints["draft"],
                  speculative=SpeculativeCfg(kind="draft_model", num_tokens=k))
    assert isinstance(spec.spec, SlotSpeculativeDecoder) and spec.spec.cuda_graphs
    a, b = greedy(plain), greedy(spec)  # 24 samples in 24 slots; then 48 over two chunks
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.rollout_logprobs, t.rollout_logprobs)) < 1e-4
    assert spec.spec.state["graphs"]["verify"].graphs  # captured
    a, b = greedy(plain, n=4), greedy(spec, n=4)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]


def test_the_target_as_its_own_draft_keeps_every_draft_on_cuda(checkpoints):
    spec = engine(checkpoints["target"], checkpoints["target"], speculative=SpeculativeCfg(kind="draft_model"))
    for s in greedy(spec):
        steps, accepted = s.draft_stats
        assert accepted == 3 * steps


def test_sampled_tokens_carry_the_targets_logprobs(checkpoints):
    spec = engine(checkpoints["target"], checkpoints["draft"], speculative=SpeculativeCfg(kind="draft_model"))
    for s in spec.generate(PROMPTS, ["?"] * len(PROMPTS), n=2, temperature=1.0):
        ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")
        lp = token_logprobs(spec.model(ids[:, :-1]), ids[:, 1:], 1.0)[0, len(s.prompt_ids) - 1:]
        assert (torch.tensor(s.rollout_logprobs, device="cuda") - lp).abs().max() < 1e-4


def test_mtp_speculation_equals_plain_greedy(checkpoints):
    plain = engine(checkpoints["mtp"])
    spec = engine(checkpoints["mtp"], speculative=SpeculativeCfg(kind="mtp"))
    assert [s.response_ids for s in greedy(plain)] == [s.response_ids for s in greedy(spec)]


def test_release_and_resume_rebuild_the_slot_caches(checkpoints):
    spec = engine(checkpoints["target"], checkpoints["draft"], speculative=SpeculativeCfg(kind="draft_model"))
    before = [s.response_ids for s in greedy(spec)]
    assert spec.held_bytes()["kv_cache"] > 0
    spec.release_memory()
    assert spec.held_bytes()["kv_cache"] == 0
    spec.resume_memory()
    assert [s.response_ids for s in greedy(spec)] == before
