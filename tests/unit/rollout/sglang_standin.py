"""A STAND-IN for an SGLang 0.5.23 HTTP server, for testing miles/rollout/sglang_engine.py where SGLang cannot run.

THIS IS NOT SGLANG. It implements the request and response schemas of the endpoints the adapter uses, as
../shared/reference/backend-apis.md §1 documents them (not as SGLang's code has them: that was not run),
over the project's own NativeEngine: its tokens and log-probs are those of a real tiny model, its
routed experts those the model chose, its weights what the requests loaded. It is a stand-in for the
server process, not a mock of results.

Strict on purpose, so a test catches adapter drift: a body with an unknown field, a missing required
field or a wrongly typed value gets HTTP 400; a documented field the stand-in does not reproduce is
accepted only at its documented default (400 otherwise, saying so). Every request is recorded
(`server.log`: (method, path, body)).

What it does NOT reproduce: SGLang's kernels and numerics (these are the native engine's), continuous
batching, the radix cache (cached_tokens is 0), streaming, text prompts / stop strings / regex and other
constrained decoding, penalties, top_logprobs, LoRA, multimodal inputs, speculative decoding, TP / DP
(tp_size > 1 only checks the per-rank payload count), CUDA IPC and NCCL (tensors cross by CPU shared
memory, weight update groups are gloo), the exact store layout of SGLang's process-group rendezvous
(here: a TCPStore client at master_address:master_port and a PrefixStore named group_name), aborting or
retracting running requests on pause (new requests wait until continue), and the allowlist of
SGLang's safe unpickler (here: the families the document names; SGLang's exact list was not read).
Choices where the document is silent: output_ids drop the matched stop token unless no_stop_trim (the
output_token_logprobs keep it); dense layers' rows of routed_experts are 0; sampling `n` > 1 expands
prompt-major; sampling_seed seeds a row's own generator.

    server = StandInServer(ckpt, enable_return_routed_experts=True).start()   # server.url
    server.kill()                                                             # connections now refused
    python tests/unit/rollout/sglang_standin.py --model-path CKPT --port 30000  # as a process (launch_server's flags)
"""

from __future__ import annotations

import argparse
import base64
import datetime
import io
import json
import pickle
import threading
import time
import traceback
import uuid
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import numpy as np
import torch

from miles.config.schema import DType, RolloutCfg
from miles.models.families import get_family
from miles.models.hf_io import from_pretrained
from miles.rollout.native import NativeEngine
from miles.types import moe_layers

VERSION = "0.5.23 (Miles stand-in)"
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
NO = object()  # "no default": a field the stand-in reproduces


class BadRequest(Exception):
    status = 400


