"""The training loops: RL (rollout -> reward -> advantages -> train -> sync) and SFT.

Both talk to the engine, the trainer and (PPO) the critic only through handles
(miles.orchestrate.handles), so the same loop drives Ray actors and in-process objects. Metric names
follow DESIGN.md.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from miles.algo.advantages import overlong_penalty
from miles.data.adapter_routing import AdapterRouting
from miles.data.example import Example
from miles.data.prompt_format import PromptFormat
from miles.data.rewards import RewardScorer
from miles.data.source import PromptSource
from miles.data.tokenizer import TokenizerInfo
from miles.orchestrate.colocate import MemoryPhases
from miles.orchestrate.handles import Handle
from miles.orchestrate.returns import make_train_batch
from miles.orchestrate.rollout_ahead import RolloutAhead
from miles.orchestrate.sync import sync_weights
from miles.rollout.multi_turn import MultiTurn
from miles.rollout.protocol import RolloutEngine
from miles.rollout.router import EngineFleet
from miles.trainer import Trainer
from miles.transport.object_store import ObjectStoreTransport
from miles.transport.protocol import WeightTransport
from miles.types import Sample, build_train_batch


@dataclass
class LoopContext:
    """What the loops hold: the components' handles (miles/orchestrate/handles.py; the engine side may
    be an EngineFleet of several engines), the data, the reward, and the hooks supervision and the
    debug modes set. None for a component a debug mode leaves out (debug.rollout_only: no trainer,
    debug.train_only: no engine)."""
    engine: Handle[RolloutEngine] | None
    trainer: Handle[Trainer] | None
    source: PromptSource
    tokenizer: TokenizerInfo
    reward_fn: Callable[..., float] | RewardScorer  # (response, label, **info) -> score; wrapped in a scorer
    log: Callable[[dict[str, float], int], None]  # (metrics, step) -> None
    on_samples: Callable[[list[Sample], int], None] = lambda samples, step: None
    task_name: str = "task"
    eval_max_new_tokens: int = 8
    critic: Handle | None = None  # a TorchCritic (algo.advantage=gae; Critics with named adapters), else None
    # Set by miles.orchestrate.supervise (resume, checkpoints, signals) and miles.orchestrate.debug.
    start_step: int = 0  # the step a resumed run continues after (0: a fresh run, evaluated at step 0)
    after_step: Callable[[int], None] = lambda step: None  # after each step is logged
    after_sync: Callable[["LoopContext"], None] = lambda ctx: None  # after each weight sync
    collect: Callable | None = None  # (ctx, cfg, step) -> (samples, metrics); None: collect_rollout
    prompt_format: PromptFormat | None = None  # example -> engine prompt (None: the text as it is)
    multi_turn: MultiTurn | None = None  # task.tools: tool-calling trajectories, else single-turn
    sft_target_key: str | None = None  # SFT trains on this record field when present (a worked solution)
    # rollout.weight_sync (miles/transport/protocol.py), over this context's handles; None: the object store
    transport: WeightTransport | None = None
    # rollout.asynchronous: the data position a checkpoint records (before the first untrained batch)
    source_state: Callable[[], dict] | None = None
    draft_sync: bool = False  # rollout.speculative.kind=draft_model trained online: sync the draft too
    adapters: AdapterRouting | None = None  # trainer.lora.adapters: each prompt's LoRA adapter

    def __post_init__(self) -> None:
        if not isinstance(self.reward_fn, RewardScorer):  # failures score 0 and are counted
            self.reward_fn = RewardScorer(self.reward_fn)
        if self.transport is None:
            self.transport = ObjectStoreTransport(self)

    @property
    def fmt(self) -> PromptFormat:
        if self.prompt_format is None:
            self.prompt_format = PromptFormat(self.tokenizer, apply_chat_template=False)
        return self.prompt_format


def generate(ctx: LoopContext, examples: list[Example], n: int, temperature: float | None = None,
             max_new_tokens: int | None = None) -> tuple[list[Sample], dict[str, float]]:
    """n samples per example (grouped), single- or multi-turn; with the multi-turn tool metrics."""
    # Several LoRA adapters: the engine samples each prompt with its own (Sample.adapter says which).
    routed = {"adapters": [ctx.adapters.of(e) for e in examples]} if ctx.adapters is not None else {}
    if ctx.multi_turn is not None:  # every turn of a prompt's trajectories with its adapter
        return ctx.multi_turn.generate(ctx.engine, examples, n, temperature, max_new_tokens, **routed)
    # A fleet of engines samples each prompt group from its own seed (drawn from the driver's
    # checkpointed RNG), so the samples do not depend on which engine ran which group.
    seeds = {"seeds": [random.getrandbits(62) for _ in examples]} if isinstance(ctx.engine, EngineFleet) else {}
    vision = {}
    if any(e.images for e in examples):  # a VLM: token ids with the image placeholders, and the pixels
        encoded = [ctx.fmt.encode(e) for e in examples]
        vision = {"prompt_ids": [ids for ids, _ in encoded], "images": [images for _, images in encoded]}
    samples = ctx.engine.call("generate", [ctx.fmt(e) for e in examples], [e.label for e in examples], n,
                              temperature, max_new_tokens, **seeds, **vision, **routed)
    for s in samples:
        s.info = examples[s.group].fields
        if vision:  # the trainer's forward takes them with the sample
            s.images = vision["images"][s.group]
    return samples, {}


def score(ctx: LoopContext, samples: list[Sample], extra: list[float] | None = None) -> int:
    """Set every sample's reward (plus `extra`); returns how many reward calls failed (scored 0).
    The reward gets the prompt, the record's other fields and (multi-turn) the trajectory as info."""
    scores, errors = ctx.reward_fn.score([(s.response, s.label, {**s.info, "prompt": s.prompt}) for s in samples])
    for i, (s, r) in enumerate(zip(samples, scores)):
        s.reward = r + (extra[i] if extra else 0.0)
    return errors


