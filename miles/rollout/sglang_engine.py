"""SGLang rollout engine: the RolloutEngine protocol (miles/rollout/protocol.py) over an SGLang server's HTTP API.

SGLang does not run on the machines this was written on. The adapter follows the 0.5.23 API as documented
in ../shared/reference/backend-apis.md §1 and as the 0.5.23 source has it (the sglang-0.5.23 wheel, read
for the weight check, the server flags and /model_info); its tests drive it against a local stand-in
server that implements those request / response schemas over the native engine
(tests/unit/rollout/sglang_standin.py). It was also driven once against a real SGLang 0.5.23 server on a
CPU (issue 25), which found what the weight check, the seed check and the weights directory below fix.

    engine = SGLangEngine(ckpt, RolloutCfg(), DType.bf16, url="http://10.0.0.5:30000")  # a running server
    engine = SGLangEngine(ckpt, RolloutCfg(), DType.bf16, device="cuda:0")                # launches one
    samples = engine.generate(["12+30="], ["42"], n=4, seeds=[7])
    engine.update_weights(state_dict, checksum(state_dict))
    engine.shutdown()                                                                     # kills a launched one

How each protocol call maps onto the server (docs/sglang.md has the user's view):
- generate: one batched POST /generate with `input_ids` (the project's tokenizer, `encode_prompt`), each
  prompt repeated n times (prompt-major, so samples[i*n:(i+1)*n] answer prompt i; SGLang's radix cache
  shares the prefill) with one `sampling_params` dict per row, `return_logprob` and (R3)
  `return_routed_experts`. Every row carries a `sampling_seed` derived from its group's seed and its index
  (from the engine's own seeded stream without `seeds`): a group samples alike on any engine of a fleet.
  SGLang uses sampling_seed only when the server runs with `--enable-deterministic-inference`
  (/server_info `enable_deterministic_inference`, read at start; the launcher passes the flag on CUDA):
  without it the adapter warns at start and refuses `seeds` at temperature > 0 (a fleet needs them).
  Images (a vision-language checkpoint: `generate(..., images=[{"pixel_values", "image_grid_thw"} or None
  per prompt])`, as the native engine takes them): each prompt's images go in `image_data` (a list aligned
  with the rows, one list of images per row: SGLang's documented form), each as a lossless PNG data URI,
  and its `input_ids` carry one image placeholder per image, as the chat template writes it: SGLang's
  Qwen-VL processor widens each to the image's grid (srt/multimodal/processors/qwen_vl.py
  build_input_ids), as Miles' processor did. The PNGs are the images Miles' processor resized, rebuilt
  from its pixel_values (miles/rollout/engine_images.py): the server's processor then neither resizes nor crops them,
  so its pixels are the trainer's (up to the rounding of the normalization). Each answer's
  `meta_info.prompt_tokens` must equal the widened prompt's length (else the two processors disagree).
  The response tokens and their log-probs are read from `meta_info.output_token_logprobs`
  (`(logprob, token_id, text)` per generated token, log_softmax(logits / temperature)); the launched
  server runs without SGLANG_RETURN_ORIGINAL_LOGPROB, an external one must too.
- update_weights: the state dict under HF names (`family.to_hf_name` + `to_hf_tensors`, as save_pretrained
  writes them), by `weight_update="disk"` (safetensors + config.json in a temporary directory the server
  can read, POST /update_weights_from_disk: works wherever the server sees that directory; the server's
  /model_info then names that directory as its model_path, so it is kept until the next update has
  loaded, and removed at shutdown() of a launched server) or "tensor"
  (POST /update_weights_from_tensor between /begin_weight_update and /end_weight_update: the default load
  format, a base64 ForkingPickler payload of [(name, tensor)] per TP rank; the tensors cross by handle,
  CPU ones through file-system shared memory, CUDA ones by IPC: the server must be on the same host).
  With a checksum: the payload's own checksum, then what the server holds, through /weights_checker
  (`check_held`): the server's per-tensor hashes under its own fused parameter names, against the sent
  tensors put in that layout and hashed as the server hashes (miles/rollout/sglang_weights.py; a
  Qwen2.5-VL tower as SGLang 0.5.23's qwen2_5_vl.py loads it: `sglang_vision_layout`). The sync carries
  the vision tower with the decoder, trained or frozen (the trainer's whole state dict).
  (/get_weights_by_name, a read-back by name, answers HTTP 400 in 0.5.23 for every Miles family: only
  llama, granite, exaone4 and opt implement it.)
- LoRA (`lora` with rank > 0, trainer.lora): SGLang's adapter API (miles/rollout/sglang_lora.py): the
  launched server gets --enable-lora --max-lora-rank --lora-target-modules; a sync writes each adapter
  as a PEFT directory, POST /load_lora_adapter under a new name, /unload_lora_adapter of its previous
  version; every /generate row names its adapter in `lora_path` (a list aligned with the rows). Several
  adapters (trainer.lora.adapters): `generate(..., adapters=[one id per prompt])`, as the native engine
  takes them, routes each prompt's n rows to its adapter, every adapter in one batch. The base weights
  never move.
- Distributed route (request side, for miles/transport/broadcast.py's bucket stream):
  `init_weights_update_group` + `update_weights_from_distributed` / `update_weights_from_bucket`.
- release_memory / resume_memory: /release_memory_occupation and /resume_memory_occupation with tags
  ("kv_cache" also carries SGLang's "cuda_graph"); the server needs `enable_memory_saver` (the launcher
  sets it when rollout.colocate on CUDA). Weights resumed without `enable_weights_cpu_backup`, or
  released with keep_weights=False, are undefined: generate refuses until the next update_weights.
- health: GET /health (+ /health_generate while nothing is released) and /model_info.
Errors: a server that cannot be reached (refused, reset, exited, HTTP 503) raises SGLangServerGone, a
ConnectionError, which the supervisor treats as transient (miles/orchestrate/supervise.py); a timeout
raises TimeoutError (transient too); any other HTTP error raises SGLangError.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import importlib.util
import io
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

import numpy as np
import torch

from miles.config.schema import DType, LoRACfg, PrecisionCfg, RolloutCfg
from miles.data.tokenizer import TokenizerInfo, encode_prompt
from miles.models.hf_io import model_class
from miles.models.config import from_hf_config
from miles.models.families import get_family
from miles.transport.checksum import TORCH_DTYPES, WeightSyncError, checksum
from miles.rollout.memory import ENGINE_TAGS, KV_CACHE, WEIGHTS, check_tags
from miles.rollout.sglang_lora import SGLangAdapters, server_lora_args, server_problems
from miles.rollout.adapter_files import check_adapter_ids
from miles.rollout.engine_images import image_prompts, png_data_uri, vision_inputs
from miles.rollout.sglang_weights import compare_checksums, sglang_layout
from miles.transport.flat import FlatWeights
from miles.types import FinishReason, Sample, moe_layers, routing_dtype

SERVER_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
SEED_FLAG = "--enable-deterministic-inference"  # SGLang ignores sampling_seed without it
log = logging.getLogger(__name__)
INSTALL_HINT = ("sglang is not installed: install the `gpu` extra (pip install 'miles[gpu]') on a CUDA machine, "
                "or point Miles at a running server (url=...)")


class SGLangError(RuntimeError):
    """The server answered with an error (HTTP 4xx / 5xx other than 503, or success=false)."""


class SGLangServerGone(ConnectionError):
    """The server cannot serve: connection refused / reset, its process exited, or HTTP 503. A
    ConnectionError, so the supervisor restarts (miles/orchestrate/supervise.py `_transient_types`)."""


class SGLangAborted(SGLangError):
    """The server aborted a request (finish_reason type "abort")."""


def sample_seed(group_seed: int, index: int) -> int:
    """The `sampling_seed` of sample `index` of a group seeded `group_seed`: a non-negative int64."""
    digest = hashlib.blake2b(f"{int(group_seed)}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def server_command(checkpoint_dir: str, host: str, port: int, dtype: torch.dtype, seed: int, device: torch.device,
                   cfg: RolloutCfg, max_slots: int | None, record_routing: bool, server_args: dict | None,
                   launcher: list[str] | None = None) -> list[str]:
    """argv of `python -m sglang.launch_server` (or `launcher`): each ServerArgs field as --its-name-dashed;
    True is a bare flag, False / None drop it. `server_args` adds or overrides fields."""
    args = {"model_path": checkpoint_dir, "host": host, "port": port, "dtype": SERVER_DTYPES[dtype],
            "random_seed": seed, "skip_tokenizer_init": True, "skip_server_warmup": True,
            "max_running_requests": min(cfg.max_running, max_slots or cfg.max_running)}
    if device.type == "cuda":
        args["base_gpu_id"] = device.index or 0
        args["enable_memory_saver"] = cfg.colocate  # release / resume_memory_occupation need it
        # sampling_seed is honoured only with it (per-group seeds: a fleet samples as one engine). Not
        # on the CPU: 0.5.23 allows it only with the fa3 / fa4 / flashinfer / triton / ascend / intel_xpu
        # attention backends, none of which its CPU backend runs.
        args["enable_deterministic_inference"] = True
    else:
        args["device"] = device.type
    if record_routing:
        args["enable_return_routed_experts"] = True
    args.update(server_args or {})
    argv = list(launcher or [sys.executable, "-m", "sglang.launch_server"])
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


class SGLangEngine:
    def __init__(
        self,
        checkpoint_dir: str,
        cfg: RolloutCfg,
        dtype: DType = DType.fp32,
        device: str = "cpu",
        threads: int | None = None,
        seed: int = 0,
        precision: PrecisionCfg | None = None,
        max_slots: int | None = None,
        record_routing: bool = False,
        true_on_policy: DType | None = None,
        *,
        url: str | None = None,
        server_args: dict | None = None,
        launcher: list[str] | None = None,
        weight_update: str = "disk",
        weights_dir: str | None = None,
        weight_session: bool = True,
        selector: str = "all",
        startup_timeout_s: float = 600.0,
        request_timeout_s: float = 3600.0,
        lora: LoRACfg | None = None,
    ):
        """Positional arguments as NativeEngine's (threads: the server's business, unused). Options:
        url: an SGLang server to use; None launches `python -m sglang.launch_server` (`launcher` replaces
          that argv prefix) with `server_args` (ServerArgs fields), waits for /health and kills it at
          shutdown(). weight_update: "disk" | "tensor". weights_dir: where "disk" writes (a directory the
          server sees). weight_session: wrap tensor / distributed updates in begin/end_weight_update (0.5.21+;
          False for 0.5.16). selector: "all" | "target" | "draft" (speculative decoding's draft).
        request_timeout_s: any one call, generate included (a TimeoutError past it). lora: trainer.lora;
        with rank > 0 syncs carry the adapters (miles/rollout/sglang_lora.py; the adapter directories
        go under weights_dir too)."""
        if true_on_policy is not None:
            raise ValueError("true_on_policy=true runs the native engine's batch-invariant kernels; SGLang's "
                             "counterpart (enable_deterministic_inference, rl_on_policy_target=fsdp) needs its "
                             "FSDP trainer kernels: set rollout=native")
        if precision is not None and precision.rollout_quant.value != "none":
            raise NotImplementedError(f"precision={precision.name} quantizes the rollout with Miles' quantizer; "
                                      "SGLang quantizes with its own (server_args quantization=...): use a "
                                      "bf16 / fp32 recipe with rollout=sglang")
        if weight_update not in ("disk", "tensor"):
            raise ValueError(f"weight_update={weight_update!r}: disk | tensor")
        self.cfg, self.device, self.dtype = cfg, torch.device(device), TORCH_DTYPES[DType(dtype)]
        self.checkpoint_dir = str(checkpoint_dir)
        self.weight_update = weight_update
        self.weights_dir, self.weight_session, self.selector = weights_dir, weight_session, selector
        self.timeout_s = request_timeout_s
        self.arch = from_hf_config(json.loads((Path(checkpoint_dir) / "config.json").read_text()))
        self.family = get_family(self.arch.family)
        with torch.device("meta"):  # names and shapes, no memory
            meta = model_class(self.arch)(self.arch).state_dict()
        self._names = list(meta)
        self._hf_names = {self.family.to_hf_name(n): n for n in self._names}
        self._hf_layout = {k: tuple(v.shape) for k, v in self._to_hf(meta).items()}
        self.tok = TokenizerInfo.load(checkpoint_dir)
        stop = ({self.tok.eos_id} if self.tok.eos_id is not None else set()) | set(self.tok.extra_stop_ids)
        for text in cfg.stop_tokens:
            token_id = self.tok.tokenizer.token_to_id(text)
            if token_id is None:
                raise ValueError(f"rollout.stop_tokens: {text!r} is not a token of the tokenizer")
            stop.add(token_id)
        self.stop_ids = sorted(stop)
        self.vision = vision_inputs(self.checkpoint_dir, self.tok) if self.arch.vision is not None else None
        self.routing_layers = None
        if record_routing:
            self.routing_layers = moe_layers(self.arch)
            if not self.routing_layers:
                raise ValueError(f"routing record (algo.routing_replay=r3) needs an MoE model; "
                                 f"{self.arch.family} has no MoE layer")
            self.routing_dtype = routing_dtype(self.arch.moe.num_experts)
        self._rng = random.Random(seed)  # group seeds when generate gets none
        self.released: set[str] = set()
        self.weights_stale = False  # resumed without a host copy: update_weights must fill them
        self._drop_weights = False  # released with keep_weights=False
        self.version = 0
        self.weights_path: Path | None = None  # weight_update=disk: the directory the server loaded last
        self._dir_finalizer = None
        self.last_check: dict = {}  # check_held's counts: checked, unchecked server tensors
        self.process, self.log_path = None, None
        self.adapters = None
        if lora is not None and lora.rank > 0:
            self.adapters = SGLangAdapters(self._post_ok, lora, self.arch, weights_dir)
            server_args = {**server_lora_args(lora, self.adapters.shapes), **(server_args or {})}
        if url is None:
            url = self._launch(server_command(self.checkpoint_dir, "127.0.0.1", _free_port(), self.dtype, seed,
                                              self.device, cfg, max_slots, record_routing, server_args, launcher),
                               launcher is None)
        self.url = url.rstrip("/")
        try:
            self._wait_healthy(startup_timeout_s)
            self.server_info = self._request("GET", "/server_info")
        except BaseException:
            self.shutdown()
            raise
        self.tp_size = int(self.server_info.get("tp_size", 1) or 1)
        if record_routing and self.server_info.get("enable_return_routed_experts") is False:
            raise ValueError(f"routing record (R3) needs the SGLang server at {self.url} started with "
                             "--enable-return-routed-experts")
        if self.adapters is not None and (problems := server_problems(self.server_info, lora, self.adapters.shapes,
                                                                      self.url)):
            self.shutdown()
            raise ValueError("; ".join(problems))
        # /server_info has the resolved ServerArgs fields (rl_on_policy_target forces this one on too).
        self.seeded = bool(self.server_info.get("enable_deterministic_inference", False))
        if not self.seeded:
            log.warning("the SGLang server at %s runs without %s: it ignores sampling_seed, so samples do not "
                        "follow per-group seeds (generate(seeds=...) at temperature > 0 is refused; a fleet, "
                        "rollout.num_engines > 1, needs the flag). Start the server with %s (CUDA attention "
                        "backends fa3 / fa4 / flashinfer / triton)", self.url, SEED_FLAG, SEED_FLAG)

    # ----------------------------------------------------------------------------- server process
    def _launch(self, argv: list[str], needs_sglang: bool) -> str:
        if needs_sglang and importlib.util.find_spec("sglang") is None:
            raise ImportError(f"rollout=sglang without a url launches `python -m sglang.launch_server`, but {INSTALL_HINT}")
        env = dict(os.environ)
        env.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)  # log-probs under the sampling temperature, as Miles'
        log_dir = tempfile.mkdtemp(prefix="miles-sglang-")
        self.log_path = Path(log_dir) / "server.log"
        log = open(self.log_path, "wb")
        # Its own session: shutdown() ends the server and whatever it started (scheduler, detokenizer).
        # Launched from the main thread (a Ray actor's), it also gets SIGTERM when this process dies
        # unannounced (ray.kill); from another thread that signal would come when the thread ends.
        main = threading.current_thread() is threading.main_thread() and sys.platform.startswith("linux")
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                        preexec_fn=_die_with_parent if main else None)
        log.close()
        self._finalizer = weakref.finalize(self, _kill, self.process)
        port = argv[argv.index("--port") + 1]
        return f"http://127.0.0.1:{port}"

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_process()
            try:
                self._request("GET", "/health", timeout=10)
                return
            except (SGLangServerGone, TimeoutError) as error:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the SGLang server at {self.url} is not healthy after {timeout_s:.0f} s: "
                                       f"{error}{self._log_tail()}") from None
            time.sleep(0.25)

    def _check_process(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise SGLangServerGone(f"the SGLang server (pid {self.process.pid}) exited with code "
                                   f"{self.process.returncode}{self._log_tail()}")

    def _log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"; its log ({self.log_path}) ends:\n" + "\n".join(tail) if tail else ""

    def shutdown(self) -> None:
        """Kill the server this engine launched and remove its last weights directory. An external
        server is left alone, and so is the directory it now serves from (its /model_info names it)."""
        if self.adapters is not None:
            self.adapters.close()
        if self.process is not None:
            self._finalizer()
            self.process = None
            if self._dir_finalizer is not None:
                self._dir_finalizer()
                self._dir_finalizer, self.weights_path = None, None

    # ----------------------------------------------------------------------------- HTTP
    def _request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None):
        """JSON in, JSON (or text, or None for an empty body) out; errors as the module docstring says."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"} if data is not None else {})
        what = f"SGLang {method} {path}"
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout_s) as response:
                raw, kind = response.read(), response.headers.get("Content-Type", "")
        except urllib.error.HTTPError as error:
            text = error.read().decode(errors="replace")[:2000]
            if error.code == 503:
                raise SGLangServerGone(f"{what}: 503 (server unavailable): {text}") from None
            raise SGLangError(f"{what}: HTTP {error.code}: {text}") from None
        except (TimeoutError, socket.timeout) as error:
            raise TimeoutError(f"{what}: no answer within {timeout or self.timeout_s:.0f} s") from error
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException, OSError) as error:
            reason = getattr(error, "reason", error)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise TimeoutError(f"{what}: no answer within {timeout or self.timeout_s:.0f} s") from error
            gone = ""
            if self.process is not None and self.process.poll() is not None:
                gone = f"; the server (pid {self.process.pid}) exited with code {self.process.returncode}{self._log_tail()}"
            raise SGLangServerGone(f"{what}: the server at {self.url} is gone ({reason}){gone}") from error
        if not raw:
            return None
        return json.loads(raw) if "json" in kind or raw[:1] in (b"{", b"[") else raw.decode(errors="replace")

    def _post(self, path: str, body: dict, timeout: float | None = None):
        return self._request("POST", path, body, timeout)

    def _post_ok(self, path: str, body: dict, timeout: float | None = None) -> dict:
        """A POST whose answer is {success, message, ...}: raise SGLangError on success=false."""
        out = self._post(path, body, timeout)
        if not isinstance(out, dict) or not out.get("success", False):
            raise SGLangError(f"SGLang POST {path} failed: {out}")
        return out

    # ----------------------------------------------------------------------------- protocol
    def decode(self, ids: list[int]) -> str:
        return self.tok.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompts: list[str], labels: list[str], n: int = 1, temperature: float | None = None,
                 max_new_tokens: int | None = None, prompt_ids: list[list[int]] | None = None,
                 seeds: list[int] | None = None, adapters: list[int] | None = None,
                 images: list[dict | None] | None = None) -> list[Sample]:
        """n samples per prompt, grouped as the protocol says (one batched /generate). `adapters`: each
        prompt's LoRA adapter id (trainer.lora.adapters), as NativeEngine.generate takes it. `images`:
        each prompt's {"pixel_values", "image_grid_thw"} or None (a vision-language checkpoint), as
        NativeEngine.generate takes them; sent as the module docstring says."""
        self._check_resident("generate")
        temperature = self.cfg.temperature if temperature is None else temperature
        max_new = max_new_tokens or self.cfg.max_new_tokens
        distinct = prompt_ids if prompt_ids is not None else [encode_prompt(self.tok, p) for p in prompts]
        if not distinct:
            return []
        if seeds is not None and len(seeds) != len(distinct):
            raise ValueError(f"seeds: one per prompt, got {len(seeds)} for {len(distinct)} prompts")
        lora_path = None
        if self.adapters is not None:
            lora_path = self.adapters.lora_paths(adapters, len(distinct), n)  # checks the ids
        else:
            check_adapter_ids([], adapters, len(distinct))
        if seeds is not None and temperature > 0 and not self.seeded:
            raise ValueError(f"generate(seeds=...): the SGLang server at {self.url} ignores sampling_seed (it runs "
                             f"without {SEED_FLAG}), so these groups would not follow their seeds. Restart it "
                             f"with {SEED_FLAG} (rollout.sglang.server_args.enable_deterministic_inference=true "
                             "when Miles launches it; CUDA only in SGLang 0.5.23)")
        width, limit = max(len(p) for p in distinct), self.arch.max_position_embeddings
        if width + max_new > limit:
            raise ValueError(f"prompt ({width} tokens) + max_new_tokens ({max_new}) exceeds the model's "
                             f"max_position_embeddings ({limit}); lower rollout.max_new_tokens")
        sent_ids, image_data = self._image_rows(distinct, images)
        groups = seeds if seeds is not None else [self._rng.getrandbits(63) for _ in distinct]
        base = {"max_new_tokens": int(max_new), "temperature": float(temperature), "top_p": float(self.cfg.top_p),
                "top_k": self.cfg.top_k if self.cfg.top_k > 0 else -1, "stop_token_ids": self.stop_ids,
                "no_stop_trim": True}
        rows = [(i, ids) for i, ids in enumerate(distinct) for _ in range(n)]
        body = {"input_ids": [sent_ids[i] for i, _ in rows],
                "sampling_params": [dict(base, sampling_seed=sample_seed(groups[i], k % n))
                                    for k, (i, _) in enumerate(rows)],
                "return_logprob": True}
        if self.routing_layers is not None:
            body["return_routed_experts"] = True
        if lora_path is not None:
            body["lora_path"] = lora_path
        if image_data is not None:
            body["image_data"] = [image_data[i] for i, _ in rows]
        outputs = self._post("/generate", body)
        if not isinstance(outputs, list) or len(outputs) != len(rows):
            raise SGLangError(f"/generate answered {type(outputs).__name__} "
                              f"{len(outputs) if isinstance(outputs, list) else ''} for {len(rows)} rows")
        return [self._sample(out, prompts[i] if i < len(prompts) else "", labels[i] if i < len(labels) else "",
                             ids, i, None if adapters is None else adapters[i]) for out, (i, ids) in zip(outputs, rows)]

    def _image_rows(self, distinct: list[list[int]], images: list[dict | None] | None):
        """(each prompt's input_ids as sent, each prompt's image_data entry; None for a batch without
        images): a prompt with images gets one placeholder per image and its images as PNG data URIs."""
        prompts = image_prompts(distinct, images, self.vision, self.arch.family, "sglang")
        if all(pictures is None for _, pictures in prompts):
            return distinct, None
        return ([ids for ids, _ in prompts],
                [None if pictures is None else [png_data_uri(im) for im in pictures] for _, pictures in prompts])

    def _sample(self, out: dict, prompt: str, label: str, ids: list[int], group: int,
                adapter: int | None = None) -> Sample:
        meta = out["meta_info"]
        if meta.get("prompt_tokens", len(ids)) != len(ids):
            raise SGLangError(f"/generate: the server's prompt has {meta['prompt_tokens']} tokens, Miles' {len(ids)}: "
                              "its image processor widened the image placeholders otherwise than the "
                              "checkpoint's preprocessor_config.json does here")
        entries = meta.get("output_token_logprobs")
        if entries is None:
            raise SGLangError("/generate answered without meta_info.output_token_logprobs (return_logprob)")
        # The tokens come from the log-prob record, one entry per generated token: output_ids may have the
        # matched stop token trimmed.
        response = [int(e[1]) for e in entries]
        logprobs = [float(e[0]) for e in entries]
        output_ids = [int(t) for t in out.get("output_ids", response)]
        if response[:len(output_ids)] != output_ids or len(response) - len(output_ids) > 1:
            raise SGLangError(f"/generate: output_ids {output_ids} disagree with output_token_logprobs' tokens {response}")
        reason = meta.get("finish_reason") or {}
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind == "abort":
            raise SGLangAborted(f"SGLang aborted a request: {reason}")
        if kind not in ("stop", "length"):
            raise SGLangError(f"/generate: unknown finish_reason {reason!r}")
        routing = None
        if self.routing_layers is not None:
            routing = self._routed_experts(meta, len(ids) + len(response) - 1)
        return Sample(prompt=prompt, label=label, prompt_ids=list(ids), response_ids=response,
                      rollout_logprobs=logprobs, response=self.decode(response),
                      finish_reason=FinishReason.stop if kind == "stop" else FinishReason.length,
                      group=group, routed_experts=routing, adapter=adapter)

    def _routed_experts(self, meta: dict, positions: int) -> torch.Tensor:
        """meta_info.routed_experts (base64 int32 [positions, num_hidden_layers, top_k]) -> Sample's
        [positions, moe_layers, top_k] in the compact routing dtype."""
        data = meta.get("routed_experts")
        if data is None:
            raise SGLangError("/generate answered without meta_info.routed_experts: start the server with "
                              "--enable-return-routed-experts")
        flat = np.frombuffer(base64.b64decode(data), dtype=np.int32)
        layers, k = self.arch.num_layers, self.arch.moe.num_experts_per_tok
        if flat.size != positions * layers * k:
            raise SGLangError(f"routed_experts holds {flat.size} ids, expected {positions} positions x "
                              f"{layers} layers x top-{k}")
        chosen = np.ascontiguousarray(flat.reshape(positions, layers, k)[:, self.routing_layers])
        return torch.from_numpy(chosen).to(self.routing_dtype)

    def update_weights(self, weights, expected_checksum: str | None = None) -> str:
        """Load a state dict (the project's names, this engine's dtype) or a FlatWeights; with a checksum,
        verify the payload and what the server then holds (`verify`); returns the checksum verified."""
        if WEIGHTS in self.released:
            raise RuntimeError("update_weights: the engine's weights are released (colocation): call "
                               "resume_memory(('weights',)) first")
        if self.adapters is not None:  # LoRA: the trainer sends its adapters, never the frozen base
            if not isinstance(weights, dict):
                raise TypeError("update_weights: with trainer.lora the sync carries the adapters as a dict")
            return self.adapters.load(weights, expected_checksum)
        if isinstance(weights, FlatWeights):  # in-process: checked by its device checksum, then by SHA-256
            if expected_checksum is not None and (sent := weights.checksum()) != expected_checksum:
                raise WeightSyncError(f"the weights reached the engine different from what the trainer sent: "
                                      f"{sent[:20]} != {expected_checksum[:20]}")
            weights = weights.views()
            expected_checksum = None if expected_checksum is None else checksum(weights)
        if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
            raise TypeError("SGLangEngine.update_weights takes a state dict of tensors (quantized rollout "
                            "payloads are not supported with rollout=sglang)")
        if expected_checksum is not None and (sent := checksum(weights)) != expected_checksum:
            raise WeightSyncError(f"the weights reached the engine different from what the trainer sent: "
                                  f"{sent[:12]} != {expected_checksum[:12]}")
        hf = self._to_hf(weights)
        self.version += 1
        if self.weight_update == "disk":
            self._update_from_disk(hf)
        else:
            with self._session():
                self._update_from_tensors(hf)
        self.weights_stale = False
        if expected_checksum is None:
            return ""
        self.check_held(hf)
        return expected_checksum  # the payload's checksum, what the server holds checked tensor by tensor

    def check_held(self, weights: dict[str, torch.Tensor]) -> dict:
        """Raise WeightSyncError unless the server holds these weights (the project's state dict, or the
        HF-named tensors update_weights sent): POST /weights_checker {"action": "checksum"} gives the
        hash of every tensor the target model holds, under SGLang's parameter names and layout; the
        sent tensors, put in that layout (sglang_weights.sglang_layout) and hashed as the server
        hashes them on its device, must match, every one of them. Server tensors that no sent tensor
        predicts (buffers of its own) are counted, not compared. Returns (and keeps in `last_check`)
        {"checked": n, "unchecked": [names]}."""
        hf = weights if set(weights) <= set(self._hf_layout) else self._to_hf(weights)
        if self.tp_size != 1 or int(self.server_info.get("pp_size", 1) or 1) != 1 \
                or int(self.server_info.get("ep_size", 1) or 1) != 1:
            raise WeightSyncError(f"the checked sync predicts SGLang's parameter layout for tp_size = pp_size = "
                                  f"ep_size = 1 only (this server: tp {self.tp_size}, pp "
                                  f"{self.server_info.get('pp_size')}, ep {self.server_info.get('ep_size')}): set "
                                  "rollout.check_weight_sync=false")
        try:
            answer = self._post("/weights_checker", {"action": "checksum", "selector": "target"})
        except SGLangError as error:
            if "HTTP 404" not in str(error):
                raise
            raise SGLangError(f"{error} (the checked sync reads SGLang's per-tensor checksums from /weights_checker, "
                              "which SGLang 0.5.23 has; a server without it: set rollout.check_weight_sync=false)"
                              ) from None
        ranks = answer.get("ranks") if isinstance(answer, dict) else None
        if not answer.get("success") or not isinstance(ranks, list) or len(ranks) != 1:
            raise WeightSyncError(f"/weights_checker answered {str(answer)[:300]}: expected one rank's checksums")
        held = ranks[0].get("checksums") or {}
        device = str(self.server_info.get("device") or "cuda")
        fused_shared = self.arch.moe is not None and not any(".shared_experts." in name for name in held)
        if self.arch.vision is not None:
            hf = sglang_vision_layout(hf)
        layout = sglang_layout(hf, self.arch.tie_word_embeddings, fuse_shared_experts=fused_shared)
        differ, missing, unchecked = compare_checksums(layout, held, device, self.dtype)
        if differ or missing:
            problems = []
            if differ:
                problems.append(f"SGLang holds other values than were sent in {len(differ)} tensors "
                                f"(e.g. {differ[:4]})")
            if missing:
                problems.append(f"SGLang reports no tensor named {missing[:4]} ({len(missing)} in all)")
            raise WeightSyncError("; ".join(problems) + f". Unless the load itself is wrong, this server's layout "
                                  f"differs from the one Miles predicts for {self.family.hf_architecture} "
                                  "(miles/rollout/sglang_weights.py: weights repacked after loading, e.g. CPU AMX "
                                  "with bf16, ROCm aiter, FlashInfer TRT-LLM MoE): set "
                                  "rollout.check_weight_sync=false")
        if unchecked and not self.last_check.get("unchecked"):
            log.info("SGLang /weights_checker: %d tensors of the server's own are not compared (e.g. %s)",
                     len(unchecked), unchecked[:3])
        self.last_check = {"checked": len(held) - len(unchecked), "unchecked": unchecked}
        return self.last_check

    # ----------------------------------------------------------------------------- weight routes
    def _to_hf(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The project's names -> the HF checkpoint layout (save_pretrained's)."""
        return self.family.to_hf_tensors({self.family.to_hf_name(n): t.detach() for n, t in weights.items()}, self.arch)

    def _update_from_disk(self, hf: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        directory = Path(tempfile.mkdtemp(prefix="miles-sglang-weights-", dir=self.weights_dir))
        try:
            for extra in ("config.json", "generation_config.json"):
                if (Path(self.checkpoint_dir) / extra).exists():
                    shutil.copy(Path(self.checkpoint_dir) / extra, directory / extra)
            # Fresh tensors: views of one buffer (a FlatWeights) would be "shared" to safetensors.
            save_file({k: t.to("cpu").clone() for k, t in hf.items()}, str(directory / "model.safetensors"),
                      metadata={"format": "pt"})
            self._post_ok("/update_weights_from_disk", {"model_path": str(directory), "weight_version": str(self.version),
                                                        "flush_cache": True})
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)  # the server still serves from the previous one
            raise
        # The server's /model_info now names this directory (its model_path): it stays until the next
        # update has loaded (or shutdown() of a launched server); the previous one is no longer named.
        previous, self.weights_path = self.weights_path, directory
        if self._dir_finalizer is not None:
            self._dir_finalizer.detach()
        # A launched server dies with this engine (shutdown, or its collection): so does its directory.
        self._dir_finalizer = weakref.finalize(self, shutil.rmtree, str(directory), True) \
            if self.process is not None else None
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)

    def _update_from_tensors(self, hf: dict[str, torch.Tensor], bucket_bytes: int = 1 << 30) -> None:
        chunks, chunk, size = [], [], 0
        for name, t in hf.items():
            if chunk and size + t.numel() * t.element_size() > bucket_bytes:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append((name, t))
            size += t.numel() * t.element_size()
        chunks.append(chunk)
        for i, chunk in enumerate(chunks):
            payload, keep_alive = serialize_named_tensors(chunk)  # the tensors live until the call returns
            self._post_ok("/update_weights_from_tensor", {
                "serialized_named_tensors": [payload] * self.tp_size,  # each TP rank loads the full tensors
                "load_format": None, "flush_cache": i == len(chunks) - 1,
                "weight_version": str(self.version), "selector": self.selector})
            del keep_alive

    @contextlib.contextmanager
    def _session(self):
        """begin_weight_update / end_weight_update around tensor and distributed updates (0.5.21+)."""
        if not self.weight_session:
            yield
            return
        self._post_ok("/begin_weight_update", {"selector": self.selector})
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self._post_ok("/end_weight_update", {})
            raise
        self._post_ok("/end_weight_update", {})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> None:
        """Each TP rank of the server joins the trainer's group as rank rank_offset + tp_rank (blocks until
        every member has joined: call it while the trainer joins as rank 0)."""
        if int(self.server_info.get("dp_size", 1) or 1) != 1:
            raise ValueError("SGLang's distributed weight updates need dp_size == 1")
        self._post_ok("/init_weights_update_group", {"master_address": master_address, "master_port": int(master_port),
                                                     "rank_offset": int(rank_offset), "world_size": int(world_size),
                                                     "group_name": group_name, "backend": backend})

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._post_ok("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list, *,
                                        group_name: str = "weight_update_group", load_format: str | None = None,
                                        flush_cache: bool = True) -> None:
        """Receive one bucket broadcast by trainer rank 0 (blocks until it has arrived: call it while the
        trainer broadcasts). `names` are the project's (mapped to HF names here); load_format None: one
        broadcast per tensor in `names` order; "flattened_bucket": one uint8 broadcast, tensors back to back."""
        if set(self._hf_layout) != set(self._hf_names):
            raise NotImplementedError(f"{self.arch.family} changes tensor layouts on the way to HF names "
                                      "(per-expert weights): use weight_update=disk or tensor")
        self._check_not_released()
        self.version += 1
        with self._session():
            self._post_ok("/update_weights_from_distributed", {
                "names": [self.family.to_hf_name(n) for n in names],
                "dtypes": [str(d).removeprefix("torch.") for d in dtypes], "shapes": [list(s) for s in shapes],
                "group_name": group_name, "flush_cache": flush_cache, "weight_version": str(self.version),
                "load_format": load_format, "selector": self.selector})
        self.weights_stale = False

    def update_weights_from_bucket(self, bucket, group_name: str = "weight_update_group") -> None:
        """Receive one bucket of miles/transport/broadcast.py (`Bucket`: slots of name, dtype, shape, offset)
        as SGLang's "flattened_bucket". Its tensors must lie back to back (no alignment padding)."""
        end = 0
        for slot in bucket.slots:
            if slot.offset != end:
                raise ValueError(f"bucket slot {slot.name} starts at byte {slot.offset}, not {end}: SGLang's "
                                 "flattened_bucket packs tensors back to back (plan the buckets without padding)")
            end += slot.nbytes
        self.update_weights_from_distributed([s.name for s in bucket.slots], [s.dtype for s in bucket.slots],
                                             [s.shape for s in bucket.slots], group_name=group_name,
                                             load_format="flattened_bucket")

    # ----------------------------------------------------------------------------- memory, control
    def release_memory(self, tags=ENGINE_TAGS, keep_weights: bool = True) -> None:
        """/release_memory_occupation for the tags not released yet. Whether the server keeps a host copy
        of the weights is its own flag (enable_weights_cpu_backup), not the call's: keep_weights=False
        (the colocated loop, which syncs after every resume) only says the caller reloads them, so
        generate refuses after resume until update_weights either way."""
        tags = check_tags(tags, ENGINE_TAGS, "release_memory")
        todo = [t for t in ENGINE_TAGS if t in tags and t not in self.released]
        if todo:
            self._post("/release_memory_occupation", {"tags": _server_tags(todo)})
            self.released.update(todo)
        if WEIGHTS in todo and not keep_weights:
            self._drop_weights = True

    def resume_memory(self, tags=ENGINE_TAGS) -> None:
        """/resume_memory_occupation for the released tags among `tags`. Weights come back undefined
        unless the server keeps a host copy (enable_weights_cpu_backup): update_weights before generate."""
        tags = check_tags(tags, ENGINE_TAGS, "resume_memory")
        todo = [t for t in ENGINE_TAGS if t in tags and t in self.released]
        if todo:
            self._post("/resume_memory_occupation", {"tags": _server_tags(todo)})
            self.released.difference_update(todo)
            if WEIGHTS in todo and (self._drop_weights or not self.server_info.get("enable_weights_cpu_backup", False)):
                self.weights_stale = True
            if WEIGHTS in todo:
                self._drop_weights = False

    def pause_generation(self, mode: str = "abort") -> None:
        """/pause_generation: "abort" running requests, "retract" them to the queue, or pause "in_place"."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_generation mode {mode!r}: abort | retract | in_place")
        self._post("/pause_generation", {"mode": mode})

    def continue_generation(self, torch_empty_cache: bool = True) -> None:
        self._post("/continue_generation", {"torch_empty_cache": torch_empty_cache})

    def update_draft_weights(self, weights, expected_checksum: str | None = None) -> str:
        """The protocol's draft-model sync (rollout.speculative.kind=draft_model, native only: validation
        refuses rollout.speculative with rollout=sglang). SGLang's draft weights load through
        update_weights with selector="draft"."""
        raise NotImplementedError("update_draft_weights: Miles' online-trained draft runs in the native engine "
                                  "(rollout.speculative needs rollout=native)")

    def flush_cache(self) -> None:
        """/flush_cache (the radix cache); SGLangError while requests are in flight."""
        self._request("POST", "/flush_cache")

    def health(self) -> dict:
        """GET /health, /model_info, and /health_generate (one token) while nothing is released."""
        self._check_process()
        self._request("GET", "/health")
        info = self._request("GET", "/model_info") or {}
        if not self.released and not self.weights_stale:
            self._request("GET", "/health_generate")
        return {"engine": "sglang", "device": str(self.device), "url": self.url,
                "resident": [t for t in ENGINE_TAGS if t not in self.released],
                "weight_version": info.get("weight_version"), "model_path": info.get("model_path"),
                "lora_adapters": [a.name for a in self.adapters.versions.current if a is not None]
                if self.adapters is not None else None,
                "seeded_sampling": self.seeded}

    def _check_not_released(self) -> None:
        if WEIGHTS in self.released:
            raise RuntimeError("the engine's weights are released (colocation): call resume_memory(('weights',)) first")

    def _check_resident(self, what: str) -> None:
        if self.released:
            tags = tuple(t for t in ENGINE_TAGS if t in self.released)
            raise RuntimeError(f"{what}: the engine's {' and '.join(tags)} memory is released (colocation): "
                               f"call resume_memory({tags}) first")
        if self.weights_stale:
            raise RuntimeError(f"{what}: the server's weights were resumed without a host copy (no "
                               "enable_weights_cpu_backup): load them with update_weights(...) first")


def _server_tags(tags: list[str]) -> list[str]:
    """SGLang's tags for ours: its CUDA graphs go and come with the KV cache."""
    return [s for t in tags for s in ((t, "cuda_graph") if t == KV_CACHE else (t,))]


