"""What Ray actors cost a GRPO step on the CPU: the default experiment in-process and with Ray on, side
by side (issue 28's target: the Ray step <= 1.15x the in-process step; docs/benchmarks.md).

    .venv/bin/python benchmarks/ray_share.py --steps 23 --repeats 1

Each mode runs `launch.py warm_start.enabled=false` (random init: the speed, not the learning) for the
same steps and seed, each repeat running the modes in an order rotated by one (no mode always first on a
machine that drifts): in-process (`ray.enabled=false`), Ray with the engine and the trainer in one actor
(`ray.hybrid`, the default where it applies), and Ray with an actor each (`ray.hybrid=false`). Reported:
medians of
`perf/step_time_s`, `perf/rollout_time_s` and `perf/train_time_s` over the steps after the first
three (warm-up), and what the step spends outside rollout and training (weight sync and the calls).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from async_rollout import launch_metrics

TIMES = ("perf/step_time_s", "perf/rollout_time_s", "perf/train_time_s")
MODES = [("in-process", ["ray.enabled=false"]), ("Ray, one actor", ["ray.enabled=true"]),
         ("Ray, an actor each", ["ray.enabled=true", "ray.hybrid=false"])]


def medians(metrics: dict[int, dict]) -> dict[str, float]:
    return {k: statistics.median(m[k] for s, m in metrics.items() if s > 3 and k in m) for k in TIMES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=23)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="more launch.py overrides, for both modes")
    args = parser.parse_args()
    base = [f"steps={args.steps}", "warm_start.enabled=false", f"eval.interval={args.steps + 1}", *args.overrides]
    print("| repeat | mode | step s | rollout s | train s | rest s | x in-process |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = [(i + repeat) % len(MODES) for i in range(len(MODES))]
            runs = {i: medians(launch_metrics([*base, *MODES[i][1]], Path(tmp) / f"mode_{i}_{repeat}")) for i in order}
            inprocess = runs[0]["perf/step_time_s"]
            for i, (mode, _) in enumerate(MODES):
                step, rollout, train = (runs[i][k] for k in TIMES)
                print(f"| {repeat} | {mode} | {step:.3f} | {rollout:.3f} | {train:.3f} | {step - rollout - train:.3f} | "
                      f"{step / inprocess:.2f} |", flush=True)


if __name__ == "__main__":
    main()
