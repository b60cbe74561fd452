"""LoRA on Llama 4's stacked experts (gate_up_proj [E, H, 2I], down_proj [E, I, H]: the x @ W layout,
PEFT's "transposed"), `trainer.lora.target_modules: [experts]` (miles/models/lora.py):

- the pairs have the shapes PEFT's ParamWrapper gives transformers' Llama4TextExperts (it reads the
  stack as [E, out, in], so A [E * rank, last dim], B [first dim, rank * E]); a fresh adapter leaves
  the logits bit for bit;
- one expert's output by hand: (w x) @ (W_e + alpha / rank * B_e A_e), on the expert's tokens only;
- merged weights give the hooks' logits; gradients reach only the chosen experts' adapters;
- the adapter in PEFT's format loads with `peft.PeftModel.from_pretrained` on transformers' tiny
  Llama 4 and gives the same logits (fp32, <= 1e-5), and loads back;
- the shared expert and the dense MLPs are nn.Linear projections, adapted by the projection entries;
- several adapters route each token's expert adapters by its row.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers
from test_llama4 import _text_config
from zoo_checks import random_ids, tiny_hf_model

from miles.models import from_pretrained
from miles.models.lora import LoRA, find_expert_targets, find_targets
from miles.models.lora_peft import load_peft, save_peft

VOCAB, H, I, EXPERTS = 64, 32, 32, 4


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """transformers' tiny Llama 4 (MoE layers 1 and 3, a shared expert, top-2 so tokens share
    experts' adapters in pairs), saved by transformers."""
    out = tmp_path_factory.mktemp("llama4_hf")
    tiny_hf_model(_text_config(num_experts_per_tok=2)).save_pretrained(out)
    return out


def _trained(lora: LoRA, seed: int = 3) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_selection_shapes_and_a_fresh_adapter(hf_dir):
    model = from_pretrained(hf_dir).eval()
    ids = random_ids(VOCAB)
    with torch.no_grad():
        before = model(ids)
    lora = LoRA(model, rank=4, alpha=8, target_modules=["q_proj", "experts"], seed=0)
    assert [n for n in lora.names if ".experts." in n] == [
        "layers.1.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj",
        "layers.3.mlp.experts.gate_up_proj", "layers.3.mlp.experts.down_proj"]
    t = lora.tensors()
    # PEFT on [E, H, 2I]: in_features 2I, out_features H (it swaps the last two dims of a 3-D stack).
    assert t["layers.1.mlp.experts.gate_up_proj.lora_A.weight"].shape == (EXPERTS, 4, 2 * I)
    assert t["layers.1.mlp.experts.gate_up_proj.lora_B.weight"].shape == (EXPERTS, H, 4)
    assert t["layers.1.mlp.experts.down_proj.lora_A.weight"].shape == (EXPERTS, 4, H)
    assert t["layers.1.mlp.experts.down_proj.lora_B.weight"].shape == (EXPERTS, I, 4)
    with torch.no_grad():
        assert torch.equal(model(ids), before)
    # The shared expert and the dense layers' MLPs are nn.Linear: the projection entries adapt them.
    dense = [n for n, _ in find_targets(model, ["gate_proj", "down_proj"])]
    assert "layers.1.mlp.shared_expert.gate_proj" in dense and "layers.0.mlp.down_proj" in dense
    assert find_expert_targets(model, ["gate_proj", "down_proj"]) == []


def test_one_expert_by_hand(hf_dir):
    model = from_pretrained(hf_dir).eval()
    lora = LoRA(model, rank=4, alpha=8, target_modules=["experts"], seed=0)
    _trained(lora)
    experts = model.layers[1].mlp.experts
    t = lora.tensors()
    stem = "layers.1.mlp.experts"
    gu_a, gu_b = t[f"{stem}.gate_up_proj.lora_A.weight"], t[f"{stem}.gate_up_proj.lora_B.weight"]
    d_a, d_b = t[f"{stem}.down_proj.lora_A.weight"], t[f"{stem}.down_proj.lora_B.weight"]
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(2))
    chosen = torch.tensor([[1, 3]] * 5)
    weights = torch.full((5, 2), 0.5)

    def expert(e):  # the weight PEFT's ParamWrapper puts in W_e's place: W_e + alpha / rank * B_e A_e
        gate, up = ((0.5 * x) @ (experts.gate_up_proj[e] + 2.0 * gu_b[e] @ gu_a[e])).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ (experts.down_proj[e] + 2.0 * d_b[e] @ d_a[e])

    with torch.no_grad():
        assert torch.allclose(experts(x, chosen, weights), expert(1) + expert(3), atol=1e-6)


