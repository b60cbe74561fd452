"""Every shipped config composes, converts to the typed schema and validates (DESIGN rule 9)."""

import copy
import typing
from dataclasses import replace
from pathlib import Path

import pytest
from hydra.errors import HydraException

from miles.config.schema import AlgoName, RunCfg
from miles.validate import validate
from miles.hardware.planner import make_plan

CONF = Path(__file__).resolve().parents[3] / "conf"
GROUPS = ["model", "algo", "precision", "hardware", "task", "rollout", "trainer", "tracking"]


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def plan_only(hardware: str) -> list[str]:
    """GPU profiles validate as plans here (no GPU on CI): dry_run, and a memory size for the profile
    that reads it from the visible device."""
    if hardware == "cpu":
        return []
    return ["dry_run=true"] + (["hardware.memory_gb=141"] if hardware == "gpu" else [])


# Options that run on a GPU only: validated as a one-GPU plan.
# Options that need another group's choice to validate: Megatron a GPU, the visual task a vision-language model.
GPU_ONLY = {("trainer", "megatron"): ["hardware=h200", "hardware.gpus_per_node=1", "dry_run=true"],
            ("task", "shape_count"): ["model=qwen2_5_vl_tiny"]}


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_validates(compose, group, option):
    extra = plan_only(option) if group == "hardware" else GPU_ONLY.get((group, option), [])
    cfg = compose([f"{group}={option}"] + extra)
    assert isinstance(cfg, RunCfg)
    assert validate(cfg) == []


@pytest.fixture(scope="module")
def combined(compose):
    """combined(model, precision, hardware) -> the typed config of `model=.. precision=.. hardware=..`
    (+ plan_only), put together from each group's own composition, each composed once. The three groups
    have no defaults lists or interpolations of their own, so this equals composing the three at once
    (test_combining_groups_equals_composing_them); it saves a Hydra compose (~0.2 s) per combination."""
    cache: dict = {}

    def part(group, option):
        if (group, option) not in cache:
            cache[group, option] = compose([f"{group}={option}"] + (plan_only(option) if group == "hardware" else []))
        return cache[group, option]

    def combine(model, precision, hardware):
        hw = part("hardware", hardware)
        return copy.deepcopy(replace(part("model", model), precision=part("precision", precision).precision,
                                     hardware=hw.hardware, dry_run=hw.dry_run))

    return combine


@pytest.mark.parametrize("model", options("model"))
def test_combining_groups_equals_composing_them(compose, combined, model):
    """One real three-group composition per model, the precisions and hardware profiles in turn."""
    i, precisions, profiles = options("model").index(model), options("precision"), options("hardware")
    precision, hardware = precisions[i % len(precisions)], profiles[i % len(profiles)]
    overrides = [f"model={model}", f"precision={precision}", f"hardware={hardware}"] + plan_only(hardware)
    assert compose(overrides) == combined(model, precision, hardware)


@pytest.mark.parametrize("model", options("model"))
@pytest.mark.parametrize("precision", options("precision"))
@pytest.mark.parametrize("hardware", options("hardware"))
def test_model_precision_hardware_combinations_plan_or_are_refused_clearly(combined, model, precision, hardware):
    cfg = combined(model, precision, hardware)
    assert validate(cfg) == []
    plan = make_plan(cfg)
    if model.endswith("_tiny"):
        assert plan.fits, plan.problems  # the tiny variants run everywhere, the laptop CPU included
    if not plan.fits:
        assert plan.problems and all("GB" in p for p in plan.problems)  # names the sizes that clash
        assert plan.suggestions  # and what to change


