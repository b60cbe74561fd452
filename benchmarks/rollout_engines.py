"""Rollout speed of the two engines side by side on the CPU: native (miles/rollout/native.py) vs vLLM
(miles/rollout/vllm_engine.py), same checkpoint, same prompts, same shapes, one process.

    make vllm-env && .venv-vllm/bin/python benchmarks/rollout_engines.py [--repeats 5] [--threads 2] [--quick]

Needs the vLLM venv (`make vllm-env`); both engines run in it (same torch). Each case writes one random
checkpoint with `random_checkpoint`, builds both engines on it (fp32), and times
`engine.generate(prompt strings, labels, n)` -> Samples on each, calls interleaved (native, vllm,
native, ...) so that load from other jobs hits both alike; medians are reported. Every row decodes
exactly `new tokens` (benchmark only: both engines get no stop ids; vLLM knows no eos of its own, the
engine passes token ids with skip_tokenizer_init), at temperature 1 without top-k / top-p.
Threads: the native engine runs `--threads` torch threads (hardware.cpu_threads, 2 by default),
vLLM its serve_threads (`--vllm-threads`, 1 by default: vLLM's own choice for its step loop).
A greedy pass per case (stop at eos, one row per distinct prompt) checks that both produce the same
tokens; "start s" is the engine's construction (vLLM: after its import, which costs more).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace

import numpy as np
import torch

from miles.config.schema import DType, RolloutCfg
from miles.data.arithmetic import ArithmeticTask
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.rollout.vllm_engine import VLLMEngine, import_vllm
import rollout_speed
from rollout_speed import Case, load, timed

# rollout_speed's shapes, with tied embeddings as conf/model/qwen3_tiny.yaml has (vLLM ties the head).
TINY = replace(rollout_speed.TINY, tie_word_embeddings=True)
BIGGER = replace(rollout_speed.BIGGER, tie_word_embeddings=True)


CASES = [  # the first is the default experiment's rollout (conf/rollout/native.yaml); --quick runs only it
    Case("tiny, default rollout (64 prompts x 8 x 8 tokens)", TINY, 64, 8, 8),
    Case("512x8L, 32 prompts x 8 x 32 tokens", BIGGER, 32, 8, 32),
]


def run_case(case: Case, threads: int, vllm_threads: int, repeats: int, workdir: str) -> dict:
    ckpt = str(random_checkpoint(case.model, DEFAULT_ALPHABET, seed=0, out=f"{workdir}/{case.model.name}"))
    examples = ArithmeticTask(num_digits=2).sample_train(case.prompts * case.n, np.random.default_rng(0))
    greedy_prompts = [e.prompt for e in examples]  # one row per distinct prompt, as many as the batch has rows
    prompts, labels = greedy_prompts[: case.prompts], [e.label for e in examples[: case.prompts]]
    cfg = RolloutCfg(max_new_tokens=case.new_tokens, temperature=1.0)
    start = time.perf_counter()
    native = NativeEngine(ckpt, cfg, DType.fp32, threads=threads, seed=0)
    native_start = time.perf_counter() - start
    start = time.perf_counter()
    vllm = VLLMEngine(ckpt, cfg, DType.fp32, threads=threads, seed=0, serve_threads=vllm_threads)
    vllm_start = time.perf_counter() - start
    torch.set_num_threads(threads)

    greedy = [[s.response_ids for s in e.generate(greedy_prompts, ["?"] * len(greedy_prompts), n=1, temperature=0.0)]
              for e in (native, vllm)]
    agreement = sum(a == b for a, b in zip(*greedy)) / len(greedy[0])
    # Benchmark only: no stop ids, so every row decodes exactly new_tokens on both sides.
    native.stop_ids = torch.tensor([], dtype=torch.long)
    vllm.stop_ids = []
    calls = {"native": lambda: native.generate(prompts, labels, n=case.n),
             "vllm": lambda: vllm.generate(prompts, labels, n=case.n)}
    for call in calls.values():  # warm-up, and the shapes checked
        assert all(len(s.response_ids) == case.new_tokens for s in call())
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(timed(call))
    vllm.close()
    rows = case.prompts * case.n
    out = dict(case=case.name, rows=rows, new=case.new_tokens, agreement=agreement,
               native_start=native_start, vllm_start=vllm_start)
    for name in calls:
        out[f"{name}_s"] = statistics.median(times[name])
        out[f"{name}_tps"] = rows * case.new_tokens / out[f"{name}_s"]
    out["ratio"] = out["vllm_tps"] / out["native_tps"]
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| case | rows | new tokens | native s | vLLM s | native tok/s | vLLM tok/s | vLLM / native "
             "| greedy agreement | start s (native / vLLM) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['case']} | {r['rows']} | {r['new']} | {r['native_s']:.3f} | {r['vllm_s']:.3f} "
                     f"| {r['native_tps']:,.0f} | {r['vllm_tps']:,.0f} | {r['ratio']:.2f}x | {r['agreement']:.0%} "
                     f"| {r['native_start']:.1f} / {r['vllm_start']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the native engine (and the process)")
    parser.add_argument("--vllm-threads", type=int, default=1, help="torch threads while vLLM generates")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per engine (median reported)")
    parser.add_argument("--quick", action="store_true", help="only the default-rollout case, 2 repeats")
    args = parser.parse_args()
    vllm = import_vllm()
    cases, repeats = (CASES[:1], min(args.repeats, 2)) if args.quick else (CASES, args.repeats)
    print(f"torch {torch.__version__}, vllm {vllm.__version__}, native threads {args.threads}, vLLM threads "
          f"{args.vllm_threads}, repeats {repeats} (interleaved, median), {os.cpu_count()} CPUs, "
          f"load average before {load()}")
    with tempfile.TemporaryDirectory() as workdir:
        results = [run_case(case, args.threads, args.vllm_threads, repeats, workdir) for case in cases]
    print(f"load average after {load()}\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
