"""What TIS and MIS do to learning when the engine's kernels really differ: vLLM in bf16, trainer in fp32.

    .venv-vllm/bin/python benchmarks/engine_mismatch.py --steps 200

Each arm runs the default experiment (warm start, qwen3_tiny, arithmetic, GRPO) with vLLM rollouts
(`rollout=vllm`) and the trainer in fp32 (`precision=fp32`), in-process (`ray.enabled=false`;
`--ray` for Ray actors), one arm after another, same steps and seed:

- `none`: the engine in bf16 (`precision.rollout_dtype=bf16`), no correction;
- `tis`: bf16 engine, `algo.tis=token` (weights clipped at `algo.tis_clip`, 2);
- `mis`: bf16 engine, `algo.mis=token` (tokens with a ratio outside [0.5, 2] dropped);
- `fp32 engine`: the reference, vLLM in fp32, no correction (no real mismatch).

Every RL step logs `mismatch/ratio_*` (pi_old / pi_rollout per loss token). TIS and MIS take the old
log-probs from a no-grad forward before the update. The arms without a correction get that same
forward from `algo.mis=token algo.mis_low=0 algo.mis_high=inf`, a band that masks nothing, so every
arm computes its old log-probs the same way. The update is the uncorrected one.
Reported per arm, from the run's journal: held-out accuracy at step 0 and at the last step, the
means over the steps of `mismatch/logprob_abs_diff`, `ratio_mean` and `ratio_std`, the lowest
`ratio_min` and highest `ratio_max`, the mean TIS clipped share (tis) or MIS masked share (mis), and
the median `perf/step_time_s` after step 1. Prints a Markdown table and each arm's eval curve.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from async_rollout import run as launch  # launch.py in a subprocess, its journal's metrics by step

BASE = ["rollout=vllm", "precision=fp32"]
OBSERVE = ["algo.mis=token", "algo.mis_low=0", "algo.mis_high=inf"]  # the corrected arms' old-log-prob pass, masks nothing
ARMS = {
    "none": ["precision.rollout_dtype=bf16", *OBSERVE],
    "tis": ["precision.rollout_dtype=bf16", "algo.tis=token"],
    "mis": ["precision.rollout_dtype=bf16", "algo.mis=token"],
    "fp32 engine": ["precision.rollout_dtype=fp32", *OBSERVE],
}
SHARE = {"tis": "mismatch/tis_clipfrac", "mis": "mismatch/mis_maskfrac"}


def summary(arm: str, metrics: dict[int, dict], steps: int) -> dict:
    series = lambda key: [m[key] for s, m in sorted(metrics.items()) if key in m and s > 0]  # noqa: E731
    mean = lambda key: statistics.mean(series(key)) if series(key) else None  # noqa: E731
    acc = next(k for k in metrics[0] if k.startswith("eval/") and k.endswith("/accuracy"))
    return {"arm": arm, "acc0": metrics[0][acc], "acc": metrics[steps][acc],
            "curve": [(s, m[acc]) for s, m in sorted(metrics.items()) if acc in m],
            "diff": mean("mismatch/logprob_abs_diff"), "ratio_mean": mean("mismatch/ratio_mean"),
            "ratio_std": mean("mismatch/ratio_std"), "ratio_min": min(series("mismatch/ratio_min"), default=None),
            "ratio_max": max(series("mismatch/ratio_max"), default=None),
            "share": mean(SHARE[arm]) if arm in SHARE else None,
            "step_s": statistics.median(m["perf/step_time_s"] for s, m in metrics.items()
                                        if s > 1 and "perf/step_time_s" in m)}


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--ray", action="store_true", help="Ray actors (default: ray.enabled=false)")
    parser.add_argument("--extra", nargs="*", default=[], help="more launch.py overrides for every arm")
    args = parser.parse_args()
    base = BASE + ([] if args.ray else ["ray.enabled=false"]) + args.extra
    print(f"| arm | engine dtype | acc step 0 | acc step {args.steps} | gain | logprob_abs_diff | ratio mean | "
          "ratio std | ratio min | ratio max | TIS clipped / MIS masked | median step s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for arm in args.arms:
            out = Path(tmp) / arm.replace(" ", "_")
            out.mkdir()
            try:
                metrics = launch("synchronous", args.seed, args.steps, base + ARMS[arm], out)
            except RuntimeError as error:
                raise SystemExit(f"arm {arm!r}: {error}") from None
            r = summary(arm, metrics, args.steps)
            results.append(r)
            dtype = "fp32" if arm == "fp32 engine" else "bf16"
            print(f"| {arm} | {dtype} | {r['acc0']:.3f} | {r['acc']:.3f} | {r['acc'] - r['acc0']:+.3f} | "
                  f"{fmt(r['diff'], '.3e')} | {fmt(r['ratio_mean'], '.4f')} | {fmt(r['ratio_std'], '.4f')} | "
                  f"{fmt(r['ratio_min'], '.3g')} | {fmt(r['ratio_max'], '.3g')} | {fmt(r['share'], '.2e')} | "
                  f"{r['step_s']:.3f} |", flush=True)
    print()
    for r in results:
        print(f"- {r['arm']}: held-out accuracy by step " + ", ".join(f"{s}: {a:.3f}" for s, a in r["curve"]))


if __name__ == "__main__":
    main()
