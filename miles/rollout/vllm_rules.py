"""What `rollout=vllm` (miles/rollout/vllm_engine.py) combines with, checked before anything starts
(miles/validate.py runs it with the config's own rules). Pure: no vllm import, so any machine validates
a vLLM run's config. Its adapters' rules are miles/rollout/vllm_lora.py `vllm_lora_problems`."""

from __future__ import annotations

from miles.config.rules import engine_chosen_by_group
from miles.config.schema import EngineName, RunCfg, SpeculativeKind
from miles.config.vlm_rules import family, is_vlm

# Vision-language families rollout=vllm runs with images: those tested against the native engine on
# vLLM's CPU build (tests/vllm/test_vllm_images.py).
VISION_FAMILIES = ("qwen2_5_vl",)
# Head sizes vLLM 0.32's CPU attention takes (vllm/v1/attention/backends/cpu_attn.py); another fails at start.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_problems(cfg: RunCfg) -> list[str]:
    if cfg.rollout.engine != EngineName.vllm:
        return []
    # Without its group's rollout.vllm block the config's engine_problems says how to choose the engine.
    problems = _offline_api_problems(cfg) if engine_chosen_by_group(cfg.rollout) else []
    if cfg.rollout.speculative.kind != SpeculativeKind.none:
        problems.append("rollout.speculative runs in the native engine; rollout=vllm has its own speculative "
                        "options (rollout.vllm.llm_args): set rollout.speculative.kind=none")
    if is_vlm(cfg):
        problems += [f"{cfg.model.name} is a vision-language model: {message}"
                     for message in vllm_vision_problems(cfg, family(cfg))]
    return problems


def _offline_api_problems(cfg: RunCfg) -> list[str]:
    """What vLLM's offline API can do for this run."""
    r, v = cfg.rollout, cfg.rollout.vllm
    problems = []
    if r.top_k > 0 or r.top_p < 1:
        problems.append("rollout=vllm returns log-probs renormalized after top-k / top-p, the trainer's are "
                        "before the truncation: set rollout.top_k=0 and rollout.top_p=1.0")
    if cfg.precision.rollout_quant.value != "none":
        problems.append(f"rollout=vllm runs plain weights, not precision={cfg.precision.name}'s quantized "
                        "rollout format: use precision=fp32 or bf16")
    if cfg.algo.routing_replay == "r3":
        problems.append("algo.routing_replay=r3 needs routed experts, which vLLM's offline API does not return: "
                        "use rollout=native or rollout=sglang")
    if not cfg.ray.enabled and r.num_engines > 1:
        problems.append("rollout=vllm holds one engine per process (vLLM's parallel state is global): "
                        "set rollout.num_engines=1 or ray.enabled=true")
    if v.enable_sleep_mode and cfg.hardware.device == "cpu":
        problems.append("rollout.vllm.enable_sleep_mode needs CUDA (vLLM has no sleep mode on the CPU): set it false")
    if r.offload and not v.enable_sleep_mode:
        problems.append("rollout.offload=true with rollout=vllm frees memory through vLLM's sleep mode: "
                        "set rollout.vllm.enable_sleep_mode=true")
    if v.kv_cache_gb <= 0:
        problems.append(f"rollout.vllm.kv_cache_gb must be > 0 (got {v.kv_cache_gb})")
    if cfg.debug.compare_weights_tensorwise:
        problems.append("debug.compare_weights_tensorwise compares the native engine's tensors; rollout=vllm "
                        "checks its syncs by reading its kernels' weights back (rollout.check_weight_sync): "
                        "set debug.compare_weights_tensorwise=false")
    for key, instead in (("max_num_seqs", "rollout.max_running"),
                         ("tensor_parallel_size", "rollout.num_gpus_per_engine")):
        if key in v.llm_args:
            problems.append(f"rollout.vllm.llm_args.{key} is {instead} (one key for both engines): set "
                            f"{instead}={v.llm_args[key]} and drop it from llm_args")
    return problems


def torchvision_problem() -> str | None:
    """Why this environment's vLLM cannot run a vision-language model (vLLM 0.32's Qwen-VL / GLM-4V
    models import transformers' torchvision image processors), or None. Imports torchvision to know:
    PyPI's wheel is a CUDA build, whose import fails beside torch's CPU build."""
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # noqa: BLE001  (ImportError, or the CUDA build's RuntimeError)
        return (f"vLLM's Qwen-VL models need torchvision, which does not import in this environment "
                f"({type(error).__name__}: {error}); `make vllm-env` uninstalls PyPI's torchvision, a CUDA build "
                "that does not import beside torch's CPU build (docs/rollout.md)")
    return None


def vllm_vision_problems(cfg: RunCfg, family: str) -> list[str]:
    """What keeps rollout=vllm from running this vision-language model with images."""
    problems = []
    if family not in VISION_FAMILIES:
        problems.append(f"rollout=vllm takes images for {', '.join(VISION_FAMILIES)} only ({family} is not tested "
                        "against the native engine): set rollout=native")
    if cfg.hardware.device == "cpu" and cfg.model.hf_checkpoint is None and cfg.model.head_dim not in CPU_HEAD_SIZES:
        problems.append(f"rollout=vllm on the CPU takes model.head_dim in {list(CPU_HEAD_SIZES)} (vLLM's CPU "
                        f"attention), not {cfg.model.head_dim}: e.g. model.num_heads=2 model.head_dim=32 "
                        "model.mrope_section=[4,6,6] for qwen2_5_vl_tiny, or rollout=native")
    if (reason := torchvision_problem()) is not None:
        problems.append(f"rollout=vllm does not take images yet: set rollout=native ({reason})")
    return problems
