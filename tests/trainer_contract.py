"""The trainer protocol's contract suite (miles/trainer/protocol.py), written once and run against every trainer.

What the loops and the orchestration rely on, whichever trainer they hold: it is a Trainer (every
method and argument the callers use, `check_trainer`); on the same checkpoint and batch its steps give
the native torch trainer's loss, grad norm and metrics, and its weights, log-probs and KL after them;
what get_weights returns is what it computes with (the project's model on those weights gives its
log-probs) and carries its own checksum; a zero-lr step leaves the weights as they came in; the first
step of every rollout has train/ppo_kl == 0 and train/pg_clipfrac == 0 exactly, with and without a
separate old-log-prob pass; save_state / load_state (as miles/orchestrate/resume.py calls them) give
a fresh trainer the very next steps of the saved one; offload / onload keep the protocol's refusals
and training continues bit for bit; the online speculative draft trains and syncs where the backend
has one, and is refused with a message naming the setting where it has not. Every call goes through
a handle (miles/orchestrate/handles.py), in-process or to Ray actors, as the loop makes it.
References are backend-independent: an in-process TorchTrainer on the same checkpoint, and the
project's model (miles.models) loaded with the weights a trainer returns.

Each tier imports these test functions (and the fixtures `ckpt`, `batches`, `draft_ckpt`) into a
module of its own that defines a `contract` fixture (a Contract, below):
- tests/unit/trainer/test_trainer_contract.py (`make test`, CPU): torch and FSDP (1 gloo rank) in-process.
- tests/integration/test_trainer_contract_ray.py (slow): torch in a Ray actor, FSDP with 1 and 2
  gloo ranks in Ray actors (miles/trainer/fsdp_group.py).
- tests/gpu/test_trainer_contract_cuda.py (CUDA + megatron-core): Megatron-core in-process.

What a backend documents it does not do is checked as a clear refusal: FSDP trains no online draft
and gives no in-process weights, Megatron trains no online draft and does not offload.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from miles.config.schema import (AlgoCfg, AlgoName, DType, ModelCfg, PrecisionCfg, RolloutCfg, SpeculativeCfg,
                                 TrainerCfg)

__all__ = [
    "Contract", "ckpt", "batches", "draft_ckpt", "force_copy",
    "test_is_a_trainer",
    "test_steps_match_the_torch_trainer",
    "test_first_step_of_each_rollout_has_zero_ppo_kl",
    "test_a_zero_lr_step_keeps_the_weights",
    "test_get_weights_carries_its_checksum_and_save_writes_them",
    "test_save_state_load_state_continue_exactly",
    "test_offload_onload_round_trip",
    "test_draft_weights_or_a_clear_refusal",
]

ROOT = Path(__file__).resolve().parents[1]
FP32 = PrecisionCfg(name="fp32")
# Small micro-batches: each rank accumulates over several, and ranks get different counts; grad_clip
# below these steps' gradient norms, so the clip over (sharded) gradients is part of the update.
CFG = TrainerCfg(lr=1e-3, global_batch_size=8, micro_batch_size=2, max_tokens_per_micro_batch=24, grad_clip=0.5)
GRPO_KL = AlgoCfg(name=AlgoName.grpo, kl_coef=0.1)  # a KL reference in the loss: sharded and offloaded too
MAX_NEW = 8
DRAFT = SpeculativeCfg(kind="draft_model", lr=1e-2)


@dataclass
class Contract:
    """One trainer backend under the suite, reached through handles.

    `build(algo, cfg, precision, **kwargs)`: a new trainer of this backend on `ckpt` (TorchTrainer's
    arguments: kwargs such as max_response_len, speculative, draft_dir), as a handle (call / submit /
    apply); `close(handle)` ends it. `cls`: the class `check_trainer` checks. `device`: where it trains;
    the torch reference trains there too. `tol`: relative tolerance of metrics, weights and log-probs
    against the torch trainer's (0: equal bit for bit). `in_process_weights`: get_weights(in_process=True)
    gives a FlatWeights (else it is refused; only asked of in-process handles). `drafts`: trains an
    online speculative draft (else its construction is refused naming rollout.speculative.train_online).
    `offloads`: offload / onload move state (else refused naming trainer.offload). `moves`: a context
    in which offload really copies on this device (miles/trainer/offload.py FORCE_COPY), or None."""

    name: str
    ckpt: str
    build: Callable[..., Any]
    cls: type
    close: Callable[[Any], None] = lambda handle: None
    device: str = "cpu"
    tol: float = 0.0
    in_process_weights: bool = True
    drafts: bool = True
    offloads: bool = True
    moves: Callable[[], contextlib.AbstractContextManager] | None = None
    extra: dict = field(default_factory=dict)


@contextlib.contextmanager
def force_copy():
    """Offload into fresh host tensors on the CPU too (miles/trainer/offload.py FORCE_COPY), so the round
    trip moves: a `Contract.moves`."""
    from miles.trainer import offload

    offload.FORCE_COPY = True
    try:
        yield
    finally:
        offload.FORCE_COPY = False


@contextlib.contextmanager
def trainer(contract: Contract, algo: AlgoCfg = GRPO_KL, cfg: TrainerCfg = CFG, precision: PrecisionCfg = FP32,
            **kwargs):
    handle = contract.build(algo, cfg, precision, max_response_len=MAX_NEW, **kwargs)
    try:
        yield handle
    finally:
        contract.close(handle)


def torch_reference(contract: Contract, algo: AlgoCfg = GRPO_KL, cfg: TrainerCfg = CFG,
                    precision: PrecisionCfg = FP32, **kwargs):
    from miles.trainer.torch_trainer import TorchTrainer

    return TorchTrainer(contract.ckpt, algo, cfg, precision, device=contract.device, threads=1,
                        max_response_len=MAX_NEW, **kwargs)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """qwen3_tiny (conf/model/qwen3_tiny.yaml), seeded random weights, as an HF-format dir."""
    from omegaconf import OmegaConf

    from miles.data.tokenizer import DEFAULT_ALPHABET
    from miles.orchestrate.checkpoints import random_checkpoint

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg),
                                              OmegaConf.load(ROOT / "conf" / "model" / "qwen3_tiny.yaml")))
    return str(random_checkpoint(cfg, DEFAULT_ALPHABET, 0, tmp_path_factory.mktemp("qwen3_tiny")))


@pytest.fixture(scope="module")
def batches(ckpt):
    """Two rollouts of 8 engine samples (4 prompts x 2, up to 8 response tokens), advantages over [-1, 1]."""
    from miles.rollout.native import NativeEngine
    from miles.types import build_train_batch

    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=MAX_NEW), seed=0)
    out = []
    for prompts, labels in ((["1+2=", "35+47=", "9*9=", "(12-3)*4="], ["3", "82", "81", "36"]),
                            (["7+5=", "99+1=", "6*7=", "45+45="], ["12", "100", "42", "90"])):
        samples = engine.generate(prompts, labels, n=2, temperature=1.0, max_new_tokens=MAX_NEW)
        out.append(build_train_batch(samples, torch.linspace(-1, 1, len(samples)), engine.pad_id))
    return out


def write_draft_checkpoint(ckpt: str, out) -> str:
    """A smaller model than `ckpt` with its vocabulary (speculative kind draft_model), saved in `out`;
    the draft fixture of the trainer tests too (tests/unit/trainer/conftest.py)."""
    from miles.models import CausalLM, from_pretrained, save_pretrained

    vocab = from_pretrained(ckpt).config.vocab_size
    arch = ModelCfg(name="d", hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=8, max_position_embeddings=64).arch(vocab)
    torch.manual_seed(1)
    save_pretrained(CausalLM(arch), out)
    return str(out)


@pytest.fixture(scope="module")
def draft_ckpt(ckpt, tmp_path_factory):
    return write_draft_checkpoint(ckpt, tmp_path_factory.mktemp("draft"))


# ----------------------------------------------------------------------------- references, checks
def checkpoint_weights(ckpt: str) -> dict[str, torch.Tensor]:
    from miles.models import from_pretrained

    return from_pretrained(ckpt, dtype=torch.float32).state_dict()


@torch.no_grad()
def model_logprobs(ckpt: str, weights: dict[str, torch.Tensor], batch) -> torch.Tensor:
    """The project's model with `weights`: log-probs of tokens[:, 1:] at the loss positions (T = 1)."""
    from miles.algo.losses import token_logprobs
    from miles.models import from_pretrained

    model = from_pretrained(ckpt, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=True)
    return token_logprobs(model(batch.tokens[:, :-1]), batch.tokens[:, 1:], 1.0) * batch.loss_mask


