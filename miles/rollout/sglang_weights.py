"""What an SGLang server's `/weights_checker` reports for the weights Miles sent: SGLang's parameter
layout and its per-tensor hashes, predicted on the sender's side (miles/rollout/sglang_engine.py's
checked sync).

SGLang 0.5.23 reads weights back by name (`/get_weights_by_name`) only for the few model classes that
implement it (llama, granite, exaone4, opt), none of Miles' families. Every model has `/weights_checker`
(python/sglang/srt/utils/weight_checker.py, `action="checksum"`): for each tensor of
`model.named_parameters()` and `named_buffers()` (non-persistent buffers such as `cos_sin_cache` and
tensors flagged `_skip_weight_check` left out) a 16-hex-digit hash of its bytes, under SGLang's own
names, in SGLang's own layout. So the sender predicts that layout from the HF tensors it sent,
`sglang_layout`, hashes each tensor as the server does, `tensor_hash`, and compares per name.

The layout, as the 0.5.23 model loaders build it (qwen3.py, qwen3_moe.py, deepseek_v2.py and
deepseek_common/deepseek_weight_loader.py, layers/moe/fused_moe_triton/layer.py,
layers/vocab_parallel_embedding.py), for TP = PP = EP = 1:
- `<p>.q_proj` / `k_proj` / `v_proj` (weight, bias) -> `<p>.qkv_proj`: q, k, v rows concatenated;
- `<p>.gate_proj` / `up_proj` (dense MLPs, shared experts) -> `<p>.gate_up_proj`: gate rows, then up;
- `<p>.experts.<e>.{gate,up,down}_proj` (also Mixtral's w1 / w3 / w2) -> FusedMoE's
  `<p>.experts.w13_weight` [E, 2I, H] (gate rows then up rows per expert) and `w2_weight` [E, H, I];
- DeepSeek's `q_a_proj` + `kv_a_proj_with_mqa` -> `fused_qkv_a_proj_with_mqa` (q_lora_rank set);
  with SGLang's shared-experts fusion on (the server then has no `shared_experts` tensors) the shared
  expert is the last expert of the fused ones;
- `model.embed_tokens` / `lm_head`: rows padded with zeros to a multiple of 64; a head tied to the
  embedding is one tensor (named_parameters drops the duplicate).
Everything else keeps its HF name and layout. A tensor the server holds in another dtype than the
engine's (DeepSeek's fp32 `e_score_correction_bias`) is compared as the server casts it.

Hashes (python/sglang/srt/managers/mm_utils.py `tensor_hash`): a CPU tensor's is the first 8 bytes of
the SHA-256 of its bytes, big-endian; a CUDA tensor's is SGLang's Triton kernel
(kernels/ops/memory/gpu_tensor_hash.py), reimplemented here in torch integer ops, `gpu_tensor_hash`.

Not predicted (a checked sync then fails, naming the tensors): TP / EP / PP > 1 (per-rank shards),
kernels that repack weights after loading (CPU AMX with bf16 weights, ROCm aiter's shuffle, FlashInfer
TRT-LLM's block layout, SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED), quantized SGLang checkpoints.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from typing import Iterator

import torch

Tensors = dict[str, torch.Tensor]
VOCAB_PADDING = 64  # layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1

_QKV = re.compile(r"^(.*)\.([qkv])_proj\.(weight|bias)$")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_GATE_UP = re.compile(r"^(.*)\.(gate|up)_proj\.weight$")
_MLA_A = re.compile(r"^(.*)\.(q_a_proj|kv_a_proj_with_mqa)\.weight$")
_EXPERT_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def pad_vocab_size(vocab_size: int, pad_to: int = VOCAB_PADDING) -> int:
    return (vocab_size + pad_to - 1) // pad_to * pad_to


def sglang_layout(hf: Tensors, tie_word_embeddings: bool = False,
                  fuse_shared_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(SGLang parameter name, tensor as SGLang holds it) for HF-named tensors (the module docstring's
    rules, TP = 1). Fused tensors are built one at a time (one layer's worth of memory at most)."""
    hf = dict(hf)
    if tie_word_embeddings:
        hf.pop("lm_head.weight", None)
    if fuse_shared_experts:
        counts = defaultdict(int)
        for name in hf:
            if (m := _EXPERT.match(name)) is not None:
                counts[m.group(1)] = max(counts[m.group(1)], int(m.group(2)) + 1)
        for name in [n for n in hf if ".mlp.shared_experts." in n]:
            prefix = name.split(".mlp.shared_experts.")[0] + ".mlp.experts"
            if prefix in counts:  # the shared expert is expert E of the fused ones (deepseek_weight_loader.py)
                hf[name.replace(".mlp.shared_experts.", f".mlp.experts.{counts[prefix]}.")] = hf.pop(name)
    qkv, experts, gate_up, mla, rest = defaultdict(dict), defaultdict(dict), defaultdict(dict), defaultdict(dict), {}
    for name, t in hf.items():
        if (m := _EXPERT.match(name)) is not None:
            experts[m.group(1)][(int(m.group(2)), _EXPERT_ROLE[m.group(3)])] = t
        elif (m := _QKV.match(name)) is not None:
            qkv[(m.group(1), m.group(3))][m.group(2)] = t
        elif (m := _GATE_UP.match(name)) is not None:
            gate_up[m.group(1)][m.group(2)] = t
        elif (m := _MLA_A.match(name)) is not None:
            mla[m.group(1)][m.group(2)] = t
        else:
            rest[name] = t
    # Incomplete groups (DeepSeek's q_proj without k / v, a lone gate) stay as they are.
    for (prefix, kind), parts in qkv.items():
        if set(parts) == {"q", "k", "v"}:
            yield f"{prefix}.qkv_proj.{kind}", torch.cat([parts["q"], parts["k"], parts["v"]])
        else:
            rest.update({f"{prefix}.{p}_proj.{kind}": t for p, t in parts.items()})
    for prefix, parts in gate_up.items():
        if set(parts) == {"gate", "up"}:
            yield f"{prefix}.gate_up_proj.weight", torch.cat([parts["gate"], parts["up"]])
        else:
            rest.update({f"{prefix}.{p}_proj.weight": t for p, t in parts.items()})
    for prefix, parts in mla.items():
        if set(parts) == {"q_a_proj", "kv_a_proj_with_mqa"}:
            yield f"{prefix}.fused_qkv_a_proj_with_mqa.weight", torch.cat([parts["q_a_proj"],
                                                                            parts["kv_a_proj_with_mqa"]])
        else:
            rest.update({f"{prefix}.{p}.weight": t for p, t in parts.items()})
    for prefix, parts in experts.items():
        count = max(e for e, _ in parts) + 1
        if set(parts) != {(e, r) for e in range(count) for r in ("gate", "up", "down")}:
            raise ValueError(f"{prefix}: per-expert tensors incomplete")
        yield f"{prefix}.w13_weight", torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]])
                                                   for e in range(count)])
        yield f"{prefix}.w2_weight", torch.stack([parts[(e, "down")] for e in range(count)])
    for name, t in rest.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight") and t.dim() == 2:
            padded = pad_vocab_size(t.shape[0])
            if padded != t.shape[0]:
                t = torch.cat([t, t.new_zeros(padded - t.shape[0], t.shape[1])])
        yield name, t


