"""Online draft training (miles/trainer/draft.py, TorchTrainer's `speculative`): a separate draft model
and the policy's MTP modules. Losses and accuracies against direct full-logits computations, the
draft learning a fixed batch, gradients kept out of everything the policy owns, the policy optimizer
without MTP parameters, weight sync of the draft, resume and offload bit for bit."""

import copy

import pytest
import torch

from miles.config.schema import AlgoCfg, AlgoName, DType, ModelCfg, PrecisionCfg, SpeculativeCfg, TrainerCfg
from miles.models import CausalLM, from_pretrained, save_pretrained
from miles.models.config import ArchConfig
from miles.orchestrate.checkpoints import random_checkpoint
from miles.orchestrate.resume import load_component_state, save_component_state
from miles.transport.checksum import checksum
from miles.trainer import offload as off
from miles.trainer.torch_trainer import TorchTrainer

FP32 = PrecisionCfg(name="fp32")
BF16 = PrecisionCfg(name="bf16", train_dtype=DType.bf16, rollout_dtype=DType.bf16)
CFG = TrainerCfg(lr=1e-2, global_batch_size=16, micro_batch_size=4)  # 4 micro-batches of the 16 samples
GRPO = AlgoCfg(name=AlgoName.grpo)
DRAFT = SpeculativeCfg(kind="draft_model", lr=1e-2)
MTP = SpeculativeCfg(kind="mtp", lr=1e-2)
HAS_MTP = hasattr(CausalLM, "mtp_forward")
needs_mtp = pytest.mark.skipif(not HAS_MTP, reason="CausalLM.mtp_forward (MTP modules) not implemented yet")


def draft_trainer(ckpt, draft_ckpt, precision=FP32, **kw):
    return TorchTrainer(ckpt, GRPO, CFG, precision, speculative=DRAFT, draft_dir=draft_ckpt, **kw)


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]


def masked_mean(x, mask):
    return float((x * mask).sum() / mask.sum())


@torch.no_grad()
def next_token_reference(model, batch, temperature=1.0):
    """(token-mean NLL, accuracy) of the next token at the loss mask, from the whole logits."""
    logits = model(batch.tokens[:, :-1]).double() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    hits = (logits.argmax(-1) == batch.tokens[:, 1:]).double()
    mask = batch.loss_mask.double()
    return -masked_mean(logp, mask), masked_mean(hits, mask)


# ------------------------------------------------------------------------------ draft_model
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_draft_model_loss_is_the_next_token_nll(ckpt, draft_ckpt, rollout_batch, temperature):
    trainer = draft_trainer(ckpt, draft_ckpt, temperature=temperature)
    nll, _ = next_token_reference(from_pretrained(draft_ckpt), rollout_batch, temperature)
    m = trainer.train_rl(rollout_batch)
    assert m["spec/draft_loss"] == pytest.approx(nll, rel=1e-5)
    assert m["spec/draft_grad_norm"] > 0


def test_draft_model_learns_and_its_accuracy_is_a_hand_count(ckpt, draft_ckpt, rollout_batch):
    trainer = draft_trainer(ckpt, draft_ckpt)
    losses = [trainer.draft.train(rollout_batch)["spec/draft_loss"] for _ in range(20)]
    assert losses[-1] < 0.5 * losses[0]
    nll, accuracy = next_token_reference(copy.deepcopy(trainer.draft.model), rollout_batch)
    m = trainer.draft.train(rollout_batch)  # metrics of the draft before this step
    assert 0.0 < accuracy < 1.0  # a count that a wrong mask or alignment would change
    assert m["spec/draft_accuracy"] == pytest.approx(accuracy, abs=1e-6)  # fp32 of k / n
    assert m["spec/draft_loss"] == pytest.approx(nll, rel=1e-5)


