"""Native engine beyond the rollout contract (tests/engine_contract.py runs that against it, in
test_engine_contract.py): bf16 weight updates and their checksum, the sampling knobs, and the batch
manipulations (shared prefill, dropping finished rows) that must change no sample."""

import math

import pytest
import torch

from miles.algo.losses import token_logprobs
from miles.config.schema import DType, RolloutCfg
from miles.transport.checksum import WeightSyncError, checksum
from miles.rollout.native import NativeEngine
from miles.rollout.sampling import sample_next

PROMPTS = ["1+2=", "35+47=", "9+9=", "12+3="]


def full_forward_logprobs(engine, sample, temperature):
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    logits = engine.model(ids[:, :-1])
    lp = token_logprobs(logits, ids[:, 1:], temperature)[0]
    return lp[len(sample.prompt_ids) - 1:]


def test_update_weights_checks_the_checksum(ckpt):
    engine = NativeEngine(ckpt, RolloutCfg(), DType.bf16)
    weights = {k: (v.float() + 0.01).to(torch.bfloat16) for k, v in engine.model.state_dict().items()}
    assert engine.update_weights(weights, checksum(weights)) == checksum(weights)
    with pytest.raises(WeightSyncError):
        engine.update_weights(weights, "0" * 64)


def test_sampling_top_k_top_p_and_greedy():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    tok, lp = sample_next(logits, 1.0, top_k=2, generator=g)
    assert set(tok.tolist()) == {0, 1}
    # the reported log-prob is the untruncated one
    torch.testing.assert_close(lp[tok == 1][0], torch.tensor(math.log(0.3)))
    tok, _ = sample_next(logits, 1.0, top_p=0.7, generator=g)  # mass before token 2 is 0.8 >= 0.7
    assert set(tok.tolist()) == {0, 1}
    tok, _ = sample_next(logits, 1.0, top_p=0.45, generator=g)  # the top token alone reaches 0.45
    assert set(tok.tolist()) == {0}
    # one sample per row, drawn as torch.multinomial draws it: the same tokens from the same seed
    probs = torch.softmax(torch.randn(64, 50), -1)
    expected = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(7)).squeeze(-1)
    tok, _ = sample_next(probs.log(), 1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(tok, expected)
    noise = torch.empty(64, 50).exponential_(generator=torch.Generator().manual_seed(7))
    assert torch.equal(sample_next(probs.log(), 1.0, noise=noise)[0], expected)
    tok, lp = sample_next(logits[:1], 0.0)
    assert tok.item() == 0 and abs(lp.item() - math.log(0.5)) < 1e-6
    freq = (sample_next(logits, 1.0, generator=g)[0] == 0).float().mean().item()
    assert abs(freq - 0.5) < 0.05


def test_shared_prefill_changes_nothing(ckpt):
    """n samples share one prefill per prompt: greedy, each of them equals the prompt generated on
    its own with n=1, and its log-probs equal a full forward over prompt + response."""
    n = 3
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=6))
    shared = engine.generate(PROMPTS, ["3", "82", "18", "15"], n=n, temperature=0.0)
    assert len(shared) == len(PROMPTS) * n
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], ["?"], n=1, temperature=0.0)[0]
        for s in shared[i * n:(i + 1) * n]:
            assert (s.prompt, s.group, s.prompt_ids) == (prompt, i, alone.prompt_ids)
            assert s.response_ids == alone.response_ids
            assert s.finish_reason == alone.finish_reason
            torch.testing.assert_close(torch.tensor(s.rollout_logprobs), full_forward_logprobs(engine, s, 0.0),
                                       atol=1e-5, rtol=1e-5)
    # the prompts have different lengths (left padding) and the responses are not trivially short
    assert len({len(s.prompt_ids) for s in shared}) > 1
    assert max(len(s.response_ids) for s in shared) > 1


def batch_sizes_seen(engine):
    """Record the batch size of every forward the engine runs."""
    sizes, forward = [], engine.model.forward
    engine.model.forward = lambda ids, **kw: (sizes.append(ids.shape[0]), forward(ids, **kw))[1]
    return sizes


# Stop sets under which rows finish at different steps (greedy: this checkpoint's responses
# stop after 8, 5, 6 and 3 tokens).
@pytest.mark.parametrize("temperature, stops", [(1.0, "02468+*("), (0.0, "46")])
def test_dropping_finished_rows_changes_nothing(ckpt, temperature, stops):
    """Finished rows leave the decode batch; with the same seed the samples are the same as when
    they stay, and the log-probs still equal a full forward."""
    cfg = RolloutCfg(max_new_tokens=8, stop_tokens=list(stops))
    compacting, keeping = NativeEngine(ckpt, cfg, seed=5), NativeEngine(ckpt, cfg, seed=5)
    keeping.compact_at = 2.0  # never
    sizes, kept_sizes = batch_sizes_seen(compacting), batch_sizes_seen(keeping)
    a = compacting.generate(PROMPTS, ["?"] * 4, n=4, temperature=temperature)
    b = keeping.generate(PROMPTS, ["?"] * 4, n=4, temperature=temperature)
    assert sizes[0] == kept_sizes[0] == len(PROMPTS)  # one prefill row per distinct prompt
    assert all(s == 16 for s in kept_sizes[1:])
    assert min(sizes[1:]) < 16 and sizes[1:] == sorted(sizes[1:], reverse=True)  # the batch shrank
    assert len(sizes) == len(kept_sizes)
    lengths = {len(s.response_ids) for s in a}
    assert len(lengths) > 1  # rows did finish at different steps
    for x, y in zip(a, b):
        assert (x.response_ids, x.finish_reason, x.group) == (y.response_ids, y.finish_reason, y.group)
        torch.testing.assert_close(torch.tensor(x.rollout_logprobs), torch.tensor(y.rollout_logprobs),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.tensor(x.rollout_logprobs),
                                   full_forward_logprobs(compacting, x, temperature), atol=1e-5, rtol=1e-5)
