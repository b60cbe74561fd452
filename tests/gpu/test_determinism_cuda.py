"""deterministic=true on CUDA: the tiny variants of each attention / MoE kind train and decode with
torch's deterministic kernels (no op refuses) and repeat bit for bit, bf16 autocast included.

Skipped without a GPU (CI); run on a GPU machine with `pytest tests/gpu/test_determinism_cuda.py`
(needs only torch, numpy, pyyaml and the miles package: no Hydra, Ray or MLflow).
"""

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from miles.orchestrate import determinism

# cuBLAS reads its workspace setting when it first starts in the process: set it at import time,
# before any test of the session touches CUDA.
os.environ.update(determinism.CUBLAS_ENV)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
# one of each: GQA + softmax MoE, MLA + grouped sigmoid MoE, MLA + sparse attention (DSA),
# gated DeltaNet, chunked attention + interleaved MoE, dense GQA
MODELS = ["qwen3_moe_tiny", "deepseek_v3_tiny", "glm5_tiny", "qwen3_next_tiny", "llama4_tiny", "qwen3_tiny"]
VOCAB = 64


def tiny_arch(name: str):
    from miles.models import config as mc

    blocks = {"moe": mc.MoEConfig, "mla": mc.MLAConfig, "dsa": mc.DSAConfig, "linear_attn": mc.LinearAttnConfig,
              "rope_scaling": mc.RopeScalingConfig, "llama4": mc.Llama4AttnConfig}
    values = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    values = {k: blocks[k](**v) if k in blocks and v is not None else v for k, v in values.items()
              if k not in ("name", "hf_checkpoint")}
    return mc.ArchConfig(**{**values, "vocab_size": VOCAB})


def train_and_decode(name: str, device: str = "cuda"):
    """loss, every gradient, and 8 greedy tokens after a 16-token prefill, from a fresh model."""
    from miles.models import CausalLM

    model = CausalLM(tiny_arch(name), seed=0).to(device)
    ids = torch.randint(1, VOCAB, (4, 24), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    tokens = []
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        cache = model.new_cache(4, 32)
        logits = model(ids[:, :16], cache=cache)
        for _ in range(8):
            tokens.append(logits[:, -1].argmax(-1, keepdim=True))
            logits = model(tokens[-1], cache=cache)
    return loss.detach(), grads, torch.cat(tokens, 1)


@pytest.fixture
def deterministic():
    determinism.enable(0)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("name", MODELS)
def test_training_and_decoding_repeat_bit_for_bit(deterministic, name):
    first, again = train_and_decode(name), train_and_decode(name)
    assert torch.equal(first[0], again[0])
    assert len(first[1]) == len(again[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(first[1], again[1]))
    assert torch.equal(first[2], again[2])
