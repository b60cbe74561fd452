"""LoRA on stacked MoE experts (miles/models/lora.py, `trainer.lora.target_modules: [experts]`):

- a fresh adapter leaves a Qwen3-MoE model's logits bit for bit;
- one expert's output by hand: W_e x + alpha / rank * B_e A_e x, on that expert's tokens only;
- merged weights (W_e + alpha / rank * B_e A_e) give the hooks' logits, and gradients reach only the
  chosen experts' adapters;
- the adapter in PEFT's format (`target_parameters`) loads with `peft.PeftModel.from_pretrained` on the
  transformers model and gives the same logits (fp32, <= 1e-5), and loads back;
- selection: a bare "down_proj" keeps meaning the nn.Linear projections; "experts" adds the stacked ones;
- several adapters: each token's expert adapters are its row's (routed rows = that adapter's model).
"""

import pytest
import torch
import torch.nn.functional as F
import transformers
from zoo_checks import backward_nodes, random_ids, tiny_hf_model

from miles.models import from_pretrained
from miles.models.lora import ALL_PROJECTIONS, LoRA, find_expert_targets
from miles.models.lora_peft import load_peft, save_peft

VOCAB = 64
EXPERTS = 4


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen3-MoE saved by transformers (fused expert tensors in memory), weights randomized."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=EXPERTS, num_experts_per_tok=2, decoder_sparse_step=1,
                                      mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
                                      rope_theta=10000.0, rms_norm_eps=1e-6)
    out = tmp_path_factory.mktemp("qwen3_moe_hf")
    tiny_hf_model(cfg).save_pretrained(out)
    return out


def _ids():
    return random_ids(VOCAB)


def _trained(lora: LoRA, seed: int = 3) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_selection_and_shapes(hf_dir):
    model = from_pretrained(hf_dir)
    assert find_expert_targets(model, ALL_PROJECTIONS) == []  # "down_proj" is the Linear projections'
    lora = LoRA(model, rank=4, alpha=8, target_modules=["q_proj", "experts"], seed=0)
    assert lora.names == ["layers.0.self_attn.q_proj", "layers.1.self_attn.q_proj",
                          "layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj",
                          "layers.1.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj"]
    t = lora.tensors()
    assert t["layers.0.mlp.experts.gate_up_proj.lora_A.weight"].shape == (EXPERTS, 4, 32)
    assert t["layers.0.mlp.experts.gate_up_proj.lora_B.weight"].shape == (EXPERTS, 32, 4)  # 2 x 16 rows
    assert t["layers.0.mlp.experts.down_proj.lora_A.weight"].shape == (EXPERTS, 4, 16)
    only_down = find_expert_targets(model, ["experts.down_proj"])
    assert [name for name, _, _ in only_down] == ["layers.0.mlp.experts.down_proj", "layers.1.mlp.experts.down_proj"]
    assert [n for n, _, _ in find_expert_targets(model, [r"layers\.1\.mlp\.experts\..*"])] == \
        ["layers.1.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj"]


def test_fresh_adapter_is_the_base_model_exactly(hf_dir):
    model = from_pretrained(hf_dir).eval()
    ids = _ids()
    with torch.no_grad():
        before = model(ids)
        LoRA(model, rank=4, alpha=8, target_modules=["experts"], seed=0)
        assert torch.equal(model(ids), before)


def test_one_expert_by_hand(hf_dir):
    model = from_pretrained(hf_dir).eval()
    lora = LoRA(model, rank=4, alpha=8, target_modules=["experts.gate_up_proj"], seed=0)
    _trained(lora)
    experts = model.layers[0].mlp.experts
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    chosen = torch.tensor([[1, 3]] * 5)
    weights = torch.full((5, 2), 0.5)
    a, b = lora.tensors()["layers.0.mlp.experts.gate_up_proj.lora_A.weight"], \
        lora.tensors()["layers.0.mlp.experts.gate_up_proj.lora_B.weight"]

    def expert(e):
        gate_up = F.linear(x, experts.gate_up_proj[e]) + 2.0 * F.linear(F.linear(x, a[e]), b[e])  # alpha / rank = 2
        gate, up = gate_up.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, experts.down_proj[e])

    with torch.no_grad():
        assert torch.allclose(experts(x, chosen, weights), 0.5 * expert(1) + 0.5 * expert(3), atol=1e-6)


