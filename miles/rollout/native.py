"""Native torch rollout engine: batched KV-cache generation with the trainer's own model modules.

Two decode paths, the same samples contract:
- slots (the default on CUDA for GQA, MLA and DSA families, `rollout.slot_decode`): continuous
  batching over a static slot cache with CUDA-graph decode steps (miles/rollout/slots.py);
- padded (the CPU default, and every family): described below.

Padded path: prompts are left-padded into one batch and prefilled once per distinct prompt; the KV
cache, the last logits, the attention mask and the positions are then expanded n times, so the n samples of a
prompt are n rows of the batch that share one prefill. Decoding goes a token at a time with a
preallocated KV cache, sampling each row on its own. Plain class: `miles.orchestrate` wraps it in a
Ray actor, tests and the GPU machine call it directly.

    engine = NativeEngine("ckpt_dir", RolloutCfg(), DType.fp32)
    samples = engine.generate(["12+30="], ["42"], n=4)

Routing record (R3, `record_routing=True`, MoE models): both paths also return, per sample, the
experts every MoE layer chose for each input token (`Sample.routed_experts`, layout in
miles/types.py): prompt positions from the prefill of the distinct prompt (the same for its n
samples, left / right padding removed), response positions from the decode step that fed each token.
DSA models (padded path) also return the key positions each indexer kept (`Sample.selected_keys`).

Per-group seeds (`seeds=[...]`, one int per prompt): each group's samples draw their sampling noise
from a generator seeded by its value, one [n, vocab] draw per decode step, so a group's samples do
not depend on which prompts share its batch, nor on the engine that runs it (a fleet of engines,
miles/rollout/router.py). Without seeds, one engine generator draws for the whole batch.

    samples = engine.generate(["12+30=", "7*6="], ["42", "42"], n=4, seeds=[101, 102])

Colocation (`rollout.colocate`, the engine and the trainer take turns on the GPU): SGLang's calls,

    engine.release_memory()                      # weights to host (pinned), slot cache + graphs freed
    engine.resume_memory(("weights",)); engine.update_weights(...); engine.resume_memory(("kv_cache",))

tags "weights" and "kv_cache"; `release_memory(keep_weights=False)` drops the weights instead of
copying them (the next update_weights must fill them). Details in miles/rollout/memory.py.

Speculative rollout (`rollout.speculative`): a draft proposes `num_tokens` tokens per row and the model
verifies them in one forward, with exact rejection sampling, so the samples and their log-probs are
the model's own (miles/rollout/spec_decode.py; the draft is the model's MTP module or a small model of
`draft_dir`, trained online by the trainer). Each sample reports its `draft_stats`.

Images (vision-language models, miles/models/vlm.py): `images=[{"pixel_values", "image_grid_thw"}
or None per prompt]` with `prompt_ids` that hold one image placeholder per merged patch
(miles/data/vision_inputs.py). The padded path runs the vision tower once per distinct prompt, in
its prefill, and the n samples share it as they share the prefill; positions are mRoPE's, and the
text decoded after the prompt continues from the prompt's largest mRoPE position + 1 on all three
axes. The slot decoder does not take images (a VLM decodes on the padded path; docs/vlm.md).

    samples = engine.generate(prompts, labels, n=4, prompt_ids=ids, images=pixels)

Several LoRA adapters (`lora` with `adapters`, trainer.lora.adapters): `adapters=[one id per prompt]`
routes each prompt's rows through its adapter, every adapter in the same batch (miles/models/lora.py
masks the others' outputs): the padded path routes its prefill per prompt and each decode step per
live row; the slot decoder keeps each slot's adapter in a buffer its graphs read; the speculative
decoders route their verify forwards (and the MTP draft's) by each live row's adapter.

    samples = engine.generate(["12+30=", "7*6="], ["42", "42"], n=4, adapters=[0, 1])

True on-policy (`true_on_policy=<the trainer's compute dtype>`): the trainer's fp32 weights, its
autocast and batch-invariant kernels (miles/models/invariant.py) in prefill, decode and sampling,
so the log-probs it returns equal the trainer's bit for bit. On CUDA it decodes in the slot layout,
dense models from CUDA graphs captured under those kernels (the same kernels, launched at once).
"""

from __future__ import annotations

import contextlib

import torch