def assert_close(a, b, tol: float, what: str) -> None:
    """Equal within `tol` relative to max(1, |b|) (tol 0: bit for bit): numbers, tensors or state dicts."""
    if isinstance(b, dict) and b and isinstance(next(iter(b.values())), torch.Tensor):
        assert list(a) == list(b), what
        for k in b:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (what, k)
            assert_close(a[k], b[k], tol, f"{what}[{k}]")
        return
    if isinstance(b, dict):
        assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
        for k in b:
            assert_close(a[k], b[k], tol, f"{what}[{k}]")
        return
    if isinstance(b, torch.Tensor):
        diff = float((a.double().cpu() - b.double().cpu()).abs().max()) if b.numel() else 0.0
        scale = max(1.0, float(b.double().abs().max())) if b.numel() else 1.0
        assert diff <= tol * scale, (what, diff)
        return
    assert abs(a - b) <= tol * max(1.0, abs(b)), (what, a, b)


def weights_of(handle, method: str = "get_weights") -> tuple[dict[str, torch.Tensor], str]:
    """get_weights() (or get_draft_weights()) as copies: in-process, fp32 weights on the CPU may be the
    live parameters themselves."""
    weights, digest = handle.call(method)
    return {k: v.clone() for k, v in weights.items()}, digest


