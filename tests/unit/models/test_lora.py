"""LoRA adapters (miles/models/lora.py, lora_peft.py) against hand-computed values and PEFT itself.

- a fresh adapter (B = 0) leaves the logits bit for bit as the base model's;
- one adapted projection equals W x + alpha / r * B A x computed by hand;
- the merged weights give the unmerged logits (fp32, 1e-5) and are put back exactly afterwards;
- an adapter saved in PEFT's format loads with `peft.PeftModel.from_pretrained` on the transformers
  Qwen3 (a transformers-saved checkpoint) and gives this model's logits (fp32, <= 1e-5), and loads back;
- several adapters: rows routed to an adapter holding a single-adapter LoRA's weights are that model's
  rows bit for bit, rows routed to an all-zero adapter the base model's (per row, per token, and
  through a projection whose input is flattened); PEFT loads each adapter of a run from its directory.
"""

import pytest
import torch
import transformers

from miles.models import from_pretrained
from miles.models.lora import ALL_PROJECTIONS, LoRA, find_targets
from miles.models.lora_peft import load_peft, save_peft

VOCAB = 64


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen3 saved by transformers, weights randomized (norms around 1)."""
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    out = tmp_path_factory.mktemp("qwen3_hf")
    model.save_pretrained(out)
    return out


def _ids():
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


def _trained(lora: LoRA, seed: int = 3) -> None:
    """Random B (and A) as if trained: every adapter changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_fresh_adapter_is_the_base_model_exactly(hf_dir):
    model = from_pretrained(hf_dir).eval()
    ids = _ids()
    base = model(ids)
    lora = LoRA(model, rank=8, alpha=16, seed=0)
    assert len(lora.names) == 2 * len(ALL_PROJECTIONS)
    assert all(a.abs().sum() > 0 for a in lora.lora_A)  # A drawn, B zero: the product is zero
    assert torch.equal(model(ids), base)


def test_one_projection_by_hand(hf_dir):
    model = from_pretrained(hf_dir).eval()
    lora = LoRA(model, rank=4, alpha=8, target_modules=[r"layers\.0\.self_attn\.q_proj"], seed=0)
    assert lora.names == ["layers.0.self_attn.q_proj"]
    _trained(lora)
    q = model.layers[0].self_attn.q_proj
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    want = x @ q.weight.T + 2.0 * (x @ lora.lora_A[0].T @ lora.lora_B[0].T)
    torch.testing.assert_close(q(x), want, atol=1e-6, rtol=0)


def test_targets_by_name_and_regex_and_a_clear_error(hf_dir):
    model = from_pretrained(hf_dir)
    assert [n for n, _ in find_targets(model, ["v_proj"])] == ["layers.0.self_attn.v_proj", "layers.1.self_attn.v_proj"]
    assert len(find_targets(model, [r"layers\.1\..*_proj"])) == 7
    assert find_targets(model, ["lm_head"]) == []  # the head is not a decoder projection
    with pytest.raises(ValueError, match="matches no projection.*q_proj"):
        LoRA(model, rank=4, alpha=8, target_modules=["qkv"])


def test_merged_weights_give_the_same_logits_and_are_restored(hf_dir):
    model = from_pretrained(hf_dir).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lora = LoRA(model, rank=8, alpha=16, seed=0)
    _trained(lora)
    ids = _ids()
    unmerged = model(ids)
    with lora.merged():
        merged = model(ids)
        assert not torch.equal(model.layers[0].mlp.up_proj.weight, before["layers.0.mlp.up_proj.weight"])
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert torch.equal(model(ids), unmerged)


