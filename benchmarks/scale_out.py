"""Step time of the scale-out layouts on one machine, side by side (docs/benchmarks.md).

    .venv/bin/python benchmarks/scale_out.py --steps 6

Each layout runs `launch.py` for the same steps and seed on the default task (no warm start); the
figure is the median `perf/step_time_s` over the steps after the first (start-up and first-call
costs excluded), with its ratio to the in-process run. Layouts: in-process (one process), Ray (a
trainer and an engine actor), 2 engines, 2 FSDP2 trainer ranks, broadcast and shared-memory weight sync,
asynchronous rollout (Ray and in-process). On a 2-core machine several actors share the cores, so more
processes mostly measure the overhead, not a gain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "in-process": ["ray.enabled=false"],
    "ray": [],
    "ray, 2 engines": ["rollout.num_engines=2"],
    "ray, 2 FSDP2 ranks": ["trainer=fsdp", "trainer.num_ranks=2"],
    "ray, broadcast sync": ["rollout.weight_sync=broadcast"],
    "ray, shared-memory sync": ["rollout.weight_sync=shared_memory"],
    "ray, asynchronous": ["rollout.asynchronous=true"],

    "in-process, asynchronous": ["ray.enabled=false", "rollout.asynchronous=true"],
}


def step_times(name: str, overrides: list[str], steps: int, tmp: Path) -> list[float]:
    run_dir = tmp / name.replace(" ", "_").replace(",", "")
    args = [f"steps={steps}", f"eval.interval={steps}", "task.eval_size=8", "warm_start.enabled=false",
            "tracking.log_samples=0", f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    times = {}
    for line in (run_dir / "mlflow" / "journal.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry["op"] == "metrics" and "perf/step_time_s" in entry["metrics"]:
            times[entry["step"]] = entry["metrics"]["perf/step_time_s"]
    return [times[s] for s in sorted(times) if s > 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    print("| layout | median step s | x in-process |")
    print("|---|---:|---:|")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts:
            median = statistics.median(step_times(name, LAYOUTS[name], args.steps, Path(tmp)))
            base = median if base is None else base
            print(f"| {name} | {median:.2f} | {median / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