def same_weights(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in b)


# ----------------------------------------------------------------------------- the protocol
def test_is_a_trainer(contract):
    """check_trainer on the class, and on the instance where it lives (a Ray worker's class included)."""
    from miles.trainer.protocol import check_trainer, check_trainer_instance

    check_trainer(contract.cls)
    with trainer(contract) as t:
        t.apply(check_trainer_instance)


# ----------------------------------------------------------------------------- against the torch trainer
def test_steps_match_the_torch_trainer(contract, batches):
    """Two RL steps (KL to the reference in the loss, clipped gradients), an SFT step, then log-probs and
    the KL to the reference: the torch trainer's loss, grad norm and every metric, its weights, log-probs
    and KL. And absolutely: what get_weights returns is what the trainer computes with."""
    first, second = batches
    ref = torch_reference(contract)
    want = [ref.train_rl(first), ref.train_rl(second), ref.train_sft(first)]
    want_weights, _ = ref.get_weights()
    want_logp, want_kl = ref.logprobs(first), ref.kl_to_ref(first)
    assert want[0]["train/grad_norm"] > CFG.grad_clip  # the clip is part of the update
    assert float(want_kl.abs().max()) > 0  # the policy has moved off the reference
    with trainer(contract) as t:
        got = [t.call("train_rl", first), t.call("train_rl", second), t.call("train_sft", first)]
        weights, _ = weights_of(t)
        logp, kl = t.call("logprobs", first), t.call("kl_to_ref", first)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(g, w, contract.tol, f"step {step} metrics")
    assert not same_weights(weights, checkpoint_weights(contract.ckpt))  # it trained
    assert_close(weights, want_weights, contract.tol * 10, "weights")
    assert_close(logp, want_logp, contract.tol * 10, "logprobs")
    assert_close(kl, want_kl, contract.tol * 10 + 1e-7, "kl_to_ref")
    assert_close(logp.cpu(), model_logprobs(contract.ckpt, weights, first), 1e-5, "logprobs vs get_weights' weights")