from miles.config.schema import DType, LoRACfg, PrecisionCfg, RolloutCfg
from miles.data.tokenizer import TokenizerInfo, encode_prompt
from miles.models import fused, fused_projections, from_pretrained, invariant
from miles.models.moe import graph_capturable
from miles.models.quant_experts import quantize_engine_experts
from miles.models.vlm import mrope_positions
from miles.transport.checksum import TORCH_DTYPES, WeightSyncError, checksum
from miles.precision import dense_copy
from miles.precision.recipe import QuantLinear, Recipe
from miles.rollout import pausable
from miles.rollout.adapter_files import check_adapter_ids
from miles.rollout.lora import engine_adapters, load_synced
from miles.rollout.memory import ENGINE_TAGS, KV_CACHE, WEIGHTS, EngineWeights, check_tags
from miles.rollout.sampling import sample_next
from miles.rollout.slots import Sampling, SlotDecoder
from miles.rollout.spec_decode import MTPDraft, ModelDraft, SpeculativeDecoder
from miles.rollout.spec_slots import SlotSpeculativeDecoder
from miles.transport.device import free_device_memory
from miles.transport.flat import DEVICE_DIGEST, FlatWeights, tensors_checksum
from miles.types import (FinishReason, Sample, index_layers, keys_dtype, moe_layers, routing_dtype, stack_keys,
                         stack_routing)

# Finished rows are dropped from the decode batch once they are at least this fraction of it:
# fewer rows to compute per step, against one copy of the KV cache per compaction.
COMPACT_AT = 0.25