def greedy_accuracy(ctx: LoopContext, examples: list[Example]) -> tuple[float, list[Sample], dict[str, float]]:
    """(mean reward of greedy responses, the samples, multi-turn tool metrics)."""
    samples, tool_metrics = generate(ctx, examples, 1, 0.0, ctx.eval_max_new_tokens)
    score(ctx, samples)
    return sum(s.reward for s in samples) / len(samples), samples, tool_metrics


def evaluate(ctx: LoopContext, step: int) -> dict[str, float]:
    """Greedy accuracy on the held-out split: eval/<task>/accuracy (multi-turn: and its tool-call rate).
    The first metric is the objective sweeps maximize."""
    if not ctx.source.eval or ctx.engine is None:
        return {}
    accuracy, samples, tool_metrics = greedy_accuracy(ctx, ctx.source.eval)
    ctx.on_samples(samples, step)
    metrics = {f"eval/{ctx.task_name}/accuracy": accuracy}
    if tool_metrics:
        metrics[f"eval/{ctx.task_name}/tool_call_rate"] = tool_metrics["rollout/tool_call_rate"]
    if ctx.adapters is not None:
        metrics.update(per_adapter(samples, ctx.adapters.names, f"eval/{ctx.task_name}/accuracy"))
    return metrics


def per_adapter(samples: list[Sample], names: tuple[str, ...], metric: str, counts: str | None = None
                ) -> dict[str, float]:
    """Several LoRA adapters: `<metric>/<adapter>`, the mean reward of each adapter's samples (and
    `<counts>/<adapter>`, how many, when named); an adapter without samples here logs nothing."""
    out = {}
    for k, name in enumerate(names):
        rewards = [s.reward for s in samples if s.adapter == k]
        if rewards:
            out[f"{metric}/{name}"] = sum(rewards) / len(rewards)
            if counts is not None:
                out[f"{counts}/{name}"] = float(len(rewards))
    return out