@pytest.mark.parametrize("old_pass", ["reused", "separate"])
def test_first_step_of_each_rollout_has_zero_ppo_kl(contract, batches, old_pass):
    """train/ppo_kl == 0 and train/pg_clipfrac == 0 exactly on the first step of every rollout, whether
    the old log-probs are the training forward's own or a separate pass's (TIS asks for one)."""
    algo = GRPO_KL if old_pass == "reused" else AlgoCfg(name=AlgoName.grpo, kl_coef=0.1, tis="token")
    with trainer(contract, algo) as t:
        for batch in batches:
            metrics = t.call("train_rl", batch)
            assert metrics["train/ppo_kl"] == 0.0 and metrics["train/pg_clipfrac"] == 0.0, metrics
            assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0


def test_a_zero_lr_step_keeps_the_weights(contract, batches):
    """lr 0 (AdamW's decoupled weight decay scales by lr too): RL and SFT steps run, gradients flow,
    and the weights out are the weights in, the checkpoint's, bit for bit."""
    from dataclasses import replace

    with trainer(contract, cfg=replace(CFG, lr=0.0)) as t:
        before, digest = weights_of(t)
        steps = [t.call("train_rl", batches[0]), t.call("train_sft", batches[1]), t.call("train_rl", batches[1])]
        after, digest_after = weights_of(t)
    assert all(m["train/grad_norm"] > 0 for m in steps)
    assert same_weights(before, checkpoint_weights(contract.ckpt))
    assert same_weights(after, before) and digest_after == digest


def test_get_weights_carries_its_checksum_and_save_writes_them(contract, batches, tmp_path):
    """get_weights: the rollout dtype's state dict under the project's names with its checksum, the
    same as the torch trainer's on the same weights; in_process=True gives a FlatWeights holding them,
    with its device checksum (where the backend shares a process; refused where not). save writes them
    as an HF-format dir."""
    from miles.models import from_pretrained
    from miles.transport.checksum import checksum

    bf16_out = PrecisionCfg(name="bf16_out", rollout_dtype=DType.bf16)
    want, want_digest = torch_reference(contract, precision=bf16_out).get_weights()
    with trainer(contract, precision=bf16_out) as t:
        weights, digest = weights_of(t)
        assert all(v.dtype == torch.bfloat16 for v in weights.values())
        assert digest == checksum(weights) == want_digest and same_weights(weights, want)
        t.call("train_rl", batches[0])
        trained, trained_digest = weights_of(t)
        assert trained_digest == checksum(trained) != digest
        t.call("save", str(tmp_path / "hf"))
        saved = {k: v.to(torch.bfloat16) for k, v in from_pretrained(tmp_path / "hf").state_dict().items()}
        assert same_weights(saved, trained)
        if not getattr(t, "in_process", False):
            return
        if not contract.in_process_weights:
            with pytest.raises(ValueError, match="in_process"):
                t.call("get_weights", in_process=True)
            return
        flat, flat_digest = t.call("get_weights", in_process=True)
        assert flat_digest == flat.checksum()
        held = flat.views()  # by name (a flat buffer lays them out in sorted order)
        assert sorted(held) == sorted(trained) and all(torch.equal(held[k].cpu(), trained[k]) for k in trained)