def test_draft_model_leaves_the_policy_as_without_a_draft(ckpt, draft_ckpt, rollout_batch):
    plain, drafted = TorchTrainer(ckpt, GRPO, CFG, FP32), draft_trainer(ckpt, draft_ckpt)
    before = params(drafted.draft.model)
    m_plain, m_drafted = plain.train_rl(rollout_batch), drafted.train_rl(rollout_batch)
    spec = {k: m_drafted.pop(k) for k in list(m_drafted) if k.startswith("spec/")}
    assert set(spec) == {"spec/draft_loss", "spec/draft_accuracy", "spec/draft_grad_norm"}
    assert not any(k.startswith("spec/") for k in m_plain)
    assert m_drafted == m_plain
    assert_bitwise(params(drafted.model), params(plain.model))
    after = params(drafted.draft.model)
    assert all(not torch.equal(before[k], after[k]) for k in before)  # every draft parameter trained
    policy_params = {id(p) for p in drafted.model.parameters()}
    held = [p for g in drafted.draft.optimizer.param_groups for p in g["params"]]
    assert held and not any(id(p) in policy_params for p in held)


def test_frozen_or_no_draft_builds_nothing(ckpt, draft_ckpt, rollout_batch):
    frozen = TorchTrainer(ckpt, GRPO, CFG, FP32, speculative=SpeculativeCfg(kind="draft_model", train_online=False),
                          draft_dir=draft_ckpt)
    none = TorchTrainer(ckpt, GRPO, CFG, FP32, speculative=SpeculativeCfg(kind="none"))
    for trainer in (frozen, none):
        assert trainer.draft is None
        assert not any(k.startswith("spec/") for k in trainer.train_rl(rollout_batch))


def test_draft_configuration_errors(ckpt, tmp_path):
    with pytest.raises(ValueError, match="draft_dir"):
        TorchTrainer(ckpt, GRPO, CFG, FP32, speculative=DRAFT)
    with pytest.raises(ValueError, match="kind"):
        TorchTrainer(ckpt, GRPO, CFG, FP32, speculative=SpeculativeCfg(kind="eagle"))
    with pytest.raises(ValueError, match="model.mtp_layers"):
        TorchTrainer(ckpt, GRPO, CFG, FP32, speculative=MTP)
    other = ModelCfg(name="o", hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=8, max_position_embeddings=64)
    wrong_vocab = random_checkpoint(other, "0123456789", 0, tmp_path / "other")
    with pytest.raises(ValueError, match="vocab_size"):
        TorchTrainer(ckpt, GRPO, CFG, FP32, speculative=DRAFT, draft_dir=str(wrong_vocab))


def test_fsdp_refuses_online_draft_training_before_any_process_group(ckpt, draft_ckpt):
    import torch.distributed as dist

    from miles.trainer.fsdp import FSDPTrainer

    with pytest.raises(ValueError, match="train_online=false"):
        FSDPTrainer(0, 1, "127.0.0.1", 1, ckpt, GRPO, CFG, FP32, speculative=DRAFT, draft_dir=draft_ckpt)
    assert not dist.is_initialized()


def test_sft_trains_the_draft_too(ckpt, draft_ckpt, rollout_batch):
    trainer = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.sft, policy_loss="nll"), CFG, FP32, speculative=DRAFT,
                           draft_dir=draft_ckpt)
    nll, _ = next_token_reference(from_pretrained(draft_ckpt), rollout_batch)
    first = trainer.train_sft(rollout_batch)
    assert first["spec/draft_loss"] == pytest.approx(nll, rel=1e-5)
    assert trainer.train_sft(rollout_batch)["spec/draft_loss"] < first["spec/draft_loss"]


def test_get_draft_weights_in_the_rollout_dtype(ckpt, draft_ckpt, rollout_batch, tmp_path):
    trainer = draft_trainer(ckpt, draft_ckpt, precision=BF16)
    trainer.train_rl(rollout_batch)
    weights, digest = trainer.get_draft_weights()
    assert weights.keys() == trainer.draft.model.state_dict().keys()
    assert all(w.dtype == torch.bfloat16 and w.device.type == "cpu" for w in weights.values())
    assert digest == checksum(weights)
    for k, w in trainer.draft.model.state_dict().items():
        assert torch.equal(weights[k], w.to(torch.bfloat16)), k
    trainer.save_draft(str(tmp_path / "draft"))
    assert_bitwise(params(from_pretrained(tmp_path / "draft")), params(trainer.draft.model))
    with pytest.raises(ValueError, match="draft_model"):
        TorchTrainer(ckpt, GRPO, CFG, FP32).get_draft_weights()


