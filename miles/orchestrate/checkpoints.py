"""Where a run's initial weights come from: a user HF checkpoint, a cached SFT warm start, or a
seeded random init. Each is an HF-format directory (config.json, model.safetensors, tokenizer.json)
that the engine and the trainer load on their own, so actors only ever receive a path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import torch

from miles.config.schema import (AlgoCfg, AlgoName, DType, ModelCfg, PrecisionCfg, RunCfg, SpeculativeCfg,
                                 TrainerCfg)
from miles.data.source import PromptSource
from miles.data.tokenizer import TokenizerInfo, build_char_tokenizer, save_tokenizer
from miles.data.vision_inputs import VISION_TOKENS, save_image_processor, vision_token_ids
from miles.models import save_pretrained
from miles.models.hf_io import model_class
from miles.orchestrate.prompting import prompt_setup, uses_chat

# With the chat model's template and end-of-turn ids where it has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "preprocessor_config.json")
# Bump when the warm-start recipe changes, so stale cached checkpoints are rebuilt.
WARM_START_VERSION = 1
# The built-in OPD teacher: the warm-start recipe continued until it solves this share of training problems.
TEACHER_TARGET_ACCURACY = 0.9
TEACHER_STEPS = 3000


def copy_tokenizer(src: str | Path, dst: str | Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, Path(dst) / name)


def random_checkpoint(model: ModelCfg, alphabet: str, seed: int, out: str | Path, chat: bool = False) -> Path:
    """A seeded, randomly initialized model of `model`'s sizes with a char tokenizer over `alphabet`
    (`chat`: with the tiny chat format, miles/data/tiny_chat.py). A vision-language model's tokenizer
    also carries Qwen's vision tokens (their ids replace the YAML's) and an image processor is saved."""
    out = Path(out)
    tok = build_char_tokenizer(alphabet, chat=chat)
    vision = {}
    if model.vision is not None:
        tok.add_special_tokens(list(VISION_TOKENS))
        vision = {"vision": replace(model.vision, **vision_token_ids(TokenizerInfo.from_tokenizer(tok)))}
    info = TokenizerInfo.from_tokenizer(tok)
    arch = model.arch(info.vocab_size, bos_token_id=info.bos_id, eos_token_id=info.eos_id, pad_token_id=info.pad_id,
                      **vision)
    torch.manual_seed(seed)
    save_pretrained(model_class(arch)(arch), out)
    save_tokenizer(tok, out)
    if arch.vision is not None:
        save_image_processor(arch.vision, out)
    return out


def _warm_start_key(cfg: RunCfg) -> str:
    ws = asdict(cfg.warm_start)
    ws.pop("cache_dir")
    if not ws["from_checkpoint"]:  # keys of random-init warm starts stay what they were
        ws.pop("from_checkpoint")
    recipe = {"v": WARM_START_VERSION, "model": asdict(cfg.model), "task": asdict(cfg.task), "ws": ws, "seed": cfg.seed}
    if cfg.hardware.device != "cpu":  # built on a GPU: other kernels, other weights (CPU keys unchanged)
        recipe["device"] = cfg.hardware.device
    if cfg.model.vision is not None:  # a frozen or a trained tower: other weights (text keys unchanged)
        recipe["freeze_vision"] = cfg.trainer.freeze_vision
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:12]


def warm_start_checkpoint(cfg: RunCfg, log=print) -> Path:
    """The cached SFT checkpoint for this model + task + recipe; built (in-process) when absent."""
    from miles.orchestrate.handles import LocalHandle
    from miles.orchestrate.loop import LoopContext, sft_loop
    from miles.data.rewards import build_scorer
    from miles.rollout.native import NativeEngine
    from miles.trainer.torch_trainer import TorchTrainer

    ws = cfg.warm_start
    out = Path(ws.cache_dir) / f"sft-{cfg.model.name}-{cfg.task.name}-{_warm_start_key(cfg)}"
    if (out / "warm_start.json").exists():
        return out
    log(f"building the warm-start SFT checkpoint (until {ws.target_accuracy:.0%} of training problems are solved, "
        f"at most {ws.steps} steps) -> {out}")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    # Its own data stream, so RL's prompts do not depend on whether the cache existed.
    source = PromptSource(cfg.task, cfg.seed, stream=1)
    # SFT the user's model when there is one (warm_start.from_checkpoint, or the built-in OPD teacher).
    from_hf = cfg.model.hf_checkpoint is not None
    init = Path(cfg.model.hf_checkpoint) if from_hf else \
        random_checkpoint(cfg.model, source.alphabet(), cfg.seed, tmp / "init", chat=uses_chat(cfg, source))
    fp32 = PrecisionCfg(name="fp32", train_dtype=DType.fp32, rollout_dtype=DType.fp32)
    # The vision tower as trainer.freeze_vision says, a random init's too: trained from scratch by
    # AdamW at the SFT learning rate, a random tower's output collapses within tens of steps (the
    # patch embedding grows along the mean-pixel direction, every merged token turns parallel) and
    # the decoder learns the answers' prior; frozen, its random features keep each cell's colour
    # (docs/vlm.md, "Why it did not learn").
    trainer_cfg = TrainerCfg(lr=ws.lr, global_batch_size=ws.batch_size, micro_batch_size=ws.batch_size,
                             freeze_vision=cfg.trainer.freeze_vision)
    device = cfg.hardware.device
    # A model with MTP modules trains them with the policy (as DeepSeek pretrains them), so a
    # speculative run starts from a draft that predicts the warm start's own outputs.
    draft = SpeculativeCfg(kind="mtp", lr=ws.lr) if cfg.model.mtp_layers > 0 else None
    trainer = TorchTrainer(str(init), AlgoCfg(name=AlgoName.sft, policy_loss="nll"), trainer_cfg, fp32,
                           device=device, threads=cfg.hardware.cpu_threads, seed=cfg.seed, speculative=draft)
    engine = NativeEngine(str(init), replace(cfg.rollout, stop_tokens=[], speculative=SpeculativeCfg()), DType.fp32,
                          device=device, threads=cfg.hardware.cpu_threads, seed=cfg.seed)
    history: list[dict] = []
    tokenizer = TokenizerInfo.load(init)
    prompt_format, multi_turn = prompt_setup(cfg, init, source)
    ctx = LoopContext(
        engine=LocalHandle(engine), trainer=LocalHandle(trainer), source=source,
        tokenizer=tokenizer, reward_fn=build_scorer(cfg.task),
        log=lambda m, step: _progress(history, step, m, log), task_name=cfg.task.name,
        eval_max_new_tokens=cfg.eval.max_new_tokens, prompt_format=prompt_format, multi_turn=multi_turn,
        sft_target_key=cfg.task.label_key,
    )
    probe = PromptSource(cfg.task, cfg.seed, stream=2).next_batch(256)
    accuracy = sft_loop(ctx, ws.steps, ws.batch_size, ws.check_interval, stop_when=(probe, ws.target_accuracy))
    trainer.save(str(tmp))
    copy_tokenizer(init, tmp)
    if not from_hf:
        shutil.rmtree(init)
    (tmp / "warm_start.json").write_text(json.dumps({"eval_accuracy": accuracy, "last": history[-1]}, indent=2))
    os.replace(tmp, out)  # atomic: a half-built cache entry is never picked up
    log(f"warm start ready: held-out accuracy {accuracy:.3f}")
    return out


def _progress(history: list[dict], step: int, metrics: dict, log) -> None:
    """Record a warm-start step; say where it stands at each check (minutes of SFT otherwise print nothing)."""
    history.append({"step": step, **metrics})
    if "train/probe_accuracy" in metrics:
        log(f"  warm start step {step}: loss {metrics.get('train/loss', float('nan')):.4f}, "
            f"training problems solved {metrics['train/probe_accuracy']:.3f}")


def initial_checkpoint(cfg: RunCfg, source: PromptSource, run_dir: Path, log=print) -> Path:
    """The weights RL (or SFT) starts from: model.hf_checkpoint as it is (validate() checked it), or
    after the SFT warm start (warm_start.from_checkpoint); else a random init or its warm start."""
    ws = cfg.warm_start
    if cfg.model.hf_checkpoint and not (ws.enabled and ws.from_checkpoint and cfg.algo.name != AlgoName.sft):
        return Path(cfg.model.hf_checkpoint)
    if cfg.algo.name == AlgoName.sft or not ws.enabled:
        return random_checkpoint(cfg.model, source.alphabet(), cfg.seed, run_dir / "init", chat=uses_chat(cfg, source))
    return warm_start_checkpoint(cfg, log)


def teacher_checkpoint(cfg: RunCfg, student_dir: Path, log=print) -> Path | None:
    """The on-policy distillation teacher (None without distillation): `algo.teacher_checkpoint`, or
    on the built-in task the warm-start SFT recipe trained further, until it solves
    TEACHER_TARGET_ACCURACY of the training problems (at most TEACHER_STEPS steps); built once and
    cached like the warm start, so the student (the warm start) learns from a better policy.
    Raises ConfigError if its vocabulary differs from the student's (OPD compares the two models'
    log-probs of the same token ids), or, for a vision-language student, if the teacher has no vision
    tower or processes images otherwise (its forward reads the student's pixel values)."""
    from tokenizers import Tokenizer

    from miles.config.errors import ConfigError

    a = cfg.algo
    if a.opd_kl_coef <= 0:
        return None
    if a.teacher_checkpoint is None:
        ws = replace(cfg.warm_start, target_accuracy=TEACHER_TARGET_ACCURACY, steps=TEACHER_STEPS)
        return warm_start_checkpoint(replace(cfg, warm_start=ws), log)
    teacher = Path(a.teacher_checkpoint)  # validate() checked that it holds a checkpoint
    vocab = [Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab() for d in (teacher, student_dir)]
    if vocab[0] != vocab[1]:
        raise ConfigError([f"algo.teacher_checkpoint={teacher} has another vocabulary than the student "
                           f"({student_dir}); the teacher must share the student's tokenizer"])
    if _vision_config(student_dir) is not None:
        if _vision_config(teacher) is None:
            raise ConfigError([f"algo.teacher_checkpoint={teacher} has no vision tower, and the student ({student_dir}) "
                               "is a vision-language model whose prompts hold images: the teacher must be one too"])
        processors = [(d / "preprocessor_config.json").read_text() if (d / "preprocessor_config.json").exists()
                      else None for d in (teacher, student_dir)]
        if json.loads(processors[0] or "null") != json.loads(processors[1] or "null"):
            raise ConfigError([f"algo.teacher_checkpoint={teacher} processes images otherwise than the student "
                               f"({student_dir}: preprocessor_config.json differs); the teacher reads the student's "
                               "pixel values"])
    return teacher


def _vision_config(directory: Path) -> dict | None:
    """The checkpoint's vision_config (config.json), None for a text model."""
    return json.loads((Path(directory) / "config.json").read_text()).get("vision_config")


MODEL_CONFIGS = Path(__file__).resolve().parents[2] / "conf" / "model"


def draft_checkpoint(cfg: RunCfg, policy_dir: Path, run_dir: Path, log=print) -> Path | None:
    """The speculative draft model (rollout.speculative.kind=draft_model; None otherwise): an HF
    checkpoint directory as it is, or a conf/model name built like the policy (its warm start on the
    task, cached; a random init without warm start), so that it shares the task's tokenizer. Raises
    ConfigError when the draft's vocabulary differs from the policy's."""
    from omegaconf import OmegaConf
    from tokenizers import Tokenizer

    from miles.config.errors import ConfigError

    spec = cfg.rollout.speculative
    if spec.kind != "draft_model":
        return None
    path = Path(spec.draft_model)
    if not (path / "config.json").exists():
        if not (MODEL_CONFIGS / f"{spec.draft_model}.yaml").exists():
            raise ConfigError([f"rollout.speculative.draft_model={spec.draft_model!r} is neither an HF checkpoint "
                               f"directory nor a config in {MODEL_CONFIGS}"])
        if cfg.model.hf_checkpoint is not None:
            raise ConfigError([f"rollout.speculative.draft_model={spec.draft_model} would be built with the task's "
                               "character tokenizer, the policy (model.hf_checkpoint) has its own: give an HF "
                               "checkpoint directory of a model with the policy's tokenizer"])
        model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg),
                                                    OmegaConf.load(MODEL_CONFIGS / f"{spec.draft_model}.yaml")))
        model = replace(model, max_position_embeddings=max(model.max_position_embeddings,
                                                           cfg.model.max_position_embeddings))
        draft_cfg = replace(cfg, model=model)
        if cfg.warm_start.enabled and cfg.algo.name != AlgoName.sft:
            return warm_start_checkpoint(draft_cfg, log)
        source = PromptSource(cfg.task, cfg.seed)
        return random_checkpoint(model, source.alphabet(), cfg.seed + 1, run_dir / "draft",
                                 chat=uses_chat(cfg, source))
    vocab = [Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab() for d in (path, policy_dir)]
    if vocab[0] != vocab[1]:
        raise ConfigError([f"rollout.speculative.draft_model={path} has another vocabulary than the policy "
                           f"({policy_dir}); the draft must share the policy's tokenizer"])
    return path