class Unavailable(Exception):
    status = 503


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
    "lora_path": (ANY, None), "custom_logit_processor": (ANY, None), "image_data": (ANY, None),
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
    "/release_memory_occupation": ({"tags": (_opt(_list_of(lambda t: t in MEMORY_TAGS)), NO)}, ()),
    "/resume_memory_occupation": ({"tags": (_opt(_list_of(lambda t: t in MEMORY_TAGS)), NO)}, ()),
    "/pause_generation": ({"mode": (lambda v: v in ("abort", "retract", "in_place"), NO)}, ()),
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
                 enable_weights_cpu_backup: bool = False, weight_version: str = "default", **other_args):
        self.args = dict(model_path=model_path, dtype=dtype, random_seed=random_seed, host=host, tp_size=tp_size,
                         dp_size=1, skip_tokenizer_init=skip_tokenizer_init,
                         enable_return_routed_experts=enable_return_routed_experts,
                         enable_memory_saver=enable_memory_saver, enable_weights_cpu_backup=enable_weights_cpu_backup,
                         **other_args)
        engine_dtype = DType.bf16 if dtype in ("bfloat16", "bf16") else DType.fp32
        self.base_cfg = RolloutCfg(slot_decode=False)
        self.engine = NativeEngine(model_path, self.base_cfg, engine_dtype, seed=random_seed,
                                   record_routing=enable_return_routed_experts)
        self.config = self.engine.model.config
        self.family = get_family(self.config.family)
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
            self.engine.generate([""], [""], n=1, temperature=0.0, max_new_tokens=1, prompt_ids=[[0]])
        return None

    def _model_info(self, body):
        return {"model_path": self.args["model_path"], "tokenizer_path": self.args["model_path"],
                "is_generation": True, "weight_version": self.weight_version}

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
        rows, params = [r for r in rows for _ in range(n)], [p for p in params for _ in range(n)]
        start = int(body.get("routed_experts_start_len", 0))
        with self.resume:
            while self.paused is not None:  # pause_generation: new requests wait for continue_generation
                self.resume.wait()
            self.in_flight += 1
        try:
            with self.lock:
                outputs = self._decode(rows, params, bool(body.get("return_logprob")),
                                       bool(body.get("return_routed_experts")), start, body.get("rid"))
        finally:
            with self.resume:
                self.in_flight -= 1
        return outputs[0] if single and n == 1 else outputs

    def _decode(self, rows, params, logprob: bool, routed: bool, start: int, rids):
        began = time.perf_counter()
        eos = self.engine.tok.eos_id
        outputs: list = [None] * len(rows)
        partitions: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            temperature, top_p, top_k = float(p.get("temperature", 1.0)), float(p.get("top_p", 1.0)), int(p.get("top_k", -1))
            if temperature < 0 or not 0 < top_p <= 1 or (top_k != -1 and top_k < 1):
                raise BadRequest(f"sampling_params: invalid temperature / top_p / top_k in {p}")
            stop = tuple(sorted(set(p.get("stop_token_ids") or ()) | ({eos} if eos is not None else set())))
            key = (temperature, top_p, top_k, int(p.get("max_new_tokens", 128)), stop, "sampling_seed" in p)
            partitions.setdefault(key, []).append(i)
        for (temperature, top_p, top_k, max_new, stop, seeded), index in partitions.items():
            if max_new < 1:
                raise BadRequest("max_new_tokens < 1 is not reproduced by the stand-in")
            self.engine.cfg = replace(self.base_cfg, top_p=top_p, top_k=max(top_k, 0), max_new_tokens=max_new)
            self.engine.stop_ids = torch.tensor(stop, dtype=torch.long)
            seeds = [int(params[i]["sampling_seed"]) for i in index] if seeded else None
            try:
                samples = self.engine.generate([""] * len(index), [""] * len(index), n=1, temperature=temperature,
                                               max_new_tokens=max_new, prompt_ids=[rows[i] for i in index], seeds=seeds)
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
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def _new_version(self, body):
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]

    def _get_weights_by_name(self, body):
        tensor = self.hf_view().get(body["name"])
        if tensor is None:
            raise BadRequest(f"Get parameter by name failed: {body['name']}")
        return tensor.float().numpy().tolist()[: body.get("truncate_size", 100)]

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
    for flag in ("--skip-tokenizer-init", "--skip-server-warmup", "--enable-return-routed-experts",
                 "--enable-memory-saver", "--enable-weights-cpu-backup"):
        parser.add_argument(flag, action="store_true")
    args = parser.parse_args(argv)
    dtype = "bfloat16" if args.dtype == "bfloat16" else "float32"
    server = StandInServer(args.model_path, dtype=dtype, random_seed=args.random_seed, host=args.host, port=args.port,
                           tp_size=args.tp_size, skip_tokenizer_init=args.skip_tokenizer_init,
                           enable_return_routed_experts=args.enable_return_routed_experts,
                           enable_memory_saver=args.enable_memory_saver,
                           enable_weights_cpu_backup=args.enable_weights_cpu_backup,
                           max_running_requests=args.max_running_requests, device=args.device)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
