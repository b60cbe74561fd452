"""The rollout protocol's contract suite (miles/rollout/protocol.py), written once and run against every engine.

What the loops, the router and the weight-sync transports rely on, whichever engine they hold: it is a
RolloutEngine; generate returns n samples per prompt, grouped in prompt order, each with one finite
log-prob <= 0 per response token and at most max_new_tokens of them; stop tokens end responses; a
group's seed reproduces its samples whatever else is in the batch, unseeded calls differ; greedy
(temperature 0) is deterministic; what update_weights loads is what generate then computes with
(greedy decoding and log-probs equal those of the project's own model on those weights), and
restoring the weights restores the outputs; release_memory / resume_memory / health keep the
protocol's bookkeeping, also called as the colocated loop calls them (miles/orchestrate/colocate.py's
MemoryPhases itself drives the engine: release_memory(keep_weights=False), then resume, a checked
sync and resume). Every method is called with the arguments its callers pass, and
`check_engine` checks that each takes the protocol's, so an engine that drifts from what the loop
calls fails here. References are engine-independent: the checkpoint's tokenizer and the
project's model (miles.models) loaded from the same checkpoint, never the engine's own attributes.

Each tier imports these test functions into a module of its own that defines a `contract` fixture
(a Contract, below):
- tests/unit/rollout/test_engine_contract.py (`make test`, CPU): the native engine, and the SGLang
  adapter (miles/rollout/sglang_engine.py) over a STAND-IN server (tests/unit/rollout/sglang_standin.py)
  that implements SGLang 0.5.23's documented HTTP API over the native engine. No live SGLang runs here:
  the SGLang side checks the adapter's reading of the documented API, not SGLang's own behaviour.
- tests/vllm/test_vllm_contract.py (`make test-vllm`, .venv-vllm): real vLLM on the CPU.

What an engine documents it does not do is checked as documented: vLLM has no sleep mode on the CPU,
so its release_memory / resume_memory free nothing but keep the bookkeeping these checks test (its
health() saying so is checked in the vLLM tier); the native engine serves while its process lives, so
its health() is only checked to answer. Engine-specific behaviour (request schemas, fault types,
one vLLM engine per process) stays in each engine's own tests.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from miles.config.schema import RolloutCfg
from miles.data.tokenizer import TokenizerInfo, encode_prompt

__all__ = [
    "Contract",
    "test_is_a_rollout_engine",
    "test_groups_logprobs_lengths_and_finish_reasons",
    "test_max_new_tokens_bounds_every_response",
    "test_prompt_ids_replace_the_prompts",
    "test_stop_tokens_end_responses_and_a_dead_engine_fails_health",
    "test_group_seeds_reproduce_whatever_the_batch",
    "test_unseeded_calls_differ",
    "test_greedy_is_deterministic",
    "test_update_weights_changes_and_restores_what_is_generated",
    "test_release_resume_memory_and_health",
    "test_colocation_phases_as_the_loop_runs_them",
]

PROMPTS = ["12+30=", "7+5=", "99+1=", "45+45="]
LABELS = ["42", "12", "100", "90"]
MAX_NEW = 6
SEEDS = [11, 12, 13, 14]
TAGS = ["weights", "kv_cache"]
# Log-probs against the project's model forward: native / stand-in ~1e-7; vLLM fp32 on the CPU measured
# 1.7e-6 (tests/vllm/test_vllm_vs_native.py).
LOGPROB_ATOL = 2e-5


@dataclass
class Contract:
    """One engine under the suite. `engine`: built from `ckpt` with fp32 weights and the default sampling
    filters (top_k 0, top_p 1); the suite passes n, temperature and max_new_tokens on every call, and
    leaves it holding the checkpoint's weights, resident. `build(cfg)`: a new engine of the same backend
    on `ckpt` with that RolloutCfg (vLLM: this closes `engine`, one engine per process; its fixture builds
    it again). `kill(engine)`: leave an engine from `build` unable to serve (a dead server, a closed
    engine); None where the engine documents that it serves whenever its process lives. `dead`,
    `dead_match`: what health() of a killed engine raises."""

    engine: Any
    name: str  # health()["engine"]
    ckpt: str
    build: Callable[[RolloutCfg], Any]
    kill: Callable[[Any], None] | None = None
    dead: type[BaseException] = RuntimeError
    dead_match: str = ""


# ----------------------------------------------------------------------------- references
@lru_cache(maxsize=4)
def tokenizer(ckpt: str) -> TokenizerInfo:
    return TokenizerInfo.load(ckpt)


@lru_cache(maxsize=4)
def _checkpoint(ckpt: str):
    from miles.models import from_pretrained

    model = from_pretrained(ckpt, dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def base_weights(ckpt: str) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under the project's parameter names, fp32 (a fresh copy)."""
    return {k: v.clone() for k, v in _checkpoint(ckpt)[1].items()}


