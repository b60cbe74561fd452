"""LoRA adapters over a CausalLM's decoder projections, the same module on the trainer and the engine.

    lora = LoRA(model, rank=8, alpha=16, target_modules=["q_proj", "v_proj"], seed=0)
    model(...)                # each targeted nn.Linear returns base(x) + alpha / rank * B(A(dropout(x)))
    lora.tensors()            # {"layers.0.self_attn.q_proj.lora_A.weight": [r, in], "...lora_B.weight": [out, r]}
    lora.load(tensors)        # in place (the engine's side of a weight sync)
    with lora.merged():       # W + alpha / rank * B @ A in the base weights, the adapters off:
        save_pretrained(model, out)                                  # the merged HF checkpoint

Several adapters over the one base (`adapters=["add", "mul"]`, trainer.lora.adapters): every
projection holds one A / B pair per adapter, and `lora.route(ids)` says which adapter each row
([B, 1]) or token ([B, T]: packed rows) of the next forwards goes through. Each targeted projection
then adds sum_k where(ids == k, alpha / rank * B_k(A_k(x)), 0): every adapter runs on every row
(N times the LoRA FLOPs, still small next to the base's), the others' results masked out, so shapes
never depend on the routing (a captured CUDA graph replays it) and a row's gradient reaches only
its own adapter. Their tensors are named "<adapter>/<module>.lora_A.weight". With one adapter no
mask is computed: the single-adapter forward is unchanged.

The math and the initialisation are PEFT's `lora.Linear` (A kaiming-uniform, B zero, so a fresh
adapter leaves the model's outputs bit for bit as they were); the PEFT file format is
miles/models/lora_peft.py. Why the project's own module and not PEFT's layers: PEFT wraps each
targeted nn.Linear in a new module, which renames its weight (`q_proj.weight` becomes
`q_proj.base_layer.weight`). Everything that moves the base weights keys on the native names: the
strict HF loader and saver, the engine's flat weight buffer whose parameters are views, the
checksums, FSDP's state gathering, the precision recipes. Here the adapters live outside the model
(a module of their own, reached by forward hooks), so the model's state dict, and all that code, do
not change, and the adapters travel, checksum and save as a dict of their own.

Targets: nn.Linear modules of the main decoder (`layers.*`; not the LM head, whose weight the
trainer's chunked loss reads directly, nor the MTP draft modules), or their quantized form under an
FP8 / INT4 recipe (miles.precision's QuantLinear: the engine's layers, and the trainer's frozen base
under QLoRA, miles/precision/qlora.py), over which the adapters run unmerged: a quantized weight
cannot hold W + B A, so merging is refused there. An entry of `target_modules`
matches a module whose name equals it or ends with "." + it (PEFT's rule for a list: "q_proj"),
or that the entry matches whole as a regular expression ("layers\\.[0-3]\\..*_proj").

Stacked MoE experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I] of
miles.models.moe.Experts, not nn.Linear) are adapted where an entry names them: "experts" (both),
"experts.gate_up_proj" / "experts.down_proj", or a pattern that contains "experts"; a bare "down_proj"
keeps meaning the nn.Linear projections (the dense and shared-expert MLPs), so the default targets
do not grow by E adapters a layer. Each expert gets its own pair, A [E, rank, in] and B [E, out,
rank], applied inside the expert loop on the expert's own tokens (`Experts.lora_hooks`); merged, W_e
+ alpha / rank * B_e A_e. PEFT saves them as `target_parameters` (miles/models/lora_peft.py). With
several adapters each expert's tokens are routed as a projection's are, by the token's place in the
layer's flat input.

Llama 4's stacks (miles.models.llama4.Llama4Experts: gate_up_proj [E, H, 2I], down_proj [E, I, H],
multiplied as x @ W_e) are what PEFT calls transposed. PEFT's ParamWrapper reads every 3-D stack
as [E, out, in] unless its module says `is_transposed` (transformers' Llama4TextExperts does not),
so on Llama 4 it builds A [E * rank, last dim] and B [first dim, rank * E] and adds B_e A_e to W_e,
which the forward multiplies as x @ (W_e + B_e A_e). The same pair here: A [E, rank, 2I] and B [E, H,
rank] for gate_up_proj (B @ A has the stack's shape, so merging and the PEFT file are the other
families'), applied as x @ B_e @ A_e.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from miles.models.llama4 import Llama4Experts
from miles.models.moe import Experts, stack_slices
from miles.precision.recipe import QuantLinear

# Every projection of a dense Qwen / Llama-style decoder layer (attention and MLP).
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_TENSORS = ("gate_up_proj", "down_proj")  # Experts' stacked [E, out, in] tensors, in their module order
STACKED_EXPERTS = (Experts, Llama4Experts)  # the modules holding them (Llama 4's transposed: [E, in, out])
DECODER_PREFIX = "layers."
# Several adapters: "<adapter>/<module>.lora_A.weight" (an adapter name is a directory name, never "/").
ADAPTER_SEPARATOR = "/"


def _matches(name: str, entry: str) -> bool:
    if name == entry or name.endswith("." + entry):
        return True
    try:
        return re.fullmatch(entry, name) is not None
    except re.error:
        return False


def _projection(name: str, m: nn.Module) -> bool:
    return isinstance(m, (nn.Linear, QuantLinear)) and name.startswith(DECODER_PREFIX)


def find_targets(model: nn.Module, target_modules) -> list[tuple[str, nn.Module]]:
    """(name, module) of the decoder's projections (nn.Linear or QuantLinear) that `target_modules`
    selects, in model order."""
    return [(name, m) for name, m in model.named_modules()
            if _projection(name, m) and any(_matches(name, entry) for entry in target_modules)]


def _selects_expert(name: str, entry: str) -> bool:
    return "experts" in entry and (entry == "experts" or _matches(name, entry))


def find_expert_targets(model: nn.Module, target_modules) -> list[tuple[str, nn.Module, str]]:
    """(tensor name, experts module (STACKED_EXPERTS), its attribute) of the stacked expert tensors
    `target_modules` names (module docstring), in model order."""
    return [(f"{name}.{attr}", m, attr) for name, m in model.named_modules()
            if isinstance(m, STACKED_EXPERTS) and name.startswith(DECODER_PREFIX)
            for attr in EXPERT_TENSORS if any(_selects_expert(f"{name}.{attr}", e) for e in target_modules)]


def adapter_shapes(model: nn.Module, rank: int, target_modules) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Adapted weight's name -> (A's shape, B's shape) of one adapter: [rank, in] / [out, rank] for a
    projection, [E, rank, in] / [E, out, rank] for stacked experts (works on a meta-device model)."""
    shapes = {name: ((rank, m.in_features), (m.out_features, rank)) for name, m in find_targets(model, target_modules)}
    for name, m, attr in find_expert_targets(model, target_modules):
        e, out, inp = m.stacked_shape(attr)
        shapes[name] = ((e, rank, inp), (e, out, rank))
    return shapes


