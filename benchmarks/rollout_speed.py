"""Rollout speed: miles' NativeEngine vs `transformers` generate on the same weights and batch.

    .venv/bin/python benchmarks/rollout_speed.py [--threads 2] [--repeats 5] [--quick] [--checkpoint DIR]
    python benchmarks/rollout_speed.py --device cuda --dtype bf16     # the GPU cases: benchmarks/rollout_gpu.py
    python benchmarks/rollout_speed.py --device cuda --dtype bf16 --model deepseek_v3_dense_4l --skip-hf   # MLA
    python benchmarks/rollout_speed.py --device cuda --dtype bf16 --model qwen3_30b_a3b_8l --skip-hf   # MoE

Both sides load one random checkpoint written by `random_checkpoint`, get the same arithmetic
prompts and n samples per prompt, generate exactly the same number of new tokens per row at
temperature 1.0 with no top-k / top-p, and run on the same `torch.set_num_threads`. HF gets each
prompt left-padded and repeated n times as rows (what `num_return_sequences=n` does as well); the
engine gets the prompt strings and n, prefills each prompt once and expands its KV cache n times.
Calls are interleaved (native, hf, native, hf, ...) so that load from other jobs on the machine
hits both sides alike; the ratio hf / native is the figure to trust.
Each timed call goes from prompt strings to response ids on both sides (tokenize, pad, prefill,
decode loop). A greedy run per case checks that both produce the same tokens. A second table
splits one engine call into its prefill forward, its decode forwards and the rest.

`--checkpoint DIR` (e.g. the default experiment's warm start, `.cache/miles/sft-qwen3_tiny-*`)
adds a third table: the engine with and without dropping finished rows from the decode batch, on
the default rollout with real stopping at eos. Both engines get the same seed and must return
identical samples, so they generate the same tokens; there is no HF side in that table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
import transformers

from miles.config.schema import DType, ModelCfg, RolloutCfg
from miles.data.arithmetic import ArithmeticTask
from miles.data.tokenizer import DEFAULT_ALPHABET, TokenizerInfo
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from rollout_gpu import MODELS as GPU_MODELS, left_padded, markdown as gpu_markdown, run_gpu

TINY = ModelCfg(name="qwen3_tiny", hidden_size=128, intermediate_size=384, num_layers=3, num_heads=4, num_kv_heads=2,
                head_dim=32, rope_theta=10000.0, max_position_embeddings=64)  # conf/model/qwen3_tiny.yaml
BIGGER = ModelCfg(name="qwen3_512x8", hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                  num_kv_heads=4, head_dim=64, max_position_embeddings=128)


@dataclass
class Case:
    name: str
    model: ModelCfg
    prompts: int
    n: int  # samples per prompt: rows = prompts * n
    new_tokens: int


CASES = [  # the first is the default experiment's rollout (conf/rollout/native.yaml); --quick runs only it
    Case("tiny, default rollout (64 prompts x 8)", TINY, 64, 8, 8),
    Case("tiny, 32 prompts x 8", TINY, 32, 8, 8),
    Case("tiny, 64 rows x 32 tokens", TINY, 16, 4, 32),
    Case("512x8L, 64 rows x 32 tokens", BIGGER, 16, 4, 32),
    Case("512x8L, 256 rows x 8 tokens", BIGGER, 32, 8, 8),
]


class HFSide:
    def __init__(self, ckpt: str):
        self.model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        self.info = TokenizerInfo.load(ckpt)

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int, new_tokens: int, greedy: bool = False) -> list[list[int]]:
        tokens, mask = left_padded(self.info, prompts, n)
        if greedy:  # default stopping at eos, as the engine's default stop_ids; no forced length
            kw = dict(do_sample=False, max_new_tokens=new_tokens)
        else:  # exactly new_tokens per row: min_new_tokens masks eos, matching the engine's empty stop_ids
            kw = dict(do_sample=True, temperature=1.0, top_k=None, top_p=1.0,
                      min_new_tokens=new_tokens, max_new_tokens=new_tokens)
        out = self.model.generate(input_ids=tokens, attention_mask=mask, pad_token_id=self.info.pad_id,
                                  eos_token_id=self.info.eos_id, use_cache=True, **kw)
        return [trim_at_eos(row, self.info.eos_id) for row in out[:, tokens.shape[1]:].tolist()]


def trim_at_eos(ids: list[int], eos: int) -> list[int]:
    """HF keeps padding finished rows; the engine returns the response up to and including eos."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def greedy_agreement(engine: NativeEngine, hf: HFSide, prompts: list[str], new_tokens: int) -> float:
    """Share of rows whose greedy responses (up to eos) are token-identical. One row per prompt:
    greedy samples of one prompt are equal, so distinct prompts fill the batch instead."""
    ours = [s.response_ids for s in engine.generate(prompts, ["?"] * len(prompts), n=1, temperature=0.0,
                                                    max_new_tokens=new_tokens)]
    theirs = hf.generate(prompts, 1, new_tokens, greedy=True)
    return sum(a == b for a, b in zip(ours, theirs)) / len(ours)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def native_split(engine: NativeEngine, call, calls: int = 3) -> tuple[float, float, float]:
    """Seconds of one engine call spent in the prefill forward, in the decode forwards, and in the
    rest (tokenizing, sampling, bookkeeping); medians over `calls` extra calls, outside the timing."""
    spans, forward = [], engine.model.forward
    def timed_forward(ids, **kw):
        start = time.perf_counter()
        out = forward(ids, **kw)
        spans.append(time.perf_counter() - start)
        return out
    engine.model.forward = timed_forward
    parts = []
    for _ in range(calls):
        spans.clear()
        total = timed(call)
        parts.append((spans[0], sum(spans[1:]), total - sum(spans)))
    del engine.model.forward  # back to the model's own forward
    return tuple(statistics.median(p[i] for p in parts) for i in range(3))


