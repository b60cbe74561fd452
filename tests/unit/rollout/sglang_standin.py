"""A STAND-IN for an SGLang 0.5.23 HTTP server, for testing miles/rollout/sglang_engine.py where SGLang cannot run.

THIS IS NOT SGLANG. It implements the request and response schemas of the endpoints the adapter uses, as
../shared/reference/backend-apis.md §1 documents them and as SGLang 0.5.23's source has them where that
was read (the sglang-0.5.23 wheel: srt/entrypoints/http_server.py, srt/managers/io_struct.py,
srt/utils/weight_checker.py, srt/sampling/sampling_batch_info.py, srt/managers/tokenizer_manager.py),
over the project's own NativeEngine: its tokens and log-probs are those of a real tiny model, its
routed experts those the model chose, its weights what the requests loaded. It is a stand-in for the
server process, not a mock of results.

Behaviours taken from 0.5.23's source (a real 0.5.23 server on a CPU showed the first three):
- `/get_weights_by_name` answers HTTP 400 {"error": {"message": "Get parameter by name failed"}} unless
  the model class implements `get_weights_by_name` (llama, granite, exaone4, opt, embedding_gemma2):
  for every Miles family (Qwen2 / Qwen3 / Qwen3-MoE / DeepSeek / GLM / ...) it fails.
- `sampling_seed` is used only with `--enable-deterministic-inference` (sampling_batch_info.py builds
  the batch's seeds only then, 42 for a row without one); without it, rows sample from the server's
  own stream and the seed is ignored.
- `/model_info`'s `model_path` (and `served_model_name`) become the directory of the last successful
  `/update_weights_from_disk` (TokenizerManager._update_model_path_info).
- `/weights_checker` (action "checksum"): per-tensor hashes of the model's parameters under SGLang's
  fused names and layout (`sglang_parameters`, which loads the HF tensors the way 0.5.23's loaders do:
  stacked qkv_proj / gate_up_proj, FusedMoE w13_weight / w2_weight, DeepSeek's
  fused_qkv_a_proj_with_mqa, vocabulary rows padded to 64, a tied head once), hashed as
  mm_utils.tensor_hash does on the server's `device` ("cpu": SHA-256, "cuda": the Triton kernel's
  arithmetic, here in numpy), in the response layout of http_server.py `check_weights`.
- LoRA (server args enable_lora, max_lora_rank, lora_target_modules; the current SGLang source's
  http_server.py, io_struct.py LoadLoRAAdapterReqInput / UnloadLoRAAdapterReqInput / LoRAUpdateOutput,
  lora_registry.py, tokenizer_manager.py, read through the `search` tools, not the 0.5.23 wheel):
  POST /load_lora_adapter {lora_name, lora_path} reads a PEFT adapter directory and answers
  {success, error_message, loaded_adapters: {name: path}}, HTTP 400 with success false on an error
  ("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", "LoRA with name ... already
  exists. Loaded LoRAs: ..."); /unload_lora_adapter {lora_name} ("LoRA with name ... does not exist.
  ..."); with --max-loaded-loras, a load past that many adapters is refused ("Cannot load LoRA adapter
  ... Maximum number of loaded LoRA adapters is ..."); /generate's `lora_path` (one name, or one per
  input row, None = the base model) names loaded adapters ("The following requested LoRA adapters are
  not loaded: ..."), and each row is computed with the adapter it names (a batch naming several is
  decoded one adapter's rows at a time: SGLang's one mixed batch is not reproduced, its results are).
  The adapters run as the native engine's LoRA module (miles/models/lora.py) at max_lora_rank, each
  adapter zero-padded to it with its alpha / r folded into B: SGLang's LoRA kernels and numerics are
  not reproduced.
- Images (`image_data`, io_struct.py GenerateReqInput and its _normalize_image_data; multimodal/
  processors/base_processor.py, qwen_vl.py, utils/common.py load_image, read in the 0.5.23 wheel): a
  list aligned with the `input_ids` rows, each None or a list of that row's images as data URIs,
  bare base64 or file paths (length other than the batch's: 400 "The length of image_data should be
  equal to the batch size."). Each image is loaded with PIL and processed by the checkpoint's own
  image processor (preprocessor_config.json, as SGLang's processor wrapper loads it); each image
  placeholder token of the row's input_ids is widened to its image's grid (qwen_vl.py
  build_input_ids: one placeholder per image; another count: 400), and the row is computed by the
  native engine's vision-language path with those pixels. `meta_info.prompt_tokens` is the widened
  length. /weights_checker holds a Qwen2.5-VL tower as qwen2_5_vl.py loads it (`attn.qkv` ->
  `attn.qkv_proj`, the MLP's gate / up weights and biases fused into `gate_up_proj`).

Strict on purpose, so a test catches adapter drift: a body with an unknown field, a missing required
field or a wrongly typed value gets HTTP 400; a documented field the stand-in does not reproduce is
accepted only at its documented default (400 otherwise, saying so). Every request is recorded
(`server.log`: (method, path, body)).

What it does NOT reproduce: SGLang's kernels and numerics (these are the native engine's), continuous
batching, the radix cache (cached_tokens is 0), streaming, text prompts / stop strings / regex and other
constrained decoding, penalties, top_logprobs, LoRA's pinning / eviction / max_loras_per_batch /
load_lora_adapter_from_tensors / the checks of rank and modules beyond those below, video / audio data,
the processor_output / precomputed_embedding image formats, image URLs, speculative decoding, TP / DP
(tp_size > 1 only checks the per-rank payload count), CUDA IPC and NCCL (tensors cross by CPU shared
memory, weight update groups are gloo), the exact store layout of SGLang's process-group rendezvous
(here: a TCPStore client at master_address:master_port and a PrefixStore named group_name), aborting or
retracting running requests on pause (new requests wait until continue), and the allowlist of
SGLang's safe unpickler (here: the families the document names; SGLang's exact list was not read).
Choices where the document is silent: output_ids drop the matched stop token unless no_stop_trim (the
output_token_logprobs keep it); dense layers' rows of routed_experts are 0; sampling `n` > 1 expands
prompt-major; with deterministic inference, sampling_seed seeds a row's own generator (SGLang hashes
(seed, position) instead: the same property, other samples). /weights_checker reproduces "checksum"
only (not snapshot / compare / reset_tensors), TP = 1.

    server = StandInServer(ckpt, enable_return_routed_experts=True).start()   # server.url
    server.kill()                                                             # connections now refused
    python tests/unit/rollout/sglang_standin.py --model-path CKPT --port 30000  # as a process (launch_server's flags)
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import io
import json
import pickle
import re
import threading
import time
import traceback
import uuid
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch

from miles.config.schema import DType, LoRACfg, RolloutCfg
from miles.data.vision_inputs import VisionInputs
from miles.models.families import get_family
from miles.models.hf_io import from_pretrained
from miles.models.lora import ALL_PROJECTIONS
from miles.models.lora_peft import CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE, hf_module_names
from miles.rollout.lora import engine_adapters
from miles.rollout.native import NativeEngine
from miles.types import moe_layers

VERSION = "0.5.23 (Miles stand-in)"
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
NO = object()  # "no default": a field the stand-in reproduces


class BadRequest(Exception):
    status = 400


class Unavailable(Exception):
    status = 503


class _Reply:
    """An endpoint's answer with its own status (SGLang's {success: false} bodies come back as 400)."""

    def __init__(self, status: int, body):
        self.status, self.body = status, body


# SGLang 0.5.23 model classes with a get_weights_by_name method (srt/models/{llama,granite,exaone4,opt,
# embedding_gemma2}.py, and llama's subclasses); every other model answers /get_weights_by_name with 400.
GET_WEIGHTS_BY_NAME = {"LlamaForCausalLM", "GraniteForCausalLM", "Exaone4ForCausalLM", "OPTForCausalLM",
                       "Gemma2ForSequenceClassification"}


# ----------------------------------------------------------------------------- SGLang's parameter layout
def sglang_parameters(hf: dict[str, torch.Tensor], config: dict, dtype: torch.dtype,
                      shared_experts_fusion: bool = False) -> dict[str, torch.Tensor]:
    """The model's named_parameters as SGLang 0.5.23 would hold them after loading these HF tensors
    (TP = 1): parameters allocated from config.json's sizes, then each checkpoint tensor copied into
    its slice the way the loaders do it (qwen3.py / qwen3_moe.py stacked_params_mapping and
    QKVParallelLinear / MergedColumnParallelLinear shard offsets, FusedMoE._load_w13 / _load_w2,
    deepseek_weight_loader.py's cached q_a / kv_a fusion and shared-experts fusion,
    VocabParallelEmbedding.weight_loader's zero-padded rows; a tied head is the embedding's tensor).
    A vision-language config's decoder sizes are its text_config's; a Qwen2.5-VL tower loads as
    qwen2_5_vl.py load_weights does (`vision_parameter`)."""
    vision = config.get("vision_config")
    config = {**config, **config.get("text_config", {})}
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    routed = config.get("num_experts") or config.get("n_routed_experts") or config.get("num_local_experts")
    moe_inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    shared_inter = moe_inter * (config.get("n_shared_experts") or 1)
    stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    q_offsets = {"q": (0, heads * head_dim), "k": (heads * head_dim, kv_heads * head_dim),
                 "v": ((heads + kv_heads) * head_dim, kv_heads * head_dim)}
    params: dict[str, torch.Tensor] = {}

    def param(name: str, shape, kind=dtype) -> torch.Tensor:
        if name not in params:
            params[name] = torch.full(tuple(shape), float("nan"), dtype=kind)  # torch.empty, made visible
        return params[name]

    hf = dict(hf)
    if config.get("tie_word_embeddings"):
        hf.pop("lm_head.weight", None)
    if shared_experts_fusion and routed:
        hf = {n.replace("mlp.shared_experts", f"mlp.experts.{routed}"): t for n, t in hf.items()}
    experts = (routed + any(f".experts.{routed}." in n for n in hf)) if routed else 0  # + a fused shared one
    cached_a = {}
    for name, w in hf.items():
        if name.startswith("visual.") and vision is not None:
            vision_parameter(name, w, vision, param)
            continue
        if (m := re.match(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$", name)):
            e, which = int(m.group(2)), {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}.get(m.group(3), m.group(3))
            if which == "w2":
                param(f"{m.group(1)}.w2_weight", (experts, w.shape[0], moe_inter))[e].copy_(w)
            else:
                w13 = param(f"{m.group(1)}.w13_weight", (experts, 2 * moe_inter, w.shape[1]))
                w13[e].narrow(0, moe_inter if which == "w3" else 0, moe_inter).copy_(w)  # w1 first, then w3
            continue
        if name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")) and config.get("q_lora_rank"):
            cached_a[name] = w
            q = name.replace("kv_a_proj_with_mqa", "q_a_proj")
            kv = name.replace("q_a_proj", "kv_a_proj_with_mqa")
            if q in cached_a and kv in cached_a:
                fused = torch.cat([cached_a.pop(q), cached_a.pop(kv)], dim=0)
                target = q.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")
                param(target, fused.shape).copy_(fused)
            continue
        for fused, shard, shard_id in stacked:
            prefix, dot, suffix = name.rpartition(f".{shard}.")
            if not dot or (shard_id in q_offsets and not all(f"{prefix}.{s}_proj.{suffix}" in hf for s in "qkv")):
                continue
            if shard_id in q_offsets:
                start, size = q_offsets[shard_id]
                total = (heads + 2 * kv_heads) * head_dim
            else:
                size = shared_inter if ".shared_experts" in prefix else config["intermediate_size"]
                start, total = shard_id * size, 2 * size
            target = param(f"{prefix}.{fused}.{suffix}", (total, *w.shape[1:]))
            target.narrow(0, start, size).copy_(w)
            break
        else:
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                rows = (w.shape[0] + 63) // 64 * 64
                target = param(name, (rows, w.shape[1]))
                target[: w.shape[0]].copy_(w)
                target[w.shape[0]:].fill_(0)
            elif name.endswith("e_score_correction_bias"):  # deepseek_v2.py MoEGate: fp32 for noaux_tc
                param(name, w.shape, torch.float32).copy_(w)
            else:
                param(name, w.shape).copy_(w)
    unloaded = [n for n, t in params.items() if torch.isnan(t).any()]
    if unloaded or cached_a:
        raise BadRequest(f"stand-in layout: parameters not fully loaded: {unloaded[:3]} {list(cached_a)[:3]}")
    return params


def vision_parameter(name: str, w: torch.Tensor, vision: dict, param) -> None:
    """One Qwen2.5-VL tower tensor into SGLang's parameters (qwen2_5_vl.py load_weights, TP = 1): the
    MLP's gate_proj / up_proj (weight and bias: the stacked mapping matches any name holding them) as
    shards 0 / 1 of `gate_up_proj` (MergedColumnParallelLinear, the tower's intermediate_size each),
    `attn.qkv` renamed `attn.qkv_proj` (VisionAttention's QKVParallelLinear, loaded whole); the rest as it is."""
    for shard, shard_id in (("gate_proj", 0), ("up_proj", 1)):
        prefix, dot, suffix = name.rpartition(f".{shard}.")
        if dot:
            size = vision["intermediate_size"]
            fused = param(f"{prefix}.gate_up_proj.{suffix}", (2 * size, *w.shape[1:]))
            fused.narrow(0, shard_id * size, size).copy_(w)
            return
    name = name.replace("attn.qkv.", "attn.qkv_proj.")
    param(name, w.shape).copy_(w)


def _cpu_tensor_hash(t: torch.Tensor) -> int:
    """mm_utils.tensor_hash of a CPU tensor: the first 8 bytes of SHA-256 of its bytes, big-endian."""
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return int.from_bytes(hashlib.sha256(data.tobytes()).digest()[:8], byteorder="big", signed=False)


def _gpu_tensor_hash(t: torch.Tensor, seed: int = 0x243F6A88, tile: int = 8192) -> int:
    """kernels/ops/memory/gpu_tensor_hash.py's arithmetic (hash_tiles32_kernel_blocked, the add-tree
    reduce, _final_splitmix64) in numpy uint32 / uint64, which wrap as Triton's do."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    raw += b"\0" * ((4 - len(raw) % 4) % 4)
    v = np.frombuffer(raw, dtype="<u4").astype(np.uint32)
    n = v.size
    if n == 0:
        return 0

    def fmix(x):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x85EBCA6B)
        x = x ^ (x >> np.uint32(13))
        x = x * np.uint32(0xC2B2AE35)
        return x ^ (x >> np.uint32(16))

    def rotl(x, r):
        return (x << np.uint32(r)) | (x >> np.uint32(32 - r))

    with np.errstate(over="ignore"):
        s1 = np.uint32(seed & 0xFFFFFFFF)
        s2 = np.uint32(((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF)
        iu = np.arange(n, dtype=np.uint64).astype(np.uint32)
        k1 = fmix(v ^ ((iu * np.uint32(0x27D4EB2D) + s1) ^ rotl(iu, 15)))
        k2 = fmix(v ^ ((iu * np.uint32(0x165667B1) + s2) ^ rotl(iu, 13)))
        pad = (-n) % tile
        k1, k2 = np.concatenate([k1, np.zeros(pad, np.uint32)]), np.concatenate([k2, np.zeros(pad, np.uint32)])
        nbytes = np.uint32((n * 4) & 0xFFFFFFFF)
        h1 = fmix(k1.reshape(-1, tile).sum(axis=1, dtype=np.uint32) ^ nbytes)
        h2 = fmix(k2.reshape(-1, tile).sum(axis=1, dtype=np.uint32) ^ nbytes)
        total = int(((h1.astype(np.uint64) << np.uint64(32)) | h2.astype(np.uint64)).sum(dtype=np.uint64))
    mask = (1 << 64) - 1
    total ^= total >> 30
    total = (total * 0xBF58476D1CE4E5B9) & mask
    total ^= total >> 27
    total = (total * 0x94D049BB133111EB) & mask
    return total ^ (total >> 31)


# ----------------------------------------------------------------------------- schemas (doc §1.3-§1.6)
def _is(*types):
    return lambda v: isinstance(v, types) and not (isinstance(v, bool) and bool not in types)


def _opt(check):
    return lambda v: v is None or check(v)


def _list_of(check):
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


BOOL, INT, NUM, STR, DICT = _is(bool), _is(int), _is(int, float), _is(str), _is(dict)
ANY = lambda v: True  # noqa: E731
INTS = _list_of(INT)

# field -> (check, default): default NO = reproduced; anything else = accepted at that value only.
GENERATE = {
    "text": (ANY, None), "input_ids": (lambda v: INTS(v) or _list_of(INTS)(v), NO),
    "sampling_params": (lambda v: DICT(v) or _list_of(DICT)(v), NO), "rid": (_opt(lambda v: STR(v) or _list_of(STR)(v)), NO),
    "return_logprob": (_opt(BOOL), NO), "logprob_start_len": (_opt(INT), None), "top_logprobs_num": (_opt(INT), None),
    "token_ids_logprob": (ANY, None), "return_text_in_logprobs": (BOOL, False),
    "return_routed_experts": (BOOL, NO), "routed_experts_start_len": (INT, NO), "return_hidden_states": (BOOL, False),
    "lora_path": (lambda v: v is None or STR(v) or _list_of(_opt(STR))(v), NO), "custom_logit_processor": (ANY, None),
    "image_data": (_opt(_list_of(_opt(_list_of(STR)))), NO),
    "routed_dp_rank": (ANY, None), "priority": (ANY, None), "stream": (BOOL, False),
}
SAMPLING = {
    "max_new_tokens": (INT, NO), "temperature": (NUM, NO), "top_p": (NUM, NO), "top_k": (INT, NO),
    "min_p": (NUM, 0.0), "frequency_penalty": (NUM, 0.0), "presence_penalty": (NUM, 0.0),
    "repetition_penalty": (NUM, 1.0), "min_new_tokens": (INT, 0), "n": (INT, NO), "stop": (ANY, None),
    "stop_token_ids": (_opt(INTS), NO), "stop_regex": (ANY, None), "ignore_eos": (BOOL, False),
    "skip_special_tokens": (BOOL, NO), "spaces_between_special_tokens": (BOOL, NO), "no_stop_trim": (BOOL, NO),
    "json_schema": (ANY, None), "regex": (ANY, None), "ebnf": (ANY, None), "logit_bias": (ANY, None),
    "sampling_seed": (_opt(INT), NO), "custom_params": (ANY, None),
}
SELECTOR = lambda v: v in ("target", "draft", "all")  # noqa: E731
UPDATE_COMMON = {"flush_cache": (BOOL, NO), "weight_version": (_opt(STR), NO), "selector": (SELECTOR, NO),
                 "abort_all_requests": (BOOL, NO), "torch_empty_cache": (BOOL, NO)}
BODIES = {  # path -> (fields, required)
    "/generate": (GENERATE, ()),
    "/update_weights_from_tensor": (dict(UPDATE_COMMON, serialized_named_tensors=(_list_of(STR), NO),
                                         load_format=(_opt(STR), NO)), ("serialized_named_tensors",)),
    "/update_weights_from_disk": ({"model_path": (STR, NO), "load_format": (_opt(STR), None),
                                   "weight_version": (_opt(STR), NO), "flush_cache": (BOOL, NO), "keep_pause": (BOOL, NO),
                                   "abort_all_requests": (BOOL, NO), "recapture_cuda_graph": (BOOL, NO),
                                   "is_async": (BOOL, False)}, ("model_path",)),
    "/update_weights_from_distributed": (dict(UPDATE_COMMON, names=(_list_of(STR), NO), dtypes=(_list_of(STR), NO),
                                              shapes=(_list_of(INTS), NO), group_name=(STR, NO),
                                              load_format=(_opt(STR), NO)), ("names", "dtypes", "shapes")),
    "/init_weights_update_group": ({"master_address": (STR, NO), "master_port": (INT, NO), "rank_offset": (INT, NO),
                                    "world_size": (INT, NO), "group_name": (STR, NO), "backend": (STR, NO)},
                                   ("master_address", "master_port", "rank_offset", "world_size")),
    "/destroy_weights_update_group": ({"group_name": (STR, NO)}, ()),
    "/begin_weight_update": ({"selector": (SELECTOR, NO)}, ()),
    "/end_weight_update": ({}, ()),
    "/get_weights_by_name": ({"name": (STR, NO), "truncate_size": (INT, NO)}, ("name",)),
    "/weights_checker": ({"action": (STR, NO), "allow_quant_error": (BOOL, False),
                          "skip_tensor_list": (_opt(_list_of(STR)), NO), "selector": (SELECTOR, NO)}, ()),
    "/release_memory_occupation": ({"tags": (_opt(_list_of(lambda t: t in MEMORY_TAGS)), NO)}, ()),
    "/resume_memory_occupation": ({"tags": (_opt(_list_of(lambda t: t in MEMORY_TAGS)), NO)}, ()),
    "/pause_generation": ({"mode": (lambda v: v in ("abort", "retract", "in_place"), NO)}, ()),
    "/load_lora_adapter": ({"lora_name": (STR, NO), "lora_path": (STR, NO), "pinned": (BOOL, False),
                            "lora_id": (_opt(STR), None)}, ("lora_name", "lora_path")),
    "/unload_lora_adapter": ({"lora_name": (STR, NO), "lora_id": (_opt(STR), None)}, ("lora_name",)),
    "/continue_generation": ({"torch_empty_cache": (BOOL, NO)}, ()),
}


def check_body(body, fields: dict, required=(), where: str = "body") -> dict:
    if not isinstance(body, dict):
        raise BadRequest(f"{where}: a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise BadRequest(f"{where}: unknown field(s) {unknown} (not in SGLang 0.5.23's schema)")
    missing = [f for f in required if f not in body]
    if missing:
        raise BadRequest(f"{where}: missing required field(s) {missing}")
    for name, value in body.items():
        check, default = fields[name]
        if not check(value):
            raise BadRequest(f"{where}: {name}={value!r} has the wrong type or value")
        if default is not NO and value != default:
            raise BadRequest(f"{where}: {name}={value!r} is documented but not reproduced by the stand-in "
                             f"(only {default!r})")
    return body


# ----------------------------------------------------------------------------- tensor payloads
# After the doc's description of SGLang's SafeUnpickler (builtins, torch tensors and storages, the
# torch.multiprocessing.reductions rebuild_* functions); a Miles-defined class is refused.
_REBUILDS = ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_filename", "rebuild_storage_fd",
             "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child", "rebuild_event")
ALLOWED = ({("builtins", n) for n in ("list", "tuple", "dict", "str", "int", "float", "bool", "bytes", "bytearray")}
           | {("torch.multiprocessing.reductions", n) for n in _REBUILDS}
           | {("torch", n) for n in ("Tensor", "Size", "device", "float32", "bfloat16", "float16", "float64", "int8",
                                     "uint8", "int16", "int32", "int64", "bool", "float8_e4m3fn", "float8_e5m2")}
           | {("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "UntypedStorage"),
              ("torch.storage", "TypedStorage"), ("torch.storage", "_load_from_bytes"),
              ("torch.nn.parameter", "Parameter"), ("collections", "OrderedDict")})


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in ALLOWED:
            raise BadRequest(f"serialized_named_tensors: {module}.{name} is not allowed by the safe unpickler")
        return super().find_class(module, name)


def deserialize(payload: str):
    import torch.multiprocessing.reductions  # noqa: F401

    return SafeUnpickler(io.BytesIO(base64.b64decode(payload))).load()


# ----------------------------------------------------------------------------- the server
class StandInServer:
    """Server args as SGLang's (the subset that matters here); `start()` serves on a thread."""

    def __init__(self, model_path: str, dtype: str = "float32", random_seed: int = 0, host: str = "127.0.0.1",
                 port: int = 0, tp_size: int = 1, skip_tokenizer_init: bool = True,
                 enable_return_routed_experts: bool = False, enable_memory_saver: bool = True,
                 enable_weights_cpu_backup: bool = False, weight_version: str = "default",
                 enable_deterministic_inference: bool = False, device: str = "cpu",
                 shared_experts_fusion: bool = False, enable_lora: bool = False, max_lora_rank: int | None = None,
                 lora_target_modules: list[str] | None = None, **other_args):
        """device: what /server_info says and which hash /weights_checker computes ("cpu" or "cuda");
        the stand-in itself runs on the CPU. shared_experts_fusion: DeepSeek's shared expert held as
        the last fused expert (SGLang's shared-experts fusion, on for some CUDA setups)."""
        self.args = dict(model_path=model_path, dtype=dtype, random_seed=random_seed, host=host, tp_size=tp_size,
                         dp_size=1, skip_tokenizer_init=skip_tokenizer_init,
                         enable_return_routed_experts=enable_return_routed_experts,
                         enable_memory_saver=enable_memory_saver, enable_weights_cpu_backup=enable_weights_cpu_backup,
                         enable_deterministic_inference=enable_deterministic_inference, device=device,
                         enable_lora=enable_lora, max_lora_rank=max_lora_rank, lora_target_modules=lora_target_modules,
                         **other_args)
        self.model_path = model_path  # /model_info's: moved by each successful update from disk
        self.hf_config = json.loads((Path(model_path) / "config.json").read_text())
        self.shared_experts_fusion = shared_experts_fusion
        engine_dtype = DType.bf16 if dtype in ("bfloat16", "bf16") else DType.fp32
        self.base_cfg = RolloutCfg(slot_decode=False)
        self.engine = NativeEngine(model_path, self.base_cfg, engine_dtype, seed=random_seed,
                                   record_routing=enable_return_routed_experts)
        self.config = self.engine.model.config
        self.family = get_family(self.config.family)
        self.vision = VisionInputs.load(model_path, self.engine.tok) if self.config.vision is not None else None
        # enable_lora: one LoRA module at max_lora_rank (scaling 1) over the engine's model; a request's
        # adapter is copied into it, zero-padded, alpha / r folded into B. Loaded adapters by name.
        self.lora, self.adapters = None, {}
        if enable_lora:
            if not max_lora_rank:
                raise ValueError("stand-in: --enable-lora needs --max-lora-rank (no --lora-paths to infer it from)")
            targets = ALL_PROJECTIONS if not lora_target_modules or "all" in lora_target_modules else lora_target_modules
            self.lora = engine_adapters(self.engine.model, LoRACfg(rank=max_lora_rank, alpha=float(max_lora_rank),
                                                                   target_modules=list(targets)), self.engine.dtype)
            self.lora_modules = {hf: name for name, hf in hf_module_names(self.lora, self.config).items()}
        self.weight_version = weight_version
        self.log: list[tuple[str, str, object]] = []
        self.lock = threading.Lock()  # one engine operation at a time
        self.resume = threading.Condition()
        self.paused: str | None = None
        self.in_flight = 0
        self.session: str | None = None
        self.groups: dict[str, tuple] = {}
        self.corrupt: str | None = None  # fault injection: this (project) tensor loads wrong, once
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self.thread = None

    def start(self) -> "StandInServer":
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True,
                                       name="sglang-standin")
        self.thread.start()
        return self

    def kill(self) -> None:
        """The server process dies: the port closes, connections are refused."""
        self.httpd.shutdown()
        self.httpd.server_close()

    def bodies(self, path: str) -> list:
        return [body for _, p, body in self.log if p == path]

    # ------------------------------------------------------------------------- endpoints
    def handle(self, method: str, path: str, body):
        routes = {
            "/health": ("GET",), "/health_generate": ("GET",), "/model_info": ("GET",), "/server_info": ("GET",),
            "/flush_cache": ("GET", "POST"), "/generate": ("POST", "PUT"), "/get_weights_by_name": ("GET", "POST"),
            "/weights_checker": ("GET", "POST"),
            "/release_memory_occupation": ("GET", "POST"), "/resume_memory_occupation": ("GET", "POST"),
        }
        if path not in routes and path not in BODIES:
            raise BadRequest(f"no endpoint {path}")  # (FastAPI would say 404)
        if method not in routes.get(path, ("POST",)):
            raise BadRequest(f"{method} {path}: method not allowed")
        if path in BODIES:
            fields, required = BODIES[path]
            check_body({} if body is None else body, fields, required, path)
        return getattr(self, "_" + path.strip("/"))(body or {})

    def _health(self, body):
        return None

    def _health_generate(self, body):
        if self.engine.released or self.engine.weights_memory.stale:
            raise Unavailable("health_generate: the model cannot generate now")
        with self.lock:
            self._use_adapter(None)
            self.engine.generate([""], [""], n=1, temperature=0.0, max_new_tokens=1, prompt_ids=[[0]])
        return None

    def _model_info(self, body):
        return {"model_path": self.model_path, "served_model_name": self.model_path,
                "tokenizer_path": self.args["model_path"], "is_generation": True,
                "weight_version": self.weight_version, "model_type": self.hf_config.get("model_type"),
                "architectures": self.hf_config.get("architectures")}

    def _server_info(self, body):
        return dict(self.args, version=VERSION)

    def _flush_cache(self, body):
        if self.in_flight or self.paused == "in_place":
            raise BadRequest("Cache not flushed: requests in flight (or paused in place)")
        return "Cache flushed."

    def _generate(self, body):
        if "input_ids" not in body:
            raise BadRequest("/generate: input_ids required (skip_tokenizer_init; text prompts not reproduced)")
        single = INTS(body["input_ids"])
        rows = [body["input_ids"]] if single else body["input_ids"]
        params = body.get("sampling_params") or {}
        params = [params] * len(rows) if isinstance(params, dict) else params
        if len(params) != len(rows):
            raise BadRequest(f"sampling_params: {len(params)} for {len(rows)} inputs")
        for p in params:
            check_body(p, SAMPLING, (), "sampling_params")
        ns = {p.get("n", 1) for p in params}
        if len(ns) != 1 or min(ns) < 1:
            raise BadRequest("sampling_params.n must be one value >= 1 for the whole batch")
        n = ns.pop()
        adapters = self._request_adapters(body.get("lora_path"), len(rows))
        rows, images = self._request_images(body.get("image_data"), rows)
        rows, params = [r for r in rows for _ in range(n)], [p for p in params for _ in range(n)]
        adapters, images = [a for a in adapters for _ in range(n)], [im for im in images for _ in range(n)]
        start = int(body.get("routed_experts_start_len", 0))
        with self.resume:
            while self.paused is not None:  # pause_generation: new requests wait for continue_generation
                self.resume.wait()
            self.in_flight += 1
        try:
            with self.lock:
                outputs = self._decode(rows, params, adapters, images, bool(body.get("return_logprob")),
                                       bool(body.get("return_routed_experts")), start, body.get("rid"))
        finally:
            with self.resume:
                self.in_flight -= 1
        return outputs[0] if single and n == 1 else outputs

    def _request_images(self, image_data, rows: list) -> tuple[list, list]:
        """(the rows with each image placeholder widened to its image's grid, each row's
        {"pixel_values", "image_grid_thw"} or None), from `image_data` as the module docstring says."""
        if image_data is None or not any(image_data):
            return rows, [None] * len(rows)
        if len(image_data) != len(rows):
            raise BadRequest("The length of image_data should be equal to the batch size.")
        if self.vision is None:
            raise BadRequest(f"image_data: {self.hf_config.get('model_type')} takes no images")
        widened, inputs = [], []
        for ids, items in zip(rows, image_data):
            if not items:
                widened.append(ids)
                inputs.append(None)
                continue
            pixels = self.vision.pixels([_load_image(item) for item in items])
            counts = [t * h * w // self.vision.merge_size ** 2 for t, h, w in pixels["image_grid_thw"].tolist()]
            placeholders = ids.count(self.vision.image_token_id)
            if placeholders != len(counts):
                raise BadRequest(f"image_data: {placeholders} image placeholders in input_ids for {len(counts)} images")
            grid = iter(counts)
            widened.append([t for token in ids
                            for t in [token] * (next(grid) if token == self.vision.image_token_id else 1)])
            inputs.append(pixels)
        return widened, inputs

    def _decode(self, rows, params, adapters, images, logprob: bool, routed: bool, start: int, rids):
        began = time.perf_counter()
        eos = self.engine.tok.eos_id
        outputs: list = [None] * len(rows)
        partitions: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            temperature, top_p, top_k = float(p.get("temperature", 1.0)), float(p.get("top_p", 1.0)), int(p.get("top_k", -1))
            if temperature < 0 or not 0 < top_p <= 1 or (top_k != -1 and top_k < 1):
                raise BadRequest(f"sampling_params: invalid temperature / top_p / top_k in {p}")
            stop = tuple(sorted(set(p.get("stop_token_ids") or ()) | ({eos} if eos is not None else set())))
            key = (temperature, top_p, top_k, int(p.get("max_new_tokens", 128)), stop, adapters[i])
            partitions.setdefault(key, []).append(i)
        seeded = self.args["enable_deterministic_inference"]  # else SGLang ignores sampling_seed
        for (temperature, top_p, top_k, max_new, stop, adapter), index in partitions.items():
            self._use_adapter(adapter)
            if max_new < 1:
                raise BadRequest("max_new_tokens < 1 is not reproduced by the stand-in")
            self.engine.cfg = replace(self.base_cfg, top_p=top_p, top_k=max(top_k, 0), max_new_tokens=max_new)
            self.engine.stop_ids = torch.tensor(stop, dtype=torch.long)
            seeds = [int(params[i].get("sampling_seed") if params[i].get("sampling_seed") is not None else 42)
                     for i in index] if seeded else None
            try:
                given = [images[i] for i in index]
                pixels = {"images": given} if any(im is not None for im in given) else {}
                samples = self.engine.generate([""] * len(index), [""] * len(index), n=1, temperature=temperature,
                                               max_new_tokens=max_new, prompt_ids=[rows[i] for i in index], seeds=seeds,
                                               **pixels)
            except ValueError as error:  # e.g. longer than the context
                raise BadRequest(str(error)) from None
            for i, s in zip(index, samples):
                outputs[i] = self._output(s, params[i], logprob, routed, start, rids, i, began)
        return outputs

    def _output(self, s, p, logprob, routed, start, rids, i, began):
        stopped = s.finish_reason.value == "stop"
        ids = s.response_ids[:-1] if stopped and not p.get("no_stop_trim", False) else s.response_ids
        rid = rids[i] if isinstance(rids, list) else rids or uuid.uuid4().hex
        finish = ({"type": "stop", "matched": s.response_ids[-1]} if stopped else
                  {"type": "length", "length": len(s.response_ids)})
        meta = {"id": rid, "prompt_tokens": len(s.prompt_ids), "completion_tokens": len(s.response_ids),
                "cached_tokens": 0, "weight_version": self.weight_version, "finish_reason": finish,
                "e2e_latency": time.perf_counter() - began}
        if logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s.rollout_logprobs, s.response_ids)]
        if routed and self.args["enable_return_routed_experts"]:  # without the server flag: silently absent
            if not 0 <= start <= len(s.prompt_ids):
                raise BadRequest("routed_experts_start_len must be within the prompt")
            full = np.zeros((s.routed_experts.shape[0], self.config.num_layers, s.routed_experts.shape[2]), np.int32)
            full[:, moe_layers(self.config)] = s.routed_experts.numpy().astype(np.int32)
            meta["routed_experts"] = base64.b64encode(np.ascontiguousarray(full[start:]).tobytes()).decode("ascii")
        out = {"output_ids": ids, "meta_info": meta}
        if not self.args["skip_tokenizer_init"]:
            out["text"] = self.engine.decode(ids)
        return out

    # ------------------------------------------------------------------------- weights
    def hf_view(self) -> dict[str, torch.Tensor]:
        state = self.engine.model.state_dict()
        return self.family.to_hf_tensors({self.family.to_hf_name(n): t for n, t in state.items()}, self.config)

    def load_hf(self, updates: dict[str, torch.Tensor]) -> None:
        """model.load_weights: any subset of the HF-named tensors, cast to the server's dtype."""
        if "weights" in self.engine.released:
            raise BadRequest("weights cannot load while their memory is released")
        current = self.hf_view()
        for name, t in updates.items():
            if name not in current or tuple(t.shape) != tuple(current[name].shape):
                raise BadRequest(f"load_weights: {name} {tuple(t.shape)} is not a parameter of the model")
        current.update({name: t.to(self.engine.dtype) for name, t in updates.items()})
        fused = self.family.from_hf_tensors(current, self.config)
        back = {self.family.to_hf_name(n): n for n in self.engine.model.state_dict()}
        self.engine.update_weights({back[k]: v for k, v in fused.items()})
        if self.corrupt is not None:
            with torch.no_grad():
                self.engine.model.state_dict()[self.corrupt].view(-1)[0] += 1.0
            self.corrupt = None

    def _require_session(self, what: str):
        if self.session is None:
            raise BadRequest(f"{what} must run between begin_weight_update() and end_weight_update()")

    def _begin_weight_update(self, body):
        if self.session is not None:
            return {"success": False, "message": "a weight update session is already open"}
        self.session = body.get("selector", "all")
        return {"success": True, "message": "begun"}

    def _end_weight_update(self, body):
        if self.session is None:
            return {"success": False, "message": "no weight update session is open"}
        self.session = None
        return {"success": True, "message": "ended"}

    def _update_weights_from_tensor(self, body):
        self._require_session("update_weights_from_tensor")
        if body.get("load_format") is not None:
            raise BadRequest(f"load_format={body['load_format']!r} is not reproduced (only the default)")
        payloads = body["serialized_named_tensors"]
        if len(payloads) != self.args["tp_size"]:
            raise BadRequest(f"serialized_named_tensors: {len(payloads)} payloads for tp_size {self.args['tp_size']}")
        named = [deserialize(p) for p in payloads][0]  # TP rank 0's (ranks > 0 only deserialized)
        if not (isinstance(named, list) and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor)
                                                for x in named)):
            raise BadRequest("serialized_named_tensors: the default load format is a list of (name, tensor)")
        with self.lock:
            self.load_hf(dict(named))
        self._new_version(body)
        return {"success": True, "message": "Succeeded to update model weights."}

    def _update_weights_from_disk(self, body):
        with self.lock:
            model = from_pretrained(body["model_path"], dtype=self.engine.dtype)
            state = model.state_dict()
            self.load_hf(self.family.to_hf_tensors({self.family.to_hf_name(n): t for n, t in state.items()}, self.config))
        self._new_version(body)
        self.model_path = body["model_path"]
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def _new_version(self, body):
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]

    def _get_weights_by_name(self, body):
        # weight_exporter.get_weights_by_name -> model.get_weights_by_name, which only these classes have;
        # the AttributeError becomes None, and http_server.py answers _create_error_response (HTTP 400).
        if not set(self.hf_config.get("architectures") or ()) & GET_WEIGHTS_BY_NAME:
            raise BadRequest("Get parameter by name failed")
        raise BadRequest("Get parameter by name failed (no Miles family is a model class with "
                         "get_weights_by_name: not reproduced)")

    def _weights_checker(self, body):
        """http_server.py check_weights: {success, message, ranks: [ChecksumInfo per TP rank],
        per_engine_checksum}; HTTP 400 with success false on an error."""
        action = body.get("action", "checksum")
        if action != "checksum":
            raise BadRequest(f"weights_checker action={action!r} is not reproduced by the stand-in (only checksum)")
        skip = body.get("skip_tensor_list") or ()
        with self.lock:
            if "weights" in self.engine.released:
                return _Reply(400, {"success": False, "message": "weights are released"})
            params = sglang_parameters(self.hf_view(), self.hf_config, self.engine.dtype, self.shared_experts_fusion)
        hash_of = _gpu_tensor_hash if self.args["device"].startswith("cuda") else _cpu_tensor_hash
        checksums = {name: f"{hash_of(t):016x}" for name, t in params.items() if not any(s in name for s in skip)}
        overall = hashlib.sha256()
        for name in sorted(checksums):
            overall.update(name.encode())
            overall.update(checksums[name].encode())
        info = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                "pp_size": 1, "rank": 0, "size": 1}
        rank = {"checksums": checksums, "per_gpu_checksum": overall.hexdigest(), "parallelism_info": [info]}
        return {"success": True, "message": "Success.", "ranks": [rank],
                "per_engine_checksum": hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()}

    def _init_weights_update_group(self, body):
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        if body.get("backend", "nccl") != "gloo":
            raise BadRequest("backend: the stand-in joins gloo groups only (no NCCL on the CPU)")
        timeout = datetime.timedelta(seconds=60)
        store = TCPStore(body["master_address"], body["master_port"], None, False, timeout=timeout)
        name = body.get("group_name", "weight_update_group")
        group = ProcessGroupGloo(PrefixStore(name, store), body["rank_offset"], body["world_size"], timeout)
        self.groups[name] = (store, group)
        return {"success": True, "message": "joined"}

    def _destroy_weights_update_group(self, body):
        self.groups.pop(body.get("group_name", "weight_update_group"), None)
        return {"success": True, "message": "destroyed"}

    def _update_weights_from_distributed(self, body):
        from torch.distributed import BroadcastOptions

        self._require_session("update_weights_from_distributed")
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest("names, dtypes and shapes must have one entry per tensor")
        group = self.groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            raise BadRequest("no such weight update group: init_weights_update_group first")
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        kinds = [getattr(torch, d) for d in dtypes]
        if body.get("load_format") is None:
            received = {}
            for name, kind, shape in zip(names, kinds, shapes):
                t = torch.empty(shape, dtype=kind)
                group[1].broadcast([t], opts).wait()
                received[name] = t
        elif body["load_format"] == "flattened_bucket":
            sizes = [int(np.prod(s)) * k.itemsize for s, k in zip(shapes, kinds)]
            buffer = torch.empty(sum(sizes), dtype=torch.uint8)
            group[1].broadcast([buffer], opts).wait()
            received, offset = {}, 0
            for name, kind, shape, size in zip(names, kinds, shapes, sizes):
                if offset % kind.itemsize:
                    raise BadRequest(f"flattened_bucket: {name} at byte {offset} is not {kind} aligned")
                received[name] = buffer[offset: offset + size].view(kind).view(shape).clone()
                offset += size
        else:
            raise BadRequest(f"load_format={body['load_format']!r} is not reproduced")
        with self.lock:
            self.load_hf(received)
        self._new_version(body)
        return {"success": True, "message": "Succeeded to update parameter online."}

    # ------------------------------------------------------------------------- LoRA
    def _lora_reply(self, error: str | None):
        """LoRAUpdateOutput; http_server.py answers 400 when success is false."""
        body = {"success": error is None, "error_message": error or "",
                "loaded_adapters": {name: path for name, (path, _) in self.adapters.items()}}
        return body if error is None else _Reply(400, body)

    def _load_lora_adapter(self, body):
        name, path = body["lora_name"], Path(body["lora_path"])
        if self.lora is None:
            return self._lora_reply("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name in self.adapters:
            return self._lora_reply(f"LoRA with name {name} already exists. Loaded LoRAs: {list(self.adapters)}")
        limit = self.args.get("max_loaded_loras")
        if limit is not None and len(self.adapters) >= limit:
            return self._lora_reply(f"Cannot load LoRA adapter {name} at path {path}. Maximum number of loaded "
                                    f"LoRA adapters is {limit}. Please unload some LoRA adapters before loading "
                                    "new ones.")
        try:
            tensors = self._read_adapter(path)
        except (OSError, ValueError, KeyError) as error:  # the stand-in's wording: SGLang's loader raises its own
            return self._lora_reply(f"Failed to load LoRA adapter {name} from {path}: {error}")
        with self.lock:
            self.adapters[name] = (str(path), tensors)
        return self._lora_reply(None)

    def _unload_lora_adapter(self, body):
        name = body["lora_name"]
        if name not in self.adapters:
            return self._lora_reply(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}")
        with self.lock:
            del self.adapters[name]
        return self._lora_reply(None)

    def _read_adapter(self, path: Path) -> dict[str, torch.Tensor]:
        """A PEFT adapter directory -> tensors for self.lora (native names, max_lora_rank wide)."""
        from safetensors.torch import load_file

        config = json.loads((path / CONFIG_FILE).read_text())
        rank, scaling = int(config["r"]), float(config["lora_alpha"]) / int(config["r"])
        if rank > self.lora.rank:
            raise ValueError(f"LoRA rank {rank} exceeds --max-lora-rank {self.lora.rank}")
        padded = {k: torch.zeros_like(t) for k, t in self.lora.tensors().items()}
        for key, t in load_file(str(path / WEIGHTS_FILE)).items():
            module, _, leaf = key.removeprefix(PEFT_PREFIX).partition(".lora_")
            if module not in self.lora_modules:
                raise ValueError(f"{module} is not among --lora-target-modules")
            target = padded[f"{self.lora_modules[module]}.lora_{leaf}"]
            if leaf.startswith("A"):
                target[:rank] = t
            else:
                target[:, :rank] = t.to(target.dtype) * scaling
        return padded

    def _request_adapters(self, lora_path, rows: int) -> list:
        """GenerateReqInput.lora_path -> one adapter name (or None) per input row."""
        names = [lora_path] * rows if lora_path is None or isinstance(lora_path, str) else lora_path
        if len(names) != rows:
            raise BadRequest(f"lora_path: {len(names)} entries for {rows} inputs")
        unloaded = sorted({n for n in names if n is not None} - set(self.adapters))
        if unloaded:
            raise BadRequest(f"The following requested LoRA adapters are not loaded: {unloaded}\n"
                             f"Loaded adapters: {list(self.adapters)}.")
        return names

    def _use_adapter(self, name: str | None) -> None:
        """The engine's LoRA module computes with this adapter (None: zeros, the base model)."""
        if self.lora is not None:
            self.lora.load(self.adapters[name][1] if name is not None else
                           {k: torch.zeros_like(t) for k, t in self.lora.tensors().items()})

    # ------------------------------------------------------------------------- memory, pause
    def _release_memory_occupation(self, body):
        if self.in_flight:
            raise RuntimeError("AssertionError: release_memory_occupation needs an idle server")
        tags = set(body.get("tags") or MEMORY_TAGS) & {"weights", "kv_cache"}
        if self.args["enable_memory_saver"] and tags:  # without it SGLang does nothing
            with self.lock:
                self.engine.release_memory(tuple(t for t in ("weights", "kv_cache") if t in tags),
                                           keep_weights=self.args["enable_weights_cpu_backup"])
        return None

    def _resume_memory_occupation(self, body):
        tags = set(body.get("tags") or MEMORY_TAGS) & {"weights", "kv_cache"}
        if self.args["enable_memory_saver"] and tags:
            with self.lock:
                self.engine.resume_memory(tuple(t for t in ("weights", "kv_cache") if t in tags))
        return None

    def _pause_generation(self, body):
        with self.resume:
            self.paused = body.get("mode", "abort")
        return {"status": "ok"}

    def _continue_generation(self, body):
        with self.resume:
            self.paused = None
            self.resume.notify_all()
        return {"status": "ok"}


def _load_image(item: str):
    """utils/common.py load_image for the string forms the stand-in takes: a data URI, a file path
    (by its image extension), else bare base64; RGB as the processor's loader converts it."""
    from PIL import Image

    if item.startswith("data:"):
        raw = base64.b64decode(item.split(",", 1)[1])
    elif item.lower().endswith((".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")):
        raw = Path(item).read_bytes()
    else:
        raw = base64.b64decode(item)
    return Image.open(io.BytesIO(raw)).convert("RGB")


def _handler(server: StandInServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self, method: str):
            path = urlparse(self.path).path
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except json.JSONDecodeError as error:
                server.log.append((method, path, raw))
                return self._reply(400, {"error": {"message": f"invalid JSON: {error}"}})
            server.log.append((method, path, body))
            try:
                result = server.handle(method, path, body)
            except (BadRequest, Unavailable) as error:
                return self._reply(error.status, {"error": {"message": str(error)}})
            except Exception as error:  # noqa: BLE001  (a server bug or an engine refusal: 500 with its text)
                return self._reply(500, {"error": {"message": f"{type(error).__name__}: {error}",
                                                   "traceback": traceback.format_exc()[-2000:]}})
            if isinstance(result, _Reply):
                return self._reply(result.status, result.body)
            self._reply(200, result)

        def _reply(self, status: int, result):
            if result is None:
                data, kind = b"", "text/plain"
            elif isinstance(result, str):
                data, kind = result.encode(), "text/plain"
            else:
                data, kind = json.dumps(result).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            self._serve("GET")

        def do_POST(self):  # noqa: N802
            self._serve("POST")

        def do_PUT(self):  # noqa: N802
            self._serve("PUT")

        def log_message(self, *args):  # quiet
            pass

    return Handler


def main(argv=None) -> None:
    """`python -m sglang.launch_server`'s flags that the adapter passes (argparse refuses others)."""
    parser = argparse.ArgumentParser(description="SGLang 0.5.23 stand-in server (NOT SGLang)")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--max-running-requests", type=int)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--base-gpu-id", type=int, default=0)
    parser.add_argument("--max-lora-rank", type=int)
    parser.add_argument("--lora-target-modules", nargs="*")
    parser.add_argument("--max-loras-per-batch", type=int, default=8)
    parser.add_argument("--max-loaded-loras", type=int)
    for flag in ("--skip-tokenizer-init", "--skip-server-warmup", "--enable-return-routed-experts",
                 "--enable-memory-saver", "--enable-weights-cpu-backup", "--enable-deterministic-inference",
                 "--enable-lora"):
        parser.add_argument(flag, action="store_true")
    args = parser.parse_args(argv)
    dtype = "bfloat16" if args.dtype == "bfloat16" else "float32"
    server = StandInServer(args.model_path, dtype=dtype, random_seed=args.random_seed, host=args.host, port=args.port,
                           tp_size=args.tp_size, skip_tokenizer_init=args.skip_tokenizer_init,
                           enable_return_routed_experts=args.enable_return_routed_experts,
                           enable_memory_saver=args.enable_memory_saver,
                           enable_weights_cpu_backup=args.enable_weights_cpu_backup,
                           enable_deterministic_inference=args.enable_deterministic_inference,
                           max_running_requests=args.max_running_requests, device=args.device,
                           enable_lora=args.enable_lora, max_lora_rank=args.max_lora_rank,
                           lora_target_modules=args.lora_target_modules, max_loras_per_batch=args.max_loras_per_batch,
                           max_loaded_loras=args.max_loaded_loras)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