def test_resume_continues_the_draft_bit_for_bit(ckpt, draft_ckpt, rollout_batch, tmp_path):
    a = draft_trainer(ckpt, draft_ckpt)
    for _ in range(2):
        a.train_rl(rollout_batch)
    save_component_state(a, str(tmp_path), "trainer")
    b, fresh = draft_trainer(ckpt, draft_ckpt), draft_trainer(ckpt, draft_ckpt)
    load_component_state(b, str(tmp_path), "trainer")
    load_component_state(fresh, str(tmp_path), "trainer")
    fresh.draft = draft_trainer(ckpt, draft_ckpt).draft  # the control: the policy resumed, the draft not
    metrics = [[t.train_rl(rollout_batch) for _ in range(3)] for t in (a, b, fresh)]
    assert metrics[0] == metrics[1]
    assert_bitwise(params(b.draft.model), params(a.draft.model))
    assert_bitwise(params(b.model), params(a.model))
    assert not torch.equal(fresh.draft.model.embed_tokens.weight, a.draft.model.embed_tokens.weight)


def test_offload_and_onload_keep_the_draft(ckpt, draft_ckpt, rollout_batch, monkeypatch):
    monkeypatch.setattr(off, "FORCE_COPY", True)  # every move a fresh copy, as on a GPU
    plain, offloaded = draft_trainer(ckpt, draft_ckpt), draft_trainer(ckpt, draft_ckpt)
    plain.train_rl(rollout_batch)
    offloaded.train_rl(rollout_batch)
    draft_params = list(offloaded.draft.model.parameters())
    sizes = offloaded.offload_bytes()
    draft_bytes = sum(t.numel() * t.element_size() for t in draft_params)
    policy_bytes = sum(t.numel() * t.element_size()
                       for t in (*offloaded.model.parameters(), *offloaded.model.buffers()))
    assert sizes["params"] == policy_bytes + draft_bytes + sum(b.numel() * b.element_size()
                                                               for b in offloaded.draft.model.buffers())
    adam = lambda o: sum(v.numel() * v.element_size() for s in o.state.values() for v in s.values())  # noqa: E731
    assert sizes["optimizer"] == adam(offloaded.optimizer) + adam(offloaded.draft.optimizer)
    assert sizes["grads"] >= draft_bytes  # the draft's gradients are counted with the policy's
    offloaded.offload()
    assert all(p.grad is None for p in draft_params)
    with pytest.raises(RuntimeError, match="onload"):
        offloaded.get_draft_weights()
    offloaded.onload()
    assert list(offloaded.draft.model.parameters()) == draft_params
    assert plain.train_rl(rollout_batch) == offloaded.train_rl(rollout_batch)
    assert_bitwise(params(offloaded.draft.model), params(plain.draft.model))
    assert_bitwise(params(offloaded.model), params(plain.model))


# ------------------------------------------------------------------------------ mtp
def mtp_arch(vocab: int, mtp_layers: int) -> ArchConfig:
    """A tiny GLM-4.5 (dense first layer, then MoE) with `mtp_layers` MTP modules."""
    from miles.models.config import MoEConfig

    moe = MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, scoring="sigmoid",
                    score_correction_bias=True, num_shared_experts=1, first_k_dense=1)
    return ArchConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, family="glm4_moe", attention_bias=True, partial_rotary_factor=0.5,
                      max_position_embeddings=64, mtp_layers=mtp_layers, moe=moe)


@pytest.fixture(scope="module", params=[1, 2], ids=["mtp1", "mtp2"])
def mtp_ckpt(request, ckpt, tmp_path_factory):
    if not HAS_MTP:
        pytest.skip("CausalLM.mtp_forward (MTP modules) not implemented yet")
    out = tmp_path_factory.mktemp(f"mtp{request.param}")
    torch.manual_seed(2)
    save_pretrained(CausalLM(mtp_arch(from_pretrained(ckpt).config.vocab_size, request.param)), out)
    return str(out)


def mtp_trainer(mtp_ckpt, precision=FP32, spec=MTP, algo=GRPO, **kw):
    return TorchTrainer(mtp_ckpt, algo, CFG, precision, speculative=spec, **kw)


