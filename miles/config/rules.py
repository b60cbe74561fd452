"""The config's own cross-field rules, checked before anything starts.

`config_problems(cfg)` returns every problem it finds at once, each naming the key to change. Types
and unknown keys are the schema's job (miles/config/schema.py). A rule that needs what a component
knows (the families Megatron maps, the tools that resolve) lives with that component, and so do a
backend's own rules (what vLLM, SGLang, FSDP, Megatron combine with: miles/rollout/vllm_rules.py,
...); miles/validate.py runs them after these: the config imports nothing above itself. What stays
here reads the shared keys: the native engine's and the torch trainer's rules are the rest of them.
"""

from __future__ import annotations

from pathlib import Path

from miles.config.schema import (AlgoName, EngineName, HardwareCfg, PrecisionCfg, RolloutCfg, RunCfg, SpeculativeKind,
                                 TaskKind, TrainerBackend)
from miles.config.debug_rules import debug_problems
from miles.config.hybrid_rules import hybrid_problems
from miles.config.lora_rules import lora_problems
from miles.config.vlm_rules import is_vlm, vlm_problems
from miles.transport.protocol import TransportName


def _positive(problems: list[str], **values: float) -> None:
    for key, value in values.items():
        if value <= 0:
            problems.append(f"{key} must be > 0 (got {value})")


def _missing_hf_files(path: str) -> list[str]:
    return [f for f in ("config.json", "tokenizer.json") if not (Path(path) / f).is_file()]


def _algo_rl(problems: list[str], cfg: RunCfg) -> None:
    """Rules of the RL knobs added with PPO and OPD: critic, KL in the reward, reward clip, teacher."""
    from miles.algo.registry import TOKEN_ADVANTAGES

    a, c = cfg.algo, cfg.critic
    if a.advantage in TOKEN_ADVANTAGES:
        if not (0 <= a.gamma <= 1 and 0 <= a.lam <= 1):
            problems.append(f"algo.gamma and algo.lam must be in [0, 1] (got {a.gamma}, {a.lam})")
        if c.lr <= 0 or (c.value_clip is not None and c.value_clip <= 0):
            problems.append("critic.lr must be > 0 and critic.value_clip > 0 (or null: off)")
        if c.updates_per_step < 1:
            problems.append(f"critic.updates_per_step must be >= 1 (got {c.updates_per_step})")
        if cfg.ray.enabled and cfg.ray.num_cpus is not None and cfg.ray.num_cpus < 3:
            problems.append(f"ray.num_cpus must be >= 3 with a critic: one each for engine, trainer, critic "
                            f"(got {cfg.ray.num_cpus})")
        if not 0 <= c.warmup_steps < cfg.steps:
            problems.append(f"critic.warmup_steps must be in [0, steps) (got {c.warmup_steps}, steps={cfg.steps})")
    if a.kl_in_reward and a.kl_coef <= 0:
        problems.append("algo.kl_in_reward needs algo.kl_coef > 0")
    if a.reward_clip is not None and a.reward_clip <= 0:
        problems.append(f"algo.reward_clip must be > 0 or null (got {a.reward_clip})")
    if a.opd_kl_coef < 0 or (a.name == AlgoName.opd and a.opd_kl_coef == 0):
        problems.append(f"algo.opd_kl_coef must be >= 0, and > 0 for algo=opd (got {a.opd_kl_coef})")
    if a.opd_kl_coef > 0:
        if a.teacher_checkpoint is None and cfg.task.kind != TaskKind.arithmetic:
            problems.append("algo.teacher_checkpoint must be set for on-policy distillation on task.kind=file")
        elif a.teacher_checkpoint is not None and (missing := _missing_hf_files(a.teacher_checkpoint)):
            problems.append(
                f"algo.teacher_checkpoint={a.teacher_checkpoint} must be an HF checkpoint directory; "
                f"missing: {', '.join(missing)}"
            )


