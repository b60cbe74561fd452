"""Helpers of the checkpoint / debug / fault tests: tiny runs and what they recorded."""

import json
import os
import subprocess
import sys
from pathlib import Path

from launch_cli import ROOT

# Random init, no warm start: all rewards are 0, so the entropy bonus is what moves the weights
# every step (through the sampled tokens, which is what makes data position and sampling RNG count).
TINY = [
    "warm_start.enabled=false", "eval.interval=1", "task.eval_size=8", "tracking.log_samples=0",
    "rollout.batch_size=2", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4", "algo.entropy_coef=0.01",
]
# Timings differ from run to run; everything else a step logs must be identical.
TIMING = ("perf/", "rollout/tokens_per_s")


def run_inprocess(compose, overrides, run_dir):
    """A run through miles.orchestrate.run, in this process (the cwd is the test's tmp dir)."""
    from omegaconf import OmegaConf

    from miles.orchestrate.run import run

    cfg = compose(["ray.enabled=false", *overrides])
    cfg.output_dir = str(run_dir)
    return run(cfg, run_dir, list(overrides), OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def journal_metrics(run_dir) -> dict[int, dict[str, float]]:
    """step -> metrics, from the run's tracking journal (every metric a run logged, uploaded or not)."""
    out: dict[int, dict[str, float]] = {}
    for line in (Path(run_dir) / "mlflow" / "journal.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry["op"] == "metrics":
            step = out.setdefault(entry["step"], {})
            assert not set(step) & set(entry["metrics"]), f"step {entry['step']} logged twice"
            step.update(entry["metrics"])
    return out


def without_timing(metrics: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    return {s: {k: v for k, v in m.items() if not k.startswith(TIMING)} for s, m in metrics.items()}


def file_digest(path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class LiveRun:
    """`python launch.py ARGS` in the background, its output read as it comes (to act mid-run)."""

    def __init__(self, args, cwd, env=None):
        import threading

        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), *args], cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 300) -> None:
        import time

        deadline = time.time() + timeout
        while text not in self.output:
            if self.proc.poll() is not None and not self._reader.is_alive() and text not in self.output:
                raise AssertionError(f"the run ended before {text!r}:\n{self.output[-3000:]}")
            if time.time() > deadline:
                self.proc.kill()
                raise AssertionError(f"no {text!r} within {timeout}s:\n{self.output[-3000:]}")
            time.sleep(0.1)

    def finish(self, timeout: float = 300) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the run did not end within {timeout}s:\n{self.output[-3000:]}")
        self._reader.join(10)
        return code


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Ray's raylet and its workers, for a driver that started Ray)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def actor_pid(driver_pid: int, class_name: str) -> int:
    """The process of the Ray actor `class_name` started by that driver (its title is ray::<class>...)."""
    for pid in descendants(driver_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if cmdline.startswith(f"ray::{class_name}"):
            return pid
    raise AssertionError(f"no ray::{class_name} process under {driver_pid}")