@torch.no_grad()
def mtp_reference(policy, batch) -> list[tuple[float, float]]:
    """Per depth j: (token-mean NLL, accuracy) of tokens[:, t + 2 + j] at loss_mask[:, t + 1 + j], from
    the MTP's whole logits through the model's own head, on the batch's full rows."""
    tokens, mask = batch.tokens, batch.loss_mask.double()
    hidden = policy(tokens, return_hidden=True)[:, :-1]  # position t: h_t, whose next token is tokens[t + 1]
    out = []
    for j in range(len(policy.mtp)):
        logits = policy.mtp_forward(hidden, tokens[:, j + 1:], depth=j)[:, :-1].double()  # [N, T - 2 - j, V]
        targets = tokens[:, j + 2:]
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
        hits = (logits.argmax(-1) == targets).double()
        out.append((-masked_mean(logp, mask[:, j + 1:]), masked_mean(hits, mask[:, j + 1:])))
        hidden = policy.mtp_forward(hidden, tokens[:, j + 1:], depth=j, return_hidden=True)[:, :-1]
    return out


def split(model) -> tuple[dict, dict]:
    """(MTP tensors, every other tensor) of the policy's state dict, cloned."""
    state = params(model)
    return ({k: v for k, v in state.items() if k.startswith("mtp.")},
            {k: v for k, v in state.items() if not k.startswith("mtp.")})


@needs_mtp
def test_mtp_loss_and_accuracy_are_the_hand_computed_ones(mtp_ckpt, rollout_batch):
    trainer = mtp_trainer(mtp_ckpt)
    for _ in range(10):  # a trained MTP: an accuracy strictly between 0 and 1 to count
        trainer.draft.train(rollout_batch)
    ref = mtp_reference(copy.deepcopy(trainer.model), rollout_batch)
    m = trainer.draft.train(rollout_batch)
    assert m["spec/draft_loss"] == pytest.approx(sum(nll for nll, _ in ref) / len(ref), rel=1e-5)
    assert m["spec/draft_accuracy"] == pytest.approx(sum(acc for _, acc in ref) / len(ref), abs=1e-6)
    assert 0.0 < ref[0][1] < 1.0
    if len(ref) > 1:  # DeepSeek-V3's average over depths, and each depth on its own
        for j, (nll, acc) in enumerate(ref):
            assert m[f"spec/draft_loss_depth{j}"] == pytest.approx(nll, rel=1e-5)
            assert m[f"spec/draft_accuracy_depth{j}"] == pytest.approx(acc, abs=1e-6)


@needs_mtp
def test_mtp_trains_on_the_updated_policy_and_leaves_the_policy_as_without(mtp_ckpt, rollout_batch):
    drafted, plain = mtp_trainer(mtp_ckpt), mtp_trainer(mtp_ckpt, spec=None)
    before = mtp_reference(copy.deepcopy(plain.model), rollout_batch)
    m_drafted, m_plain = drafted.train_rl(rollout_batch), plain.train_rl(rollout_batch)
    spec = {k: m_drafted.pop(k) for k in list(m_drafted) if k.startswith("spec/")}
    assert m_drafted == m_plain and not any(k.startswith("spec/") for k in m_plain)
    assert_bitwise(split(drafted.model)[1], split(plain.model)[1])  # the same policy update
    # the draft's loss is that of the untrained MTP on the updated policy's hidden states (plain's)
    after = mtp_reference(plain.model, rollout_batch)
    expected = sum(nll for nll, _ in after) / len(after)
    assert spec["spec/draft_loss"] == pytest.approx(expected, rel=1e-5)
    assert abs(expected - sum(nll for nll, _ in before) / len(before)) > 1e-4  # the pre-update one differs


@needs_mtp
@pytest.mark.parametrize("precision", [FP32, BF16], ids=["fp32", "bf16"])
def test_mtp_learns_a_fixed_batch(mtp_ckpt, rollout_batch, precision):
    trainer = mtp_trainer(mtp_ckpt, precision)
    losses = [trainer.draft.train(rollout_batch)["spec/draft_loss"] for _ in range(20)]
    # Slower than the draft model: the frozen random head (std 0.02) behind the MTP's final norm caps
    # the logits' scale, which only the norm's weight can raise (about 3.0 -> 2.4 in 20 steps).
    assert losses[-1] < 0.85 * losses[0]