def candidate_names(model: nn.Module) -> list[str]:
    """The distinct last components of the modules LoRA can adapt (for messages), and "experts" where
    the model has stacked experts."""
    names = {name.rpartition(".")[2] for name, m in model.named_modules() if _projection(name, m)}
    if any(isinstance(m, STACKED_EXPERTS) for m in model.modules()):
        names.add("experts")
    return sorted(names)


def _placement(linear: nn.Module, dtype: torch.dtype | None) -> dict:
    """Device and dtype of a projection's adapters: its weight's, or for a quantized projection (whose
    codes are no adapter dtype) its payload's device and the dtype the caller gives."""
    if isinstance(linear, nn.Linear):
        return dict(device=linear.weight.device, dtype=dtype or linear.weight.dtype)
    if dtype is None:
        raise ValueError("LoRA over a quantized projection needs the adapters' dtype")
    return dict(device=next(linear.buffers()).device, dtype=dtype)


class LoRA(nn.Module):
    """Adapters A [rank, in] and B [out, rank] for each targeted projection of `model`, applied by
    forward hooks. `dtype`: the adapters' (the trainer keeps them in fp32, the engine in its own).
    `seed`: A's initialisation without touching the global RNG (adapter after adapter, so the first
    is the one a single-adapter LoRA of the same seed draws). `zero`: A = 0 too (an engine's
    adapters before the first sync: the same outputs as B = 0, nothing drawn). `adapters`: the
    names of several adapters (see the module docstring); empty: one unnamed adapter. `device`: where
    the adapters live (default: each target's weight's device); lets a meta-device model of the
    native structure name, shape and seed adapters that hook elsewhere (the Megatron trainer's,
    miles/trainer/megatron/lora.py)."""

    def __init__(self, model: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                 target_modules=ALL_PROJECTIONS, dtype: torch.dtype | None = None, seed: int | None = None,
                 zero: bool = False, adapters: Sequence[str] = (), device: torch.device | str | None = None):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA rank must be > 0 (got {rank})")
        targets = find_targets(model, target_modules)
        experts = find_expert_targets(model, target_modules)
        if not targets and not experts:
            raise ValueError(f"trainer.lora.target_modules={list(target_modules)} matches no projection of the "
                             f"model; its decoder projections: {', '.join(candidate_names(model))}")
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.names = [name for name, _ in targets] + [name for name, _, _ in experts]
        self.adapter_names = list(adapters)
        self.num_adapters = max(1, len(self.adapter_names))
        self._linears = [m for _, m in targets]  # a plain list: not submodules, the model owns them
        self._experts = [(m, attr) for _, m, attr in experts]  # after the linears: target index len(_linears) + j
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True
        self._base: list[torch.Tensor] | None = None  # keep_base(): the unmerged weights merge_into_base starts from
        self._route: torch.Tensor | None = None  # several adapters: each row's / token's adapter id
        gen = None if seed is None else torch.Generator(device="cpu").manual_seed(seed)
        # Adapter k's pair for projection i at index k * len(names) + i.
        self.lora_A, self.lora_B = nn.ParameterList(), nn.ParameterList()
        for _ in range(self.num_adapters):
            for linear in self._linears:
                a = torch.zeros(rank, linear.in_features, dtype=torch.float32)
                if not zero:  # PEFT's default: kaiming-uniform A (drawn on the CPU: the same on every device)
                    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
                kind = _placement(linear, dtype)
                if device is not None:
                    kind["device"] = device
                self.lora_A.append(nn.Parameter(a.to(**kind)))
                self.lora_B.append(nn.Parameter(torch.zeros(linear.out_features, rank, **kind)))
            for m, attr in self._experts:
                num, out, inp = m.stacked_shape(attr)
                a = torch.zeros(num * rank, inp, dtype=torch.float32)  # PEFT's: one [E * rank, in] Linear weight
                if not zero:
                    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
                held = next(m.parameters(), None)
                held = held if held is not None else next(m.buffers())  # QLoRA's holder: its codes' device
                if dtype is None and not held.is_floating_point():
                    raise ValueError("LoRA over quantized experts needs the adapters' dtype")
                kind = dict(device=held.device if device is None else device, dtype=dtype or held.dtype)
                self.lora_A.append(nn.Parameter(a.view(num, rank, inp).to(**kind)))
                self.lora_B.append(nn.Parameter(torch.zeros(num, out, rank, **kind)))
        for i, linear in enumerate(self._linears):
            linear.register_forward_hook(self._hook(i))
        for j, (m, attr) in enumerate(self._experts):
            m.lora_hooks[attr] = self._expert_hook(len(self._linears) + j)

    def _pair(self, adapter: int, i: int) -> tuple[nn.Parameter, nn.Parameter]:
        j = adapter * len(self.names) + i
        return self.lora_A[j], self.lora_B[j]

    def _hook(self, i: int):
        def add_delta(module, args, out):
            if not self.enabled:
                return out
            x = args[0]
            a, b = self._pair(0, i)
            if not torch.is_autocast_enabled(x.device.type):
                x = x.to(a.dtype)  # as PEFT: the input in the adapters' dtype, the sum in the output's
            x = self.dropout(x)
            if self.num_adapters == 1:
                delta = F.linear(F.linear(x, a), b)
            else:
                ids = self._ids_for(x)
                delta = None
                for k in range(self.num_adapters):
                    a, b = self._pair(k, i)
                    mine = torch.where(ids == k, F.linear(F.linear(x, a), b), 0.0)
                    delta = mine if delta is None else delta + mine
            return out + (delta * self.scaling).to(out.dtype)
        return add_delta

    def _expert_hook(self, i: int):
        transposed = self._experts[i - len(self._linears)][0].is_transposed

        def product(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            """One expert's adapter output: B_e A_e x, or x @ B_e @ A_e on a transposed stack."""
            return (x @ b) @ a if transposed else F.linear(F.linear(x, a), b)

        def bind():
            """One expert loop's hook: each adapter's stacks unbound once for all its experts."""
            pairs = [tuple(stack_slices(t) for t in self._pair(k, i)) for k in range(self.num_adapters)]
            dtype = self._pair(0, i)[0].dtype

            def add_delta(expert: int, x: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
                          total: int) -> torch.Tensor:
                if not self.enabled:
                    return out
                if not torch.is_autocast_enabled(x.device.type):
                    x = x.to(dtype)
                x = self.dropout(x)
                if self.num_adapters == 1:
                    a, b = pairs[0]
                    delta = product(x, a(expert), b(expert))
                else:  # each token's adapter: the route laid out over the flat input, then this expert's rows
                    ids = self._ids_for(x.new_empty(total, 0))[rows]
                    delta = None
                    for k, (a, b) in enumerate(pairs):
                        mine = torch.where(ids == k, product(x, a(expert), b(expert)), 0.0)
                        delta = mine if delta is None else delta + mine
                return out + (delta * self.scaling).to(out.dtype)
            return add_delta
        return bind

    def _weight(self, i: int) -> torch.Tensor:
        """The base weight target i adapts (a projection's weight, or a stacked expert tensor)."""
        if i < len(self._linears):
            return self._linears[i].weight
        m, attr = self._experts[i - len(self._linears)]
        return getattr(m, attr)

    def state_key(self, i: int) -> str:
        """Target i's weight in the model's state dict."""
        return self.names[i] + (".weight" if i < len(self._linears) else "")

    # ------------------------------------------------------------------ routing (several adapters)
    def route(self, adapter_ids: torch.Tensor) -> None:
        """The adapter (its index in `adapter_names`) of each row ([B, 1]) or token ([B, T]) of the
        model's input in the forwards that follow, on the input's device. It stays set until the next
        call, not for a `with` block: a recomputing backward (trainer.recompute) runs the layers'
        forwards again after the trainer's forward has returned. One adapter: ignored."""
        self._route = adapter_ids

    def _ids_for(self, x: torch.Tensor) -> torch.Tensor:
        """The route laid out against the projection's input [..., in]: [B, T, 1] or [B, 1, 1] for
        [B, T, in]; per token [B * T, 1] where a module flattened the tokens (an MoE's shared expert)."""
        ids = self._route
        if ids is None:
            raise RuntimeError(f"LoRA with {self.num_adapters} adapters: no route set; call lora.route(adapter_ids) "
                               "before the forward")
        lead = x.shape[:-1]
        if ids.dim() == len(lead):
            return ids[..., None]
        if len(lead) == 1:
            return ids.expand(ids.shape[0], lead[0] // ids.shape[0]).reshape(-1, 1)
        raise ValueError(f"LoRA route of shape {tuple(ids.shape)} does not lay out over an input of shape "
                         f"{tuple(x.shape)}")

    # ------------------------------------------------------------------ tensors by name
    def tensors(self, adapter: int | None = None) -> dict[str, torch.Tensor]:
        """The adapters under `<module>.lora_A.weight` / `<module>.lora_B.weight` (native module
        names); several adapters under "<adapter>/<module>...". `adapter`: that one adapter's, unprefixed."""
        out = {}
        for k in range(self.num_adapters) if adapter is None else (adapter,):
            prefix = f"{self.adapter_names[k]}{ADAPTER_SEPARATOR}" if self.adapter_names and adapter is None else ""
            for i, name in enumerate(self.names):
                out[f"{prefix}{name}.lora_A.weight"], out[f"{prefix}{name}.lora_B.weight"] = self._pair(k, i)
        return out

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor], adapter: int | None = None) -> None:
        """Copy `tensors` (tensors(adapter)'s names and shapes, any dtype / device) into the adapters in place."""
        mine = self.tensors(adapter)
        missing, unexpected = sorted(set(mine) - set(tensors)), sorted(set(tensors) - set(mine))
        if missing or unexpected:
            raise ValueError(f"LoRA tensors do not match the adapters: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]} (rank / target_modules / adapters differ?)")
        for name, t in tensors.items():
            if t.shape != mine[name].shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)} != the adapter's {tuple(mine[name].shape)}")
            mine[name].copy_(t)

    @property
    def merges_into_base(self) -> bool:
        """Whether keep_base() made this the merged kind (the engine's trainer.lora.merge_in_engine)."""
        return self._base is not None

    def adapter_parameters(self, adapter: int) -> list[nn.Parameter]:
        return list(self.tensors(adapter).values())

    def num_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    # ------------------------------------------------------------------ merge
    def delta(self, i: int) -> torch.Tensor:
        """alpha / rank * B @ A of target i (one adapter), [out, in] ([E, out, in] for experts), in fp32."""
        a, b = self._pair(0, i)
        return (b.float() @ a.float()) * self.scaling  # batched over experts where A / B are 3-D

    def keep_base(self) -> None:
        """Copy the adapted projections' weights as they are now (the base model's), for
        merge_into_base; on the host where they are on CUDA (pinned), so the engine's device memory
        is not doubled, and outside the weights an engine releases and resumes."""
        if self.num_adapters > 1:
            raise ValueError(f"{self.num_adapters} adapters cannot be merged into one set of base weights")
        self._require_dense_base()
        self._base = [_host_copy(self._weight(i).detach()) for i in range(len(self.names))]
        self.enabled = False  # the merged weights carry the adapters from here on (zero ones until the first merge)

    def _require_dense_base(self) -> None:
        quantized = [name for name, linear in zip(self.names, self._linears) if not isinstance(linear, nn.Linear)]
        quantized += [name for name, (m, _) in zip(self.names[len(self._linears):], self._experts) if m.held_quantized]
        if quantized:
            raise ValueError(f"LoRA merge: {len(quantized)} adapted projections (e.g. {quantized[0]}) hold the base "
                             "quantized (FP8 / INT4), which cannot hold W + alpha / rank * B A exactly: apply the "
                             "adapters unmerged (trainer.lora.merge_in_engine=false)")

    @torch.no_grad()
    def merge_into_base(self) -> None:
        """Write base + alpha / rank * B @ A (fp32 sum, rounded once to the weight's dtype) into each
        adapted projection's weight in place: the same storage, so a flat weight buffer's views and
        captured CUDA graphs stay valid. Each merge starts from keep_base()'s copy, so no rounding
        accumulates over syncs."""
        if self._base is None:
            raise RuntimeError("merge_into_base needs keep_base() first (while the weights are the base model's)")
        for i in range(len(self.names)):
            w = self._weight(i)
            base = self._base[i].to(w.device, non_blocking=True).float()
            w.copy_((base + self.delta(i).to(w.device)).to(w.dtype))

    @contextlib.contextmanager
    def merged(self):
        """Inside: the base weights hold W + delta (in their dtype) and the hooks add nothing; after,
        the original weight tensors are put back (no subtraction, so nothing drifts). One adapter only:
        several share the base, which cannot hold them all."""
        if self.num_adapters > 1:
            raise ValueError(f"{self.num_adapters} adapters cannot be merged into one set of base weights")
        self._require_dense_base()
        weights = [self._weight(i) for i in range(len(self.names))]
        originals = [w.data for w in weights]
        with torch.no_grad():
            for i, w in enumerate(weights):
                w.data = (w.data.float() + self.delta(i).to(w.device)).to(w.dtype)
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True
            for w, original in zip(weights, originals):
                w.data = original


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory (pinned where `t` is on CUDA, for fast copies back)."""
    if t.is_cuda:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    return t.clone()
