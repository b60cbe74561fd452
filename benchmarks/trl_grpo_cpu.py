"""A Miles GRPO step vs TRL's GRPOTrainer step, side by side in one process on the CPU.

Set-up (a venv of its own; the project's .venv is not touched) and the run:

    python3 -m venv /tmp/trl-venv
    /tmp/trl-venv/bin/pip install -r benchmarks/requirements-trl.txt   # torch 2.13.0 CPU, trl, transformers, ...
    /tmp/trl-venv/bin/pip install -e . --no-deps                        # miles itself
    /tmp/trl-venv/bin/python benchmarks/trl_grpo_cpu.py --threads 2 --out /tmp/trl_grpo_cpu.json

    [--shapes 8x8x8,64x8x8] [--warmup 3] [--steps 10]   # prompts x samples x tokens; steps timed per side
    [--trl-micro-batch N]                              # TRL's per-device batch (default 128, as Miles')
    [--ray] [--two-actors] [--settle-ms MS]            # Miles' components as Ray actors (the default experiment's)
    [--compile]                                        # Miles' engine with rollout.compile_cpu=true
    [--set KEY=VALUE ...]                              # more Miles overrides (e.g. ray.worker_niceness=15)

Both sides start from the same random checkpoint of the default experiment's model (`qwen3_tiny`,
written by `random_checkpoint`; TRL loads it with `AutoModelForCausalLM`, Miles with its own
modules; the script checks that both give the same logits), get the same arithmetic prompts in the
same order (P per step, each sampled n times), generate exactly T new tokens per sample at
temperature 1 (no top-k / top-p; Miles' stop ids are emptied, TRL gets `min_new_tokens = T`), score
them with the same exact-match reward, and take one AdamW step per rollout at the same learning
rate (5e-4, constant), betas, weight decay 0, gradient clipping 1.0, fp32, a PPO-clipped loss
(eps 0.2) normalised by the step's token count, group-normalised advantages (mean and std),
beta = 0 (no reference model). Miles runs the default experiment's config at this shape
(`trainer.global_batch_size = P*n`, `trainer.micro_batch_size = min(128, P*n)`); micro-batching
below.

A Miles step is what `miles.orchestrate.loop.rl_loop` does in-process (`ray.enabled=false`), with the
components `miles.orchestrate.run` builds from the composed default config: `collect_rollout`
(NativeEngine.generate + reward) = rollout, `make_train_batch` + `TorchTrainer.train_rl` = train,
`sync_weights` (get_weights + update_weights with the checksum check) = sync. With `--ray` the engine
and the trainer are in one Ray actor (`ray.enabled=true` and `ray.hybrid`, the default experiment's
settings: the weights copied inside it, device-checksum checked); with `--two-actors` too, in an actor
each (the weights through Ray's object store or a /dev/shm segment, SHA-256 checked). Each side's step
then starts after an untimed `--settle-ms` pause (default 100), so that the other side's idle OpenMP
threads, in another process now, have stopped spinning on the cores.
A TRL step is one optimizer step of `trl.GRPOTrainer.train()` (transformers `generate`, no vLLM),
timed between consecutive `on_step_end` callbacks, so it includes everything TRL does per step
(data loading, generation, scoring, loss, optimizer, its metric bookkeeping). Its generation +
scoring part is timed by wrapping `_generate_and_score_completions` (measurement only).

The steps are interleaved in one `trainer.train()`: a callback runs one Miles step after each TRL
step and restarts TRL's clock when it returns (TRL, Miles, TRL, Miles, ...), so load from other jobs
hits both alike. Both run on the same `torch.set_num_threads`. The first `--warmup` steps of each
side are not timed; the table gives medians over the `--steps` after them and trl / miles of the
medians (per-pair ratios: min-max in the JSON and the last column).

Differences that stay (each side runs its own design at these settings):
- Generation: TRL runs transformers `generate` (a Python loop per token, DynamicCache) on all P*n
  rows, each with its own prefill; Miles' engine prefills each prompt once and expands its cache n
  times.
- Weight sync: TRL generates with the model it trains, so it has none; Miles copies the trainer's
  weights into the engine's own copy and checks them (`rollout.check_weight_sync`).
- Old log-probs: with one optimizer step per generation TRL reuses the training forward's detached
  log-probs (the script counts TRL's log-prob forwards per step: 1 per micro-batch, none extra).
  Miles' trainer does the same since commit 5b9ffd2; before it, it ran an extra no-grad forward.
- Micro-batches: TRL runs `--trl-micro-batch` padded sequences per forward (default: Miles'
  trainer.micro_batch_size, 128) with gradient accumulation. Miles packs samples up to
  trainer.max_tokens_per_micro_batch tokens (8192: at 64x8x8 one forward for all 512). TRL with one
  micro-batch of 512 measured the same as with 128 (2026-12-01).
- Both run the LM head at completion positions only (TRL's fused head, Miles' chunked head). AdamW
  is TRL's `adamw_torch` (single-tensor on CPU), Miles' foreach; either takes ~2 ms here.
Neither side logs to a tracker or the console during the timed steps (TRL: `logging_steps` past the
last step; Miles: the loop's log callback is a no-op). Both still compute their per-step metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent


def parse_shape(text: str) -> tuple[int, int, int]:
    p, n, t = (int(x) for x in text.lower().split("x"))
    return p, n, t


def loadavg() -> list[float]:
    return list(os.getloadavg())


# ----------------------------------------------------------------------------- Miles side
class FixedSource:
    """PromptSource stand-in: the shared prompt list, P at a time, in order; no eval set."""

    def __init__(self, examples):
        self.examples, self.pos, self.eval = examples, 0, []

    def next_batch(self, n: int):
        batch = self.examples[self.pos : self.pos + n]
        self.pos += n
        assert len(batch) == n, "ran out of prompts"
        return batch


def miles_cfg(p: int, n: int, t: int, threads: int, ray: bool = False, two_actors: bool = False,
              compile_cpu: bool = False, extra: tuple[str, ...] = ()):
    """The default experiment's composed RunCfg at this shape, in-process or (ray) as Ray actors: one
    for the engine and the trainer (ray.hybrid, the default), or (two_actors) an actor each;
    (compile_cpu) the engine's decoder compiled; `extra`: more overrides (`--set`)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from miles.config.store import register_configs
    from miles.validate import check

    register_configs()
    overrides = [
        f"rollout.batch_size={p}", f"rollout.n_samples_per_prompt={n}", f"rollout.max_new_tokens={t}",
        f"trainer.global_batch_size={p * n}", f"trainer.micro_batch_size={min(128, p * n)}",
        f"hardware.cpu_threads={threads}", f"ray.enabled={str(ray).lower()}", "warm_start.enabled=false",
        *(["ray.hybrid=false"] if two_actors else []), *(["rollout.compile_cpu=true"] if compile_cpu else []),
        *extra,
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=overrides))
    check(cfg)
    return cfg, overrides