def config_problems(cfg: RunCfg) -> list[str]:
    from miles.algo.corrections import LEVELS
    from miles.algo.losses import AGG_MODES
    from miles.algo.registry import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES, TOKEN_ADVANTAGES
    problems: list[str] = []
    r, t, a, m = cfg.rollout, cfg.trainer, cfg.algo, cfg.model
    _positive(
        problems,
        steps=cfg.steps,
        **{
            "rollout.batch_size": r.batch_size,
            "rollout.n_samples_per_prompt": r.n_samples_per_prompt,
            "rollout.max_new_tokens": r.max_new_tokens,
            "trainer.global_batch_size": t.global_batch_size,
            "trainer.micro_batch_size": t.micro_batch_size,
            "trainer.lr": t.lr,
            "algo.num_steps_per_rollout": a.num_steps_per_rollout,
            "eval.interval": cfg.eval.interval,
            "task.eval_size": cfg.task.eval_size,
        },
    )
    if r.temperature < 0:
        problems.append(f"rollout.temperature must be >= 0 (got {r.temperature}; 0 means greedy)")
    if not 0 < r.top_p <= 1:
        problems.append(f"rollout.top_p must be in (0, 1] (got {r.top_p})")
    if r.top_k < 0:
        problems.append(f"rollout.top_k must be >= 0 (got {r.top_k}; 0 turns it off)")
    problems += engine_problems(cfg)
    problems += scale_out_problems(cfg)
    problems += asynchronous_problems(cfg)
    problems += hybrid_problems(cfg)
    problems += offload_problems(cfg)
    problems += speculative_problems(cfg)
    if t.grad_clip < 0:
        problems.append(f"trainer.grad_clip must be >= 0 (got {t.grad_clip}; 0 turns it off)")

    if t.micro_batch_size > 0 and t.global_batch_size % t.micro_batch_size:
        problems.append(
            f"trainer.global_batch_size ({t.global_batch_size}) must be a multiple of "
            f"trainer.micro_batch_size ({t.micro_batch_size})"
        )
    if a.name != AlgoName.sft:
        samples = r.batch_size * r.n_samples_per_prompt
        consumed = t.global_batch_size * a.num_steps_per_rollout
        if samples > 0 and consumed > 0 and samples != consumed:
            problems.append(
                "batch invariant broken: rollout.batch_size * rollout.n_samples_per_prompt "
                f"({r.batch_size} * {r.n_samples_per_prompt} = {samples}) must equal "
                "trainer.global_batch_size * algo.num_steps_per_rollout "
                f"({t.global_batch_size} * {a.num_steps_per_rollout} = {consumed}); "
                f"e.g. set trainer.global_batch_size={samples // max(a.num_steps_per_rollout, 1)}"
            )
        if a.norm_adv_by_std and r.n_samples_per_prompt == 1:
            problems.append("rollout.n_samples_per_prompt must be >= 2 for group-normalized advantages")
        for key, name, registry in (
            ("algo.advantage", a.advantage, {**ADVANTAGES, **TOKEN_ADVANTAGES}),
            ("algo.policy_loss", a.policy_loss, POLICY_LOSSES),
            ("algo.kl_estimator", a.kl_estimator, KL_ESTIMATORS),
        ):
            if name not in registry:
                problems.append(f"{key}={name!r} is unknown; valid: {', '.join(sorted(registry))}")
        if not 0 <= a.eps_clip <= 1 or a.eps_clip_high < 0:
            problems.append("algo.eps_clip must be in [0, 1] and algo.eps_clip_high >= 0")
        if a.loss_agg not in AGG_MODES:
            problems.append(f"algo.loss_agg={a.loss_agg!r} is unknown; valid: {', '.join(AGG_MODES)}")
        # No rule ties policy_loss=gspo to sequence-level advantages: with per-token ones
        # (advantage=gae, opd_kl_coef > 0, tis=token) gspo_loss is GSPO-token, each token's gradient
        # weighted by its own advantage, and equals sequence-level GSPO when they are per-sequence.
        if a.dual_clip_c is not None and (a.dual_clip_c <= 1 or a.policy_loss != "ppo_clip"):
            problems.append("algo.dual_clip_c must be > 1 and needs algo.policy_loss=ppo_clip")
        for key, level in (("algo.tis", a.tis), ("algo.mis", a.mis)):
            if level not in ("none", *LEVELS):
                problems.append(f"{key}={level!r} is unknown; valid: none, {', '.join(LEVELS)}")
        if a.tis_clip <= 0 or not 0 <= a.mis_low < 1 < a.mis_high:
            problems.append("algo.tis_clip must be > 0 and algo.mis_low < 1 < algo.mis_high")
        if a.max_draws < 1 or not 0 <= a.overlong_buffer < r.max_new_tokens:
            problems.append("algo.max_draws must be >= 1 and 0 <= algo.overlong_buffer < rollout.max_new_tokens")
        if a.kl_coef < 0:
            problems.append(f"algo.kl_coef must be >= 0 (got {a.kl_coef})")
        _algo_rl(problems, cfg)
    elif a.policy_loss != "nll":
        problems.append(f"algo.policy_loss must be 'nll' for algo=sft (got {a.policy_loss!r})")

    if cfg.ray.worker_niceness is not None and not 0 <= cfg.ray.worker_niceness <= 19:
        # below 0 needs CAP_SYS_NICE, which Ray's raylet does not ask for
        problems.append(f"ray.worker_niceness must be in [0, 19] or null (got {cfg.ray.worker_niceness})")
    if cfg.task.kind == TaskKind.file and not cfg.task.train_file:
        problems.append("task.train_file must be set when task.kind=file")
    from miles.data.answers import EXTRACTORS

    if cfg.task.label_extractor not in EXTRACTORS:
        problems.append(f"task.label_extractor={cfg.task.label_extractor!r} is unknown; valid: {', '.join(EXTRACTORS)}")
    if cfg.task.kind == TaskKind.arithmetic and not set(cfg.task.ops) <= set("+-*"):
        problems.append(f"task.ops must use only + - * (got {cfg.task.ops!r})")
    if not 0 < cfg.task.eval_fraction < 1:
        problems.append(f"task.eval_fraction must be in (0, 1) (got {cfg.task.eval_fraction})")

    if m.hf_checkpoint is not None:
        if missing := _missing_hf_files(m.hf_checkpoint):
            problems.append(
                f"model.hf_checkpoint={m.hf_checkpoint} must be an HF checkpoint directory; missing: {', '.join(missing)}"
            )
    else:
        _positive(
            problems,
            **{
                "model.hidden_size": m.hidden_size,
                "model.num_layers": m.num_layers,
                "model.num_heads": m.num_heads,
                "model.num_kv_heads": m.num_kv_heads,
                "model.head_dim": m.head_dim,
            },
        )
        if not problems:
            problems += [f"model.{p}" if not p.startswith("model.") else p for p in m.problems()]
    problems += precision_problems(cfg.precision, cfg.hardware)
    if cfg.hardware.device == "cpu" and cfg.hardware.gpus_per_node:
        problems.append("hardware.gpus_per_node must be 0 when hardware.device=cpu")
    problems += device_problems(cfg)
    problems += reward_problems(cfg)
    problems += multi_turn_problems(cfg)
    problems += routing_replay_problems(cfg)
    problems += true_on_policy_problems(cfg)
    problems += compile_cpu_problems(cfg)
    problems += dense_copy_problems(cfg)
    problems += memory_saver_problems(cfg)
    problems += lora_problems(cfg)
    problems += vlm_problems(cfg)
    if cfg.rollout.num_engines < 1:
        problems.append(f"rollout.num_engines must be >= 1 (got {cfg.rollout.num_engines})")
    elif cfg.rollout.num_engines > 1 and cfg.rollout.max_turns > 1:
        problems.append("rollout.num_engines > 1 does not combine with multi-turn rollouts (task.tools) yet: "
                        "set rollout.num_engines=1")
    if cfg.trainer.max_tokens_per_micro_batch < 1:
        problems.append(f"trainer.max_tokens_per_micro_batch must be >= 1 (got {cfg.trainer.max_tokens_per_micro_batch})")
    for key, value, least in (("checkpoint.interval", cfg.checkpoint.interval, 0),
                              ("checkpoint.keep_last", cfg.checkpoint.keep_last, 1),
                              ("fault.max_retries", cfg.fault.max_retries, 0),
                              ("tracking.flush_timeout_s", cfg.tracking.flush_timeout_s, 0)):
        if value < least:
            problems.append(f"{key} must be >= {least} (got {value})")
    problems += debug_problems(cfg)
    return problems