def test_merged_weights_and_gradients(hf_dir):
    model = from_pretrained(hf_dir).eval().requires_grad_(False)
    lora = LoRA(model, rank=4, alpha=8, target_modules=["q_proj", "experts"], seed=0)
    _trained(lora)
    ids = random_ids(VOCAB)
    with torch.no_grad():
        hooked = model(ids)
        original = model.layers[1].mlp.experts.gate_up_proj.data.clone()
        with lora.merged():
            assert (model(ids) - hooked).abs().max().item() <= 1e-5
        assert torch.equal(model.layers[1].mlp.experts.gate_up_proj.data, original)
    routing = {}
    model(ids, routing_record=routing).float().pow(2).mean().backward()
    grad = lora.tensors()["layers.1.mlp.experts.down_proj.lora_A.weight"].grad
    used = set(routing[1].unique().tolist())
    assert used and all((grad[e].abs().sum() > 0) == (e in used) for e in range(EXPERTS))
    assert all(p.grad is None for p in model.parameters())


def test_peft_loads_the_expert_adapter_with_the_same_logits(hf_dir, tmp_path):
    peft = pytest.importorskip("peft")
    for targets in (["q_proj", "gate_proj", "experts"], ["experts.down_proj"], ["experts.gate_up_proj"]):
        model = from_pretrained(hf_dir).eval()
        lora = LoRA(model, rank=4, alpha=8, target_modules=targets, seed=0)
        _trained(lora)
        where = tmp_path / "_".join(targets)
        save_peft(lora, model.config, where)
        ids = random_ids(VOCAB)
        with torch.no_grad():
            ours = model(ids)
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
        peft_model = peft.PeftModel.from_pretrained(hf.eval(), where).eval()
        wrapped = {n for n, _ in peft_model.named_modules() if n.endswith("feed_forward.experts")}
        assert wrapped, targets  # PEFT adapted the stacked experts, not only the projections
        with torch.no_grad():
            theirs = peft_model(input_ids=ids).logits
        assert (theirs - ours).abs().max().item() <= 1e-5, targets
        with peft_model.disable_adapter(), torch.no_grad():
            assert (peft_model(input_ids=ids).logits - ours).abs().max().item() > 1e-3

        again = LoRA(from_pretrained(hf_dir), rank=4, alpha=8, target_modules=targets, seed=1)
        load_peft(again, model.config, where)
        assert all(torch.equal(again.tensors()[k], v) for k, v in lora.tensors().items())


def test_two_adapters_route_each_tokens_experts(hf_dir):
    """Adapter "a" holds a single-adapter LoRA's weights, "b" is zero: rows routed to "a" are that
    model's rows, rows routed to "b" the base model's."""
    ids = random_ids(VOCAB)
    base_model, single_model, model = (from_pretrained(hf_dir).eval() for _ in range(3))
    single = LoRA(single_model, rank=4, alpha=8, target_modules=["experts"], seed=0)
    _trained(single)
    lora = LoRA(model, rank=4, alpha=8, target_modules=["experts"], seed=0, adapters=["a", "b"])
    lora.load(single.tensors(), adapter=0)
    with torch.no_grad():
        for p in lora.adapter_parameters(1):
            p.zero_()
        lora.route(torch.tensor([[0], [1]]))
        routed = model(ids)
        assert (routed[0] - single_model(ids)[0]).abs().max().item() <= 1e-6
        assert (routed[1] - base_model(ids)[1]).abs().max().item() <= 1e-6