class MilesSide:
    def __init__(self, ckpt: str, cfg, examples):
        from miles.data.rewards import get_reward_fn
        from miles.data.tokenizer import TokenizerInfo
        from miles.orchestrate.loop import LoopContext
        from miles.orchestrate.run import _spawn_components

        self.cfg = cfg
        engine, trainer, _ = _spawn_components(cfg, Path(ckpt), None)  # LocalHandles, or Ray actors
        # Benchmark only: no stop ids, so every sample has exactly T tokens (as TRL's min_new_tokens).
        engine.apply(_no_stop_ids)
        self.ctx = LoopContext(engine=engine, trainer=trainer, source=FixedSource(examples),
                               tokenizer=TokenizerInfo.load(ckpt), reward_fn=get_reward_fn(cfg.task.reward),
                               log=lambda metrics, step: None)
        self.first_prompts: list[str] = []

    def step(self) -> dict[str, float]:
        """One step of rl_loop (without eval and logging): rollout, train, sync."""
        from miles.orchestrate.loop import collect_rollout
        from miles.orchestrate.sync import sync_weights
        from miles.orchestrate.returns import make_train_batch

        ctx, cfg = self.ctx, self.cfg
        t0 = time.perf_counter()
        samples, _ = collect_rollout(ctx, cfg)
        t1 = time.perf_counter()
        batch, metrics = make_train_batch(ctx, cfg, samples)
        metrics.update(ctx.trainer.call("train_rl", batch))
        t2 = time.perf_counter()
        sync = sync_weights(ctx, cfg.rollout.check_weight_sync)
        t3 = time.perf_counter()
        assert all(len(s.response_ids) == cfg.rollout.max_new_tokens for s in samples)
        self.first_prompts.append(samples[0].prompt)
        return {"step": t3 - t0, "rollout": t1 - t0, "train": t2 - t1, "sync": t3 - t2, "sync_fn": sync,
                "loss": metrics.get("train/loss", float("nan"))}