def reward_problems(cfg: RunCfg) -> list[str]:
    """task.reward must resolve (built-in names, importable functions, a weighted sum of them; remote
    with its task.reward_url) before anything starts, and the code reward needs usable sandbox limits."""
    from dataclasses import fields

    from miles.data.rewards import get_reward_fn, parse_spec

    t = cfg.task
    problems = [] if t.reward_timeout_s > 0 else [f"task.reward_timeout_s must be > 0 (got {t.reward_timeout_s})"]
    try:
        get_reward_fn(t.reward, t)
    except ValueError as error:
        return problems + [str(error)]
    if any(name == "code" for _, name in parse_spec(t.reward)):
        _positive(problems, **{f"task.sandbox.{f.name}": getattr(t.sandbox, f.name) for f in fields(t.sandbox)
                               if f.name != "isolation"})
        from miles.data.sandbox import sandbox_problems

        problems += sandbox_problems(t.sandbox)  # fail closed: no box here, no code reward (or isolation=none)
    return problems


def routing_replay_problems(cfg: RunCfg) -> list[str]:
    """algo.routing_replay: a known mode; r2 / r3 replay MoE routing, so they need RL and a model with
    MoE layers (the sizes of model.hf_checkpoint's config.json when one is given)."""
    import json

    from miles.types import moe_layers

    mode = cfg.algo.routing_replay
    if mode not in ("none", "r2", "r3"):
        return [f"algo.routing_replay={mode!r} is unknown; valid: none, r2, r3"]
    if mode == "none":
        return []
    if cfg.algo.name == AlgoName.sft:
        return [f"algo.routing_replay={mode} applies to RL, not algo=sft: set algo.routing_replay=none"]
    arch = cfg.model
    if arch.hf_checkpoint is not None:
        from miles.models import from_hf_config

        try:
            arch = from_hf_config(json.loads((Path(arch.hf_checkpoint) / "config.json").read_text()))
        except (OSError, ValueError):
            return []  # an unreadable checkpoint is reported by the model.hf_checkpoint rules
    if not moe_layers(arch):
        return [f"algo.routing_replay={mode} replays MoE routing, but model={cfg.model.name} has no MoE layer: "
                "set algo.routing_replay=none"]
    return []