def reference(ckpt: str, weights: dict[str, torch.Tensor]):
    """The project's model on `weights` (one cached instance per checkpoint, reloaded each call)."""
    model = _checkpoint(ckpt)[0]
    model.load_state_dict(weights, strict=True)
    return model


def vocab_size(ckpt: str) -> int:
    return int(json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"])


def default_stops(ckpt: str, stop_tokens=()) -> set[int]:
    """The stop ids every engine documents: the tokenizer's eos, generation_config's end-of-turn ids and
    rollout.stop_tokens."""
    tok = tokenizer(ckpt)
    stops = ({tok.eos_id} if tok.eos_id is not None else set()) | set(tok.extra_stop_ids)
    return stops | {tok.tokenizer.token_to_id(t) for t in stop_tokens}


@torch.no_grad()
def forward_logprobs(model, sample, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each response token, from one full forward (T = 0: of the logits)."""
    from miles.algo.losses import token_logprobs

    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    return token_logprobs(model(ids[:, :-1]), ids[:, 1:], temperature)[0][len(sample.prompt_ids) - 1:]


@torch.no_grad()
def greedy_decode(model, prompt_ids: list[int], stops: set[int], max_new: int) -> list[int]:
    """Argmax decoding by full forwards, stopping at a stop id (included) or after max_new tokens."""
    ids, out = list(prompt_ids), []
    while len(out) < max_new:
        token = int(model(torch.tensor([ids]))[0, -1].argmax())
        out.append(token)
        ids.append(token)
        if token in stops:
            break
    return out


def perturbed(weights: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def ids(samples) -> list[list[int]]:
    return [s.response_ids for s in samples]


def assert_logprobs_close(a, b, atol: float = LOGPROB_ATOL) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(torch.tensor(x.rollout_logprobs, dtype=torch.float32),
                                   torch.tensor(y.rollout_logprobs, dtype=torch.float32), atol=atol, rtol=0)


def assert_wellformed(contract: Contract, samples, prompts, labels, n: int, max_new: int, stops: set[int]) -> None:
    """Groups in prompt order; per sample its prompt, one finite log-prob <= 0 per response token, at most
    max_new tokens, a stop id only as the last token, and the finish reason that says which ended it."""
    engine, tok = contract.engine, tokenizer(contract.ckpt)
    assert len(samples) == len(prompts) * n
    assert [s.group for s in samples] == [g for g in range(len(prompts)) for _ in range(n)]
    for i, s in enumerate(samples):
        assert (s.prompt, s.label) == (prompts[i // n], labels[i // n])
        assert s.prompt_ids == encode_prompt(tok, prompts[i // n])
        assert 1 <= len(s.response_ids) <= max_new
        assert len(s.rollout_logprobs) == len(s.response_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in s.rollout_logprobs), s.rollout_logprobs
        stopped = s.response_ids[-1] in stops
        assert not stops & set(s.response_ids[:-1])  # a stop token ends the response
        assert s.finish_reason.value == ("stop" if stopped else "length")
        assert stopped or len(s.response_ids) == max_new
        assert s.response == engine.decode(s.response_ids)


# ----------------------------------------------------------------------------- the protocol
def test_is_a_rollout_engine(contract):
    from miles.rollout.protocol import RolloutEngine, check_engine

    engine = contract.engine
    check_engine(type(engine))
    assert isinstance(engine, RolloutEngine) and isinstance(engine.device, torch.device)
    tok = tokenizer(contract.ckpt)
    assert engine.decode(encode_prompt(tok, "12+30=") + [tok.eos_id]) == "12+30="  # special tokens skipped


# ----------------------------------------------------------------------------- generate
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_groups_logprobs_lengths_and_finish_reasons(contract, temperature):
    engine, n = contract.engine, 3
    samples = engine.generate(PROMPTS, LABELS, n=n, temperature=temperature, max_new_tokens=MAX_NEW)
    assert_wellformed(contract, samples, PROMPTS, LABELS, n, MAX_NEW, default_stops(contract.ckpt))
    groups = [{tuple(s.response_ids) for s in samples[g * n:(g + 1) * n]} for g in range(len(PROMPTS))]
    if temperature == 0.0:  # n greedy samples of a prompt are one sample n times
        assert all(len(g) == 1 for g in groups)
        assert all(lp >= -math.log(vocab_size(contract.ckpt)) for s in samples for lp in s.rollout_logprobs)
    else:  # sampled: the n samples of a prompt are not copies
        assert any(len(g) > 1 for g in groups)


def test_max_new_tokens_bounds_every_response(contract):
    engine, stops = contract.engine, default_stops(contract.ckpt)
    one = engine.generate(PROMPTS, LABELS, n=2, max_new_tokens=1)
    assert_wellformed(contract, one, PROMPTS, LABELS, 2, 1, stops)
    assert all(len(s.response_ids) == 1 for s in one)
    longer = engine.generate(PROMPTS, LABELS, n=4, temperature=1.0, max_new_tokens=MAX_NEW, seeds=SEEDS)
    assert max(len(s.response_ids) for s in longer) > 1  # the limit, not the engine, cut the first call
    with pytest.raises(ValueError, match="exceeds"):  # prompt + max_new_tokens beyond the model's context
        engine.generate(["1+1=" * 14], ["2"], n=1, max_new_tokens=8)


def test_prompt_ids_replace_the_prompts(contract):
    """`prompt_ids` (multi-turn contexts) are what the engine continues: the same samples as the text
    they encode, and a context that is no encoding of `prompts` is kept as given."""
    engine, tok = contract.engine, tokenizer(contract.ckpt)
    prompt = encode_prompt(tok, "3+4=")
    by_ids = engine.generate(["3+4="], ["7"], n=2, temperature=0.0, max_new_tokens=MAX_NEW, prompt_ids=[prompt])
    by_text = engine.generate(["3+4="], ["7"], n=2, temperature=0.0, max_new_tokens=MAX_NEW)
    assert all(s.prompt_ids == prompt for s in by_ids) and ids(by_ids) == ids(by_text)
    turn = prompt + tok.tokenizer.encode("7 1+1=", add_special_tokens=False).ids
    seeded = dict(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seeds=[5, 6])
    out = engine.generate(["3+4=", "x"], ["7", "2"], prompt_ids=[prompt, turn], **seeded)
    assert [s.prompt_ids for s in out] == [prompt, prompt, turn, turn]
    assert [(s.prompt, s.label, s.group) for s in out] == [("3+4=", "7", 0)] * 2 + [("x", "2", 1)] * 2
    alone = engine.generate(["x"], ["2"], prompt_ids=[turn], **dict(seeded, seeds=[6]))
    assert ids(alone) == ids(out[2:])


def test_stop_tokens_end_responses_and_a_dead_engine_fails_health(contract):
    """rollout.stop_tokens: every character of the alphabet a stop token, so a response ends at its
    first character (only special tokens may precede it). A token the tokenizer lacks is refused at
    start. Then that engine dies: health() raises (protocol: when the engine cannot serve)."""
    alphabet = "0123456789+-*=() "
    with pytest.raises(ValueError, match="rollout.stop_tokens"):
        contract.build(RolloutCfg(max_new_tokens=7, stop_tokens=["<nope>"]))
    engine = contract.build(RolloutCfg(max_new_tokens=7, stop_tokens=list(alphabet)))
    stops = default_stops(contract.ckpt, alphabet)
    chars = stops - default_stops(contract.ckpt)
    samples = engine.generate(PROMPTS, LABELS, n=4, temperature=1.0, max_new_tokens=7)
    assert len(samples) == 16
    for s in samples:
        assert s.finish_reason.value == "stop" and s.response_ids[-1] in stops
        assert not stops & set(s.response_ids[:-1])
    assert sum(s.response_ids[-1] in chars for s in samples) > len(samples) // 2  # the characters did stop them
    assert engine.health()["engine"] == contract.name
    if contract.kill is None:  # documented to serve while its process lives
        return
    contract.kill(engine)
    with pytest.raises(contract.dead, match=contract.dead_match):
        engine.health()


# ----------------------------------------------------------------------------- seeds
def test_group_seeds_reproduce_whatever_the_batch(contract):
    """A group's samples depend on its prompt and seed only: the same in another call, alone, beside
    other prompts and in another order; another seed gives other samples."""
    engine, kw = contract.engine, dict(n=4, temperature=1.0, max_new_tokens=MAX_NEW)
    a = engine.generate(PROMPTS, LABELS, seeds=SEEDS, **kw)
    b = engine.generate(PROMPTS, LABELS, seeds=SEEDS, **kw)
    assert ids(a) == ids(b) and [s.rollout_logprobs for s in a] == [s.rollout_logprobs for s in b]
    alone = engine.generate(PROMPTS[2:3], LABELS[2:3], seeds=SEEDS[2:3], **kw)
    assert ids(alone) == ids(a[8:12])
    assert_logprobs_close(alone, a[8:12])
    swapped = engine.generate([PROMPTS[3], PROMPTS[0]], [LABELS[3], LABELS[0]], seeds=[SEEDS[3], SEEDS[0]], **kw)
    assert ids(swapped) == ids(a[12:16]) + ids(a[0:4])
    assert [s.group for s in swapped] == [0] * 4 + [1] * 4
    twice = engine.generate([PROMPTS[0]] * 2, LABELS[:2], seeds=[SEEDS[0], 99], **kw)
    assert ids(twice[:4]) == ids(a[:4]) and ids(twice[4:]) != ids(twice[:4])
    assert len({tuple(r) for r in ids(a[:4])}) > 1  # the n samples of one group differ
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate(PROMPTS, LABELS, n=2, seeds=[1])


def test_unseeded_calls_differ(contract):
    engine = contract.engine
    a = engine.generate(PROMPTS, LABELS, n=4, temperature=1.0, max_new_tokens=MAX_NEW)
    b = engine.generate(PROMPTS, LABELS, n=4, temperature=1.0, max_new_tokens=MAX_NEW)
    assert ids(a) != ids(b)


def test_greedy_is_deterministic(contract):
    """temperature 0: the same responses and log-probs on every call, whatever the seeds and the batch."""
    engine, kw = contract.engine, dict(n=2, temperature=0.0, max_new_tokens=MAX_NEW)
    g = engine.generate(PROMPTS, LABELS, **kw)
    again = engine.generate(PROMPTS, LABELS, seeds=SEEDS, **kw)
    assert ids(again) == ids(g)
    assert_logprobs_close(again, g)
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], [LABELS[i]], **kw)
        assert ids(alone) == ids(g[2 * i:2 * i + 2])
        assert_logprobs_close(alone, g[2 * i:2 * i + 2])
    assert max(len(r) for r in ids(g)) > 1  # not trivially short


# ----------------------------------------------------------------------------- weights
def test_update_weights_changes_and_restores_what_is_generated(contract):
    """What update_weights loads is what generate computes with: greedy responses equal the project's
    model's argmax decoding, and sampled log-probs its forward, on the checkpoint's weights, on perturbed
    ones (a state dict, and in-process a FlatWeights), and on the checkpoint's again. With a checksum the
    held checksum comes back; a wrong one raises WeightSyncError."""
    from miles.transport.checksum import WeightSyncError, checksum
    from miles.transport.flat import FlatLayout, FlatWeights

    engine, ckpt = contract.engine, contract.ckpt
    stops, tok = default_stops(ckpt), tokenizer(ckpt)
    base = base_weights(ckpt)

    def check(weights):
        model = reference(ckpt, weights)
        greedy = engine.generate(PROMPTS, LABELS, n=1, temperature=0.0, max_new_tokens=MAX_NEW)
        assert ids(greedy) == [greedy_decode(model, encode_prompt(tok, p), stops, MAX_NEW) for p in PROMPTS]
        for s in greedy:  # greedy: log_softmax(logits) of the argmax
            torch.testing.assert_close(torch.tensor(s.rollout_logprobs, dtype=torch.float32),
                                       forward_logprobs(model, s, 0.0), atol=LOGPROB_ATOL, rtol=0)
        sampled = engine.generate(PROMPTS, LABELS, n=2, temperature=0.7, max_new_tokens=MAX_NEW, seeds=SEEDS)
        for s in sampled:  # under softmax(logits / T)
            torch.testing.assert_close(torch.tensor(s.rollout_logprobs, dtype=torch.float32),
                                       forward_logprobs(model, s, 0.7), atol=LOGPROB_ATOL, rtol=0)
        return ids(greedy)

    assert engine.update_weights(base) == ""  # unchecked (other tests may have left other weights)
    before = check(base)
    new = perturbed(base, 1)
    assert engine.update_weights(new, checksum(new)) == checksum(new)  # the held checksum, verified
    after = check(new)
    assert after != before  # the update changed what the engine generates
    newer = perturbed(base, 2)
    flat = FlatWeights.like(FlatLayout.of(newer, torch.float32), "cpu")
    flat.fill_from(newer)
    # the held checksum, verified: the buffer's device checksum (native, vLLM) or the SHA-256 of the same
    # weights (the SGLang adapter, which reads the server's weights back over HTTP)
    assert engine.update_weights(flat, flat.checksum()) in (flat.checksum(), checksum(newer))
    flat.buffer.add_(1.0)  # the engine holds a copy: changing the source afterwards changes nothing
    check(newer)
    with pytest.raises(WeightSyncError):
        engine.update_weights(new, "0" * 64)
    engine.update_weights(base)
    assert check(base) == before  # restored weights, restored outputs


# ----------------------------------------------------------------------------- memory, health
def test_release_resume_memory_and_health(contract):
    """The colocation order of calls (miles/rollout/protocol.py): release everything; generate refuses
    until resume_memory; the weights come back, are loaded again by update_weights, then the KV cache:
    the same seeded samples as before. Releasing what is released, resuming what is resident: no-ops."""
    from miles.transport.checksum import checksum

    engine, base = contract.engine, base_weights(contract.ckpt)
    engine.update_weights(base)
    health = engine.health()
    assert health["engine"] == contract.name and health["device"] == str(engine.device)
    assert health["resident"] == TAGS
    kw = dict(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seeds=SEEDS)
    before = engine.generate(PROMPTS, LABELS, **kw)
    engine.release_memory()
    assert engine.health()["resident"] == []
    engine.release_memory(("kv_cache",))  # released already: a no-op
    engine.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(PROMPTS, LABELS, **kw)
    with pytest.raises(ValueError, match="unknown memory tag"):
        engine.release_memory(("cuda_graph",))
    engine.resume_memory(("weights",))
    assert engine.health()["resident"] == ["weights"]
    with pytest.raises(RuntimeError, match="kv_cache"):
        engine.generate(PROMPTS, LABELS, **kw)
    assert engine.update_weights(base, checksum(base)) == checksum(base)  # weights resumed: loaded again
    engine.resume_memory(("kv_cache",))
    engine.resume_memory()  # resident already: a no-op
    assert engine.health()["resident"] == TAGS
    after = engine.generate(PROMPTS, LABELS, **kw)
    assert ids(after) == ids(before)
    assert_logprobs_close(after, before)
    # keep_weights=False (the colocated loop's release): the weights need not survive, so generate
    # refuses after resume until update_weights has loaded them again
    engine.release_memory(TAGS, keep_weights=False)
    engine.resume_memory()
    assert engine.health()["resident"] == TAGS
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(PROMPTS, LABELS, **kw)
    engine.update_weights(base)
    assert ids(engine.generate(PROMPTS, LABELS, **kw)) == ids(before)


class _TrainerWeights:
    """The trainer's side of a weight sync and nothing else (what miles/orchestrate/sync.py asks of it):
    the weights it holds and their checksum, as `get_weights` returns them."""

    def __init__(self, weights):
        self.weights, self.device = weights, torch.device("cpu")

    def get_weights(self, in_process: bool = False):
        from miles.transport.checksum import checksum

        return self.weights, checksum(self.weights)


def test_colocation_phases_as_the_loop_runs_them(contract):
    """miles/orchestrate/colocate.py's MemoryPhases drives the engine, through a handle, as a colocated
    GPU run with rollout.offload=true does (the phases are a no-op on the CPU, so the config says
    cuda): the train turn releases everything with keep_weights=False and generate refuses; the sync
    resumes the weights, loads the trainer's with the checksum check, resumes the KV cache; the
    seeded samples are those of before."""
    from types import SimpleNamespace

    from miles.orchestrate.colocate import MemoryPhases
    from miles.orchestrate.handles import LocalHandle
    from miles.transport.object_store import ObjectStoreTransport

    engine, base = contract.engine, base_weights(contract.ckpt)
    engine.update_weights(base)
    kw = dict(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seeds=SEEDS)
    before = engine.generate(PROMPTS, LABELS, **kw)
    ctx = SimpleNamespace(engine=LocalHandle(engine), trainer=LocalHandle(_TrainerWeights(base)),
                          draft_sync=False, after_sync=lambda ctx: None)
    ctx.transport = ObjectStoreTransport(ctx)
    # asynchronous: no per-phase device peaks to read (they need the CUDA allocator)
    cfg = SimpleNamespace(hardware=SimpleNamespace(device="cuda"), trainer=SimpleNamespace(offload=False),
                          rollout=SimpleNamespace(offload=True, check_weight_sync=True, asynchronous=True))
    phases = MemoryPhases(ctx, cfg)
    assert phases.engine and phases.engine_released
    phases.start()
    for _ in range(2):  # two steps
        phases.train_turn()
        assert engine.health()["resident"] == []
        with pytest.raises(RuntimeError, match="resume_memory"):
            engine.generate(PROMPTS, LABELS, **kw)
        phases.sync()
        assert engine.health()["resident"] == TAGS
        after = engine.generate(PROMPTS, LABELS, **kw)
        assert ids(after) == ids(before)
        assert_logprobs_close(after, before)