@needs_mtp
def test_mtp_step_touches_only_the_mtp_modules(mtp_ckpt, rollout_batch):
    trainer = mtp_trainer(mtp_ckpt)
    mtp_before, rest_before = split(trainer.model)
    trainer.draft.train(rollout_batch)
    mtp_after, rest_after = split(trainer.model)
    assert mtp_before and all(not torch.equal(mtp_before[k], mtp_after[k])
                              for k in mtp_before if not k.endswith("e_score_correction_bias"))
    assert_bitwise(rest_after, rest_before)  # embedding, lm_head, every decoder layer, final norm
    # and no gradient reached them (the next policy step would see none either)
    assert all(p.grad is None for name, p in trainer.model.named_parameters() if not name.startswith("mtp."))


@needs_mtp
def test_policy_optimizer_holds_no_mtp_parameter(mtp_ckpt, rollout_batch):
    for spec in (MTP, SpeculativeCfg(kind="mtp", train_online=False), None):
        trainer = mtp_trainer(mtp_ckpt, spec=spec)
        mtp_ids = {id(p) for p in trainer.model.mtp.parameters()}
        held = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        assert len(held) == sum(1 for n, _ in trainer.model.named_parameters() if not n.startswith("mtp."))
        assert not any(id(p) in mtp_ids for p in held)
        if spec is None or not spec.train_online:
            assert trainer.draft is None
            mtp_before, rest_before = split(trainer.model)
            m = trainer.train_rl(rollout_batch)
            mtp_after, rest_after = split(trainer.model)
            assert_bitwise(mtp_after, mtp_before)  # no optimizer moves them
            assert any(not torch.equal(rest_before[k], rest_after[k]) for k in rest_before)  # the policy did
            assert not any(k.startswith("spec/") for k in m)
    # the policy's grad clip sees no MTP gradient either
    trainer.model.zero_grad(set_to_none=True)
    for p in trainer.model.mtp.parameters():
        p.grad = torch.ones_like(p)
    assert float(trainer._clip_grad_norm(float("inf"))) == 0.0


@needs_mtp
def test_mtp_rides_in_the_policy_weights_not_in_draft_weights(mtp_ckpt, rollout_batch):
    trainer = mtp_trainer(mtp_ckpt)
    trainer.train_rl(rollout_batch)
    weights, digest = trainer.get_weights()
    assert any(k.startswith("mtp.") for k in weights) and digest == checksum(weights)
    with pytest.raises(ValueError, match="draft_model"):
        trainer.get_draft_weights()


@needs_mtp
def test_mtp_resume_continues_bit_for_bit(mtp_ckpt, rollout_batch, tmp_path):
    a = mtp_trainer(mtp_ckpt)
    for _ in range(2):
        a.train_rl(rollout_batch)
    save_component_state(a, str(tmp_path), "trainer")
    b, fresh = mtp_trainer(mtp_ckpt), mtp_trainer(mtp_ckpt)
    load_component_state(b, str(tmp_path), "trainer")
    load_component_state(fresh, str(tmp_path), "trainer")
    fresh.draft = fresh._build_draft(MTP, None)  # the control: the weights resumed, the draft's Adam state not
    metrics = [[t.train_rl(rollout_batch) for _ in range(2)] for t in (a, b, fresh)]
    assert metrics[0] == metrics[1]
    assert_bitwise(params(b.model), params(a.model))
    assert metrics[2] != metrics[0]


@needs_mtp
def test_mtp_offload_and_onload_keep_the_draft(mtp_ckpt, rollout_batch, monkeypatch):
    monkeypatch.setattr(off, "FORCE_COPY", True)
    plain, offloaded = mtp_trainer(mtp_ckpt), mtp_trainer(mtp_ckpt)
    plain.train_rl(rollout_batch)
    offloaded.train_rl(rollout_batch)
    offloaded.offload()
    assert all(p.grad is None for p in offloaded.model.mtp.parameters())
    offloaded.onload()
    assert plain.train_rl(rollout_batch) == offloaded.train_rl(rollout_batch)
    assert_bitwise(params(offloaded.model), params(plain.model))