def test_every_yaml_key_has_a_comment():
    for path in CONF.rglob("*.yaml"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            if not stripped or stripped.startswith(("#", "-")):
                continue
            if stripped.endswith(":"):  # a section header
                continue
            assert "#" in line, f"{path.relative_to(CONF)}:{n} has no comment: {line!r}"


def test_defaults(compose):
    cfg = compose()
    assert cfg.algo.name == AlgoName.grpo and cfg.model.name == "qwen3_tiny" and cfg.hardware.name == "cpu"
    # the batch invariant holds in the shipped default
    assert cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt == (
        cfg.trainer.global_batch_size * cfg.algo.num_steps_per_rollout
    )


def test_fp8_defaults_to_bf16_activations_and_the_baseline_keeps_fp8_ones(compose):
    # w8a16 keeps fp8's train / rollout mismatch at bf16's (docs/precision.md); the mismatched
    # baseline recipe keeps the engine's 1x128 FP8 activations.
    assert compose(["precision=fp8"]).precision.fp8_scheme == "w8a16"
    assert compose(["precision=bf16_train_fp8_rollout"]).precision.fp8_scheme == "w8a8"
    assert validate(compose(["precision=fp8", "precision.fp8_scheme=w8a8", "precision.fp8_gemm=emulated"])) == []
    for scheme in ("w8a8", "w8a16"):
        assert validate(compose(["precision=fp8", f"precision.fp8_scheme={scheme}", "precision.fp8_backward=fp8"])) == []
    for recipe in ("precision=fp8", "precision=int4_qat"):
        assert validate(compose([recipe, "rollout.dense_weight_copies=true"])) == []


def test_validate_reports_every_problem_at_once(compose):
    cfg = compose(["rollout.n_samples_per_prompt=0", "trainer.micro_batch_size=100", "algo.kl_estimator=k9"])
    problems = validate(cfg)
    joined = "\n".join(problems)
    assert "rollout.n_samples_per_prompt must be > 0" in joined
    assert "trainer.micro_batch_size (100)" in joined
    assert "algo.kl_estimator='k9' is unknown; valid: k1, k2, k3, low_var_kl" in joined
    assert len(problems) >= 3


def test_batch_invariant_names_the_fix(compose):
    problems = validate(compose(["rollout.batch_size=16"]))
    assert len(problems) == 1
    assert "batch invariant" in problems[0] and "trainer.global_batch_size=128" in problems[0]


def test_schema_rejects_unknown_keys_and_bad_types(compose):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose(["trainer.foo=1"])
    with pytest.raises(ConfigCompositionException):
        compose(["trainer.lr=abc"])


def test_cli_contract_keys_exist():
    """The public CLI names of the foundation issue exist in the schema."""
    keys = ["steps", "seed", "rollout.batch_size", "rollout.n_samples_per_prompt", "rollout.max_new_tokens",
            "rollout.temperature", "trainer.lr", "trainer.global_batch_size", "trainer.micro_batch_size",
            "eval.interval", "tracking.uri", "tracking.experiment", "model.hf_checkpoint"]
    for key in keys:
        node = RunCfg
        for part in key.split("."):
            hints = typing.get_type_hints(node)
            assert part in hints, key
            node = hints[part]


def test_ppo_and_opd_rules(compose, tmp_path):
    joined = "\n".join(validate(compose(["algo=ppo", "critic.updates_per_step=0", "critic.warmup_steps=200",
                                         "ray.num_cpus=2", "algo.lam=1.5", "algo.kl_in_reward=true",
                                         "algo.reward_clip=0"])))
    for expected in ("critic.updates_per_step must be >= 1", "critic.warmup_steps must be in [0, steps)",
                     "ray.num_cpus must be >= 3", "algo.gamma and algo.lam must be in [0, 1]",
                     "algo.kl_in_reward needs algo.kl_coef > 0", "algo.reward_clip must be > 0"):
        assert expected in joined
    file_task = ["algo=opd", "task.kind=file", f"task.train_file={tmp_path / 'train.jsonl'}"]
    assert any("algo.teacher_checkpoint must be set" in p for p in validate(compose(file_task)))
    problems = validate(compose(["algo=opd", f"algo.teacher_checkpoint={tmp_path}"]))
    assert problems == [f"algo.teacher_checkpoint={tmp_path} must be an HF checkpoint directory; "
                        "missing: config.json, tokenizer.json"]
    assert any("algo.opd_kl_coef must be >= 0, and > 0 for algo=opd" in p
               for p in validate(compose(["algo=opd", "algo.opd_kl_coef=0"])))


def test_unknown_advantage_lists_sequence_and_token_estimators(compose):
    (problem,) = validate(compose(["algo.advantage=ppo"]))
    assert problem == ("algo.advantage='ppo' is unknown; valid: dr_grpo, gae, grpo, none, reinforce_pp, "
                       "reinforce_pp_baseline, rloo")


def test_gpu_profiles_need_a_visible_gpu_unless_they_only_plan(compose, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CI has none; a GPU machine too, here
    problems = validate(compose(["hardware=gpu"]))
    assert len(problems) == 1 and "no CUDA device is visible" in problems[0] and "hardware=cpu" in problems[0]
    assert validate(compose(["hardware=cpu", "hardware.device=cuda"])) == [
        "hardware.device=cuda needs hardware.gpus_per_node >= 1: for one GPU use hardware=gpu"]
    assert "set hardware.memory_gb" in validate(compose(["hardware=gpu", "dry_run=true"]))[0]
    assert validate(compose(["hardware=h200", "dry_run=true"])) == []  # planning a cluster needs no GPU here


def test_a_multi_gpu_profile_is_refused_for_a_one_gpu_run(compose, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "set hardware.gpus_per_node=1" in validate(compose(["hardware=h200"]))[0]
    assert validate(compose(["hardware=h200", "hardware.gpus_per_node=1"])) == []


def test_trainer_packing_and_recompute_rules(compose):
    assert validate(compose(["trainer.max_tokens_per_micro_batch=0"])) == [
        "trainer.max_tokens_per_micro_batch must be >= 1 (got 0)"]
    # Recompute runs every recipe's training forward again (tests/unit/trainer/test_trainer_paths.py,
    # tests/megatron/test_megatron_precision.py).
    for precision in (["precision=fp8"], ["precision=int4_qat"], ["precision=bf16", "precision.forward_weights=rollout"]):
        assert validate(compose(["trainer.recompute=true", *precision])) == []
    assert validate(compose(["trainer.recompute=true"])) == []
    for precision in ("precision=int4_qat", "precision=fp8"):
        assert validate(compose([*MEGATRON_GPU, "trainer.recompute=true", precision])) == []


MEGATRON_GPU = ["trainer=megatron", "hardware=h200", "hardware.gpus_per_node=1", "dry_run=true"]


@pytest.mark.parametrize("overrides, message", [
    (["true_on_policy=true", "precision=bf16_train_fp8_rollout"], "use precision=fp8, int4_qat, bf16 or fp32"),
    (["true_on_policy=true", "rollout.top_p=0.9"], "set rollout.top_p=1.0 rollout.top_k=0"),
    (["precision=fp8", "precision.fp8_gemm=triton"], "set precision.fp8_gemm=auto"),
    (["precision=bf16", "precision.fp8_scheme=w8a16"], "drop precision.fp8_scheme or use precision=fp8"),
    (["precision=fp8", "precision.fp8_scheme=w8a16", "precision.fp8_gemm=emulated"], "set precision.fp8_gemm=auto"),
    (["precision=bf16_train_fp8_rollout", "precision.fp8_backward=fp8"], "drop precision.fp8_backward or use precision=fp8"),
    (["precision=bf16", "rollout.dense_weight_copies=true"], "no weight-only layers"),
    (["rollout=vllm", "precision=int4_qat", "rollout.dense_weight_copies=true"], "the copies are the native engine's"),
    (["precision=fp8", "true_on_policy=true", "rollout.dense_weight_copies=true"], "never read a copy"),
    ([*MEGATRON_GPU, "precision=fp8", "precision.fp8_backward=fp8"], "FP8 backward GEMMs: Transformer Engine's"),
    (["true_on_policy=true", "algo=sft"], "set true_on_policy=false"),
    (["trainer.num_ranks=2"], "use trainer=fsdp"),
    (["trainer=fsdp", "ray.enabled=false"], "set ray.enabled=true"),
    (["trainer=fsdp", "algo.routing_replay=r3", "model=qwen3_moe_tiny"], "use trainer=torch"),
    (["trainer=megatron"], "runs on CUDA only"),
    (["trainer=megatron", "trainer.num_ranks=2"], "use trainer=fsdp"),
    ([*MEGATRON_GPU, "model=qwen3_next_tiny"], "qwen3_next is not mapped yet (its gated DeltaNet"),
    ([*MEGATRON_GPU, "precision=fp8", "precision.fp8_scheme=w8a8", "trainer.lora.rank=8"],
     "w8a8's FP8 GEMMs need Transformer Engine"),
    ([*MEGATRON_GPU, "precision=fp8", "precision.fp8_scheme=w8a8"], "w8a8's FP8 GEMMs need Transformer Engine"),
    ([*MEGATRON_GPU, "trainer.tp=2"], "set trainer.tp, pp, ep, cp to 1"),
    (["rollout.num_engines=0"], "rollout.num_engines must be >= 1"),
    (["rollout.weight_sync=shared_memory", "ray.enabled=false"], "set ray.enabled=true"),
    (["rollout.weight_sync=shared_memory", "trainer=fsdp"], "set rollout.weight_sync=object_store"),
    (["rollout.weight_sync=broadcast", "ray.enabled=false"], "set ray.enabled=true"),
    (["rollout.weight_sync=broadcast", "trainer=fsdp"], "set rollout.weight_sync=object_store"),
    (["rollout.max_staleness=-1"], "rollout.max_staleness must be >= 0"),
    (["rollout.offload=true"], "set rollout.offload=false"),  # the CPU: nothing to free
    (["rollout.engine=vllm"], "choose the engine with its group, rollout=vllm"),
    (["rollout=vllm", "rollout.engine=native"], "choose the engine with its group, rollout=native"),
    (["rollout=vllm", "+rollout.vllm.llm_args.max_num_seqs=4"], "set rollout.max_running=4"),
    (["rollout=vllm", "+rollout.vllm.llm_args.tensor_parallel_size=2"], "set rollout.num_gpus_per_engine=2"),
    (["rollout=sglang", "+rollout.sglang.server_args.max_running_requests=8"], "set rollout.max_running=8"),
    (["rollout=sglang", "rollout.sglang.url=http://h:1", "rollout.num_engines=2"], "set rollout.sglang.url=null"),
    (["trainer.offload=true"], "set trainer.offload=false"),
    (["trainer.offload_optimizer=true"], "on the CPU already: set trainer.offload_optimizer=false"),
    (["trainer=megatron", "hardware=gpu", "hardware.memory_gb=80", "trainer.offload_optimizer=true"],
     "not by trainer=megatron: set trainer.offload_optimizer=false or trainer=torch"),
    (["rollout.asynchronous=true", "algo=sft"], "set rollout.asynchronous=false"),
    (["rollout.asynchronous=true", "debug.rollout_only=true"], "debug.rollout_only runs without"),
    (["rollout.asynchronous=true", "debug.compare_weights_tensorwise=true"], "set one of them false"),
])
def test_true_on_policy_and_scale_out_rules_name_the_fix(compose, overrides, message):
    problems = validate(compose(overrides))
    assert any(message in p for p in problems), problems


def test_true_on_policy_and_scale_out_defaults_validate(compose):
    assert validate(compose(["true_on_policy=true", "precision=bf16"])) == []
    assert validate(compose(["true_on_policy=true", "precision=fp8"])) == []
    assert validate(compose(["true_on_policy=true", "precision=int4_qat"])) == []
    assert validate(compose(["trainer=fsdp", "trainer.num_ranks=2", "rollout.num_engines=2"])) == []
    assert validate(compose(["rollout.num_engines=2", "rollout.weight_sync=broadcast"])) == []
    assert validate(compose(["rollout.num_engines=2", "rollout.weight_sync=shared_memory"])) == []
    assert validate(compose(["rollout=sglang", "rollout.sglang.url=http://10.0.0.5:30000"])) == []
    assert validate(compose([*MEGATRON_GPU, "model=qwen3_moe_tiny", "precision=fp32"])) == []
    # Megatron: R3, offload, INT4 QAT and quantized rollouts, the MLA families (tests/megatron runs them)
    assert validate(compose([*MEGATRON_GPU, "model=qwen3_moe_tiny", "algo.routing_replay=r3", "trainer.offload=true",
                             "precision=int4_qat"])) == []
    assert validate(compose([*MEGATRON_GPU, "precision=bf16_train_fp8_rollout"])) == []
    assert validate(compose([*MEGATRON_GPU, "precision=fp8"])) == []  # w8a16 (fp8's default scheme)
    assert validate(compose([*MEGATRON_GPU, "precision=fp8", "trainer.lora.rank=8"])) == []  # QLoRA, w8a16
    assert validate(compose([*MEGATRON_GPU, "model=deepseek_v3_tiny", "model.mtp_layers=0"])) == []
    gpu = ["hardware=h200", "hardware.gpus_per_node=1", "dry_run=true", "rollout.offload=true", "trainer.offload=true"]
    assert validate(compose(gpu)) == []
    assert any("set rollout.colocate=true" in p for p in validate(compose([*gpu, "rollout.colocate=false"])))
    assert any("set one of them false" in p for p in validate(compose([*gpu, "rollout.asynchronous=true"])))
    assert validate(compose(["rollout.asynchronous=true", "rollout.max_staleness=2", "rollout.num_engines=2"])) == []


def test_forward_weights_rule(compose):
    assert validate(compose(["precision=fp8", "precision.forward_weights=rollout"])) == []
    with pytest.raises(HydraException, match="forward_weights"):  # the ForwardWeights Enum: master | rollout
        compose(["precision.forward_weights=bf16"])


def test_ray_worker_niceness_rule(compose):
    assert not [p for p in validate(compose(["ray.worker_niceness=19"])) if "worker_niceness" in p]
    assert not [p for p in validate(compose(["ray.worker_niceness=null"])) if "worker_niceness" in p]
    for bad in (-5, 20):
        assert f"ray.worker_niceness must be in [0, 19] or null (got {bad})" in validate(
            compose([f"ray.worker_niceness={bad}"]))