def run_case(case: Case, threads: int, repeats: int, workdir: str) -> dict:
    ckpt = str(random_checkpoint(case.model, DEFAULT_ALPHABET, seed=0, out=f"{workdir}/{case.model.name}"))
    rows = case.prompts * case.n
    examples = ArithmeticTask(num_digits=2).sample_train(rows, np.random.default_rng(0))
    greedy_prompts = [e.prompt for e in examples]  # as many distinct prompts as the timed batch has rows
    prompts, labels = greedy_prompts[: case.prompts], [e.label for e in examples[: case.prompts]]
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=case.new_tokens, temperature=1.0), seed=0, threads=threads)
    hf = HFSide(ckpt)
    torch.set_num_threads(threads)  # the engine set it already; repeated so both sides visibly share it

    agreement = greedy_agreement(engine, hf, greedy_prompts, case.new_tokens)
    # Benchmark only: no stop ids, so every row decodes exactly new_tokens (a random model often
    # samples eos early, which would make the two sides do different amounts of work).
    engine.stop_ids = torch.tensor([], dtype=torch.long)
    native = lambda: engine.generate(prompts, labels, n=case.n)
    hf_call = lambda: hf.generate(prompts, case.n, case.new_tokens)
    assert all(len(s.response_ids) == case.new_tokens for s in native())  # also the warm-up
    assert all(len(r) == case.new_tokens for r in hf_call())  # min_new_tokens suppresses eos
    times = {"native": [], "hf": []}
    for _ in range(repeats):
        times["native"].append(timed(native))
        times["hf"].append(timed(hf_call))
    native_s, hf_s = statistics.median(times["native"]), statistics.median(times["hf"])
    prefill_s, decode_s, rest_s = native_split(engine, native)
    return dict(case=case.name, rows=rows, new=case.new_tokens, native_s=native_s, hf_s=hf_s,
                native_tps=rows * case.new_tokens / native_s, hf_tps=rows * case.new_tokens / hf_s,
                speedup=hf_s / native_s, agreement=agreement, prefill_s=prefill_s, decode_s=decode_s, rest_s=rest_s)


def compaction_case(ckpt: str, threads: int, repeats: int, batches: int = 5) -> dict:
    """Default rollout (64 prompts x 8, stop at eos) on a trained checkpoint: the engine dropping
    finished rows vs the same engine keeping them. Same seed, so the same samples: checked."""
    rng = np.random.default_rng(0)
    work = [ArithmeticTask(num_digits=2).sample_train(64, rng) for _ in range(batches)]
    engines = {name: NativeEngine(ckpt, RolloutCfg(max_new_tokens=8, temperature=1.0), seed=0, threads=threads)
               for name in ("drop", "keep")}
    engines["keep"].compact_at = float("inf")  # never compact
    decode_rows = {name: 0 for name in engines}
    for name, engine in engines.items():  # count the rows of each decode step during the warm-up round
        forward = engine.model.forward
        def counting(ids, _name=name, _forward=forward, **kw):
            decode_rows[_name] += ids.shape[0] if ids.shape[1] == 1 else 0
            return _forward(ids, **kw)
        engine.model.forward = counting
    times, tokens = {name: [] for name in engines}, 0
    for r in range(repeats + 1):  # round 0 is the warm-up
        for batch in work:
            prompts, labels = [e.prompt for e in batch], [e.label for e in batch]
            out = {}
            for name, engine in engines.items():  # interleaved
                start = time.perf_counter()
                out[name] = engine.generate(prompts, labels, n=8)
                times[name].append(time.perf_counter() - start)
            assert [s.response_ids for s in out["drop"]] == [s.response_ids for s in out["keep"]]
            tokens += sum(len(s.response_ids) for s in out["drop"]) if r == 0 else 0
        if r == 0:  # warm-up done: forget its times, stop counting
            times = {name: [] for name in engines}
            for engine in engines.values():
                del engine.model.forward  # back to the model's own forward
    drop_s, keep_s = statistics.median(times["drop"]), statistics.median(times["keep"])
    return dict(calls=len(times["drop"]), tokens=tokens / batches, rows_drop=decode_rows["drop"] / batches,
                rows_keep=decode_rows["keep"] / batches, drop_s=drop_s, keep_s=keep_s, speedup=keep_s / drop_s)


