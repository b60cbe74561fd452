"""Rollout speed on a GPU: the native engine (slot decode + CUDA graphs) vs transformers' generate,
eager and with its static cache, against the memory roofline. Run through rollout_speed.py:

    python benchmarks/rollout_speed.py --device cuda --dtype bf16 [--rows 64 256] [--repeats 3] [--skip-hf]
        [--model qwen3_0_6b | deepseek_v3_dense_4l | qwen3_30b_a3b_8l]

Qwen3-0.6B shape (hidden 1024, 28 layers, 16 / 8 heads, head_dim 128, intermediate 3072, vocab
151936, tied embeddings), or `--model deepseek_v3_dense_4l`: DeepSeek-V3 (conf/model/deepseek_v3.yaml)
cut to its first 4 layers, all dense (MLA at V3's widths, 128 heads, latent 512 + rope 64: the
absorbed MLA slot decode, from CUDA graphs; 4.2B parameters), or `--model qwen3_30b_a3b_8l`:
Qwen3-30B-A3B (conf/model/qwen3_30b_a3b.yaml) cut to 8 of its 48 layers (hidden 2048, 32 / 4 heads,
head_dim 128, 128 experts of width 768, top-8: the grouped expert kernels, from CUDA graphs; 5.6B
parameters). Random weights, `--prompt-len` token
prompts (default 128), exactly `--new-tokens` new tokens per row (default 256; stop ids emptied, HF's
min_new_tokens), 8 samples per prompt, temperature 1. Sides, each warmed up once, then timed calls interleaved:
  native        slot decode with CUDA-graph decode steps (the engine's GPU default)
  native eager  the same slot decode without graphs (what the graphs buy)
  padded        the engine's CPU path (left-padded batch, growing mask) on the GPU (--no-padded: left out)
  hf eager      AutoModelForCausalLM.generate, DynamicCache, SDPA
  hf static     generate(cache_implementation="static"), which compiles the decode step
Roofline: one decode step must read every weight once (bf16; an untied input embedding only by
the rows' tokens, so not counted; of a MoE layer's experts only those its rows chose: with uniform
routing E (1 - (1 - k/E)^rows) of the E, e.g. 8 of 128 at 1 row, 126 at 64) and, per row, the KV cache
of the positions so far (MLA: the latent and rope key per position):
tok/s <= rows / ((weight bytes + rows * mean context * KV bytes per token) / BW),
BW the device-to-device copy bandwidth measured here (bytes read + written over time).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from miles.config.schema import DType, ModelCfg, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET, TokenizerInfo, encode_prompt
from miles.hardware.footprint import kv_bytes_per_token
from miles.models.params import param_count
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine

QWEN3_0_6B = ModelCfg(name="qwen3_0_6b", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                      num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1e6, tie_word_embeddings=True,
                      max_position_embeddings=40960)
DEEPSEEK_V3_DENSE_4L = OmegaConf.to_object(OmegaConf.merge(
    OmegaConf.structured(ModelCfg), OmegaConf.load(Path(__file__).parents[1] / "conf" / "model" / "deepseek_v3.yaml"),
    dict(name="deepseek_v3_dense_4l", num_layers=4, mtp_layers=0, moe=dict(first_k_dense=4))))
QWEN3_30B_A3B_8L = OmegaConf.to_object(OmegaConf.merge(
    OmegaConf.structured(ModelCfg), OmegaConf.load(Path(__file__).parents[1] / "conf" / "model" / "qwen3_30b_a3b.yaml"),
    dict(name="qwen3_30b_a3b_8l", num_layers=8)))
MODELS = {"qwen3_0_6b": QWEN3_0_6B, "deepseek_v3_dense_4l": DEEPSEEK_V3_DENSE_4L, "qwen3_30b_a3b_8l": QWEN3_30B_A3B_8L}
SAMPLES = 8


def left_padded(info: TokenizerInfo, prompts: list[str], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's sample order as rows: row i*n+j is prompt i, <bos> + chars, padded on the left."""
    ids = [encode_prompt(info, p) for p in prompts for _ in range(n)]
    width = max(map(len, ids))
    tokens = torch.full((len(ids), width), info.pad_id, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, row in enumerate(ids):
        tokens[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return tokens, mask


def copy_bandwidth(gb: float = 4.0) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    src = torch.empty(int(gb * 1e9 / 2), dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 2 * 10 / (start.elapsed_time(end) / 1e3)


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def prompts(count: int, length: int) -> list[str]:
    """Distinct `length`-character prompts (one token per character, plus bos)."""
    digits = "0123456789+="
    return ["".join(digits[(i * 7 + j * (i + 3)) % len(digits)] for j in range(length - 1)) for i in range(count)]


class HFSide:
    def __init__(self, ckpt: str, dtype: torch.dtype):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).cuda().eval()
        self.info = TokenizerInfo.load(ckpt)

    @torch.no_grad()
    def generate(self, texts: list[str], new_tokens: int, static: bool):

        tokens, mask = left_padded(self.info, texts, SAMPLES)
        width = tokens.shape[1]
        extra = {"cache_implementation": "static"} if static else {}
        out = self.model.generate(input_ids=tokens.cuda(), attention_mask=mask.cuda(), do_sample=True, temperature=1.0,
                                  top_k=None, top_p=1.0, min_new_tokens=new_tokens, max_new_tokens=new_tokens,
                                  pad_token_id=self.info.pad_id, eos_token_id=self.info.eos_id, **extra)
        return out[:, width:]


def params_read(arch, rows: int) -> float:
    """Weights one decode step of `rows` tokens reads. Tied: the embedding is read once, as lm_head;
    untied, the input table only at the rows' tokens (not counted). MoE: of each layer's E experts
    the distinct ones its rows chose, E (1 - (1 - k/E)^rows) in expectation under uniform routing."""
    total, active = param_count(arch)
    read = total - (0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size)
    if arch.moe is None:
        return read
    e, k = arch.moe.num_experts, arch.moe.num_experts_per_tok
    experts = (total - active) * e / (e - k)  # idle = (E - k) experts per MoE layer
    return read - experts + experts * (1 - (1 - k / e) ** rows)


def progress(what: str, since: float) -> None:
    """A line per phase, flushed: a run cut by a time limit still says how far it got."""
    print(f"  [{time.perf_counter() - since:6.1f} s] {what}", flush=True)


def run_gpu(rows_list: list[int], prompt_len: int, new_tokens: int, repeats: int, dtype: DType, skip_hf: bool,
            model: ModelCfg = QWEN3_0_6B, padded: bool = True) -> list[dict]:
    torch_dtype = torch.bfloat16 if dtype == DType.bf16 else torch.float32
    begin = time.perf_counter()
    bandwidth = copy_bandwidth()
    results = []
    with tempfile.TemporaryDirectory() as work:
        ckpt = str(random_checkpoint(model, DEFAULT_ALPHABET, seed=0, out=f"{work}/m"))
        progress(f"random checkpoint of {model.name} written", begin)
        arch = model.arch(model.vocab_size)
        kv_token = kv_bytes_per_token(arch, torch_dtype.itemsize)
        hf = None if skip_hf else HFSide(ckpt, torch_dtype)
        for rows in rows_list:
            texts = prompts(rows // SAMPLES, prompt_len)
            cfg = RolloutCfg(max_new_tokens=new_tokens, max_prompt_len=prompt_len, max_running=rows,
                             n_samples_per_prompt=SAMPLES, temperature=1.0)
            sides, init_s = {}, {}
            engines = [("native", {}), ("native eager", {"cuda_graphs": False})]
            engines += [("padded", {"slot_decode": False})] if padded else []
            for name, kw in engines:
                start = time.perf_counter()
                engine = NativeEngine(ckpt, RolloutCfg(**{**cfg.__dict__, **kw}), dtype, device="cuda", seed=0)
                torch.cuda.synchronize()
                init_s[name] = time.perf_counter() - start
                progress(f"{rows} rows: {name} engine started", begin)
                engine.stop_ids = torch.tensor([], dtype=torch.long, device="cuda")  # exactly new_tokens per row
                sides[name] = (lambda e=engine: e.generate(texts, ["?"] * len(texts), n=SAMPLES))
            if hf is not None:
                sides["hf eager"] = lambda: hf.generate(texts, new_tokens, static=False)
                sides["hf static"] = lambda: hf.generate(texts, new_tokens, static=True)
            first = {}
            for name, fn in sides.items():  # first call at this shape
                first[name] = timed(fn)
                progress(f"{rows} rows: {name} first call {first[name]:.1f} s", begin)
            times = {name: [] for name in sides}
            for _ in range(repeats):
                for name, fn in sides.items():
                    times[name].append(timed(fn))
            progress(f"{rows} rows: {repeats} timed rounds done", begin)
            context = prompt_len + new_tokens / 2  # mean positions cached over the decode
            step_bytes = params_read(arch, rows) * torch_dtype.itemsize + rows * context * kv_token
            roofline = rows * bandwidth / step_bytes
            for name in sides:
                warm = statistics.median(times[name])
                results.append(dict(rows=rows, side=name, warm_s=warm, first_s=first[name], init_s=init_s.get(name),
                                    tps=rows * new_tokens / warm, roofline_tps=roofline,
                                    bandwidth=bandwidth, step_bytes=step_bytes))
            del sides
            torch.cuda.empty_cache()
    return results


def markdown(results: list[dict]) -> str:
    lines = ["| rows | side | warm s | tok/s | % of roofline | first call / warm | engine start s | vs hf eager |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        base = next((x for x in results if x["rows"] == r["rows"] and x["side"] == "hf eager"), None)
        ratio = f"{base['warm_s'] / r['warm_s']:.2f}x" if base else "-"
        init = f"{r['init_s']:.1f}" if r["init_s"] is not None else "-"
        lines.append(f"| {r['rows']} | {r['side']} | {r['warm_s']:.3f} | {r['tps']:,.0f} | "
                     f"{100 * r['tps'] / r['roofline_tps']:.1f}% | {r['first_s'] / r['warm_s']:.2f} | {init} | {ratio} |")
    r = results[0]
    lines.append(f"\nroofline: copy bandwidth {r['bandwidth'] / 1e12:.2f} TB/s; "
                 + "; ".join(f"{x['rows']} rows: {x['step_bytes'] / 1e9:.2f} GB per step -> {x['roofline_tps']:,.0f} tok/s"
                             for x in results if x["side"] == "native"))
    return "\n".join(lines)