def test_peft_loads_the_adapter_with_the_same_logits(hf_dir, tmp_path):
    peft = pytest.importorskip("peft")
    model = from_pretrained(hf_dir).eval()
    lora = LoRA(model, rank=8, alpha=16, seed=0)
    _trained(lora)
    save_peft(lora, model.config, tmp_path / "adapter")
    ids = _ids()
    ours = model(ids)

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    peft_model = peft.PeftModel.from_pretrained(hf.eval(), tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    assert (theirs - ours).abs().max().item() <= 1e-5
    with peft_model.disable_adapter(), torch.no_grad():  # the adapter matters: without it they differ
        assert (peft_model(input_ids=ids).logits - ours).abs().max().item() > 1e-3

    # Back into a fresh LoRA of the same shape: the same tensors.
    again = LoRA(from_pretrained(hf_dir), rank=8, alpha=16, seed=1)
    load_peft(again, model.config, tmp_path / "adapter")
    assert all(torch.equal(again.tensors()[k], v) for k, v in lora.tensors().items())
    with pytest.raises(ValueError, match="rank 8"):
        load_peft(LoRA(from_pretrained(hf_dir), rank=4, alpha=16), model.config, tmp_path / "adapter")


@pytest.mark.parametrize("name, rank, bound", [("qwen3_0_6b", 8, 0.05), ("qwen3_4b", 16, 0.05), ("qwen3_tiny", 8, 0.11)])
def test_adapter_bytes_against_the_model(compose, name, rank, bound):
    """What a sync carries at rank r on every projection, against the whole model's bytes (shapes
    only: built on the meta device). ~2r / hidden of the projections: under 5% at real widths; the
    128-wide qwen3_tiny carries ~10% at rank 8."""
    from miles.models import CausalLM

    arch = compose([f"model={name}"]).model.arch(vocab_size=151936 if name != "qwen3_tiny" else 32)
    with torch.device("meta"):
        model = CausalLM(arch)
    lora = LoRA(model, rank=rank, alpha=2 * rank)
    ratio = lora.num_bytes() / sum(p.numel() * p.element_size() for p in model.parameters())
    assert ratio <= bound
    print(f"{name} rank {rank}: adapters {lora.num_bytes() / 2**20:.2f} MiB, {ratio:.2%} of the model")


# ------------------------------------------------------------------ several adapters over one base

def test_two_adapters_route_rows_exactly(hf_dir):
    """Adapter "a" holds a single-adapter LoRA's weights, "b" is all zero: rows routed to "a" are that
    model's rows bit for bit, rows routed to "b" the base model's; per-token routes and flattened
    inputs (an MoE's shared expert) route the same."""
    ids = _ids()
    base_model = from_pretrained(hf_dir).eval()
    single_model = from_pretrained(hf_dir).eval()
    single = LoRA(single_model, rank=8, alpha=16, seed=0)
    _trained(single)
    model = from_pretrained(hf_dir).eval()
    lora = LoRA(model, rank=8, alpha=16, seed=0, adapters=["a", "b"])
    assert set(lora.tensors()) == {f"{a}/{k}" for a in "ab" for k in single.tensors()}
    lora.load(single.tensors(), adapter=0)
    with torch.no_grad():
        for p in lora.adapter_parameters(1):
            p.zero_()
    with torch.no_grad():
        base, adapted = base_model(ids), single_model(ids)
        lora.route(torch.tensor([[0], [1]]))
        routed = model(ids)
        lora.route(torch.tensor([[0], [1]]).expand(2, ids.shape[1]))  # the same route, token by token
        per_token = model(ids)
    assert torch.equal(routed[0], adapted[0]) and torch.equal(routed[1], base[1])
    assert not torch.equal(adapted[0], base[0])  # the adapter matters
    assert torch.equal(per_token, routed)
    q, single_q = model.layers[0].self_attn.q_proj, single_model.layers[0].self_attn.q_proj
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4))
    lora.route(torch.tensor([[0], [1]]))
    with torch.no_grad():  # the same [18, 32] matmuls on both sides: bit for bit
        flat, alone = q(x.reshape(18, 32)).view(2, 9, -1), single_q(x.reshape(18, 32)).view(2, 9, -1)
        assert torch.equal(flat[0], alone[0]) and torch.equal(flat[1], (x.reshape(18, 32) @ q.weight.T)[9:])


def test_several_adapters_need_a_route_and_do_not_merge(hf_dir):
    model = from_pretrained(hf_dir).eval()
    lora = LoRA(model, rank=4, alpha=8, adapters=["a", "b"])
    with pytest.raises(RuntimeError, match="no route set"):
        model(_ids())
    with pytest.raises(ValueError, match="cannot be merged"), lora.merged():
        pass


def test_peft_loads_each_adapter_of_a_run(hf_dir, tmp_path):
    """Two adapters saved as a run saves them (adapter/<name>/, miles/trainer/lora.py): PEFT loads each
    on the transformers Qwen3 with the logits of this model routed to it (fp32, <= 1e-5); they load back."""
    peft = pytest.importorskip("peft")
    from miles.trainer.lora import load_adapter, save_adapter

    model = from_pretrained(hf_dir).eval()
    lora = LoRA(model, rank=8, alpha=16, seed=0, adapters=["add", "mul"])
    _trained(lora)
    save_adapter(lora, model, tmp_path)
    ids = _ids()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    logits = []
    for k, name in enumerate(lora.adapter_names):
        lora.route(torch.full((ids.shape[0], 1), k))
        with torch.no_grad():
            ours = model(ids)
        peft_model = peft.PeftModel.from_pretrained(hf.eval(), tmp_path / "adapter" / name).eval()
        with torch.no_grad():
            theirs = peft_model(input_ids=ids).logits
        assert (theirs - ours).abs().max().item() <= 1e-5
        hf = peft_model.unload()  # the bare transformers model again, for the next adapter
        logits.append(ours)
    assert (logits[0] - logits[1]).abs().max().item() > 1e-3  # two different adapters

    again = LoRA(from_pretrained(hf_dir), rank=8, alpha=16, seed=1, adapters=["add", "mul"])
    load_adapter(again, model, tmp_path)
    assert all(torch.equal(again.tensors()[k], v) for k, v in lora.tensors().items())