def scale_out_problems(cfg: RunCfg) -> list[str]:
    """trainer.num_ranks and rollout.weight_sync: what each transport needs (the Enums of miles.config.schema
    refuse unknown names at composition); a trainer backend's own limits are in its rules module."""
    t, r = cfg.trainer, cfg.rollout
    problems = []
    if t.num_ranks < 1:
        problems.append(f"trainer.num_ranks must be >= 1 (got {t.num_ranks})")
    if r.weight_sync == TransportName.shared_memory:
        if not cfg.ray.enabled:
            problems.append("rollout.weight_sync=shared_memory maps one buffer into the engines' Ray actors: "
                            "set ray.enabled=true (in-process runs copy the weights directly)")
        if cfg.hardware.device != "cpu" and not r.colocate:
            problems.append("rollout.weight_sync=shared_memory on a GPU shares the trainer's GPU with the engines "
                            "(CUDA IPC); rollout.colocate=false gives them other GPUs: set rollout.weight_sync=broadcast")
    elif r.weight_sync == TransportName.broadcast:
        if not cfg.ray.enabled:
            problems.append("rollout.weight_sync=broadcast joins the trainer and the engines as Ray actors: "
                            "set ray.enabled=true (in-process runs copy the weights directly)")
        if cfg.hardware.device != "cpu":
            problems.append("rollout.weight_sync=broadcast on a GPU uses NCCL, one GPU per member; this run "
                            "shares one: set rollout.weight_sync=object_store")
        if r.weight_sync_bucket_mb <= 0:
            problems.append(f"rollout.weight_sync_bucket_mb must be > 0 (got {r.weight_sync_bucket_mb})")
    return problems


