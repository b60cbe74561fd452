"""rollout.compile_cpu: the native engine's decoder forward through torch.compile on the CPU (dynamic
shapes, Inductor's C++ kernels). It must sample what the eager engine samples (fp32: the same tokens,
log-probs within a reordered fp32 sum) and see every weight sync (the compiled graph reads the
parameters a sync copies into). What it was not built for is refused by name (miles/config/rules.py)."""

import pytest
import torch

from miles.config.rules import config_problems
from miles.config.schema import DType, RolloutCfg
from miles.rollout.native import NativeEngine
from miles.transport.checksum import checksum

PROMPTS = ["1+2=", "35+47=", "9+9=", "12+3="]


def _samples(engine):
    out = engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=4, temperature=1.0, max_new_tokens=8)
    return [s.response_ids for s in out], torch.tensor([lp for s in out for lp in s.rollout_logprobs])


@pytest.mark.slow
def test_compiled_engine_samples_what_the_eager_one_does_across_a_weight_sync(ckpt):
    eager = NativeEngine(ckpt, RolloutCfg(), DType.fp32, seed=0)
    compiled = NativeEngine(ckpt, RolloutCfg(compile_cpu=True), DType.fp32, seed=0)
    assert not hasattr(eager.model.forward, "_torchdynamo_orig_callable")
    assert hasattr(compiled.model.forward, "_torchdynamo_orig_callable")  # the forward is torch.compile's
    for sync in (False, True):
        if sync:  # the same new weights into both: the compiled graph must read them, not a copy
            weights = {k: v + 0.05 * torch.randn_like(v) for k, v in eager.model.state_dict().items()}
            for engine in (eager, compiled):
                engine.update_weights(weights, checksum(weights))
        ids_e, lp_e = _samples(eager)
        ids_c, lp_c = _samples(compiled)
        assert ids_c == ids_e
        assert (lp_c - lp_e).abs().max().item() < 1e-5
    assert ids_e != _samples(NativeEngine(ckpt, RolloutCfg(), DType.fp32, seed=0))[0]  # the sync changed them


@pytest.mark.parametrize("overrides, refused", [
    (["hardware=gpu"], "hardware.device=cuda"),
    (["true_on_policy=true"], "true_on_policy=true"),
    (["trainer.lora.rank=8"], "trainer.lora"),
    (["precision=fp8"], "precision=fp8"),
    (["rollout.speculative.kind=mtp", "model.mtp_layers=1"], "rollout.speculative"),
    (["rollout.slot_decode=true"], "rollout.slot_decode=true"),
])
def test_what_it_was_not_built_for_is_refused_by_name(compose, overrides, refused):
    problems = [p for p in config_problems(compose(["rollout.compile_cpu=true", *overrides]))
                if p.startswith("rollout.compile_cpu=true")]
    assert len(problems) == 1 and refused in problems[0], problems


def test_the_default_run_takes_it(compose):
    assert not [p for p in config_problems(compose(["rollout.compile_cpu=true"])) if "compile_cpu" in p]