# ----------------------------------------------------------------------------- checkpoint state
def test_save_state_load_state_continue_exactly(contract, batches, tmp_path):
    """A step, then resume's save_component_state (Trainer.save_state: model/ and the trainer's own
    files), two more steps; a fresh trainer after resume's load_component_state takes the same two
    steps: the same metrics and weights, bit for bit. model/ is the policy when it was saved."""
    from miles.models import from_pretrained
    from miles.orchestrate.resume import load_component_state, save_component_state

    first, second = batches
    with trainer(contract) as t:
        t.call("train_rl", first)
        saved_weights, _ = weights_of(t)
        t.apply(save_component_state, str(tmp_path), "trainer")
        straight = [t.call("train_rl", second), t.call("train_rl", first)]
        straight_weights, _ = weights_of(t)
    assert same_weights(from_pretrained(tmp_path / "model").state_dict(), saved_weights)
    with trainer(contract) as t:
        t.apply(load_component_state, str(tmp_path), "trainer")
        resumed = [t.call("train_rl", second), t.call("train_rl", first)]
        resumed_weights, _ = weights_of(t)
    assert resumed == straight
    assert same_weights(resumed_weights, straight_weights)


# ----------------------------------------------------------------------------- colocation
def test_offload_onload_round_trip(contract, batches):
    """A step, offload (all tags), the refusals while offloaded (train, get_weights), onload, a step:
    the metrics and weights of a trainer that never offloaded. Offloading twice, onloading what is
    resident: no-ops. A backend that does not offload refuses, naming trainer.offload."""
    first, second = batches
    if not contract.offloads:
        with trainer(contract) as t:
            with pytest.raises(NotImplementedError, match="trainer.offload"):
                t.call("offload")
        return
    with trainer(contract) as plain:
        plain.call("train_rl", first)
        want = plain.call("train_rl", second)
        want_weights, _ = weights_of(plain)
    moves = contract.moves() if contract.moves is not None else contextlib.nullcontext()
    with moves, trainer(contract) as t:
        t.call("train_rl", first)
        sizes = t.call("offload_bytes")
        assert set(sizes) == {"params", "grads", "optimizer"} and sizes["params"] > 0 and sizes["optimizer"] > 0
        t.call("offload", ("grads", "optimizer"))
        t.call("offload")  # the rest; what is offloaded already is skipped
        t.call("offload")
        with pytest.raises(RuntimeError, match="onload"):
            t.call("train_rl", second)
        with pytest.raises(RuntimeError, match="onload"):
            weights_of(t)
        t.call("onload")
        t.call("onload")
        got = t.call("train_rl", second)
        weights, _ = weights_of(t)
    assert got == want
    assert same_weights(weights, want_weights)


# ----------------------------------------------------------------------------- speculative draft
def test_draft_weights_or_a_clear_refusal(contract, batches, draft_ckpt, tmp_path):
    """rollout.speculative kind draft_model, train_online: get_draft_weights gives the draft's weights
    (those of its checkpoint first) with their checksum, a step trains them, save_draft writes them. A
    backend without an online draft refuses to build one, naming the setting. Without a draft,
    get_draft_weights and save_draft refuse."""
    from miles.models import from_pretrained
    from miles.transport.checksum import checksum

    with trainer(contract) as t:
        with pytest.raises(ValueError, match="draft"):
            t.call("get_draft_weights")
        with pytest.raises(ValueError, match="draft"):
            t.call("save_draft", str(tmp_path / "none"))
    if not contract.drafts:
        with pytest.raises(ValueError, match="train_online"):
            with trainer(contract, speculative=DRAFT, draft_dir=draft_ckpt):
                pass
        return
    with trainer(contract, speculative=DRAFT, draft_dir=draft_ckpt) as t:
        weights, digest = weights_of(t, "get_draft_weights")
        assert digest == checksum(weights) and same_weights(weights, checkpoint_weights(draft_ckpt))
        metrics = t.call("train_rl", batches[0])
        assert metrics["spec/draft_loss"] > 0
        trained, trained_digest = weights_of(t, "get_draft_weights")
        assert trained_digest == checksum(trained) != digest
        t.call("save_draft", str(tmp_path / "draft"))
    assert same_weights(from_pretrained(tmp_path / "draft").state_dict(), trained)
