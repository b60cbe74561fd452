"""Sandbox start-up cost and the code reward's pool throughput (issue 32: within 1.5x of before).

    .venv/bin/python benchmarks/sandbox_speed.py [--runs 60] [--samples 120]

  startup   runs per second of `run_python("pass")`, one after another (the fixed cost of one box)
  pool      samples per second through `build_scorer(task.reward=code)`, the run's reward pool, on
            a code task of the shape the docs show (a program plus the label's asserts), half of
            them right and half wrong, so both outcomes cost what they cost in a run
Each number is the median of --repeats timings after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

from miles.config.schema import SandboxCfg, TaskCfg
from miles.data.rewards import build_scorer
from miles.data.sandbox import run_python

_RIGHT = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
_WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
_LABEL = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def startup(runs: int) -> float:
    limits = SandboxCfg()
    start = time.perf_counter()
    for _ in range(runs):
        assert run_python("pass", limits).ok
    return runs / (time.perf_counter() - start)


def pool(samples: int) -> float:
    scorer = build_scorer(TaskCfg(name="code", reward="code"))
    items = [(_RIGHT if i % 2 == 0 else _WRONG, _LABEL, {}) for i in range(samples)]
    start = time.perf_counter()
    scores, errors = scorer.score(items)
    elapsed = time.perf_counter() - start
    assert errors == 0 and scores == [1.0 - i % 2 for i in range(samples)], (scores, errors)
    return samples / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--samples", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    startup(5), pool(12)  # warm-up: page cache, imports
    s = statistics.median(startup(args.runs) for _ in range(args.repeats))
    p = statistics.median(pool(args.samples) for _ in range(args.repeats))
    print(f"startup  {s:7.1f} runs/s   (run_python('pass'), sequential)")
    print(f"pool     {p:7.1f} samples/s (code reward, build_scorer pool)")


if __name__ == "__main__":
    main()