def markdown(results: list[dict]) -> str:
    lines = ["| case | rows | new tokens | native s | hf s | native tok/s | hf tok/s | speed-up (hf/native) "
             "| greedy agreement |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['case']} | {r['rows']} | {r['new']} | {r['native_s']:.3f} | {r['hf_s']:.3f} "
                     f"| {r['native_tps']:,.0f} | {r['hf_tps']:,.0f} | {r['speedup']:.2f}x | {r['agreement']:.0%} |")
    return "\n".join(lines)


def split_markdown(results: list[dict]) -> str:
    lines = ["| case | native prefill ms | native decode steps ms | native rest ms |", "|---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['case']} | {r['prefill_s'] * 1e3:.1f} | {r['decode_s'] * 1e3:.1f} "
                     f"| {r['rest_s'] * 1e3:.1f} |")
    return "\n".join(lines)


def compaction_markdown(r: dict) -> str:
    return "\n".join([
        "| case | timed calls | tokens per call | decode rows per call (keep / drop) | keep s | drop s "
        "| speed-up (keep/drop) |", "|---|---:|---:|---:|---:|---:|---:|",
        f"| warm start, default rollout (64 prompts x 8, stop at eos) | {r['calls']} | {r['tokens']:,.0f} "
        f"| {r['rows_keep']:,.0f} / {r['rows_drop']:,.0f} | {r['keep_s']:.3f} | {r['drop_s']:.3f} "
        f"| {r['speedup']:.2f}x |"])


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for both sides")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per side (median reported)")
    parser.add_argument("--quick", action="store_true", help="only the default-rollout case, 2 repeats")
    parser.add_argument("--checkpoint", help="a trained checkpoint (e.g. .cache/miles/sft-qwen3_tiny-*): "
                        "also time the engine dropping finished rows vs keeping them")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: Qwen3-0.6B-shaped cases")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="cuda cases: engine and HF dtype")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="cuda cases: rows (prompts x 8)")
    parser.add_argument("--prompt-len", type=int, default=128, help="cuda cases: prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=256, help="cuda cases: new tokens per row")
    parser.add_argument("--skip-hf", action="store_true", help="cuda cases: engine sides only")
    parser.add_argument("--no-padded", action="store_true",
                        help="cuda cases: without the padded engine (the CPU path; slow on MoE shapes)")
    parser.add_argument("--model", default="qwen3_0_6b", choices=sorted(GPU_MODELS),
                        help="cuda cases: the shape (deepseek_v3_dense_4l: MLA slot decode; qwen3_30b_a3b_8l: MoE)")
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()  # keep the output a clean table
    if args.device == "cuda":
        print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
        print(gpu_markdown(run_gpu(args.rows, args.prompt_len, args.new_tokens, args.repeats,
                                   DType(args.dtype), args.skip_hf, GPU_MODELS[args.model],
                                   padded=not args.no_padded)))
        return
    cases, repeats = (CASES[:1], min(args.repeats, 2)) if args.quick else (CASES, args.repeats)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {args.threads}, "
          f"repeats {repeats} (interleaved, median), {os.cpu_count()} CPUs, load average before {load()}")
    with tempfile.TemporaryDirectory() as workdir:
        results = [run_case(case, args.threads, repeats, workdir) for case in cases]
    compaction = compaction_case(args.checkpoint, args.threads, repeats) if args.checkpoint else None
    # Other jobs on the machine slow both sides alike (calls are interleaved) but make absolute
    # times noisy; the load average says how busy the machine was.
    print(f"load average after {load()}\n")
    print(markdown(results))
    print("\n" + split_markdown(results))
    if compaction:
        print("\n" + compaction_markdown(compaction))


if __name__ == "__main__":
    main()