def test_merged_weights_and_gradients(hf_dir):
    model = from_pretrained(hf_dir).eval().requires_grad_(False)  # frozen, as trainer.lora holds it
    lora = LoRA(model, rank=4, alpha=8, target_modules=["q_proj", "experts"], seed=0)
    _trained(lora)
    ids = _ids()
    with torch.no_grad():
        hooked = model(ids)
        original = model.layers[0].mlp.experts.gate_up_proj.data.clone()
        with lora.merged():
            assert (model(ids) - hooked).abs().max().item() <= 1e-5
        assert torch.equal(model.layers[0].mlp.experts.gate_up_proj.data, original)
    # Gradients: the experts some token chose get them, the others none; each adapter stack's from one
    # unbind a forward (moe.stack_slices), not a zero-filled whole-stack gradient per expert.
    routing = {}
    logits = model(ids, routing_record=routing)
    nodes = backward_nodes(logits)
    assert nodes.count("UnbindBackward0") == 4 * 2 and "SelectBackward0" not in nodes  # A, B; 2 stacks; 2 layers
    logits.float().pow(2).mean().backward()
    grad = lora.tensors()["layers.0.mlp.experts.gate_up_proj.lora_B.weight"].grad
    used = set(routing[0].unique().tolist())
    assert used and all((grad[e].abs().sum() > 0) == (e in used) for e in range(EXPERTS))
    assert all(p.grad is None for p in model.parameters())


def test_peft_loads_the_expert_adapter_with_the_same_logits(hf_dir, tmp_path):
    peft = pytest.importorskip("peft")
    for targets in (["q_proj", "experts"], ["experts.down_proj"]):
        model = from_pretrained(hf_dir).eval()
        lora = LoRA(model, rank=4, alpha=8, target_modules=targets, seed=0)
        _trained(lora)
        where = tmp_path / "_".join(targets)
        save_peft(lora, model.config, where)
        ids = _ids()
        with torch.no_grad():
            ours = model(ids)
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
        peft_model = peft.PeftModel.from_pretrained(hf.eval(), where).eval()
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
    model's rows, rows routed to "b" the base model's (per row and per token routes alike)."""
    ids = _ids()
    targets = ["q_proj", "experts"]
    base_model, single_model, model = (from_pretrained(hf_dir).eval() for _ in range(3))
    single = LoRA(single_model, rank=4, alpha=8, target_modules=targets, seed=0)
    _trained(single)
    lora = LoRA(model, rank=4, alpha=8, target_modules=targets, seed=0, adapters=["a", "b"])
    lora.load(single.tensors(), adapter=0)
    with torch.no_grad():
        for p in lora.adapter_parameters(1):
            p.zero_()
        base, adapted = base_model(ids), single_model(ids)
        lora.route(torch.tensor([[0], [1]]))
        routed = model(ids)
        lora.route(torch.tensor([[1], [0]]).expand(2, ids.shape[1]))  # swapped, token by token
        swapped = model(ids)
    # Expert batches mix the two rows' tokens, so a row's matmuls may be blocked differently: 1e-6.
    assert (routed[0] - adapted[0]).abs().max() <= 1e-6 and (routed[1] - base[1]).abs().max() <= 1e-6
    assert (swapped[1] - adapted[1]).abs().max() <= 1e-6 and (swapped[0] - base[0]).abs().max() <= 1e-6
    assert (adapted[0] - base[0]).abs().max() > 1e-3  # the adapters matter
