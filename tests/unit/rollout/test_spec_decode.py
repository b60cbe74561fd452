"""Speculative decoding in the native engine (miles/rollout/spec_decode.py): the output is the target's.

- Greedy: the responses of every family's tiny model equal plain greedy decoding, token for token,
  with the target's log-probs, whatever the draft (a random draft model, the target itself, the
  model's own MTP module) and k, in left-padded batches with shared prefills and stop tokens.
- Sampling: the frequencies of 3-token responses match the target's exact distribution, computed by
  enumerating every continuation with the model itself (chi-square, threshold at the 1 - 1e-4
  quantile, 30,000 samples padded, 10,000 in slots), and a negative control (the draft's own
  distribution) fails the test.
- The reported log-probs are those of a full forward of the target on the emitted tokens.
- Seeds: a prompt group's samples do not depend on the other prompts of its batch.
- Both layouts: the padded one (spec_decode.py) and the slots (spec_slots.py, the GPU path, run
  here without CUDA graphs).
- Linear attention (Qwen3-Next): a verify forward with step tracking, rewound to keep tokens, leaves
  the state a forward of only those tokens leaves.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from miles.algo.losses import token_logprobs
from miles.config.schema import ModelCfg, RolloutCfg, SpeculativeCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.rollout.sampling import sampling_probs
from chi_square import chi_square_counts

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
PROMPTS = ["1+2=", "35+47=", "9*9=", "(12-3)*4="]
FAMILIES = ["qwen3_tiny", "qwen2_5_tiny", "qwen3_moe_tiny", "deepseek_v3_tiny", "deepseek_v3_2_tiny",
            "glm4_moe_tiny", "glm5_tiny", "qwen3_next_tiny", "llama4_tiny", "minimax_m2_tiny"]
MTP_FAMILIES = ["deepseek_v3_tiny", "deepseek_v3_2_tiny", "glm4_moe_tiny", "glm4_7_flash_tiny", "glm5_tiny",
                "qwen3_next_tiny"]


def model_cfg(name: str, **overrides) -> ModelCfg:
    cfg = OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / f"{name}.yaml"), overrides)
    return OmegaConf.to_object(cfg)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(name: str, seed: int = 0, **overrides) -> str:
        key = (name, seed, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = str(random_checkpoint(model_cfg(name, max_position_embeddings=128, **overrides),
                                              DEFAULT_ALPHABET, seed, tmp_path_factory.mktemp(name)))
        return made[key]

    return get


def engines(target: str, kind: str, k: int, draft: str | None = None, slots: bool = False, **rollout):
    """(plain engine, speculative engine); `slots`: the speculative one in the slot layout
    (spec_slots.py, the GPU path; here without CUDA graphs)."""
    cfg = RolloutCfg(max_new_tokens=24, **rollout)
    spec_cfg = replace(cfg, speculative=SpeculativeCfg(kind=kind, num_tokens=k), slot_decode=True if slots else None)
    return NativeEngine(target, cfg), NativeEngine(target, spec_cfg, draft_dir=draft)


def assert_same_greedy(plain, spec, n: int = 2) -> list:
    a = plain.generate(PROMPTS, PROMPTS, n=n, temperature=0.0)
    b = spec.generate(PROMPTS, PROMPTS, n=n, temperature=0.0)
    for x, y in zip(a, b):
        assert y.response_ids == x.response_ids and y.finish_reason == x.finish_reason
        torch.testing.assert_close(torch.tensor(y.rollout_logprobs), torch.tensor(x.rollout_logprobs),
                                   atol=2e-5, rtol=0)
    return b


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_a_draft_model_equals_plain_greedy(checkpoint, family):
    plain, spec = engines(checkpoint(family), "draft_model", 3, checkpoint("qwen3_tiny", seed=1))
    assert_same_greedy(plain, spec)


@pytest.mark.parametrize("slots", [False, True], ids=["padded", "slots"])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_greedy_equals_plain_greedy_for_any_k_and_with_stop_tokens(checkpoint, k, slots):
    # "1" and "=" are frequent outputs of the random model: rows stop inside verify steps.
    plain, spec = engines(checkpoint("qwen3_tiny"), "draft_model", k, checkpoint("qwen3_tiny", seed=2), slots,
                          stop_tokens=["1", "="])
    samples = assert_same_greedy(plain, spec, n=3)
    assert any(s.finish_reason.value == "stop" for s in samples)


def test_slots_take_more_samples_than_slots_in_chunks(checkpoint):
    plain, spec = engines(checkpoint("qwen3_tiny"), "draft_model", 3, checkpoint("qwen3_tiny", seed=2), True,
                          max_running=5)  # 2 groups of 2 per chunk
    a = plain.generate(PROMPTS, PROMPTS, n=2, temperature=0.0)
    b = spec.generate(PROMPTS, PROMPTS, n=2, temperature=0.0)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]


@pytest.mark.parametrize("slots", [False, True], ids=["padded", "slots"])
def test_the_target_drafting_for_itself_has_every_draft_accepted(checkpoint, slots):
    target = checkpoint("qwen3_tiny")
    plain, spec = engines(target, "draft_model", 3, target, slots)
    for s in assert_same_greedy(plain, spec):
        steps, accepted = s.draft_stats
        assert accepted == 3 * steps and steps == -(-(len(s.response_ids) - 1) // 4)


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_greedy_with_the_mtp_draft_equals_plain_greedy(checkpoint, family):
    plain, spec = engines(checkpoint(family, mtp_layers=1), "mtp", 3)
    samples = assert_same_greedy(plain, spec)
    assert all(s.draft_stats[0] > 0 for s in samples)


def enumerate_responses(engine: NativeEngine, prompt: str, length: int, temperature: float):
    """{response ids: probability} of every response of at most `length` tokens, from the target
    itself: one forward per prefix, sampling_probs of its last position."""
    prompt_ids = engine.generate([prompt], [""], n=1, max_new_tokens=1)[0].prompt_ids
    stops = set(engine.stop_ids.tolist())
    out, frontier = {}, {(): 1.0}
    for step in range(length):
        nxt = {}
        for prefix, p in frontier.items():
            logits = engine.model(torch.tensor([prompt_ids + list(prefix)]))[:, -1]
            probs = sampling_probs(logits, temperature)[0][0].double()
            for token, q in enumerate(probs.tolist()):
                if q > 0:
                    seq = prefix + (token,)
                    (out if token in stops or step == length - 1 else nxt)[seq] = p * q
        frontier = nxt
    return out


@pytest.mark.parametrize("slots, samples", [(False, 30_000), (True, 10_000)], ids=["padded", "slots"])
def test_sampled_responses_follow_the_targets_distribution(tmp_path, slots, samples):
    # A 3-character alphabet keeps the response space small (6 tokens with the specials).
    target = str(random_checkpoint(model_cfg("qwen3_tiny", max_position_embeddings=64), "ab=", 0, tmp_path / "t"))
    draft = str(random_checkpoint(model_cfg("qwen3_tiny", max_position_embeddings=64), "ab=", 5, tmp_path / "d"))
    cfg = RolloutCfg(max_new_tokens=3, temperature=1.0)
    spec_cfg = replace(cfg, speculative=SpeculativeCfg(kind="draft_model", num_tokens=2), max_running=samples,
                       slot_decode=True if slots else None, max_prompt_len=8)
    spec = NativeEngine(target, spec_cfg, draft_dir=draft, seed=3)
    exact = enumerate_responses(spec, "ab=", 3, 1.0)
    drawn = spec.generate(["ab="], [""], n=samples)
    counts = {}
    for s in drawn:
        counts[tuple(s.response_ids)] = counts.get(tuple(s.response_ids), 0) + 1
    assert set(counts) <= set(exact)
    stat, threshold = chi_square_counts(counts, exact, len(drawn))
    assert stat < threshold, (stat, threshold)
    # Negative control: the draft model's own responses are told apart from the target's.
    own = NativeEngine(draft, cfg, seed=3).generate(["ab="], [""], n=samples)
    control = {}
    for s in own:
        control[tuple(s.response_ids)] = control.get(tuple(s.response_ids), 0) + 1
    assert chi_square_counts(control, exact, len(own))[0] > 3 * threshold  # rejected by a wide margin
    accepted = sum(s.draft_stats[1] for s in drawn)
    assert 0 < accepted < 2 * sum(s.draft_stats[0] for s in drawn)  # some drafts kept, not all


def test_logprobs_are_the_targets_full_forward(checkpoint):
    target = checkpoint("qwen3_next_tiny")
    _, spec = engines(target, "draft_model", 3, checkpoint("qwen3_tiny", seed=1))
    for s in spec.generate(PROMPTS, PROMPTS, n=2, temperature=0.8):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        lp = token_logprobs(spec.model(ids[:, :-1]), ids[:, 1:], 0.8)[0, len(s.prompt_ids) - 1:]
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), lp, atol=2e-5, rtol=0)


@pytest.mark.parametrize("slots", [False, True], ids=["padded", "slots"])
def test_a_groups_samples_do_not_depend_on_the_rest_of_the_batch(checkpoint, slots):
    # Frequent stop tokens: rows finish at different steps. The batch of four groups never drops its
    # finished rows, the group alone drops them at every check: a group's draws must not see either.
    _, spec = engines(checkpoint("qwen3_tiny"), "draft_model", 2, checkpoint("qwen3_tiny", seed=1), slots,
                      stop_tokens=["1", "="])
    spec.spec.compact_at = 2.0
    both = spec.generate(PROMPTS, [""] * 4, n=3, seeds=[11, 12, 13, 14])
    spec.spec.compact_at = 0.0
    alone = spec.generate(PROMPTS[1:2], [""], n=3, seeds=[12])
    assert len({len(s.response_ids) for s in both}) > 2  # rows did finish at different steps
    assert [s.response_ids for s in both[3:6]] == [s.response_ids for s in alone]
    for x, y in zip(both[3:6], alone):  # other padding widths: float noise only
        torch.testing.assert_close(torch.tensor(x.rollout_logprobs), torch.tensor(y.rollout_logprobs), atol=1e-5, rtol=0)


def test_linear_attention_rewinds_to_the_accepted_tokens(checkpoint):
    from miles.models import from_pretrained

    model = from_pretrained(checkpoint("qwen3_next_tiny")).eval()
    ids = torch.randint(3, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    keep = torch.tensor([1, 3, 5])
    with torch.no_grad():
        tracked = model.new_cache(3, 16)
        model(ids[:, :4], cache=tracked)
        tracked.track_steps(True)
        model(ids[:, 4:], cache=tracked)
        tracked.rewind(keep)
        for row, n in enumerate(keep.tolist()):
            plain = model.new_cache(1, 16)
            model(ids[row:row + 1, :4 + n], cache=plain)
            for mine, ref in zip(tracked.layers, plain.layers):
                if hasattr(ref, "state"):
                    torch.testing.assert_close(mine.state[row], ref.state[0], atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(mine.conv_state[row], ref.conv_state[0], atol=1e-6, rtol=0)


def test_bad_settings_are_refused(checkpoint):
    target = checkpoint("qwen3_tiny")
    with pytest.raises(ValueError, match="model.mtp_layers"):
        NativeEngine(target, RolloutCfg(speculative=SpeculativeCfg(kind="mtp")))
    with pytest.raises(ValueError, match="draft_model"):
        NativeEngine(target, RolloutCfg(speculative=SpeculativeCfg(kind="draft_model")))
    mtp_target = checkpoint("glm4_moe_tiny", mtp_layers=1)
    with pytest.raises(ValueError, match="slot_decode"):
        NativeEngine(mtp_target, RolloutCfg(slot_decode=True, speculative=SpeculativeCfg(kind="mtp")))