def engine_options(r: RolloutCfg) -> list[str]:
    """The engines whose options block (`rollout.<engine>`) the composed config holds."""
    return sorted(name.value for name in EngineName if getattr(r, name.value, None) is not None)


def engine_chosen_by_group(r: RolloutCfg) -> bool:
    """The options present are the chosen engine's and no other's: its group file chose it. Only then
    do that engine's rules read its block (miles/rollout/<engine>_rules.py)."""
    return engine_options(r) == ([r.engine.value] if hasattr(r, r.engine.value) else [])


def engine_problems(cfg: RunCfg) -> list[str]:
    """rollout=<engine>: the chosen engine's options are present (its group file adds them), and only its."""
    r = cfg.rollout
    if engine_chosen_by_group(r):
        return []
    # rollout.engine=<name> set by hand (or rollout.<other>.* added): the group file is the one way
    return [f"rollout.engine={r.engine} with options rollout.{', rollout.'.join(engine_options(r)) or '<none>'}: "
            f"choose the engine with its group, rollout={r.engine} (conf/rollout/{r.engine}.yaml adds its options)"]


def speculative_problems(cfg: RunCfg) -> list[str]:
    """rollout.speculative: the native engine's draft-and-verify decoding and the draft's online training."""
    s, r = cfg.rollout.speculative, cfg.rollout
    if s.kind == SpeculativeKind.none:
        return []
    problems = []
    if s.num_tokens < 1:
        problems.append(f"rollout.speculative.num_tokens must be >= 1 (got {s.num_tokens})")
    if s.lr is not None and s.lr <= 0:
        problems.append(f"rollout.speculative.lr must be > 0 (got {s.lr})")
    if s.kind == "mtp" and cfg.model.hf_checkpoint is None and cfg.model.mtp_layers < 1:
        problems.append("rollout.speculative.kind=mtp drafts with the model's MTP modules: set model.mtp_layers=1 "
                        "(families with MTP: deepseek_v3, deepseek_v32, glm4_moe, glm_moe_dsa, qwen3_next)")
    if s.kind == "draft_model" and not s.draft_model:
        problems.append("rollout.speculative.kind=draft_model needs rollout.speculative.draft_model: a conf/model "
                        "name (e.g. qwen3_tiny) or an HF checkpoint directory with the policy's tokenizer")
    if cfg.algo.routing_replay == "r3" or cfg.true_on_policy:
        problems.append("rollout.speculative does not record routed experts and does not run the trainer's kernels: "
                        "set rollout.speculative.kind=none with algo.routing_replay=r3 or true_on_policy=true")
    if r.slot_decode and s.kind == "mtp":
        problems.append("rollout.speculative.kind=mtp decodes on the padded path; rollout.slot_decode=true runs "
                        "draft models only: set rollout.slot_decode=null")
    if s.train_online and cfg.trainer.backend != TrainerBackend.torch:
        problems.append(f"rollout.speculative.train_online trains the draft in the native trainer, not "
                        f"trainer={cfg.trainer.backend}: set trainer=torch or rollout.speculative.train_online=false")
    if s.kind == "draft_model" and s.train_online:
        if r.asynchronous or r.weight_sync != "object_store":
            problems.append("rollout.speculative.kind=draft_model with train_online syncs the draft with the plain "
                            "weight sync only: set rollout.asynchronous=false and rollout.weight_sync=object_store")
        if r.offload:
            problems.append("rollout.offload=true does not release a separate draft model yet: set rollout.offload=false "
                            "or rollout.speculative.kind=mtp")
    return problems