def _generate_scored(ctx: LoopContext, cfg, num_prompts: int) -> tuple[list[list[Sample]], int, dict]:
    """Sample n responses for `num_prompts` new prompts and score them: (one list per group, failed
    reward calls, multi-turn tool metrics)."""
    r = cfg.rollout
    samples, tool_metrics = generate(ctx, ctx.source.next_batch(num_prompts), r.n_samples_per_prompt)
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    penalty = (
        overlong_penalty(lengths, r.max_new_tokens, cfg.algo.overlong_buffer)
        if cfg.algo.overlong_buffer
        else torch.zeros(len(samples))
    )
    errors = score(ctx, samples, penalty.tolist())
    n = r.n_samples_per_prompt
    return [samples[i : i + n] for i in range(0, len(samples), n)], errors, tool_metrics


def collect_rollout(ctx: LoopContext, cfg) -> tuple[list[Sample], dict[str, float]]:
    """`rollout.batch_size` scored groups. With `algo.dynamic_sampling` (DAPO), groups whose rewards
    are all equal are set aside and more prompts drawn, up to `algo.max_draws` generate calls; if
    the budget runs out, set-aside groups (advantage 0) top the batch up so its size stays fixed."""
    a, need = cfg.algo, cfg.rollout.batch_size
    informative: list[list[Sample]] = []
    uninformative: list[list[Sample]] = []
    draws = errors = 0
    tool_metrics: dict[str, float] = {}  # of the last draw
    while len(informative) < need and draws < (a.max_draws if a.dynamic_sampling else 1):
        groups, failed, tool_metrics = _generate_scored(ctx, cfg, need - len(informative) if a.dynamic_sampling else need)
        errors += failed
        for group in groups:
            varied = len({s.reward for s in group}) > 1
            (informative if varied or not a.dynamic_sampling else uninformative).append(group)
        draws += 1
    groups = (informative + uninformative)[:need]
    samples = []
    for g, group in enumerate(groups):
        for s in group:
            s.group = g
            samples.append(s)
    metrics = {"rollout/reward_errors": float(errors), **tool_metrics}
    if a.dynamic_sampling:
        metrics.update({"rollout/num_draws": float(draws),
                        "rollout/informative_group_frac": min(len(informative), need) / need})
    return samples, metrics


def draft_metrics(samples: list[Sample], k: int) -> dict[str, float]:
    """Speculative rollout: `spec/accept_len`, tokens emitted per verify step (accepted drafts + the
    target's own token, 1..k+1), and `spec/accept_rate`, the share of drafted tokens accepted."""
    stats = [s.draft_stats for s in samples if s.draft_stats is not None]
    steps = sum(steps for steps, _ in stats)
    if not steps:
        return {}
    accepted = sum(accepted for _, accepted in stats)
    return {"spec/accept_len": (accepted + steps) / steps, "spec/accept_rate": accepted / (k * steps)}


