"""Multi-token-prediction modules (miles/models/mtp.py: CausalLM.mtp, mtp_forward, new_mtp_cache) of every
family whose checkpoints carry them, at the shipped tiny sizes with model.mtp_layers=1.

References. transformers 5.24 does implement an MTP forward: `transformers.modeling_layers.MtpModel`
(behind `generate(use_mtp=True)`), wired for deepseek_v3 and glm4_moe, whose configs count
`num_mtp_layers`. It reads the MTP tensors of a checkpoint by their published names, so loading it
from our saved checkpoint checks names and math at once. Its layer is generic: given the same count
in the config (and the per-layer kind lists its get_mtp_config asks for) it also runs qwen3_next,
deepseek_v32 and glm4_moe_lite; not glm_moe_dsa, whose decoder layer returns a tuple that MtpModel does
not unpack. The second reference, for every family, is the published formula composed by hand from
the module's own sub-modules. Checkpoint names are checked against a literal list, against the
layout rules written out here, and by loading a checkpoint assembled by hand.

fp32 tolerance as in zoo_checks (1e-5: same math, another op order); Qwen3-Next's randomized
zero-centered norms (scales around 2) amplify rounding, as test_qwen3_next.py measures, hence 5e-5 there.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpModel

from miles.config.schema import ModelCfg
from miles.models import ArchConfig, CausalLM, from_pretrained, param_count, save_pretrained
from miles.models.config import MoEConfig, from_hf_config
from miles.models.context import ForwardContext
from zoo_checks import left_padded, max_diff, random_ids, randomize, tiny_hf_model

CONF_DIR = Path(__file__).resolve().parents[3] / "conf" / "model"
VOCAB = 64
TINY = {  # family -> its shipped tiny config
    "deepseek_v3": "deepseek_v3_tiny",  # MLA
    "deepseek_v32": "deepseek_v3_2_tiny",  # DSA
    "glm4_moe": "glm4_moe_tiny",  # GQA with q/k/v bias, QK-norm, partial rotary
    "glm4_moe_lite": "glm4_7_flash_tiny",  # MLA
    "glm_moe_dsa": "glm5_tiny",  # DSA, a shared-index layer
    "qwen3_next": "qwen3_next_tiny",  # gated attention block after gated DeltaNet layers
}
COPIES = {"deepseek_v3": True, "deepseek_v32": True, "glm4_moe": True, "glm4_moe_lite": True,
          "glm_moe_dsa": False}  # whether saves carry the MTP embedding / head copies (as the release)
# fp32 logits against transformers' on random weights: the two sum in different orders. DeepSeek-V3's
# MLA + MoE reached 1.25e-5 on an Intel Xeon (AVX-512 / AMX kernels), under 1e-5 on an AMD EPYC (AVX2).
ATOL = {"qwen3_next": 5e-5, "deepseek_v3": 5e-5}


def atol(family: str) -> float:
    return ATOL.get(family, 1e-5)


def tiny_arch(family: str, mtp_layers: int = 1) -> ArchConfig:
    """The shipped tiny config through the config schema, with model.mtp_layers set."""
    yaml = OmegaConf.load(CONF_DIR / f"{TINY[family]}.yaml")
    cfg = OmegaConf.merge(OmegaConf.structured(ModelCfg), yaml, {"mtp_layers": mtp_layers})
    return OmegaConf.to_object(cfg).arch(VOCAB)


def tiny_model(family: str, mtp_layers: int = 1, seed: int = 3) -> CausalLM:
    model = CausalLM(tiny_arch(family, mtp_layers), seed=0).eval()
    randomize(model, seed)
    return model


def mtp_names(names, arch) -> list[str]:
    """The checkpoint names of the MTP layers (both published layouts)."""
    return sorted(n for n in names if n.startswith((f"model.layers.{arch.num_layers}.", "mtp.")))


def inputs(model, batch=2, length=8, seed=1):
    """(hidden [B, T, H] of the main model, the tokens one ahead [B, T]) of random sequences."""
    ids = random_ids(VOCAB, batch, length + 1, seed)
    with torch.no_grad():
        hidden = model(ids, return_hidden=True)
    return hidden[:, :-1], ids[:, 1:]


# ------------------------------------------------------------------------------ checkpoint names
def test_save_writes_the_published_glm4_5_names(tmp_path):
    """GLM-4.5's MTP layer (there model.layers.92) as released: DeepSeek-V3's layout with GQA + bias."""
    model = tiny_model("glm4_moe")
    save_pretrained(model, tmp_path)
    names = mtp_names(load_file(tmp_path / "model.safetensors"), model.config)
    experts = [f"model.layers.3.mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("down", "gate", "up")]
    assert names == sorted(experts + [
        "model.layers.3.eh_proj.weight",
        "model.layers.3.embed_tokens.weight",
        "model.layers.3.enorm.weight",
        "model.layers.3.hnorm.weight",
        "model.layers.3.input_layernorm.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias",
        "model.layers.3.mlp.gate.weight",
        "model.layers.3.mlp.shared_experts.down_proj.weight",
        "model.layers.3.mlp.shared_experts.gate_proj.weight",
        "model.layers.3.mlp.shared_experts.up_proj.weight",
        "model.layers.3.post_attention_layernorm.weight",
        "model.layers.3.self_attn.k_norm.weight",
        "model.layers.3.self_attn.k_proj.bias",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.o_proj.weight",
        "model.layers.3.self_attn.q_norm.weight",
        "model.layers.3.self_attn.q_proj.bias",
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.v_proj.bias",
        "model.layers.3.self_attn.v_proj.weight",
        "model.layers.3.shared_head.head.weight",
        "model.layers.3.shared_head.norm.weight",
    ])
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize("family", sorted(TINY))
def test_save_writes_the_published_layout(family, tmp_path):
    """MTP names = the decoder tensors of a main MoE layer at the MTP index (Qwen3-Next: under mtp.layers.0)
    + the layout's own tensors; every other name as without MTP; the copies equal the main tensors."""
    model = tiny_model(family)
    arch, n = model.config, model.config.num_layers
    save_pretrained(model, tmp_path / "mtp")
    plain = CausalLM(dataclasses.replace(arch, mtp_layers=0))
    save_pretrained(plain, tmp_path / "plain")
    tensors = load_file(tmp_path / "mtp" / "model.safetensors")
    ours = mtp_names(tensors, arch)
    main = load_file(tmp_path / "plain" / "model.safetensors").keys()
    assert sorted(set(tensors) - set(ours)) == sorted(main)
    shared = set(arch.dsa.shared_layers) if arch.dsa else set()
    ref = max(i for i in range(n) if arch.is_moe_layer(i) and i not in shared
              and not (arch.linear_attn and arch.linear_attn.is_linear_layer(i)))
    block = [k.removeprefix(f"model.layers.{ref}.") for k in main if k.startswith(f"model.layers.{ref}.")]
    if family == "qwen3_next":
        want = ["mtp.layers.0." + k for k in block]
        want += [f"mtp.{k}.weight" for k in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")]
    else:
        extra = ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"]
        extra += ["embed_tokens.weight", "shared_head.head.weight"] if COPIES[family] else []
        want = [f"model.layers.{n}.{k}" for k in block + extra]
    assert ours == sorted(want)
    if COPIES.get(family):
        assert torch.equal(tensors[f"model.layers.{n}.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
        assert torch.equal(tensors[f"model.layers.{n}.shared_head.head.weight"], tensors["lm_head.weight"])


@pytest.mark.parametrize("family", sorted(TINY))
@torch.no_grad()
def test_round_trip_and_transformers_loads_ours(family, tmp_path):
    """save -> from_pretrained is bitwise; transformers' model loads the same checkpoint, leaves only
    MTP tensors unused (at real sizes its ignore patterns drop them silently) and gives our logits."""
    model = tiny_model(family)
    save_pretrained(model, tmp_path)
    loaded = from_pretrained(tmp_path)
    assert loaded.config == model.config
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"]
    unused = sorted(info["unexpected_keys"])
    if family == "qwen3_next":
        assert unused == []  # its ignore pattern is ^mtp.*
    else:
        assert unused and mtp_names(unused, model.config) == unused
    hf.config._attn_implementation = "eager"
    ids = random_ids(VOCAB, seed=5)
    assert max_diff(model(ids), hf.eval()(ids).logits) < atol(family)


def hand_written(model) -> dict[str, torch.Tensor]:
    """The MTP tensors of `model` under the published names, written out here independently of the
    family code (experts one matrix each, as released)."""
    arch, out = model.config, {}
    for name, t in model.state_dict().items():
        if not name.startswith("mtp.0."):
            continue
        part = name.removeprefix("mtp.0.")
        if arch.family == "qwen3_next":
            table = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight", "eh_proj.weight": "mtp.fc.weight",
                     "hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "norm.weight": "mtp.norm.weight"}
            prefix = "mtp.layers.0."
        else:
            table = {k: f"model.layers.{arch.num_layers}.{v}" for k, v in {
                "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                "norm.weight": "shared_head.norm.weight"}.items()}
            prefix = f"model.layers.{arch.num_layers}."
        if part in table:
            out[table[part]] = t.clone()
            continue
        part = part.removeprefix("block.")
        if part.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}{part[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate[e].clone()
                out[f"{prefix}{part[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up[e].clone()
        elif part.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{prefix}{part[:-len('down_proj')]}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[prefix + part] = t.clone()
    return out


@pytest.mark.parametrize("family", sorted(TINY))
def test_a_hand_written_published_checkpoint_loads(family, tmp_path):
    """The main model's checkpoint plus MTP tensors named by hand: with the embedding / head copies
    (DeepSeek-V3, GLM-4.5, GLM-4.7-Flash) and without (GLM-4.6+, GLM-5) both load exactly; a copy that
    differs from the main tensor is refused."""
    model = tiny_model(family)
    arch = model.config
    twin = CausalLM(dataclasses.replace(arch, mtp_layers=0))  # the main model alone
    twin.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    save_pretrained(twin, tmp_path)
    plain = load_file(tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(arch.to_hf_config()))
    variants = [hand_written(model)]
    if family != "qwen3_next":
        layer = f"model.layers.{arch.num_layers}."
        copies = {layer + "embed_tokens.weight": plain["model.embed_tokens.weight"].clone(),
                  layer + "shared_head.head.weight": plain["lm_head.weight"].clone()}
        variants.append({**variants[0], **copies})
    for extra in variants:
        save_file({**plain, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
        loaded = from_pretrained(tmp_path)
        a, b = model.state_dict(), loaded.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if family != "qwen3_next":
        bad = {**variants[1], layer + "shared_head.head.weight": plain["lm_head.weight"] + 1}
        save_file({**plain, **bad}, tmp_path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match="shared_head.head.weight differs from lm_head.weight"):
            from_pretrained(tmp_path)


# ------------------------------------------------------------------------------ the forward
@pytest.mark.parametrize("family", sorted(TINY))
@torch.no_grad()
def test_mtp_forward_is_the_published_formula(family):
    """logits = head(norm(block(eh_proj([enorm(embed(x_{t+1})) ; hnorm(h_t)])))), the block a full-attention
    MoE layer run on a fresh context, composed here from the module's own parts one by one."""
    model = tiny_model(family)
    layer = model.mtp[0]
    assert type(layer.block.mlp).__name__ == "MoE"
    assert layer.block.attn_name == "self_attn"  # Qwen3-Next: gated attention, though index 4 is a DeltaNet's
    if model.config.dsa:
        assert layer.block.attn.indexer is not None
    hidden, ids = inputs(model)
    x = layer.eh_proj(torch.cat((layer.enorm(model.embed_tokens(ids)), layer.hnorm(hidden)), dim=-1))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    out = layer.norm(layer.block(x, ForwardContext(positions, None, 0)))
    assert max_diff(model.mtp_forward(hidden, ids, return_hidden=True), out) == 0.0
    assert max_diff(model.mtp_forward(hidden, ids), model.lm_head(out)) == 0.0


def test_the_mtp_block_is_full_attention_and_moe_whatever_its_index_says():
    """As the checkpoints' MTP layers are (and SGLang / transformers build them): Qwen3-Next's pattern makes
    index num_layers a DeltaNet layer, dense-first rules past num_layers would make it dense."""
    arch = tiny_arch("qwen3_next")
    assert arch.linear_attn.is_linear_layer(arch.num_layers)
    assert type(CausalLM(arch).mtp[0].block.attn).__name__ == "GatedAttention"
    arch = tiny_arch("deepseek_v3")
    dense = CausalLM(dataclasses.replace(arch, moe=dataclasses.replace(arch.moe, first_k_dense=arch.num_layers + 1)))
    assert {type(layer.mlp).__name__ for layer in dense.layers} == {"SwiGLUMLP"}
    assert type(dense.mtp[0].block.mlp).__name__ == "MoE"


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "qwen3_next"])
@torch.no_grad()
def test_mtp_forward_equals_transformers_mtp_model(family, tmp_path):
    """transformers' MtpModel, loaded from our checkpoint by its own name conversions, gives our MTP
    output (positions of h_t on both sides). deepseek_v3 / glm4_moe: its supported path; the others get
    the MTP count (and the layer kinds of the MTP layer) that their transformers configs do not model."""
    model = tiny_model(family)
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    cfg = hf.config
    cfg.num_mtp_layers = 1
    if getattr(cfg, "layer_types", None) is not None:
        cfg.mtp_layer_types = ["full_attention"]
    if getattr(cfg, "mlp_layer_types", None) is not None:
        cfg.mtp_mlp_layer_types = ["sparse"]
    if family != "qwen3_next":  # its patterns name the released layer index (61, 92...), not ours
        hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{model.config.num_layers}\..*"]
    mtp = MtpModel.from_pretrained(hf).eval()
    mtp.config._attn_implementation = "eager"
    hidden, ids = inputs(model)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    theirs = mtp.forward_layer(0, hidden, positions, None, input_ids=ids)
    assert max_diff(model.mtp_forward(hidden, ids, return_hidden=True), theirs) < atol(family)
    assert max_diff(model.mtp_forward(hidden, ids), mtp._project_to_logits(theirs)) < atol(family)


def padded(rows: list[torch.Tensor], lens, width: int) -> torch.Tensor:
    """Left-pad each row's first lens[i] hidden vectors to `width` (zeros: never attended)."""
    out = torch.zeros(len(rows), width, rows[0].shape[-1])
    for i, n in enumerate(lens):
        out[i, width - n:] = rows[i][:n]
    return out


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next"])
@torch.no_grad()
def test_cached_decoding_equals_the_full_forward(family):
    """GQA, MLA, DSA (both indexer layouts), gated attention: a left-padded prefill through new_mtp_cache,
    a row reorder, then one token per step equal each sequence's full mtp_forward without a cache."""
    model = tiny_model(family)
    lens, new = (3, 5, 7), 4
    gen = torch.Generator().manual_seed(2)
    hs = [torch.randn(n + new, model.config.hidden_size, generator=gen) for n in lens]
    toks = [torch.randint(0, VOCAB, (n + new,), generator=gen) for n in lens]
    refs = [model.mtp_forward(h[None], t[None])[0] for h, t in zip(hs, toks)]
    ids, mask, pos = left_padded(toks, lens)
    width = ids.shape[1]
    cache = model.new_mtp_cache(len(lens), width + new)
    prefill = model.mtp_forward(padded(hs, lens, width), ids, attention_mask=mask, position_ids=pos, cache=cache)
    for i, n in enumerate(lens):
        assert max_diff(prefill[i, width - n:], refs[i][:n]) < atol(family)
    order = torch.arange(len(lens)).flip(0)
    cache.select(order)
    mask, pos = mask[order], pos[order][:, -1:] + 1
    for step in range(new):
        h = torch.stack([hs[i][lens[i] + step] for i in order.tolist()])[:, None]
        t = torch.stack([toks[i][lens[i] + step] for i in order.tolist()])[:, None]
        mask = torch.cat([mask, torch.ones(len(lens), 1, dtype=mask.dtype)], dim=1)
        out = model.mtp_forward(h, t, attention_mask=mask, position_ids=pos + step, cache=cache)[:, 0]
        for row, i in enumerate(order.tolist()):
            assert max_diff(out[row], refs[i][lens[i] + step]) < atol(family), (step, i)
    assert cache.length == width + new


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next"])
@torch.no_grad()
def test_mask_holes_in_the_cache_equal_the_sequence_without_them(family):
    """Speculative decoding's layout: drafts written into the cache, the rejected ones masked to 0 in the
    middle of the cached columns, decoding going on at the positions after the kept ones. Equals the
    forward of the kept sequence alone, with the same positions. Row 0 rejects all 3 drafts, row 1 keeps
    the first; the continuation comes as a 2-token chunk, then token by token."""
    model = tiny_model(family)
    size, n, prefix, drafts, keep = model.config.hidden_size, 8, 3, 3, (0, 1)
    gen = torch.Generator().manual_seed(4)
    hs, toks = torch.randn(2, n, size, generator=gen), torch.randint(0, VOCAB, (2, n), generator=gen)
    draft_h, draft_t = torch.randn(2, drafts, size, generator=gen), torch.randint(0, VOCAB, (2, drafts), generator=gen)
    cache = model.new_mtp_cache(2, prefix + drafts + n)
    mask = torch.ones(2, prefix, dtype=torch.long)
    model.mtp_forward(hs[:, :prefix], toks[:, :prefix], attention_mask=mask, cache=cache)
    mask = torch.cat([mask, torch.ones(2, drafts, dtype=torch.long)], dim=1)
    model.mtp_forward(draft_h, draft_t, attention_mask=mask, cache=cache)
    for row, k in enumerate(keep):
        mask[row, prefix + k:] = 0
    outs, start = [], prefix
    for chunk in (2, *[1] * (n - prefix - 2)):
        mask = torch.cat([mask, torch.ones(2, chunk, dtype=torch.long)], dim=1)
        pos = torch.tensor([[k + start + j for j in range(chunk)] for k in keep])
        outs.append(model.mtp_forward(hs[:, start:start + chunk], toks[:, start:start + chunk],
                                      attention_mask=mask, position_ids=pos, cache=cache))
        start += chunk
    outs = torch.cat(outs, dim=1)
    assert (mask[:, prefix:prefix + drafts] == 0).any(-1).all()  # holes in the middle of both rows
    for row, k in enumerate(keep):
        h = torch.cat([hs[row, :prefix], draft_h[row, :k], hs[row, prefix:]])[None]
        t = torch.cat([toks[row, :prefix], draft_t[row, :k], toks[row, prefix:]])[None]
        ref = model.mtp_forward(h, t)[0, prefix + k:]
        assert max_diff(outs[row], ref) < atol(family), row


@torch.no_grad()
def test_chained_depths_take_the_previous_depth_output():
    """Depth 1 runs on depth 0's return_hidden output with its own cache; both depths' logits are the
    shared head of that output; cached decoding of depth 1 equals its full forward."""
    model = tiny_model("deepseek_v3", mtp_layers=2)
    hidden, ids = inputs(model, length=9)
    g0 = model.mtp_forward(hidden[:, :-1], ids[:, :-1], return_hidden=True)
    assert max_diff(model.mtp_forward(hidden[:, :-1], ids[:, :-1]), model.logits_from_hidden(g0)) == 0.0
    full = model.mtp_forward(g0, ids[:, 1:], depth=1)
    cache = model.new_mtp_cache(2, 8, depth=1)
    steps = [model.mtp_forward(g0[:, :5], ids[:, 1:6], depth=1, cache=cache)]
    steps += [model.mtp_forward(g0[:, i:i + 1], ids[:, i + 1:i + 2], depth=1, cache=cache) for i in range(5, 8)]
    assert max_diff(torch.cat(steps, dim=1), full) < 1e-5
    assert not torch.equal(model.mtp[0].eh_proj.weight, model.mtp[1].eh_proj.weight)
    with pytest.raises(ValueError, match="depth 2"):
        model.mtp_forward(g0, ids[:, 1:], depth=2)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_detach_embedding_keeps_gradients_out_of_the_embedding(family):
    model = tiny_model(family)
    hidden, ids = inputs(model)
    hidden.requires_grad_(True)
    model.mtp_forward(hidden, ids, detach_embedding=True).logsumexp(-1).sum().backward()
    trainable = {n: p for n, p in model.named_parameters() if n.startswith("mtp.") and p.requires_grad}
    assert trainable and all(p.grad is not None for p in trainable.values())
    assert model.embed_tokens.weight.grad is None and hidden.grad is not None
    model.zero_grad()
    model.mtp_forward(hidden, ids).logsumexp(-1).sum().backward()  # control: without it, the embedding learns
    assert model.embed_tokens.weight.grad is not None and model.embed_tokens.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------ config and construction
@pytest.mark.parametrize("family", sorted(TINY))
def test_config_json_carries_the_mtp_count(family):
    arch = tiny_arch(family)
    assert arch.mtp_layers == 1
    assert from_hf_config(arch.to_hf_config()) == arch
    assert arch.to_hf_config()["num_nextn_predict_layers"] == 1
    assert tiny_arch(family, 0).to_hf_config()["num_nextn_predict_layers"] == 0
    assert param_count(arch) == param_count(tiny_arch(family, 0))  # MTP left out, total and active


def test_qwen3_next_reads_qwen3_5s_spelling_too():
    d = tiny_arch("qwen3_next", 0).to_hf_config()
    del d["num_nextn_predict_layers"]
    assert from_hf_config(d).mtp_layers == 0  # the released config.json names no count
    assert from_hf_config({**d, "mtp_num_hidden_layers": 1}).mtp_layers == 1


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_init_weights_covers_the_mtp_modules(family):
    """Norms 1 (Qwen3-Next's zero-centered ones 0), matrices ~ N(0, 0.02), as the main model's."""
    model = CausalLM(tiny_arch(family), seed=0)
    layer, unit = model.mtp[0], 0.0 if family == "qwen3_next" else 1.0
    for norm in (layer.enorm, layer.hnorm, layer.norm, layer.block.input_layernorm):
        assert torch.equal(norm.weight, torch.full_like(norm.weight, unit))
    assert abs(layer.eh_proj.weight.std().item() - 0.02) < 2e-3
    assert abs(layer.block.mlp.experts.gate_up_proj.std().item() - 0.02) < 2e-3
    plain = CausalLM(tiny_arch(family, 0), seed=0)  # MTP built last: the same seed, the same main weights
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in plain.state_dict().items())


@torch.no_grad()
def test_a_transformers_checkpoint_without_mtp_tensors_loads_without_mtp(tmp_path):
    """transformers 5 saves DeepSeek-V3 with num_nextn_predict_layers: 1 but no MTP tensors (its MTP model
    is separate): such a checkpoint loads as the main model alone."""
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
              topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=64)
    hf = tiny_hf_model(transformers.DeepseekV3Config(**kw))
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    ours = from_pretrained(tmp_path)
    assert ours.config.mtp_layers == 0 and ours.mtp is None
    ids = random_ids(VOCAB)
    assert max_diff(ours(ids), hf(ids).logits) < 1e-5


def test_families_without_mtp_modules_refuse_mtp_layers():
    def arch(**kw):
        return ArchConfig(vocab_size=VOCAB, **kw)

    with pytest.raises(ValueError, match="family qwen3 has no MTP modules.*set mtp_layers: 0"):
        arch(family="qwen3", mtp_layers=1)
    with pytest.raises(ValueError, match="family qwen3_moe has no MTP modules"):
        arch(family="qwen3_moe", moe=MoEConfig(), mtp_layers=1)
    with pytest.raises(ValueError, match=r"minimax_m2: the checkpoint's MTP modules \(model.mtp...\) are not"):
        dataclasses.replace(tiny_arch_of("minimax_m2_tiny"), mtp_layers=1)
    with pytest.raises(ValueError, match="mtp_layers must be 0 or 1"):
        dataclasses.replace(tiny_arch("qwen3_next"), mtp_layers=2)
    with pytest.raises(ValueError, match="mtp_layers must be >= 0"):
        arch(family="qwen3", mtp_layers=-1)
    with pytest.raises(ValueError, match="no MTP modules: set mtp_layers > 0"):
        CausalLM(arch(family="qwen3")).mtp_forward(torch.zeros(1, 2, 64), torch.zeros(1, 2, dtype=torch.long))


def tiny_arch_of(name: str) -> ArchConfig:
    cfg = OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF_DIR / f"{name}.yaml"))
    return OmegaConf.to_object(cfg).arch(VOCAB)


def test_mtp_forward_checks_the_hidden_shape():
    model = tiny_model("glm4_moe")
    with pytest.raises(ValueError, match="hidden must have shape"):
        model.mtp_forward(torch.zeros(2, 3, model.config.hidden_size), torch.zeros(2, 4, dtype=torch.long))