@contextlib.contextmanager
def _sharing_strategy(strategy: str):
    import torch.multiprocessing as mp

    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy(strategy)
    try:
        yield
    finally:
        mp.set_sharing_strategy(previous)


_SERIALIZE_LOCK = threading.Lock()


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> tuple[str, list]:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True) of [(name, tensor)]: ForkingPickler,
    then base64. CPU tensors go through file-system shared memory (a file-descriptor handle would pickle
    multiprocessing's DupFd, which SGLang's safe unpickler refuses); CUDA tensors as IPC handles (with
    sglang's monkey_patch_torch_reductions where sglang is installed). Returns (payload, the tensors the
    payload points at: keep them until the server has loaded them)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401  (registers torch's reducers with ForkingPickler)

    if any(t.is_cuda for _, t in named) and importlib.util.find_spec("sglang") is not None:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
    # CPU: a fresh copy moves into shared memory, not the caller's tensor.
    tensors = [(name, t.detach().clone() if t.device.type == "cpu" else t.detach()) for name, t in named]
    buffer = io.BytesIO()
    with _SERIALIZE_LOCK, _sharing_strategy("file_system"):
        ForkingPickler(buffer).dump(tensors)
    return base64.b64encode(buffer.getvalue()).decode("ascii"), tensors


_VISION_GATE_UP_BIAS = re.compile(r"^(visual\..*\.mlp)\.(gate|up)_proj\.bias$")


def sglang_vision_layout(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen2.5-VL tower's HF tensors renamed as SGLang 0.5.23's qwen2_5_vl.py load_weights holds them,
    before sglang_layout fuses the rest: `attn.qkv` -> `attn.qkv_proj` (one tensor, VisionAttention),
    the MLP's gate / up biases fused like their weights (sglang_layout fuses those) into `gate_up_proj`."""
    out, biases = {}, {}
    for name, t in hf.items():
        if (m := _VISION_GATE_UP_BIAS.match(name)) is not None:
            biases.setdefault(m.group(1), {})[m.group(2)] = t
        elif name.startswith("visual.") and ".attn.qkv." in name:
            out[name.replace(".attn.qkv.", ".attn.qkv_proj.")] = t
        else:
            out[name] = t
    for prefix, parts in biases.items():
        out[f"{prefix}.gate_up_proj.bias"] = torch.cat([parts["gate"], parts["up"]])
    return out


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(process: subprocess.Popen, grace_s: float = 20.0) -> None:
    """End a launched server and its process group: SIGTERM, then SIGKILL after `grace_s`."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
