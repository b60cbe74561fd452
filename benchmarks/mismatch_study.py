"""Train / rollout mismatch per model family, precision recipe and consistency mode, side by side.

    .venv/bin/python benchmarks/mismatch_study.py --steps 5                       # CPU, every tiny family
    python benchmarks/mismatch_study.py --models qwen3_0_6b --precisions bf16 --modes none true \\
        --extra hardware=gpu rollout.batch_size=8 rollout.max_new_tokens=256      # the step-time cost on a GPU

Each (model, precision, mode) runs `launch.py` in-process (no Ray) for the same steps and seed. Modes:
`none`; `r2` / `r3` (`algo.routing_replay`, MoE models); `true` (`true_on_policy=true`, recipes
whose trainer and engine share one quantization). Every run also computes token-level TIS (clip 2) and MIS ([0.5, 2]) statistics on the
mismatch it has (`algo.tis=token algo.mis=token`: what the corrections would reweight or drop).
Columns are means over the steps of the run's journal: `mismatch/logprob_abs_diff` (its maximum too:
exactly 0 is what true on-policy promises), `mismatch/routing_agreement` and, DSA models,
`mismatch/index_agreement` (replay modes), the TIS mean
weight and clipped share, the MIS masked share, the median step time and its ratio to mode `none`.
Prints a Markdown table (docs/precision.md).
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
TINY = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*_tiny.yaml"))
MODES = {"none": [], "r2": ["algo.routing_replay=r2"], "r3": ["algo.routing_replay=r3"], "true": ["true_on_policy=true"]}
SMALL = ["warm_start.enabled=false", "task.eval_size=8", "tracking.log_samples=0", "rollout.batch_size=4",
         "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=16", "trainer.micro_batch_size=8",
         "algo.entropy_coef=0.01", "algo.tis=token", "algo.mis=token"]


def is_moe(model: str) -> bool:
    text = (ROOT / "conf" / "model" / f"{model}.yaml").read_text()
    return "num_experts:" in text and "num_experts: 0" not in text


def applies(model: str, precision: str, mode: str) -> bool:
    if mode in ("r2", "r3"):
        return is_moe(model)
    return mode != "true" or not precision.startswith("bf16_train_")  # true on-policy: one quantization on both sides


def run(model: str, precision: str, mode: str, steps: int, extra: list[str], tmp: Path) -> dict:
    run_dir = tmp / f"{model}-{precision}-{mode}"
    overrides = [f"model={model}", f"precision={precision}", f"steps={steps}", f"eval.interval={steps}",
                 "ray.enabled=false", f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"hydra.run.dir={run_dir}",
                 *SMALL, *MODES[mode], *extra]
    args = list({o.split("=", 1)[0]: o for o in overrides}.values())  # a later value of a key wins
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{model} {precision} {mode} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    steps_metrics: dict[int, dict] = {}
    for line in (run_dir / "mlflow" / "journal.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry["op"] == "metrics":
            steps_metrics.setdefault(entry["step"], {}).update(entry["metrics"])
    series = lambda key: [m[key] for _, m in sorted(steps_metrics.items()) if key in m]  # noqa: E731
    mean = lambda key: statistics.mean(series(key)) if series(key) else None  # noqa: E731
    return {"model": model, "precision": precision, "mode": mode, "mismatch": mean("mismatch/logprob_abs_diff"),
            "max": max(series("mismatch/logprob_abs_diff")), "agreement": mean("mismatch/routing_agreement"),
            "index": mean("mismatch/index_agreement"),
            "tis_mean": mean("mismatch/tis_mean"), "tis_clip": mean("mismatch/tis_clipfrac"),
            "mis_mask": mean("mismatch/mis_maskfrac"), "step_s": statistics.median(series("perf/step_time_s"))}


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=TINY)
    parser.add_argument("--precisions", nargs="*", default=["bf16", "fp8"])
    # r2 only differs from none with several optimizer steps per rollout (the mismatch is measured before).
    parser.add_argument("--modes", nargs="*", default=["none", "r3", "true"], choices=list(MODES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--extra", nargs="*", default=[], help="more launch.py overrides for every run")
    args = parser.parse_args()
    print("| model | precision | mode | mismatch mean | max | routing agreement | index agreement | TIS mean | "
          "TIS clipped | MIS masked | step s | x none |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for precision in args.precisions:
                base = None
                for mode in args.modes:
                    if not applies(model, precision, mode):
                        continue
                    r = run(model, precision, mode, args.steps, args.extra, Path(tmp))
                    base = r["step_s"] if mode == "none" else base
                    ratio = fmt(r["step_s"] / base, ".1f") if base else "-"
                    print(f"| {model} | {precision} | {mode} | {r['mismatch']:.2e} | {r['max']:.2e} | "
                          f"{fmt(r['agreement'], '.4f')} | {fmt(r['index'], '.4f')} | {fmt(r['tis_mean'], '.4f')} | {fmt(r['tis_clip'], '.4f')} | "
                          f"{fmt(r['mis_mask'], '.4f')} | {r['step_s']:.2f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
