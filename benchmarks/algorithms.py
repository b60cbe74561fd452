"""Held-out accuracy reached by every RL algorithm preset with the same seed and step budget.

    .venv/bin/python benchmarks/algorithms.py --steps 100          # all presets, ~1 min each on 2 cores
    .venv/bin/python benchmarks/algorithms.py --presets grpo dapo  # a subset
    .venv/bin/python benchmarks/algorithms.py --overrides hardware.cpu_threads=1  # extra launch.py overrides

Each preset runs `launch.py algo=<preset>` in-process (no Ray) from the same cached warm start, so the
only difference between rows is the algorithm. `opd` is the exception in kind, not in setup: it
learns from a teacher (on the built-in task a longer-trained SFT checkpoint, built once and cached)
instead of the reward, so the table's footnote gives the teacher's own held-out accuracy.
Prints a Markdown table for docs/algorithms.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVAL = re.compile(r"step\s+(\d+)/\d+ .*eval \S+ ([0-9.]+)")
TEACHER = re.compile(r"distilling from the teacher in (\S+)")


def rl_presets() -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "algo").glob("*.yaml") if p.stem != "sft")


def run_preset(preset: str, steps: int, seed: int, overrides: list[str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), f"algo={preset}", f"steps={steps}", f"seed={seed}",
         "ray.enabled=false", f"eval.interval={max(steps // 4, 1)}", "tracking.experiment=algo-benchmark",
         *overrides],
        cwd=ROOT, capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"algo={preset} failed:\n{proc.stderr[-2000:]}")
    evals = {int(step): float(acc) for step, acc in EVAL.findall(proc.stdout)}
    teacher = TEACHER.search(proc.stdout)
    return {"preset": preset, "evals": evals, "seconds": time.perf_counter() - start,
            "teacher": teacher.group(1) if teacher else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--presets", nargs="*", default=None)
    # e.g. hardware.cpu_threads=1 on a machine shared with other jobs: two threads per run then
    # oversubscribe the cores, and the wall clock balloons (results depend on the thread count)
    parser.add_argument("--overrides", nargs="*", default=[], help="launch.py overrides for every preset")
    args = parser.parse_args()
    rows = [run_preset(p, args.steps, args.seed, args.overrides) for p in (args.presets or rl_presets())]
    checkpoints = sorted(rows[0]["evals"])
    print(f"| preset | {' | '.join(f'step {s}' for s in checkpoints)} | gain | wall s |")
    print(f"|---|{'---|' * len(checkpoints)}---|---|")
    for row in rows:
        ev = row["evals"]
        gain = ev[checkpoints[-1]] - ev[checkpoints[0]]
        cells = " | ".join(f"{ev[s]:.3f}" for s in checkpoints)
        print(f"| {row['preset']} | {cells} | {gain:+.3f} | {row['seconds']:.0f} |")
    for row in (r for r in rows if r["teacher"]):
        record = ROOT / row["teacher"] / "warm_start.json"  # the built-in teacher's build record
        if record.is_file():
            accuracy = json.loads(record.read_text())["eval_accuracy"]
            print(f"\n{row['preset']}'s teacher ({row['teacher']}): held-out accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
