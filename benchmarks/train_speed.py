"""Training speed: `TorchTrainer.train_rl` tokens/s, MFU and peak memory, the packed + chunked trainer
against its padded, whole-logits configuration in the same process.

    .venv/bin/python benchmarks/train_speed.py --model qwen3_tiny --device cpu --compare          # seconds
    python benchmarks/train_speed.py --model qwen3_0_6b --device cuda --dtype bf16 --compare --out train.json

Model: the shapes of conf/model/<model>.yaml (`--set key=value` changes one, e.g. fewer layers or
experts so that a DeepSeek-V3-shaped model fits one GPU), random weights (`random_checkpoint`, fp32 master
weights; `--dtype bf16` trains under bf16 autocast). Batch: synthetic RL samples of random token
ids, loss on the response tokens, advantages +-1 per sample, rollout log-probs 0 (mismatch is not
measured here). Cases (token counts divided by `--shrink`, default 8 on the CPU):
  fixed      64 x (128 prompt + 256 response) tokens, 8192-token micro-batches
  varied     the same with response lengths uniform in [32, 256] (what packing removes: padding)
  rows-2k    fixed, 2048-token micro-batches
  seq-2k     16 x (512 + 1536) tokens: 2k-token sequences, 8192-token micro-batches
Configurations (rows of the table; `--configs`, `--compare` = packed,padded):
  packed          the defaults: trainer.pack_sequences, max_tokens_per_micro_batch = the case's, LM
                  head chunked at the loss positions
  padded          pack_sequences=false with micro_batch_size = max_tokens // sequence length (as many
                  token slots per forward as a packed row), logits_chunk_tokens=0: the model's own
                  head over every position, logits whole
  padded-chunked  padded micro-batches, chunked head (what chunking alone changes)
  megatron        trainer=megatron (CUDA, megatron-core installed): the policy a Megatron-core
                  GPTModel in bf16 with Megatron's distributed optimizer, padded micro-batches as
                  padded-chunked (miles/trainer/megatron)
  megatron-packed trainer=megatron with packed micro-batches as `packed` (THD)
`--profile` (CUDA): one more call of each configuration under torch.profiler, kernel time by category
(GEMMs, attention, compiled Triton kernels, eager elementwise work, the optimizer, copies), the
GPU's busy share and the host ops with the most self time (benchmarks/gpu_profile.py).
`--eager-ops` keeps the decoder's RMSNorm / RoPE / SwiGLU eager; by default the trainer on CUDA runs
them compiled (miles/models/fused.py), as it does in a launch. `--eager-ce` keeps the chunked LM
head's softmax eager (else fused Triton passes on CUDA, miles/trainer/chunked_ce_triton.py).
`--fp32-residual`: the bf16 trainer's residual stream in fp32 (precision.fp32_residual), else bf16.
Both take the old log-probs from the training forward (GRPO, ppo_clip, token mean, one optimizer
step per call); `--separate-old` adds the no-grad old-log-prob forward to both. The pre-issue-9
trainer also synced to the host after every micro-batch and used the unfused AdamW; that is not
reproduced here. Timing: `--warmup` calls, then the median of `--repeats` (CUDA: synchronized);
one CPU thread by default.

MFU = F * tokens / seconds / peak, F per token = 6 * N + 12 * layers * (heads * head_dim) * seq:
  N = non-embedding parameters plus the output projection (vocab x hidden, counted once, tied or
  not); 6 N = the matmuls of forward and backward;
  12 * layers * heads * head_dim * seq = attention scores and weighted values, forward and backward,
  seq = the length of the token's own sample (PaLM's convention: no halving for causality);
  tokens = the real prompt + response tokens of the batch (padding is not counted: its cost shows
  as lower MFU); peak = `--peak-tflops` (default 989: H100 / H200 dense bf16).
  The packed trainer runs the LM head at the response tokens only; F counts it at every token (the
  usual model FLOPs), and the separate old-log-prob forward (--separate-old) is not counted either.
Memory (CUDA): peak GB = the most allocated during the calls; held GB = allocated between steps (the
  weights, kept gradient buffers, optimizer state), so peak - held is what one step adds on top.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from miles.config.schema import AlgoCfg, AlgoName, DType, ModelCfg, PrecisionCfg, TrainerCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.models import CausalLM, from_hf_config
from miles.orchestrate.checkpoints import random_checkpoint
from miles.trainer.torch_trainer import TorchTrainer
from miles.types import TrainBatch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"packed": (True, 4096), "padded": (False, 0), "padded-chunked": (False, 4096),  # pack, chunk tokens
           "megatron": (False, 4096), "megatron-packed": (True, 4096)}


# Training kernels by name, first match wins (--profile).
PROFILE_CATEGORIES = [
    ("attention", re.compile(r"flash|fmha|sdpa|attention|cudnn", re.I)),
    ("GEMM (cuBLAS)", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_", re.I)),
    ("compiled (Triton)", re.compile(r"^triton_")),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("copy / fill / cast", re.compile(r"memcpy|memset|copy|fill|cast", re.I)),
    ("reduction", re.compile(r"reduce|norm|softmax|logsumexp", re.I)),
    ("elementwise (eager)", re.compile(r"elementwise|vectorized", re.I)),
    ("other", re.compile(r".")),
]


@dataclass
class Case:
    name: str
    samples: int
    prompt: int
    response: int
    max_tokens: int
    min_response: int = 0  # > 0: response lengths uniform in [min_response, response]


CASES = [
    Case("fixed", 64, 128, 256, 8192),
    Case("varied", 64, 128, 256, 8192, min_response=32),
    Case("rows-2k", 64, 128, 256, 2048),
    Case("seq-2k", 16, 512, 1536, 8192),
]


def shrunk(case: Case, by: int) -> Case:
    return Case(case.name, case.samples, max(1, case.prompt // by), max(1, case.response // by),
                max(8, case.max_tokens // by), max(1, case.min_response // by) if case.min_response else 0)


def conf_cfg(group: str, schema, name: str, sets=()):
    """conf/<group>/<name>.yaml as its `schema` dataclass, with `key=value` changes (dotted keys into
    its sections, YAML values)."""
    values = yaml.safe_load((ROOT / "conf" / group / f"{name}.yaml").read_text())
    for item in sets:
        key, sep, value = item.partition("=")
        *sections, leaf = key.split(".")
        target = values
        for section in sections:
            target = target.get(section) if isinstance(target, dict) else None
        if not sep or not isinstance(target, dict) or leaf not in target:
            raise SystemExit(f"error: {item!r}: not a key=value of conf/{group}/{name}.yaml")
        target[leaf] = yaml.safe_load(value)
    from omegaconf import OmegaConf  # the schema's nested sections (mla, moe, ...) as their dataclasses

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))


def model_cfg(name: str, sets: list[str] = ()) -> ModelCfg:
    """conf/model/<name>.yaml with `--set key=value` changes."""
    return conf_cfg("model", ModelCfg, name, sets)


def synthetic_batch(case: Case, vocab: int, seed: int = 0) -> TrainBatch:
    """Right-padded samples: tokens [N, T], loss on the response, advantage +-1 per sample."""
    gen = torch.Generator().manual_seed(seed)
    if case.min_response:
        responses = torch.randint(case.min_response, case.response + 1, (case.samples,), generator=gen)
    else:
        responses = torch.full((case.samples,), case.response)
    width = case.prompt + int(responses.max())
    tokens = torch.randint(0, vocab, (case.samples, width), generator=gen)
    mask = torch.zeros(case.samples, width - 1)
    for i, r in enumerate(responses.tolist()):
        tokens[i, case.prompt + r:] = 0
        mask[i, case.prompt - 1: case.prompt - 1 + r] = 1.0
    adv = (torch.randint(0, 2, (case.samples, 1), generator=gen).float() * 2 - 1) * mask
    return TrainBatch(tokens=tokens, loss_mask=mask, advantages=adv, rollout_logprobs=torch.zeros_like(mask))


def flops_per_token(arch, seq: int) -> float:
    """6 N + 12 L (heads * head_dim) seq: N counts the output projection once, not the input embedding."""
    model_params = sum(p.numel() for n, p in arch.named_parameters() if not n.startswith("embed_tokens"))
    if arch.lm_head is None:  # tied: the embedding matrix is also the output projection
        model_params += arch.embed_tokens.weight.numel()
    c = arch.config
    return 6 * model_params + 12 * c.num_layers * c.num_heads * c.head_dim * seq


def batch_flops(ckpt: str, batch: TrainBatch) -> tuple[int, float]:
    """(the batch's real tokens, the model FLOPs of one training step on them): F per token at each
    sample's own length, padding not counted."""
    lengths = (batch.loss_mask.shape[1] - batch.loss_mask.flip(-1).argmax(-1) + 1).tolist()
    with torch.device("meta"):  # the shapes only, whatever holds the weights
        shapes = CausalLM(from_hf_config(json.loads((Path(ckpt) / "config.json").read_text())))
    return sum(lengths), sum(flops_per_token(shapes, n) * n for n in lengths)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def precision_cfg(spec: str | None, args) -> PrecisionCfg:
    """`--precisions` item: a conf/precision recipe with overrides (`fp8,fp8_backward=fp8`); None: --dtype's."""
    if spec is None:
        dtype = DType.bf16 if args.dtype == "bf16" else DType.fp32
        return PrecisionCfg(name=args.dtype, train_dtype=dtype, rollout_dtype=dtype, fp32_residual=args.fp32_residual)
    name, *sets = spec.split(",")
    return conf_cfg("precision", PrecisionCfg, name, sets)


def run_config(ckpt: str, case: Case, batch: TrainBatch, config: str, args, device: torch.device,
               recipe: str | None = None) -> dict:
    packed, chunk_tokens = CONFIGS[config]
    seq_len = case.prompt + case.response
    trainer_cfg = TrainerCfg(lr=1e-5, global_batch_size=case.samples, pack_sequences=packed,
                             max_tokens_per_micro_batch=case.max_tokens, recompute=args.recompute,
                             offload_optimizer=args.offload_optimizer or None,
                             micro_batch_size=max(1, case.max_tokens // seq_len))
    precision = precision_cfg(recipe, args)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer_cls = TorchTrainer
    if config.startswith("megatron"):
        from miles.trainer.megatron.trainer import MegatronTrainer as trainer_cls
    trainer = trainer_cls(ckpt, AlgoCfg(name=AlgoName.grpo), trainer_cfg, precision, device=str(device),
                          threads=args.threads, logits_chunk_tokens=chunk_tokens,
                          reuse_forward_for_old=not args.separate_old)
    times, first = [], None
    for call in range(args.warmup + args.repeats):
        sync(device)
        start = time.perf_counter()
        metrics = trainer.train_rl(batch)
        sync(device)
        if call >= args.warmup:
            times.append(time.perf_counter() - start)
        first = first or metrics  # every configuration's first step starts from the same weights
    seconds = statistics.median(times)
    # between steps: what the trainer keeps (weights, gradient buffers, optimizer state); peak - held
    # is what a step adds on top (activations, transient copies)
    held_gb = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if args.profile:
        from gpu_profile import profile_call, report

        events, wall, host, by_shape = profile_call(lambda: trainer.train_rl(batch), top=12, shapes=args.profile)
        report(f"{case.name}, {config}", events, wall, 1, 12, host, PROFILE_CATEGORIES)
        print("| op (its own kernels) | input shapes | GPU us | calls |\n|---|---|---:|---:|")
        for op, shapes, us, calls in by_shape:
            print(f"| `{op}` | {shapes[:120]} | {us:.0f} | {calls} |")
    tokens, flops = batch_flops(ckpt, batch)
    peak_gb = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del trainer
    gc.collect()
    return dict(case=case.name, config=config, precision=recipe or args.dtype, samples=case.samples,
                width=batch.tokens.shape[1], max_tokens=case.max_tokens, tokens=tokens, seconds=seconds,
                tokens_per_s=tokens / seconds, mfu=flops / seconds / (args.peak_tflops * 1e12),
                peak_gb=peak_gb, held_gb=held_gb, first_loss=first["train/loss"])


def markdown(rows: list[dict], args) -> str:
    lines = [f"train_rl, {args.model}, {args.device}, {args.dtype}; MFU of {args.peak_tflops:g} TFLOP/s",
             "",
             "| case | config | precision | samples x width | tokens | s / step | tokens/s | MFU | peak GB | held GB | vs padded |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    speed = {(r["case"], r["config"]): r["tokens_per_s"] for r in rows}
    for r in rows:
        ratio = speed.get((r["case"], "padded"))
        ratio = f"{r['tokens_per_s'] / ratio:.2f}x" if r["config"] != "padded" and ratio else ""
        peak, held = ("-" if r[k] is None else f"{r[k]:.1f}" for k in ("peak_gb", "held_gb"))
        lines.append(f"| {r['case']} | {r['config']} | {r['precision']} | {r['samples']} x {r['width']} | {r['tokens']} | "
                     f"{r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.3g} | {peak} | {held} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--model", default="qwen3_tiny", help="a conf/model/*.yaml name (qwen3_tiny, qwen3_0_6b)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="change the model's shape, e.g. num_layers=3 moe.num_experts=8 (a model that fits)")
    p.add_argument("--compare", action="store_true", help="also run the padded, whole-logits configuration")
    p.add_argument("--configs", default=None, help=f"comma-separated, of {', '.join(CONFIGS)} (default: packed)")
    p.add_argument("--separate-old", action="store_true", help="a separate no-grad forward for the old log-probs")
    p.add_argument("--recompute", action="store_true", help="trainer.recompute=true (activation checkpointing)")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="trainer.offload_optimizer=true: AdamW's moments in host memory (the 4B shape on 80 GB)")
    p.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated subset")
    p.add_argument("--shrink", type=int, default=None, help="divide token counts by this (default: 8 cpu, 1 cuda)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default: 1 cpu, 2 cuda)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls, median taken (default: 3 cpu, 5 cuda)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: on a shared machine, OpenMP threads waiting for a descheduled "
                        "peer can stall a step for seconds)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the MFU denominator (H100/H200 dense bf16)")
    p.add_argument("--profile", type=int, nargs="?", const=20, default=0, metavar="OPS",
                   help="CUDA: profile one more call of each configuration, listing the OPS ops (default 20) "
                        "with the most GPU time by input shape")
    p.add_argument("--eager-ops", action="store_true", help="CUDA: RMSNorm / RoPE / SwiGLU eager, not compiled")
    p.add_argument("--fp32-residual", action="store_true", help="bf16: precision.fp32_residual=true")
    p.add_argument("--eager-ce", action="store_true", help="CUDA: the LM head's softmax eager, not fused")
    p.add_argument("--precisions", nargs="+", default=None, metavar="RECIPE[,KEY=VALUE]",
                   help="rows per precision recipe of conf/precision with overrides, e.g. bf16 fp8 "
                        "fp8,fp8_backward=fp8 (default: --dtype's plain recipe)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    cpu = args.device == "cpu"
    shrink = args.shrink or (8 if cpu else 1)
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 2)
    args.repeats = args.repeats or (3 if cpu else 5)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but CUDA is not available")
    if args.profile and device.type != "cuda":
        raise SystemExit("error: --profile reads CUDA kernel times: add --device cuda")
    if args.eager_ops:  # the trainer enables the compiled ops on CUDA; keep them eager instead
        from miles.models import fused

        fused.enable = lambda: None
    if args.eager_ce:
        from miles.trainer import chunked_ce_triton

        chunked_ce_triton.enabled = False

    configs = (args.configs or ("packed,padded" if args.compare else "packed")).split(",")
    if unknown := set(configs) - set(CONFIGS):
        raise SystemExit(f"error: unknown --configs {sorted(unknown)}; valid: {', '.join(CONFIGS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(random_checkpoint(model_cfg(args.model, args.set), DEFAULT_ALPHABET, seed=0, out=Path(tmp) / args.model))
        vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
        for case in CASES:
            if case.name not in args.cases.split(","):
                continue
            case = shrunk(case, shrink)
            batch = synthetic_batch(case, vocab)
            for config, recipe in [(c, r) for c in configs for r in (args.precisions or [None])]:
                rows.append(run_config(ckpt, case, batch, config, args, device, recipe))
                r = rows[-1]
                print(f"{r['case']:8s} {r['config']:6s} {r['precision']} {r['seconds']:.3f} s/step  {r['tokens_per_s']:,.0f} tok/s  "
                      f"MFU {r['mfu']:.3g}  first loss {r['first_loss']:.6f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))
    print()
    print(markdown(rows, args))


if __name__ == "__main__":
    main()