# ----------------------------------------------------------------------------- hashes
def cpu_tensor_hash(t: torch.Tensor) -> int:
    """mm_utils.tensor_hash of a CPU tensor: SHA-256 of its bytes, the first 8 as a big-endian int."""
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return int.from_bytes(hashlib.sha256(memoryview(data)).digest()[:8], "big")


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding uint32 values (products wrap mod 2^64,
    their low 32 bits are exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _splitmix64(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def gpu_tensor_hash(t: torch.Tensor, seed: int = 0x243F6A88, tile_words: int = 8192,
                    chunk_tiles: int = 512) -> int:
    """SGLang's `gpu_tensor_hash` (Triton) in torch ops, on the tensor's own device: the bytes as
    little-endian uint32 words (zero-padded to 4 bytes); per tile of 8192 words two sums of
    fmix32(word ^ position mix), xor the byte count, fmix32, packed into a uint64; the tiles' sum
    mod 2^64 through splitmix64. `chunk_tiles` bounds the temporary memory."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (4 - raw.numel() % 4) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    words = raw.view(torch.int32)
    n = words.numel()
    if n == 0:
        return 0
    s1, s2 = seed & _M32, ((seed * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
    nbytes = (n * 4) & _M32
    high = low = 0
    step = tile_words * chunk_tiles
    for start in range(0, n, step):
        v = words[start:start + step].to(torch.int64) & _M32
        i = torch.arange(start, start + v.numel(), device=v.device, dtype=torch.int64) & _M32
        k1 = _fmix32(v ^ ((((i * 0x27D4EB2D) + s1) & _M32) ^ _rotl32(i, 15)))
        k2 = _fmix32(v ^ ((((i * 0x165667B1) + s2) & _M32) ^ _rotl32(i, 13)))
        tail = (-v.numel()) % tile_words  # the last tile's masked words add 0
        if tail:
            k1, k2 = torch.nn.functional.pad(k1, (0, tail)), torch.nn.functional.pad(k2, (0, tail))
        h1 = _fmix32((k1.view(-1, tile_words).sum(1) & _M32) ^ nbytes)
        h2 = _fmix32((k2.view(-1, tile_words).sum(1) & _M32) ^ nbytes)
        high += int(h1.sum())
        low += int(h2.sum())
    return _splitmix64((high << 32) + low)


def tensor_hash(t: torch.Tensor, server_device: str) -> str:
    """The hex string /weights_checker reports for a tensor SGLang holds on `server_device`."""
    value = gpu_tensor_hash(t) if server_device.startswith("cuda") else cpu_tensor_hash(t)
    return f"{value:016x}"


# ----------------------------------------------------------------------------- the comparison
def compare_checksums(sent: Iterator[tuple[str, torch.Tensor]], held: dict[str, str], server_device: str,
                      dtype: torch.dtype) -> tuple[list[str], list[str], list[str]]:
    """(tensors whose hash differs, tensors the server reports no hash for, server tensors not
    predicted) for the predicted layout `sent` against the server's per-tensor hashes `held`. A
    floating-point tensor is hashed as the server's load casts it: to the engine's `dtype`; where that
    differs, as sent and as float32 (SGLang keeps a few tensors in fp32 whatever the model's dtype,
    e.g. DeepSeek's e_score_correction_bias; float32 holds every bf16 / fp16 value exactly)."""
    differ, missing, seen = [], [], set()
    for name, tensor in sent:
        seen.add(name)
        if name not in held:
            missing.append(name)
            continue
        if not any(tensor_hash(c, server_device) == held[name] for c in _as_loaded(tensor, dtype)):
            differ.append(name)
    return differ, missing, sorted(set(held) - seen)


def _as_loaded(t: torch.Tensor, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The tensors a server parameter may hold after loading `t`, most likely first (lazily)."""
    if not t.is_floating_point():
        yield t
        return
    cast = t.to(dtype)
    yield cast
    if t.dtype != dtype:
        yield t
    if torch.float32 not in (dtype, t.dtype):
        yield cast.float()
