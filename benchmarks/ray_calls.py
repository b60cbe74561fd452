"""Where Ray's share of a CPU GRPO step goes: each call of a step timed inside the actor (wall-clock
timestamps, one machine) against the driver's submit and receive (docs/benchmarks.md, issue 28 item 6).

    .venv/bin/python benchmarks/ray_calls.py --shape 8x8x8 --steps 15 [--pause-ms 100] [--one-actor]

The components are the default experiment's at that shape (trl_grpo_cpu.miles_cfg, ray.enabled=true,
an actor each unless --one-actor, no stop ids); each step runs generate, train_rl, get_weights and update_weights (checked) one after
the other through `handle.apply`, so the weights pass through the driver here (in the loop they go
from the trainer's future to the engine's call directly). Reported: medians of the time from submit
to the method's start, of the method itself, and from its end to the driver holding the result.
`--pause-ms`: the actors idle that long before each step, as they do in trl_grpo_cpu.py while TRL's
step and the settle pause run. `--one-actor`: the engine and the trainer in one actor (ray.hybrid,
the default experiment's arrangement).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from trl_grpo_cpu import FixedSource, _no_stop_ids, miles_cfg, parse_shape


def call_in(obj, method: str, *args):
    start = time.time()
    result = getattr(obj, method)(*args)
    return start, time.time(), result


def main() -> None:
    from miles.data.arithmetic import ArithmeticTask
    from miles.data.rewards import get_reward_fn
    from miles.data.tokenizer import DEFAULT_ALPHABET, TokenizerInfo
    from miles.orchestrate.checkpoints import random_checkpoint
    from miles.orchestrate.loop import LoopContext
    from miles.orchestrate.returns import make_train_batch
    from miles.orchestrate.run import _spawn_components

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8x8x8")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pause-ms", type=float, default=0.0, help="idle time before each step")
    ap.add_argument("--one-actor", action="store_true", help="engine and trainer in one actor (ray.hybrid)")
    args = ap.parse_args()
    p, n, t = parse_shape(args.shape)
    torch.set_num_threads(args.threads)
    cfg, _ = miles_cfg(p, n, t, args.threads, ray=True, two_actors=not args.one_actor)
    ckpt = str(random_checkpoint(cfg.model, DEFAULT_ALPHABET, seed=cfg.seed, out=f"{tempfile.mkdtemp()}/ckpt"))
    examples = ArithmeticTask(num_digits=cfg.task.num_digits).sample_train(p * (args.steps + 3), np.random.default_rng(0))
    engine, trainer, _ = _spawn_components(cfg, Path(ckpt), None)
    engine.apply(_no_stop_ids)
    reward = get_reward_fn(cfg.task.reward)
    ctx = LoopContext(engine=engine, trainer=trainer, source=FixedSource(examples), tokenizer=TokenizerInfo.load(ckpt),
                      reward_fn=reward, log=lambda m, s: None)
    times: dict[str, list[float]] = {}

    def timed(handle, name, method, *a):
        submitted = time.time()
        start, end, result = handle.apply(call_in, method, *a)
        for part, seconds in (("submit -> start", start - submitted), ("in the actor", end - start),
                              ("end -> result", time.time() - end)):
            times.setdefault(f"{name}: {part}", []).append(seconds)
        return result

    for step in range(args.steps + 3):
        if step == 3:
            times.clear()  # warm-up
        time.sleep(args.pause_ms / 1000)
        batch = ctx.source.next_batch(p)
        samples = timed(engine, "generate", "generate", [e.prompt for e in batch], [e.label for e in batch], n)
        for s in samples:
            s.reward = reward(s.response, s.label)
        train_batch, _ = make_train_batch(ctx, cfg, samples)
        timed(trainer, "train_rl", "train_rl", train_batch)
        weights, digest = timed(trainer, "get_weights", "get_weights")
        timed(engine, "update_weights", "update_weights", weights, digest)
    print(f"| {args.shape}, medians of {args.steps} steps, {args.pause_ms:g} ms pause | ms |\n|---|---:|")
    for key, values in times.items():
        print(f"| {key} | {statistics.median(values) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