def _no_stop_ids(engine) -> None:
    engine.stop_ids = torch.tensor([], dtype=torch.long)


# ----------------------------------------------------------------------------- TRL side
def build_trl(ckpt: str, cfg, examples, steps_total: int, outdir: str, callback, micro: int):
    import datasets
    import transformers
    import trl

    from miles.data.rewards import get_reward_fn

    r, tr = cfg.rollout, cfg.trainer
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    reward = get_reward_fn(cfg.task.reward)
    seen: list[str] = []

    def exact_match(prompts, completions, label, completion_ids, **_):
        assert all(len(c) == r.max_new_tokens for c in completion_ids)
        seen.append(prompts[0])
        return [reward(c, y) for c, y in zip(completions, label)]

    # TRL tokenizes plain-text prompts with add_special_tokens and our tokenizer adds none: prepend
    # the <bos> token that Miles' encode_prompt puts first, so both see the same prompt ids.
    ds = datasets.Dataset.from_dict({"prompt": [tok.bos_token + e.prompt for e in examples],
                                     "label": [e.label for e in examples]})
    args = trl.GRPOConfig(
        output_dir=outdir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=micro, gradient_accumulation_steps=tr.global_batch_size // micro,
        num_generations=r.n_samples_per_prompt, max_completion_length=r.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        generation_kwargs={"min_new_tokens": r.max_new_tokens},
        learning_rate=tr.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=tr.weight_decay,
        adam_beta1=tr.adam_beta1, adam_beta2=tr.adam_beta2, optim="adamw_torch", max_grad_norm=tr.grad_clip,
        beta=0.0, num_iterations=cfg.algo.num_steps_per_rollout, epsilon=cfg.algo.eps_clip,
        epsilon_high=cfg.algo.eps_clip_high, loss_type="dapo",  # dapo = token mean over the whole step
        scale_rewards="group" if cfg.algo.norm_adv_by_std else "none",
        max_steps=steps_total, logging_steps=steps_total + 1, save_strategy="no", report_to="none",
        disable_tqdm=True, shuffle_dataset=False, seed=cfg.seed, dataloader_pin_memory=False,
        log_completions=False,
    )
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[exact_match], args=args, train_dataset=ds,
                              processing_class=tok, callbacks=[callback])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its only print is after the last step
    # Measurement only: time generation + scoring inside TRL's step.
    inner = trainer._generate_and_score_completions

    def timed_generate(*a, **kw):
        start = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            callback.trl_generate += time.perf_counter() - start

    trainer._generate_and_score_completions = timed_generate
    # ... and count its log-prob forwards (no extra "old log-probs" forward is expected in this set-up).
    logp_forward = trainer._get_per_token_logps_and_entropies

    def counted_forward(*a, **kw):
        callback.trl_forwards += 1
        return logp_forward(*a, **kw)

    trainer._get_per_token_logps_and_entropies = counted_forward
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
            "generation_batch_size", "num_generations", "max_completion_length", "learning_rate",
            "lr_scheduler_type", "optim", "max_grad_norm", "beta", "epsilon", "loss_type", "scale_rewards",
            "activation_checkpointing", "bf16", "use_cpu")
    trainer.benchmark_config = {k: str(getattr(args, k, None)) for k in keys}
    return trainer, model, seen


def make_callback(miles: MilesSide, threads: int, settle_s: float = 0.0):
    from transformers import TrainerCallback

    class Interleave(TrainerCallback):
        """After each TRL optimizer step: one Miles step, then TRL's clock restarts. `settle_s`: an
        untimed pause before each side's step, so that the other side's idle OpenMP threads have
        stopped spinning (with Ray the two sides compute in different processes)."""

        def __init__(self):
            self.resume = None
            self.trl_generate = 0.0
            self.trl_forwards = 0
            self.trl: list[dict[str, float]] = []
            self.miles: list[dict[str, float]] = []

        def on_step_begin(self, args, state, control, **kw):
            if self.resume is None:  # the first step starts here (trainer set-up excluded)
                self.resume = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            end = time.perf_counter()
            self.trl.append({"step": end - self.resume, "generate": self.trl_generate, "forwards": self.trl_forwards})
            assert torch.get_num_threads() == threads
            time.sleep(settle_s)
            self.miles.append(miles.step())
            assert torch.get_num_threads() == threads
            self.trl_generate, self.trl_forwards = 0.0, 0
            time.sleep(settle_s)
            self.resume = time.perf_counter()

    return Interleave()