def offload_problems(cfg: RunCfg) -> list[str]:
    """rollout.offload / trainer.offload: the sides of a colocated GPU run give their memory back in turn."""
    problems = []
    for key, on in (("rollout.offload", cfg.rollout.offload), ("trainer.offload", cfg.trainer.offload)):
        if not on:
            continue
        if cfg.hardware.device == "cpu":
            problems.append(f"{key}=true frees GPU memory between phases; on the CPU everything is in host memory "
                            f"already: set {key}=false")
        elif not cfg.rollout.colocate:
            problems.append(f"{key}=true is for the sides taking turns on the same GPUs: set rollout.colocate=true "
                            f"or {key}=false")
        if cfg.rollout.asynchronous:
            problems.append(f"{key}=true takes turns on the GPU; rollout.asynchronous=true overlaps the turns: "
                            "set one of them false")
    if cfg.trainer.offload_optimizer:  # the state lives in host memory, streamed through the device each step
        if cfg.hardware.device == "cpu":
            problems.append("trainer.offload_optimizer=true keeps the optimizer state in host memory, where it is "
                            "on the CPU already: set trainer.offload_optimizer=false")
        elif cfg.trainer.backend != TrainerBackend.torch:
            problems.append(f"trainer.offload_optimizer=true is implemented by the torch trainer, not by "
                            f"trainer={cfg.trainer.backend.value}: set trainer.offload_optimizer=false or trainer=torch")
    return problems


def asynchronous_problems(cfg: RunCfg) -> list[str]:
    """rollout.asynchronous overlaps generating and training an RL run's batches."""
    r, d = cfg.rollout, cfg.debug
    if r.max_staleness < 0:
        return [f"rollout.max_staleness must be >= 0 (got {r.max_staleness})"]
    if not r.asynchronous:
        return []
    problems = []
    if cfg.algo.name == AlgoName.sft:
        problems.append("rollout.asynchronous=true overlaps RL rollouts with training; algo=sft has none: "
                        "set rollout.asynchronous=false")
    for key, on in (("debug.rollout_only", d.rollout_only), ("debug.train_only", d.train_only),
                    ("debug.load_rollouts", bool(d.load_rollouts))):
        if on:
            problems.append(f"rollout.asynchronous=true needs both an engine and a trainer generating and training; "
                            f"{key} runs without one of them: set rollout.asynchronous=false")
    if d.compare_weights_tensorwise:
        problems.append("debug.compare_weights_tensorwise compares the engine's weights with the trainer's right after a sync; "
                        "with rollout.asynchronous=true the trainer has moved on by then: set one of them false")
    return problems


def true_on_policy_problems(cfg: RunCfg) -> list[str]:
    """true_on_policy=true is exact only where both sides can run the same kernels on the same layout."""
    if not cfg.true_on_policy:
        return []
    p, r, m = cfg.precision, cfg.rollout, cfg.model
    problems = []
    if cfg.algo.name == AlgoName.sft:
        problems.append("true_on_policy=true applies to RL (rollout log-probs), not algo=sft: set true_on_policy=false")
    if p.train_quant != p.rollout_quant:
        problems.append(f"true_on_policy=true needs one set of kernels on both sides, but precision={p.name} "
                        f"quantizes the rollout ({p.rollout_quant.value}) and not the training forward the same way "
                        f"({p.train_quant.value}): use precision=fp8, int4_qat, bf16 or fp32")
    if p.forward_weights != "master":
        problems.append("true_on_policy=true runs the engine on the trainer's fp32 masters under autocast: "
                        "set precision.forward_weights=master")
    if r.top_p < 1.0 or r.top_k > 0:
        problems.append("true_on_policy=true samples from the policy's own distribution; top-p / top-k "
                        "truncate it: set rollout.top_p=1.0 rollout.top_k=0")
    if r.engine != EngineName.native:
        problems.append(f"true_on_policy=true runs the native engine's batch-invariant kernels; "
                        f"rollout={r.engine} has its own: use rollout=native")
    if cfg.hardware.device != "cpu":
        # The CUDA kernels sum keys in blocks from column 0, so keys must sit at their positions: the
        # slot decoder's layout. MLA has slots too (under these kernels without the absorbed decode,
        # whose reduction order is not the trainer's), but only GQA's slot path is checked exact on a GPU.
        if m.mla is not None or m.dsa is not None or m.linear_attn is not None or m.llama4 is not None:
            problems.append(f"true_on_policy=true on a GPU needs the batch-invariant slot decode (GQA attention in "
                            f"every layer); model={m.name} has other attention kinds: run it with hardware=cpu")
        if r.slot_decode is False:
            problems.append("true_on_policy=true on a GPU decodes in the slot layout: set rollout.slot_decode=null")
    return problems


