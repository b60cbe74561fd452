"""Synchronous vs asynchronous rollout on the default experiment, side by side (docs/benchmarks.md).

    .venv/bin/python benchmarks/async_rollout.py --steps 200 --seeds 0 1

Each mode runs `launch.py` (the default task, warm start and model; Ray actors unless --in-process)
for the same steps and seeds. Reported per mode: the median `perf/step_time_s` over the steps after
the first, and the held-out accuracy at step 0 and at the last step (the gain is the RL part).
Asynchronous: `rollout.asynchronous=true rollout.max_staleness=1`, batch k+1 generated while step k
trains; once with PPO's ratio against the behaviour policy (the default), once against the
trainer's own recomputed log-probs (`algo.use_rollout_logprobs=false`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "synchronous": [],
    "asynchronous": ["rollout.asynchronous=true", "rollout.max_staleness=1"],
    # PPO's ratio against the trainer's recomputed log-probs instead of the behaviour policy's
    "asynchronous, ratio to the trainer's log-probs": ["rollout.asynchronous=true", "algo.use_rollout_logprobs=false"],
}


def run(mode: str, seed: int, steps: int, extra: list[str], tmp: Path) -> dict[int, dict]:
    run_dir = tmp / f"{re.sub(r'[^a-z]+', '_', mode)}_{seed}"
    return launch_metrics([f"steps={steps}", f"seed={seed}", *MODES[mode], *extra], run_dir)


def launch_metrics(overrides: list[str], run_dir: Path) -> dict[int, dict]:
    """`launch.py OVERRIDES` into run_dir (its MLflow store beside it); the run's metrics per step."""
    args = ["tracking.log_samples=0", f"tracking.uri=sqlite:///{run_dir.parent}/mlflow.db",
            f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"launch.py {' '.join(overrides)} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    metrics: dict[int, dict] = {}
    for line in (run_dir / "mlflow" / "journal.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry["op"] == "metrics":
            metrics.setdefault(entry["step"], {}).update(entry["metrics"])
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--in-process", action="store_true", help="ray.enabled=false")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    extra = ["ray.enabled=false"] if args.in_process else []
    key = "eval/arithmetic/accuracy"
    print("| mode | seed | median step s | x synchronous | accuracy step 0 | accuracy last | gain |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            base = None
            for mode in args.modes:
                metrics = run(mode, seed, args.steps, extra, Path(tmp))
                median = statistics.median(m["perf/step_time_s"] for s, m in metrics.items()
                                           if s > 1 and "perf/step_time_s" in m)
                base = median if base is None else base
                first, last = metrics[0][key], metrics[args.steps][key]
                print(f"| {mode} | {seed} | {median:.3f} | {median / base:.2f} | {first:.3f} | {last:.3f} | "
                      f"{last - first:+.3f} |", flush=True)


if __name__ == "__main__":
    main()