# ----------------------------------------------------------------------------- checks and report
@torch.no_grad()
def same_logits(ckpt: str, hf_model, examples) -> float:
    """max |logits| difference of the two loaded models on a few prompts (same weights, same modules' maths)."""
    from miles.data.tokenizer import TokenizerInfo, encode_prompt
    from miles.models import from_pretrained

    info = TokenizerInfo.load(ckpt)
    ours = from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = [encode_prompt(info, e.prompt) for e in examples[:8]]
    width = min(map(len, ids))
    tokens = torch.tensor([row[:width] for row in ids])
    hf_model.eval()
    theirs = hf_model(input_ids=tokens).logits
    hf_model.train()
    return float((ours(tokens) - theirs).abs().max())


def run_shape(shape: tuple[int, int, int], threads: int, warmup: int, steps: int, workdir: str,
              trl_micro: int | None = None, ray: bool = False, settle_s: float = 0.0, two_actors: bool = False,
              compile_cpu: bool = False, extra: tuple[str, ...] = ()) -> dict:
    from miles.data.arithmetic import ArithmeticTask
    from miles.data.tokenizer import DEFAULT_ALPHABET
    from miles.orchestrate.checkpoints import random_checkpoint

    p, n, t = shape
    total = warmup + steps
    cfg, overrides = miles_cfg(p, n, t, threads, ray, two_actors, compile_cpu, extra)
    ckpt = str(random_checkpoint(cfg.model, DEFAULT_ALPHABET, seed=cfg.seed, out=f"{workdir}/ckpt-{p}x{n}x{t}"))
    examples = ArithmeticTask(num_digits=cfg.task.num_digits).sample_train(p * (total + 1), np.random.default_rng(0))
    torch.set_num_threads(threads)
    miles = MilesSide(ckpt, cfg, examples)
    callback = make_callback(miles, threads, settle_s)
    trl_micro = min(trl_micro or cfg.trainer.micro_batch_size, p * n)
    assert (p * n) % trl_micro == 0, "--trl-micro-batch must divide prompts x samples"
    trainer, hf_model, trl_prompts = build_trl(ckpt, cfg, examples, total, f"{workdir}/trl-{p}x{n}x{t}", callback,
                                               trl_micro)
    torch.set_num_threads(threads)
    logit_diff = same_logits(ckpt, hf_model, examples)
    params = sum(x.numel() for x in hf_model.parameters())
    load_before = loadavg()
    trainer.train()
    load_after = loadavg()
    assert len(callback.trl) == total and len(callback.miles) == total
    trl_steps, miles_steps = callback.trl[warmup:], callback.miles[warmup:]
    med = lambda rows, key: statistics.median(r[key] for r in rows)
    pair = [a["step"] / b["step"] for a, b in zip(trl_steps, miles_steps)]
    return {
        "shape": f"{p}x{n}x{t}", "ray": ray, "two_actors": two_actors, "settle_s": settle_s, "prompts": p, "samples": n, "new_tokens": t, "rows": p * n,
        "micro_batch": cfg.trainer.micro_batch_size, "trl_micro_batch": trl_micro,
        "miles_trainer_cfg": str(cfg.trainer), "params": params, "overrides": overrides,
        "same_prompts": miles.first_prompts == [x.removeprefix("<bos>") for x in trl_prompts],
        "max_logit_diff": logit_diff, "trl_config": trainer.benchmark_config,
        "trl_logp_forwards_per_step": sorted({r["forwards"] for r in trl_steps}),
        "miles": {k: med(miles_steps, k) for k in ("step", "rollout", "train", "sync")},
        "trl": {"step": med(trl_steps, "step"), "generate": med(trl_steps, "generate"),
                "rest": statistics.median(r["step"] - r["generate"] for r in trl_steps)},
        "ratio_trl_over_miles": med(trl_steps, "step") / med(miles_steps, "step"),
        "pair_ratio_min": min(pair), "pair_ratio_max": max(pair),
        "miles_steps": callback.miles, "trl_steps": callback.trl, "warmup": warmup,
        "loadavg_before": load_before, "loadavg_after": load_after,
    }