def dense_copy_problems(cfg: RunCfg) -> list[str]:
    """rollout.dense_weight_copies=true asks the native engine's weight-only layers for bf16 copies
    (miles/precision/dense_copy.py); where no layer would hold one, the setting is refused by name."""
    if cfg.rollout.dense_weight_copies is not True:
        return []
    from miles.precision.dense_copy import weight_only

    p, off = cfg.precision, "set rollout.dense_weight_copies=false"
    refused = [
        (cfg.rollout.engine != EngineName.native, f"rollout={cfg.rollout.engine} (the copies are the native engine's)"),
        (not weight_only(p.rollout_quant.value, p.fp8_scheme.value), f"precision={p.name} with fp8_scheme={p.fp8_scheme.value} (no weight-only layers: "
                          "fp8 w8a16 and int4 hold copies)"),
        (cfg.true_on_policy, "true_on_policy=true (its batch-invariant kernels never read a copy)")]
    return [f"rollout.dense_weight_copies=true does not combine with {what}: {off}" for bad, what in refused if bad]


def memory_saver_problems(cfg: RunCfg) -> list[str]:
    """rollout.memory_saver pauses the native CUDA engine's plain weights and slot cache at their
    addresses (miles/rollout/pausable.py); where it would pause nothing, it is refused by name."""
    r = cfg.rollout
    if not r.memory_saver:
        return []
    off = "set rollout.memory_saver=false"
    refused = [
        (cfg.hardware.device == "cpu", "hardware.device=cpu (it pauses CUDA memory)"),
        (r.engine != EngineName.native, f"rollout={r.engine} (it is the native engine's)"),
        (cfg.precision.rollout_quant.value != "none",
         f"precision={cfg.precision.name} (a quantized rollout format is not held in the flat buffer it pauses)")]
    return [f"rollout.memory_saver=true does not combine with {what}: {off}" for bad, what in refused if bad]


def compile_cpu_problems(cfg: RunCfg) -> list[str]:
    """rollout.compile_cpu compiles the native engine's plain decoder on the CPU; what it was not built
    or tested for is refused by name (CUDA has rollout.compile and CUDA graphs instead)."""
    r = cfg.rollout
    if not r.compile_cpu:
        return []
    off = "set rollout.compile_cpu=false"
    refused = [  # (refused, what, the change)
        (cfg.hardware.device != "cpu", f"hardware.device={cfg.hardware.device} (the GPU path has rollout.compile "
                                       "and CUDA graphs)", off),
        (r.engine != EngineName.native, f"rollout={r.engine} (it is the native engine's)", "use rollout=native"),
        (cfg.true_on_policy, "true_on_policy=true (its batch-invariant kernels run eagerly)", off),
        (cfg.trainer.lora.rank > 0, "trainer.lora (the adapters' hooks are not compiled)", off),
        (cfg.precision.rollout_quant.value != "none", f"precision={cfg.precision.name} (a quantized rollout)", off),
        (r.speculative.kind != SpeculativeKind.none, "rollout.speculative (draft and verify stay eager)", off),
        (r.slot_decode is True, "rollout.slot_decode=true (the padded decode is the one compiled)", off),
        (cfg.algo.routing_replay != "none", f"algo.routing_replay={cfg.algo.routing_replay} (the routing record is "
                                            "written during the forward)", off),
        (is_vlm(cfg), f"model={cfg.model.name} (a vision-language model)", off)]
    return [f"rollout.compile_cpu=true does not combine with {what}: {fix}" for bad, what, fix in refused if bad]


