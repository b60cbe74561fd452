"""What `trainer=megatron` combines with, checked before anything starts (miles/validate.py runs it
with the config's own rules): one CUDA process, the families `arch.py` maps, the recipes without FP8
GEMMs (fp8's w8a16 trains, w8a8 does not); every weight-sync transport (their own rules apply:
miles/config/rules.py; LoRA's adapters through object_store only); a teacher (on-policy
distillation); LoRA (the config's own LoRA rules) over a bf16 / fp32 base or, under int4_qat and fp8
w8a16, QLoRA (the frozen base's round trip taken once at build).
Pure: no megatron import, so a CPU machine validates a Megatron run's config."""

from __future__ import annotations

from miles.config.schema import RunCfg, TrainerBackend
from miles.trainer.megatron.arch import problems as unmapped


def megatron_problems(cfg: RunCfg) -> list[str]:
    if cfg.trainer.backend != TrainerBackend.megatron:
        return []
    t = cfg.trainer
    problems = list(unmapped(cfg.model))
    if cfg.hardware.device == "cpu":
        problems.append("trainer=megatron runs on CUDA only (Megatron-core allocates its RoPE, RNG and "
                        "gradient buffers there): pick a GPU hardware profile or trainer=torch")
    if max(t.tp, 1) * max(t.pp, 1) * max(t.ep, 1) * max(t.cp, 1) > 1:
        problems.append(f"trainer=megatron runs one GPU for now: set trainer.tp, pp, ep, cp to 1 "
                        f"(got {t.tp}, {t.pp}, {t.ep}, {t.cp})")
    # w8a8 multiplies FP8 operands in the forward, which Megatron-core does through Transformer Engine
    # only; w8a16 trains: each forward's weights are the FP8 round trips of their native parts
    # (megatron/quant.py, as INT4 QAT and the quantized rollouts); with LoRA, the frozen base's FP8 round
    # trip, taken once at build (QLoRA).
    fp8 = cfg.precision.train_quant.value == "fp8"
    unsupported = {f"precision={cfg.precision.name} (w8a8's FP8 GEMMs need Transformer Engine)":
                   fp8 and cfg.precision.fp8_scheme == "w8a8",
                   "precision.fp8_backward=fp8 (FP8 backward GEMMs: Transformer Engine's in Megatron-core)":
                   cfg.precision.fp8_backward == "fp8",
                   "precision.forward_weights=rollout": cfg.precision.forward_weights == "rollout",
                   "precision.fp32_residual=true (its residual stream is in the parameters' bf16)":
                   cfg.precision.fp32_residual,
                   "true_on_policy=true": cfg.true_on_policy}
    problems += [f"trainer=megatron does not support {what} yet: use trainer=torch"
                 for what, bad in unsupported.items() if bad]
    return problems