def environment(threads: int) -> dict:
    import accelerate
    import datasets
    import transformers
    import trl

    import miles

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "trl": trl.__version__, "accelerate": accelerate.__version__,
        "datasets": datasets.__version__, "threads": threads, "cpu": cpu, "nproc": os.cpu_count(),
        "miles_path": str(Path(miles.__file__).parent), "git_head": git("rev-parse", "--short", "HEAD"),
        "git_dirty": git("status", "--short").splitlines(), "git_dirty_sha256": dirty_digest(git),
    }


def dirty_digest(git) -> str:
    """sha256 of the uncommitted state (tracked diff + untracked files), to tell runs on a changing tree apart."""
    import hashlib

    h = hashlib.sha256(git("diff", "HEAD").encode())
    for name in sorted(git("ls-files", "--others", "--exclude-standard").splitlines()):
        try:
            h.update(name.encode() + (REPO / name).read_bytes())
        except OSError:
            pass
    return h.hexdigest()[:16]


def table(results: list[dict]) -> str:
    lines = [
        "| shape (prompts x samples x tokens) | miles s/step (rollout / train / sync) | trl s/step (generate+score / rest)"
        " | trl/miles | per-pair trl/miles |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        m, t = r["miles"], r["trl"]
        lines.append(
            f"| {r['shape']} | {m['step']:.3f} ({m['rollout']:.3f} / {m['train']:.3f} / {m['sync']:.3f}) "
            f"| {t['step']:.3f} ({t['generate']:.3f} / {t['rest']:.3f}) | {r['ratio_trl_over_miles']:.2f}x "
            f"| {r['pair_ratio_min']:.2f}-{r['pair_ratio_max']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="8x8x8,64x8x8", help="prompts x samples x new tokens, comma-separated")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per side")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side")
    ap.add_argument("--trl-micro-batch", type=int, default=None,
                    help="TRL's per_device_train_batch_size (gradient accumulation makes up the rest of the step); "
                         "default: Miles' trainer.micro_batch_size")
    ap.add_argument("--ray", action="store_true", help="Miles' engine and trainer as Ray actors (the default "
                    "experiment's ray.enabled=true: one actor for both, ray.hybrid); else in-process")
    ap.add_argument("--two-actors", action="store_true", help="with --ray: an actor each (ray.hybrid=false)")
    ap.add_argument("--settle-ms", type=float, default=None,
                    help="untimed pause before each side's step (default: 100 with --ray, else 0)")
    ap.add_argument("--compile", action="store_true", help="Miles' engine with rollout.compile_cpu=true (its "
                    "first compile falls in the untimed warm-up steps)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more Miles config overrides, e.g. ray.worker_niceness=15 (Ray's default)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    env = environment(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for text in args.shapes.split(","):
            settle = (args.settle_ms if args.settle_ms is not None else 100.0 if args.ray else 0.0) / 1000
            res = run_shape(parse_shape(text), args.threads, args.warmup, args.steps, workdir, args.trl_micro_batch,
                            args.ray, settle, args.two_actors, args.compile, tuple(args.set))
            print(f"{res['shape']}: miles {res['miles']['step']:.3f} s/step, trl {res['trl']['step']:.3f} s/step, "
                  f"trl/miles {res['ratio_trl_over_miles']:.2f}x; {res['params']:,} params; same prompts "
                  f"{res['same_prompts']}; max logit diff {res['max_logit_diff']:.1e}; TRL log-prob forwards per step "
                  f"{res['trl_logp_forwards_per_step']}; "
                  f"load {res['loadavg_before'][0]:.2f} -> {res['loadavg_after'][0]:.2f}", file=sys.stderr)
            results.append(res)
            if args.ray:  # the next shape's actors need the CPUs these held
                import ray

                ray.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps({"env": env, "results": results}, indent=2) + "\n")
    print(f"\ntorch {env['torch']}, transformers {env['transformers']}, trl {env['trl']}, "
          f"{args.threads} threads, {env['cpu']}; median of {args.steps} steps after {args.warmup} warm-up; "
          f"Miles {('in Ray actors of their own' if args.two_actors else 'in one Ray actor') if args.ray else 'in-process'}"
          f"{', engine compiled (rollout.compile_cpu=true)' if args.compile else ''}\n")
    print(table(results))


if __name__ == "__main__":
    main()