class NativeEngine:
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
        draft_dir: str | None = None,
        lora: LoRACfg | None = None,
    ):
        """max_slots: sequences the planner's KV budget holds (caps rollout.max_running).
        record_routing: return each sample's routed experts (R3, algo.routing_replay=r3; MoE only).
        true_on_policy: the trainer's compute dtype (true on-policy mode): compute as the trainer
        does, batch-invariant kernels under that autocast over weights in `dtype` (the trainer's
        fp32 masters), no fused or graph-captured kernels.
        draft_dir: rollout.speculative.kind=draft_model, the draft's HF checkpoint (same tokenizer).
        lora: trainer.lora; with rank > 0 weight syncs carry the trainer's adapters (miles/rollout/lora.py)."""
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.device = torch.device(device)
        self.true_on_policy = true_on_policy is not None
        self.autocast_dtype = TORCH_DTYPES[DType(true_on_policy)] if self.true_on_policy else None
        self.dtype = TORCH_DTYPES[DType(dtype)]
        self.model = from_pretrained(checkpoint_dir, dtype=torch.float32).to(self.device).eval()
        self.model.requires_grad_(False)
        # True on-policy computes under the trainer's autocast: its residual stream's dtype too.
        self.model.fp32_residual = precision is not None and precision.fp32_residual
        # FP8 / INT4 recipes: quantized Linear layers hold the rollout format, built from the
        # checkpoint by the quantizer the trainer uses (later syncs replace it).
        self.recipe = Recipe.from_cfg(precision or PrecisionCfg(name="none"), self.model.config.num_layers)
        if self.true_on_policy and self.recipe.rollout_quant != self.recipe.train_quant:
            raise ValueError("true_on_policy=true needs the trainer's kernels in the engine; a rollout quantized "
                             f"as {self.recipe.rollout_quant} against a training forward quantized as "
                             f"{self.recipe.train_quant} has others: use precision=fp8, int4_qat, bf16 or fp32")
        payload = self.recipe.sync_payload(self.model.state_dict()) if self.recipe.rollout_quant != "none" else None
        self.model.to(self.dtype)
        if payload is not None:
            self.recipe.prepare_engine(self.model)
            quantize_engine_experts(self.model, self.recipe)  # MoE stacks held as the payload sends them
            self.recipe.load_engine(self.model, payload, self.dtype)
            # (true on-policy multiplies through the batch-invariant kernels, never a copy)
            if not self.true_on_policy and dense_copy.wanted(
                    cfg.dense_weight_copies, str(self.device), self.recipe.rollout_quant, self.recipe.fp8_scheme,
                    cfg.batch_size * cfg.n_samples_per_prompt):
                for module in self.model.modules():
                    if isinstance(module, QuantLinear):
                        module.hold_dense_copy(self.dtype)
        # Plain weights live in one flat buffer: an in-process sync is one copy plus a device checksum.
        # rollout.memory_saver: the buffer (and below the slot cache) in pausable memory, so a colocated
        # release keeps the addresses the decode graphs captured (a quantized format is not in it).
        self.pausable = pausable.load(cfg.memory_saver, self.device)
        with self.pausable.region(WEIGHTS) if self.pausable is not None and payload is None else \
                contextlib.nullcontext():
            self.flat = FlatWeights.adopt(self.model) if payload is None else None
        # One GEMM per q / k / v and gate / up group, over views of the flat buffer or of joined payloads.
        self.fuses_projections = cfg.fuse_projections and self.device.type == "cuda" and not self.true_on_policy
        if self.fuses_projections:
            fused_projections.enable(self.model)
            fused_projections.join_quantized(self.model)
        self.lora = engine_adapters(self.model, lora, self.dtype) if lora is not None and lora.rank > 0 else None
        self.tok = TokenizerInfo.load(checkpoint_dir)
        stop = ({self.tok.eos_id} if self.tok.eos_id is not None else set()) | set(self.tok.extra_stop_ids)
        for text in cfg.stop_tokens:
            token_id = self.tok.tokenizer.token_to_id(text)
            if token_id is None:
                raise ValueError(f"rollout.stop_tokens: {text!r} is not a token of the tokenizer")
            stop.add(token_id)
        self.stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=self.device)
        self.pad_id = self.tok.pad_id if self.tok.pad_id is not None else 0
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # Compact the decode batch once this fraction of its rows has finished (> 1: never).
        self.compact_at = COMPACT_AT
        # R3: the MoE layers whose choices are recorded (None: no recording) and their id dtype.
        self.routing_layers = None
        if record_routing:
            config = self.model.config
            self.routing_layers = moe_layers(config)
            if not self.routing_layers:
                raise ValueError(f"routing record (algo.routing_replay=r3) needs an MoE model; "
                                 f"{config.family} has no MoE layer")
            self.routing_dtype = routing_dtype(config.moe.num_experts)
            # DSA models: the keys each indexer kept are recorded next to the experts.
            self.key_layers = index_layers(config)
            self.keys_dtype = keys_dtype(config.max_position_embeddings)
        if cfg.compile_cpu and self.device.type == "cpu":
            # A small model's CPU decode step is bound by per-op dispatch, not arithmetic: Inductor's C++
            # kernels fuse the elementwise ops and drop most of the Python (docs/benchmarks.md, "Miles GRPO
            # step vs TRL"). Dynamic shapes: one compile serves every batch size and cache length.
            self.model.forward = torch.compile(self.model.forward, dynamic=True)
        self.spec = self._speculative(draft_dir, max_slots)
        with self._numerics():  # the decode graphs are captured here: with true on-policy's kernels
            self.slots = self._slot_decoder(max_slots) if self._use_slots() else None
        # Colocation (release_memory / resume_memory): what is off the device now.
        self.weights_memory = EngineWeights(self.model, self.flat, self.device,
                                            self.pausable if self.flat is not None else None)
        self.released: set[str] = set()

    def _speculative(self, draft_dir: str | None, max_slots: int | None):
        """rollout.speculative: the draft-and-verify decoder over the model's MTP module or a draft
        model; with a GQA draft model where slot decode applies, in slots with CUDA graphs."""
        spec = self.cfg.speculative
        if spec.kind == "none":
            return None
        if self.model.config.vision is not None:
            raise ValueError(f"rollout.speculative: {self.model.config.family} (vision-language) decodes on the padded "
                             "path without a draft; set rollout.speculative.kind=none")
        if self.true_on_policy or self.routing_layers is not None:
            raise ValueError("rollout.speculative decodes on the padded path without routing records or the "
                             "trainer's kernels: set rollout.speculative.kind=none for R3 / true on-policy")
        if spec.kind == "mtp":
            draft = MTPDraft(self.model)
        elif spec.kind == "draft_model":
            if draft_dir is None:
                raise ValueError("rollout.speculative.kind=draft_model needs rollout.speculative.draft_model")
            self.draft_model = from_pretrained(draft_dir, dtype=self.dtype).to(self.device).eval().requires_grad_(False)
            if self.draft_model.config.vocab_size != self.model.config.vocab_size:
                raise ValueError(f"rollout.speculative.draft_model: its vocabulary ({self.draft_model.config.vocab_size}) "
                                 f"differs from the policy's ({self.model.config.vocab_size}); use a model of the same family")
            if self._wants_slots() and self.model.supports_slot_decode and self.draft_model.supports_slot_decode:
                cfg = self.cfg
                columns = -(-(cfg.max_prompt_len + cfg.max_new_tokens + spec.num_tokens + 1) // 64) * 64
                slots = max(cfg.n_samples_per_prompt, min(cfg.max_running, max_slots or cfg.max_running))
                graphs = cfg.cuda_graphs and self.model.config.moe is None and self.draft_model.config.moe is None
                if cfg.compile and self.device.type == "cuda":
                    fused.enable()  # as the slot decoder: the captured forwards run the fused kernels
                return SlotSpeculativeDecoder(self.model, self.draft_model, spec.num_tokens, slots, columns,
                                              self.pad_id, self.stop_ids, graphs, self.compact_at, cfg.sync_every,
                                              route=self.lora.route if self._routes_adapters else None)
            draft = ModelDraft(self.draft_model)
        else:
            raise ValueError(f"rollout.speculative.kind: unknown {spec.kind!r}; choose none, mtp or draft_model")
        if self.cfg.slot_decode:
            raise ValueError("rollout.slot_decode=true: speculative decoding in slots needs a draft model and GQA "
                             "attention in both models; set rollout.slot_decode=null")
        return SpeculativeDecoder(self.model, draft, spec.num_tokens, self.pad_id, self.stop_ids, self.compact_at,
                                  self.cfg.sync_every, route=self.lora.route if self._routes_adapters else None)

    def _wants_slots(self) -> bool:
        return self.cfg.slot_decode if self.cfg.slot_decode is not None else self.device.type == "cuda"

    def _use_slots(self) -> bool:
        wanted = self._wants_slots()
        if self.spec is not None:  # the speculative decoder has its own layout (padded, or slots of its own)
            return False
        if self.model.config.vision is not None:  # images (mRoPE offsets) are fed on the padded path only
            if self.cfg.slot_decode:
                raise ValueError(f"rollout.slot_decode=true: {self.model.config.family} (vision-language) decodes on "
                                 "the padded path; set rollout.slot_decode=null")
            return False
        if wanted and not self.model.supports_slot_decode:
            if self.cfg.slot_decode:
                raise ValueError(f"rollout.slot_decode=true needs GQA, MLA or DSA attention in every layer; "
                                 f"{self.model.config.family} has other kinds: set rollout.slot_decode=null")
            return False
        # The slot decoder records MoE experts, not the keys DSA indexers keep.
        if wanted and self.routing_layers is not None and self.key_layers:
            if self.cfg.slot_decode:
                raise ValueError("rollout.slot_decode=true: a DSA model's routing record (the kept keys) is taken on "
                                 "the padded path; set rollout.slot_decode=null")
            return False
        return wanted

    def _slot_decoder(self, max_slots: int | None) -> SlotDecoder:
        cfg = self.cfg
        if cfg.compile and self.device.type == "cuda" and not self.true_on_policy:
            fused.enable()  # before graph capture: the captured step runs the fused kernels
        slots = max(cfg.n_samples_per_prompt, min(cfg.max_running, max_slots or cfg.max_running))
        columns = -(-(cfg.max_prompt_len + cfg.max_new_tokens) // 64) * 64  # aligned rows for the kernels
        routing = None if self.routing_layers is None else (self.routing_layers, self.routing_dtype)
        return SlotDecoder(self.model, slots, columns, self.dtype, self.device, self.pad_id, self._slot_graphs(),
                           cfg.sync_every, routing=routing, route=self.lora.route if self._routes_adapters else None,
                           pausable=self.pausable)

    def _slot_graphs(self) -> bool:
        """Whether the slot decoder captures its steps in CUDA graphs (on CUDA; `rollout.cuda_graphs`).
        MoE layers decode through the grouped expert kernels (no host sync: captured like the rest);
        where a layer keeps the expert loop, which sizes its batches on the host (expert LoRA hooks,
        QLoRA's quantized holder, Llama 4's experts; true on-policy's batch-invariant kernels), the
        steps run eagerly. A model whose moe block leaves every layer dense has no MoE layer."""
        return self.cfg.cuda_graphs and (not moe_layers(self.model.config)
                                         or (not self.true_on_policy and graph_capturable(self.model)))

    @property
    def _routes_adapters(self) -> bool:
        """Whether this engine holds named LoRA adapters, so every generate names each prompt's."""
        return self.lora is not None and bool(self.lora.adapter_names)

    def decode(self, ids: list[int]) -> str:
        return self.tok.tokenizer.decode(ids, skip_special_tokens=True)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        labels: list[str],
        n: int = 1,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        prompt_ids: list[list[int]] | None = None,
        seeds: list[int] | None = None,
        images: list[dict | None] | None = None,
        adapters: list[int] | None = None,
    ) -> list[Sample]:
        """n samples for each prompt, grouped: samples[i*n:(i+1)*n] answer prompts[i]. `prompt_ids`:
        the prompts already as token ids (a multi-turn context), used instead of encoding `prompts`.
        `seeds`: one per prompt; its group's sampling noise comes from a generator seeded by it.
        `images`: one per prompt, its {"pixel_values", "image_grid_thw"} or None (a VLM; see above).
        `adapters`: one LoRA adapter id per prompt (an engine of several adapters; see above)."""
        self._check_resident("generate")
        cfg = self.cfg
        temperature = cfg.temperature if temperature is None else temperature
        max_new = max_new_tokens or cfg.max_new_tokens
        distinct = prompt_ids if prompt_ids is not None else [encode_prompt(self.tok, p) for p in prompts]
        prompt_ids = [ids for ids in distinct for _ in range(n)]  # row i*n+j samples prompts[i]
        width = max(len(p) for p in distinct)
        limit = self.model.config.max_position_embeddings
        if width + max_new > limit:
            raise ValueError(
                f"prompt ({width} tokens) + max_new_tokens ({max_new}) exceeds the model's "
                f"max_position_embeddings ({limit}); lower rollout.max_new_tokens"
            )
        generators = self._group_generators(seeds, len(distinct))
        vision = self._vision_inputs(images, len(distinct))
        self._check_adapters(adapters, len(distinct))
        with self._numerics():
            if self.spec is not None:
                sampling = Sampling(temperature, cfg.top_p, cfg.top_k, max_new)
                decoded = [(resp, lp, stopped, None, None, (steps, accepted)) for resp, lp, stopped, steps, accepted
                           in self.spec.generate(distinct, n, sampling, self.generator, generators, adapters)]
            elif self.slots is not None and width + max_new <= self.slots.max_len:
                sampling = Sampling(temperature, cfg.top_p, cfg.top_k, max_new)
                decoded = self.slots.generate(distinct, n, sampling, self.stop_ids, self.generator, generators,
                                              adapters)
            else:
                if self.true_on_policy and self.device.type == "cuda":
                    raise ValueError("true_on_policy=true on CUDA decodes in the slot layout (keys at their "
                                     "positions, as the trainer lays them out); this batch does not fit its "
                                     "cache: raise rollout.max_prompt_len")
                decoded = self._generate_padded(distinct, n, temperature, max_new, generators, vision, adapters)
        samples = []
        for i, (ids, (resp, logprobs, stopped, routing, *rest)) in enumerate(zip(prompt_ids, decoded)):
            samples.append(
                Sample(
                    prompt=prompts[i // n],
                    label=labels[i // n],
                    prompt_ids=ids,
                    response_ids=resp,
                    rollout_logprobs=logprobs,
                    response=self.decode(resp),
                    finish_reason=FinishReason.stop if stopped else FinishReason.length,
                    group=i // n,
                    routed_experts=routing,
                    selected_keys=rest[0] if rest else None,  # the padded path's DSA record
                    draft_stats=rest[1] if len(rest) > 1 else None,
                    adapter=None if adapters is None else adapters[i // n],
                )
            )
        return samples

    def _vision_inputs(self, images: list[dict | None] | None, prompts: int) -> dict | None:
        """A VLM's prefill inputs: the prompts' images concatenated in prompt order (None: a text model)."""
        if self.model.config.vision is None:
            if images is not None and any(im is not None for im in images):
                raise ValueError(f"generate: images given to a text model ({self.model.config.family}); "
                                 "use a vision-language model (e.g. model=qwen2_5_vl_tiny)")
            return None
        present = [im for im in images or () if im is not None]
        if images is not None and len(images) != prompts:
            raise ValueError(f"images: one entry (or None) per prompt, got {len(images)} for {prompts} prompts")
        if not present:
            return {}
        # Images' and videos' inputs (miles.models.vlm.VisionLM), each key over the prompts that have it.
        keys = sorted({key for im in present for key in im})
        return {key: torch.cat([im[key] for im in present if key in im]).to(self.device) for key in keys}

    def _check_adapters(self, adapters: list[int] | None, prompts: int) -> None:
        """An engine of named adapters needs every prompt's; one without takes none."""
        check_adapter_ids(self.lora.adapter_names if self._routes_adapters else [], adapters, prompts)

    def _group_generators(self, seeds: list[int] | None, groups: int) -> list[torch.Generator] | None:
        """One generator per prompt group, seeded by its seed (None without seeds: the engine's own)."""
        if seeds is None:
            return None
        if len(seeds) != groups:
            raise ValueError(f"seeds: one per prompt, got {len(seeds)} for {groups} prompts")
        return [torch.Generator(device=self.device).manual_seed(int(seed)) for seed in seeds]

    def _numerics(self):
        """True on-policy: the trainer's numerics (its autocast, batch-invariant kernels); else nothing."""
        if not self.true_on_policy:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(invariant.kernels())
        stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype,
                                           enabled=self.autocast_dtype != torch.float32,
                                           cache_enabled=False))  # no cached casts inside a graph capture
        return stack

    def _generate_padded(self, distinct: list[list[int]], n: int, temperature: float, max_new: int,
                         generators: list[torch.Generator] | None = None, vision: dict | None = None,
                         adapters: list[int] | None = None,
                         ) -> list[tuple[list[int], list[float], bool, torch.Tensor | None, torch.Tensor | None]]:
        """(response ids, log-probs, ended on a stop token, routed experts or None, DSA selected keys
        or None) per sample: left-padded batch decode. `generators`: one per prompt group (seeds).
        `vision` (a VLM; None otherwise): the prompts' pixel_values / image_grid_thw, {} without images.
        `adapters`: each prompt's LoRA adapter id (several adapters), its rows' route."""
        cfg = self.cfg
        batch, width = len(distinct) * n, max(len(p) for p in distinct)
        # Prefill each distinct prompt once (P rows), then expand everything that is per row to
        # P*n rows: the n samples of a prompt start from the same cache and the same logits.
        tokens = torch.full((len(distinct), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(distinct), width, dtype=torch.long)
        for i, ids in enumerate(distinct):
            tokens[i, width - len(ids):] = torch.tensor(ids)
            mask[i, width - len(ids):] = 1
        tokens, mask = tokens.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)

        cache = self.model.new_cache(len(distinct), width + max_new, dtype=self.dtype, device=self.device)
        record = None if self.routing_layers is None else {}
        sample_adapters = None
        if adapters is not None:  # the prefill routes per prompt, each decode step per live row
            prompt_adapters = torch.tensor(adapters, dtype=torch.long, device=self.device)
            self.lora.route(prompt_adapters[:, None])
            sample_adapters = prompt_adapters.repeat_interleave(n)
        if vision is not None:  # the tower runs here, once per distinct prompt; positions are mRoPE's
            vision = {**vision, "mrope_position_ids": mrope_positions(
                tokens, vision.get("image_grid_thw"), self.model.config, mask, video_grid_thw=vision.get("video_grid_thw"),
                second_per_grid_ts=vision.get("second_per_grid_ts"))}
        logits = self.model(tokens, attention_mask=mask, position_ids=positions, cache=cache,
                            routing_record=record, **(vision or {}))[:, -1]
        if vision is not None:  # text after the prompt: from its largest mRoPE position + 1, on every axis
            positions = positions + (vision["mrope_position_ids"].amax(dim=(0, 2)) + 1 - mask.sum(-1))[:, None]
        if record is not None:  # prompts' experts [P, width, L, k]; each sample's decode steps fill its row
            prompt_routing = stack_routing(record, self.routing_layers, self.routing_dtype)
            response_routing = prompt_routing.new_zeros(batch, max_new, *prompt_routing.shape[2:])
        keys = record is not None and bool(self.key_layers)
        if keys:  # DSA: the same for the indexers' kept key positions
            prompt_keys = stack_keys(record, self.key_layers, self.keys_dtype)
            response_keys = prompt_keys.new_full((batch, max_new, *prompt_keys.shape[2:]), -1)
        if n > 1:
            expand = torch.arange(len(distinct), device=self.device).repeat_interleave(n)
            cache = _select(cache, expand)
            logits, mask, positions = logits[expand], mask[expand], positions[expand]
        out = torch.full((batch, max_new), self.pad_id, dtype=torch.long, device=self.device)
        out_lp = torch.zeros(batch, max_new, device=self.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        lengths = torch.full((batch,), max_new, dtype=torch.long, device=self.device)
        # The batch shrinks as rows finish: `rows` maps each batch row to its sample, `done` marks
        # batch rows that finished since the last compaction (they still ride along until then).
        rows = torch.arange(batch, device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        position = positions[:, -1:]
        for t in range(max_new):
            noise = None
            if temperature > 0:  # noise for every sample, live or not: the draws do not depend on compaction
                noise = self._noise(batch, n, logits.shape[-1], generators)
                noise = noise if len(rows) == batch else noise[rows]
            next_tok, next_lp = sample_next(logits, temperature, cfg.top_p, cfg.top_k, noise=noise)
            next_tok = next_tok.masked_fill(done, self.pad_id)
            out[rows, t], out_lp[rows, t] = next_tok, next_lp
            stopped = torch.isin(next_tok, self.stop_ids) & ~done
            lengths[rows[stopped]] = t + 1
            finished[rows[stopped]] = True
            done |= stopped
            num_done = int(done.sum())
            if num_done == len(rows) or t == max_new - 1:
                break
            if num_done >= self.compact_at * len(rows):  # drop finished rows; amortizes the cache copy
                keep = (~done).nonzero().squeeze(1)
                cache = _select(cache, keep)
                rows, done, next_tok = rows[keep], done[keep], next_tok[keep]
                mask, position = mask[keep], position[keep]
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype, device=self.device)], dim=1)
            position = position + 1
            mrope = {} if vision is None else {"mrope_position_ids": position[None].expand(3, -1, -1)}
            if sample_adapters is not None:
                self.lora.route(sample_adapters[rows, None])
            logits = self.model(next_tok[:, None], attention_mask=mask, position_ids=position, cache=cache,
                                routing_record=record, **mrope)[:, -1]
            if record is not None:  # the input was response token t of each batch row's sample
                response_routing[rows, t] = stack_routing(record, self.routing_layers, self.routing_dtype)[:, 0]
            if keys:
                response_keys[rows, t] = stack_keys(record, self.key_layers, self.keys_dtype)[:, 0]

        out, out_lp, lengths, finished = out.cpu().tolist(), out_lp.cpu().tolist(), lengths.tolist(), finished.tolist()
        routing, selected = [None] * batch, [None] * batch
        if record is not None:
            prompt_routing, response_routing = prompt_routing.cpu(), response_routing.cpu()
            for i in range(batch):
                p = len(distinct[i // n])
                # Fresh tensors (cat copies): a view would carry the whole buffer through pickling.
                routing[i] = torch.cat([prompt_routing[i // n, width - p:], response_routing[i, : lengths[i] - 1]])
        if keys:
            prompt_keys, response_keys = prompt_keys.cpu(), response_keys.cpu()
            for i in range(batch):
                p = len(distinct[i // n])
                selected[i] = torch.cat([prompt_keys[i // n, width - p:], response_keys[i, : lengths[i] - 1]])
        return [(out[i][: lengths[i]], out_lp[i][: lengths[i]], finished[i], routing[i], selected[i])
                for i in range(batch)]

    def _noise(self, batch: int, n: int, vocab: int, generators: list[torch.Generator] | None) -> torch.Tensor:
        """Exp(1) sampling noise [batch, vocab] for one decode step: from the engine's generator, or
        n rows from each group's own (so a group's draws do not depend on the rest of the batch)."""
        if generators is None:
            return torch.empty(batch, vocab, device=self.device).exponential_(generator=self.generator)
        return torch.cat([torch.empty(n, vocab, device=self.device).exponential_(generator=g) for g in generators])

    def update_weights(self, weights: dict[str, torch.Tensor] | FlatWeights,
                       expected_checksum: str | None = None) -> str:
        """Load what the trainer sent (weights in this engine's dtype, or the recipe's rollout format,
        or in-process a FlatWeights of this engine's layout); verify what the engine then holds when a
        checksum is given. Weights are copied in place: captured CUDA graphs stay valid."""
        if WEIGHTS in self.released:
            raise RuntimeError("update_weights: the engine's weights are released (colocation): call "
                               "resume_memory(('weights',)) first")
        if self.lora is not None:
            return load_synced(self.lora, weights, expected_checksum)
        if isinstance(weights, FlatWeights):
            self.flat.copy_from(weights)
            self.weights_memory.stale = False  # filled (dropped weights too); a wrong checksum still raises
            held = self.flat.checksum() if expected_checksum is not None else ""
            if held != (expected_checksum or ""):
                raise WeightSyncError(f"engine weights checksum {held[:20]} != trainer's {expected_checksum[:20]}")
            return held
        if self.flat is not None:  # one foreach copy into the parameters' buffer (load_state_dict walks the modules)
            _check_shapes(weights, self.flat)
            self.flat.fill_from(weights)
        elif self.recipe.rollout_quant == "none":
            self.model.load_state_dict(weights, strict=True)
        else:
            self.recipe.load_engine(self.model, weights, self.dtype)
        self.weights_memory.stale = False
        if expected_checksum is None:
            return ""
        if expected_checksum.startswith(DEVICE_DIGEST):  # an in-process quantized payload: checked on the device
            held = tensors_checksum(self.recipe.held_tensors(self.model))
        elif self.flat is not None:  # the state dict's names, tensors and bytes, without building it
            held = checksum(self.flat.views())
        else:
            held = checksum(self.model.state_dict()) if self.recipe.rollout_quant == "none" else \
                self.recipe.held_checksum(self.model)
        if held != expected_checksum:
            raise WeightSyncError(f"engine weights checksum {held[:12]} != trainer's {expected_checksum[:12]}")
        return held

    def update_draft_weights(self, weights: dict[str, torch.Tensor], expected_checksum: str | None = None) -> str:
        """rollout.speculative.kind=draft_model: load the draft the trainer trained online (its state
        dict in this engine's dtype); verify the checksum when one is given."""
        if getattr(self, "draft_model", None) is None:
            raise RuntimeError("update_draft_weights: this engine has no draft model "
                               "(rollout.speculative.kind is not draft_model)")
        self.draft_model.load_state_dict(weights, strict=True)
        if expected_checksum is None:
            return ""
        held = checksum(self.draft_model.state_dict())
        if held != expected_checksum:
            raise WeightSyncError(f"engine draft checksum {held[:12]} != trainer's {expected_checksum[:12]}")
        return held

    # ----------------------------------------------------------------------------- colocation memory
    def release_memory(self, tags=ENGINE_TAGS, keep_weights: bool = True) -> None:
        """Free the engine's device memory for the trainer's turn. "kv_cache": the slot cache, the
        per-slot state and the captured CUDA graphs (the padded path holds no cache between calls);
        "weights": the weights leave the device, to a host copy (pinned on CUDA) or, with
        `keep_weights=False`, nowhere (zeros after resume until the next update_weights). Then the
        allocator's cached blocks go back to the driver. A tag already released is skipped. With LoRA
        the weights are always kept: a sync brings the adapters only, never the frozen base.
        rollout.memory_saver: the plain weights and the slot cache are paused instead, their addresses
        kept, and the per-slot state and the graphs stay on the device (miles/rollout/pausable.py)."""
        tags = check_tags(tags, ENGINE_TAGS, "release_memory")
        if KV_CACHE in tags and KV_CACHE not in self.released:
            if self.slots is not None and self.slots.pausable is not None:
                self.slots.pause()
            elif self.slots is not None:
                self.slots.release()
            if isinstance(self.spec, SlotSpeculativeDecoder):  # rebuilt (and recaptured) by the next call
                self.spec.release()
            self.released.add(KV_CACHE)
        if WEIGHTS in tags and WEIGHTS not in self.released:
            if self.slots is not None and self.weights_memory.pausable is None:
                self.slots.drop_graphs()  # captured at the weights' addresses, which a pause keeps
            if isinstance(self.spec, SlotSpeculativeDecoder):
                self.spec.release()
            self.weights_memory.release(keep=keep_weights or self.lora is not None)
            self.released.add(WEIGHTS)
        free_device_memory(self.device)

    def resume_memory(self, tags=ENGINE_TAGS) -> None:
        """Bring back what `release_memory` freed: the weights (from the host copy, or zeros; paused
        ones at their addresses, their contents from the host copy or the next sync), the slot cache;
        the decode graphs are captured again once both are on the device, unless a pause kept them.
        A tag not released is skipped."""
        tags = check_tags(tags, ENGINE_TAGS, "resume_memory")
        if WEIGHTS in tags and WEIGHTS in self.released:
            self.weights_memory.resume()
            if self.fuses_projections:  # the payload buffers came back as tensors of their own
                fused_projections.join_quantized(self.model)
            self.released.discard(WEIGHTS)
        if KV_CACHE in tags and KV_CACHE in self.released:
            if self.slots is not None and self.slots.paused:
                self.slots.unpause()
            elif self.slots is not None:
                self.slots.allocate(capture=False)
            self.released.discard(KV_CACHE)
        if self.slots is not None and not self.released:
            with self._numerics():
                self.slots.capture()  # no-op without graphs, or when they are still captured
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def health(self) -> dict:
        """The protocol's health report: this engine serves whenever its process is alive."""
        return {"engine": "native", "device": str(self.device),
                "resident": [t for t in ENGINE_TAGS if t not in self.released]}

    def held_bytes(self) -> dict[str, int]:
        """Device bytes of the engine's weights and of its slot cache now (0 once released; the
        cache is 0 on the padded path, which allocates one per generate call)."""
        return {WEIGHTS: self.weights_memory.nbytes(),
                KV_CACHE: self.slots.nbytes() if self.slots is not None else
                self.spec.nbytes() if isinstance(self.spec, SlotSpeculativeDecoder) else 0}

    def _check_resident(self, what: str) -> None:
        if self.released:
            tags = tuple(t for t in ENGINE_TAGS if t in self.released)
            raise RuntimeError(f"{what}: the engine's {' and '.join(tags)} memory is released (colocation): "
                               f"call resume_memory({tags}) first")
        if self.weights_memory.stale:
            raise RuntimeError(f"{what}: the engine's weights were released without a host copy "
                               "(keep_weights=False): load them with update_weights(...) first")


def _check_shapes(weights: dict[str, torch.Tensor], flat: FlatWeights) -> None:
    """What load_state_dict refuses and a copy would broadcast: a tensor of another shape."""
    for name, shape in zip(flat.layout.names, flat.layout.shapes):
        if name in weights and tuple(weights[name].shape) != shape:
            raise ValueError(f"update_weights: {name} has shape {tuple(weights[name].shape)}, the engine's {shape}")


def _select(cache, index: torch.Tensor):
    """cache.select(index) keeps / reorders batch rows; use its return value when it gives one."""
    selected = cache.select(index)
    return cache if selected is None else selected