def multi_turn_problems(cfg: RunCfg) -> list[str]:
    """Multi-turn needs both tools and turns to call them in (the tools' names resolve in
    miles/rollout/tools.py's tool_problems)."""
    t, r = cfg.task, cfg.rollout
    problems = []
    if t.tools and r.max_turns < 2:
        problems.append("task.tools needs rollout.max_turns >= 2 (a turn to call a tool, one to answer)")
    if r.max_turns > 1 and not t.tools:
        problems.append("rollout.max_turns > 1 needs task.tools (the tools the model calls between turns)")
    return problems


def device_problems(cfg: RunCfg) -> list[str]:
    """A GPU profile needs a GPU here, unless the run only plans (dry_run); one process drives one GPU."""
    hw = cfg.hardware
    if hw.device == "cpu":
        return []
    if not hw.device.startswith("cuda"):
        return [f"hardware.device must be cpu or cuda (got {hw.device!r})"]
    if hw.gpus_per_node < 1:
        return [f"hardware.device={hw.device} needs hardware.gpus_per_node >= 1: for one GPU use hardware=gpu"]
    import torch

    if cfg.dry_run:
        if hw.memory_gb == 0 and not torch.cuda.is_available():
            return [f"hardware={hw.name} reads GPU memory from the visible device (hardware.memory_gb=0) and "
                    "none is visible: set hardware.memory_gb to plan for it"]
        return []
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return [f"hardware.device={hw.device} but no CUDA device is visible (torch {torch.__version__}, {build}): "
                "use hardware=cpu, or plan only with dry_run=true"]
    gpus = hw.num_nodes * hw.gpus_per_node
    if gpus > 1:
        return [f"hardware={hw.name} plans {gpus} GPUs, but a run drives one GPU today: "
                "set hardware.gpus_per_node=1 (or use hardware=gpu), or dry_run=true to plan the cluster"]
    return []


def precision_problems(precision: PrecisionCfg, hw: HardwareCfg) -> list[str]:
    """A recipe needs every number format it uses to be supported by the hardware profile."""
    needed = {precision.train_dtype.value, precision.rollout_dtype.value,
              precision.train_quant.value, precision.rollout_quant.value} - {"none"}
    missing = sorted(needed - set(hw.precisions))
    problems = []
    if missing:
        problems.append(f"precision={precision.name} uses {', '.join(missing)}, which hardware={hw.name} does not "
                        f"support (it runs {', '.join(hw.precisions)}); pick another precision recipe or hardware profile")
    if hw.device == "cpu" and precision.fp8_gemm not in ("auto", "emulated"):
        problems.append(f"precision.fp8_gemm={precision.fp8_gemm.value} is a CUDA kernel; the CPU runs the emulated "
                        "GEMM: set precision.fp8_gemm=auto")
    if precision.fp8_backward == "fp8" and precision.train_quant != "fp8":
        problems.append(f"precision.fp8_backward=fp8 applies to recipes that train in FP8, and precision="
                        f"{precision.name} trains with train_quant={precision.train_quant.value}: drop "
                        "precision.fp8_backward or use precision=fp8")
    if precision.fp8_scheme == "w8a16":
        if "fp8" not in (precision.train_quant.value, precision.rollout_quant.value):
            problems.append(f"precision.fp8_scheme=w8a16 applies to FP8 recipes, and precision={precision.name} "
                            "quantizes nothing to FP8: drop precision.fp8_scheme or use precision=fp8")
        elif precision.fp8_gemm != "auto":
            problems.append(f"precision.fp8_gemm={precision.fp8_gemm.value} picks the FP8 x FP8 kernel of "
                            "fp8_scheme=w8a8; w8a16 multiplies bf16 activations with its own kernel: set "
                            "precision.fp8_gemm=auto")
    return problems