def rl_loop(ctx: LoopContext, cfg) -> float:
    """`cfg` is the RunCfg; returns the last eval accuracy (the objective of sweeps).
    rollout.asynchronous: the batches come from a RolloutAhead, generated while the trainer trains."""
    last = {}
    phases = MemoryPhases(ctx, cfg)  # colocated GPU: the engine and the trainer give memory back in turn
    phases.start()
    if ctx.start_step == 0:
        last = evaluate(ctx, 0)
        ctx.log(last, 0)
    collect = ctx.collect or (lambda ctx, cfg, step: collect_rollout(ctx, cfg))
    ahead = RolloutAhead(ctx, cfg, collect) if cfg.rollout.asynchronous else None
    if ahead is not None:
        ctx.source_state = ahead.source_state
    try:
        for step in range(ctx.start_step + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            if ahead is not None:
                samples, rollout_metrics = ahead.next(step)
            else:
                samples, rollout_metrics = collect(ctx, cfg, step)
                generated = time.perf_counter() - t0
                rollout_metrics = {**rollout_metrics, "rollout/staleness": 0.0, "perf/rollout_time_s": generated,
                                   "rollout/tokens_per_s": sum(len(s.response_ids) for s in samples) / generated}
            rollout_metrics.update(draft_metrics(samples, cfg.rollout.speculative.num_tokens))
            t1 = time.perf_counter()
            memory = phases.train_turn()
            batch, metrics = make_train_batch(ctx, cfg, samples)
            # The critic trains on the same batch, one after the other with the policy: run concurrently
            # on CPU, the two updates fight over the same cores and both slow down several-fold. During
            # the critic's warm-up the policy waits (and its weights need no sync).
            if ctx.critic is not None:
                metrics.update(ctx.critic.call("train", batch))
            policy_update = ctx.critic is None or step > cfg.critic.warmup_steps
            if policy_update and ctx.trainer is not None:
                metrics.update(ctx.trainer.call("train_rl", batch))
            t2 = time.perf_counter()
            if ahead is not None:
                metrics["perf/weight_sync_s"] = ahead.publish(step, updated=policy_update)
            elif policy_update or phases.engine_released:
                metrics["perf/weight_sync_s"], train_memory = phases.sync()
                memory.update(train_memory)
            metrics.update(
                {
                    **rollout_metrics,
                    **memory,
                    "rollout/reward_mean": sum(s.reward for s in samples) / len(samples),
                    "rollout/response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
                    "perf/train_time_s": t2 - t1,
                }
            )
            if ctx.adapters is not None:
                metrics.update(per_adapter(samples, ctx.adapters.names, "rollout/reward_mean", "rollout/samples"))
            if step % cfg.eval.interval == 0 or step == cfg.steps:
                evaluated = time.perf_counter()
                with ahead.engine_idle() if ahead is not None else contextlib.nullcontext():
                    last = evaluate(ctx, step)
                metrics.update(last)
                metrics["perf/eval_time_s"] = time.perf_counter() - evaluated
            metrics["perf/step_time_s"] = time.perf_counter() - t0
            ctx.log(metrics, step)
            ctx.after_step(step)
    finally:
        if ahead is not None:
            ahead.close()
            ctx.source_state = None
    return next(iter(last.values()), 0.0)


def sft_batch(examples: list[Example], tok: TokenizerInfo, fmt: PromptFormat | None = None,
              target_key: str | None = None):
    """SFT sequences: a record's reference conversation (loss on its assistant turns), else the
    prompt followed by the target (the record's `target_key` field when present, e.g. a worked
    solution, else its label) and eos, the loss on the target and eos."""
    fmt = fmt or PromptFormat(tok, apply_chat_template=False)
    samples = []
    for ex in examples:
        target = ex.fields.get(target_key, ex.label) if target_key else ex.label
        prompt_ids, response_ids, mask = fmt.sft_sequence(ex, str(target))
        samples.append(Sample(prompt=ex.prompt, label=ex.label, prompt_ids=prompt_ids, response_ids=response_ids,
                              rollout_logprobs=[], response_mask=mask,
                              images=fmt.encode(ex)[1] if ex.images else None))
    return build_train_batch(samples, torch.zeros(len(samples)), tok.pad_id or 0)


def sft_loop(
    ctx: LoopContext,
    steps: int,
    batch_size: int,
    eval_interval: int,
    stop_when: tuple[list[Example], float] | None = None,
) -> float:
    """SFT on the task's training pairs; evaluates through the engine after syncing weights.

    `stop_when=(probe, target)` ends training at the first eval where the greedy accuracy on the
    probe examples (training-distribution problems, never the held-out split) reaches `target`.
    """
    last = {}
    if ctx.start_step == 0:
        last = evaluate(ctx, 0)
        ctx.log(last, 0)
    for step in range(ctx.start_step + 1, steps + 1):
        t0 = time.perf_counter()
        batch = sft_batch(ctx.source.next_batch(batch_size), ctx.tokenizer, ctx.fmt, ctx.sft_target_key)
        metrics = ctx.trainer.call("train_sft", batch)
        done = step == steps
        if step % eval_interval == 0 or done:
            sync_weights(ctx, check=True)
            if stop_when is not None:
                metrics["train/probe_accuracy"], _, _ = greedy_accuracy(ctx, stop_when[0])
                done = done or metrics["train/probe_accuracy"] >= stop_when[1]
            if done or stop_when is None:
                last = evaluate(ctx, step)
                metrics.update(last)
        metrics["perf/step_time_s"] = time.perf_counter() - t0
        ctx.log(metrics, step)
        ctx.after_step(step)
        if done:
            break
    return next(iter(last.values()), 0.0)

