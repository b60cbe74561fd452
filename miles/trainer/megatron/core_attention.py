"""The project's core attention for megatron-core specs: `DotProductAttention`'s interface, PyTorch SDPA inside.

Why: Transformer Engine cannot be installed on the GPU machine, and megatron-core's local
`DotProductAttention` (the non-TE spec's) materialises the [b * heads, L, L] scores in one buffer
(16 x 2048 tokens: 79 GB) and takes no `k_channels` / `v_channels`, so megatron-core's
`MLASelfAttention` (qk head dim != v head dim) cannot be built without TE. This module takes both,
and `scaled_dot_product_attention` picks FlashAttention / cuDNN / memory-efficient kernels on CUDA
(causal masks through `is_causal`, which keeps the flash kernel), so nothing of [L, L] is stored.

Layout as megatron-core's: query [sq, b, heads, k], key [sk, b, groups, k], value [sk, b, groups, v]
(GQA / MQA: groups divide heads), output [sq, b, heads * v]. Masks as megatron-core's:
- causal: the mask type says what the mask is, so a passed mask is not read (as Transformer
  Engine's attention does) and SDPA's `is_causal` applies it without building one;
- padding / arbitrary: the boolean mask, True where a query must not see a key (Megatron's sense,
  the inverse of SDPA's), broadcastable to [b, heads, sq, sk];
- padding_causal: both; no_mask: none.
Packed sequences (`packed_seq_params`, THD: query [t, heads, k] holding the sequences at
`cu_seqlens_q_padded`, or `cu_seqlens_q`, each `cu_seqlens_q` long), causal within each sequence for
the causal mask types; output [t, heads * v], zeros in the padding between sequences:
- CUDA, bf16 / fp16, causal, no padding between sequences, no dropout: torch's variable-length
  kernel (`torch.nn.attention.varlen.varlen_attn`, FlashAttention's, as miles/models/packed.py calls
  it) over the whole pack, no host sync, cost sum len_i^2;
- elsewhere (the CPU, fp32, dropout, older torch): one SDPA per sequence (one host sync).
Both compute softmax(q k^T * scale) v within each sequence: the same function.
(MLA pads THD values to the query's head dim and trims the output after: the value's own width is
the output's.)

RoPE (`rope_theta`, the GQA families; miles/trainer/megatron/specs.py builds GPTModel without its
own): query and key are rotated here with the native model's RoPE (miles/models/rope.py), at
positions 0, 1, ... of each row, or of each packed sequence from `cu_seqlens` on the device.
megatron-core's THD RoPE copies cu_seqlens to the host and rotates one sequence at a time in
every layer.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from miles.models.packed import _causal_kwargs, _takes_enable_gqa, _varlen_attn, uses_varlen
from miles.models.rope import apply_rope, rope_cos_sin


def packed_positions(starts: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each token's position within its packed sequence ([tokens], int64; `starts`: cu_seqlens),
    computed on the device (no host copy of cu_seqlens)."""
    starts = starts.long()
    index = torch.arange(tokens, device=starts.device)
    return index - starts[torch.searchsorted(starts, index, right=True) - 1]


class SDPACoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None,
                 cp_comm_type: str | None = None, pg_collection: ProcessGroupCollection | None = None,
                 rope_theta: float | None = None):
        super().__init__(config=config)
        self.rope_theta = rope_theta  # None: the attention module rotated query and key already
        refused = {"context parallelism (context_parallel_size > 1)": config.context_parallel_size > 1,
                   f"softmax_type={config.softmax_type}": config.softmax_type != "vanilla",
                   "sliding-window attention (window_size)": config.window_size is not None}
        if bad := [what for what, on in refused.items() if on]:
            raise NotImplementedError(f"SDPACoreAttention does not implement {', '.join(bad)}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type, self.attention_type = attn_mask_type, attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.heads = divide(config.num_attention_heads, tp)  # this tensor-parallel rank's
        self.groups = divide(config.num_query_groups, tp)
        # v_channels needs no keeping: the output's head width is the value's (MLA's THD pads it)
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        # apply_query_key_layer_scaling divides the scores by layer_number and the local softmax
        # multiplies them back (in fp32): no net effect, so the plain scale is the scale.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def _mask(self, mask_type: AttnMaskType, attention_mask, sq: int, sk: int, device):
        """(SDPA's boolean attn_mask, True = attend, or None; is_causal)."""
        if mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal) and sq != sk:
            raise NotImplementedError(f"SDPACoreAttention: a causal mask needs sq == sk (got {sq}, {sk})")
        if mask_type == AttnMaskType.causal or (mask_type == AttnMaskType.padding_causal and attention_mask is None):
            return None, sq > 1
        if mask_type == AttnMaskType.no_mask or attention_mask is None:
            return None, False
        keep = ~attention_mask
        if mask_type == AttnMaskType.padding_causal:
            keep = keep & torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
        return keep, False

    def _sdpa(self, q, k, v, mask, causal: bool):
        """q [b, heads, sq, k], k / v [b, groups, sk, k or v] -> [b, heads, sq, v]."""
        dropout = self.dropout if self.training else 0.0
        # dropout draws from Megatron's model-parallel RNG stream, as the local attention's does
        rng = (tensor_parallel.get_cuda_rng_tracker().fork() if dropout and not self.config.sequence_parallel
               else contextlib.nullcontext())
        with rng:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                  scale=self.softmax_scale, enable_gqa=self.groups != self.heads)

    def _rotate(self, positions, *xs):
        """RoPE on each x [b, heads, s, d] at positions [b or 1, s]: one cos / sin table for all."""
        cos, sin = rope_cos_sin(positions, xs[0].shape[-1], self.rope_theta)
        return [apply_rope(x, cos, sin) for x in xs]

    def _packed(self, query, key, value, params, mask_type: AttnMaskType):
        """THD: one attention per packed sequence (see the module docstring)."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"SDPACoreAttention: packed qkv_format={params.qkv_format} (thd only)")
        # the trainer passes one tensor for both: no comparison, so no host sync
        if params.cu_seqlens_kv is not params.cu_seqlens_q and not torch.equal(params.cu_seqlens_q,
                                                                               params.cu_seqlens_kv):
            raise NotImplementedError("SDPACoreAttention: packed queries and keys of different lengths")
        starts = params.cu_seqlens_q if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
        if self.rope_theta is not None:  # [t, h, d] as [1, h, t, d]
            positions = packed_positions(starts, query.shape[0])[None]
            query, key = (x[0].transpose(0, 1) for x in self._rotate(positions, query.transpose(0, 1)[None],
                                                                      key.transpose(0, 1)[None]))
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        if causal and starts is params.cu_seqlens_q and self._takes_varlen(query, value):
            return self._varlen(query, key, value, params)
        out = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
        for start, n in zip(starts[:-1].tolist(), params.cu_seqlens_q.diff().tolist()):  # one host sync
            q, k, v = (t[start:start + n].transpose(0, 1)[None] for t in (query, key, value))  # [1, h, n, d]
            out[start:start + n] = self._sdpa(q, k, v, None, causal and n > 1)[0].transpose(0, 1)
        return out.reshape(out.shape[0], -1)

    def _takes_varlen(self, query, value) -> bool:
        """Whether a causal THD pack goes to the variable-length kernel (see the module docstring)."""
        return (not (self.dropout and self.training) and query.shape[-1] == value.shape[-1]
                and uses_varlen(query.device, query.dtype, query.shape[-1])
                and "scale" in inspect.signature(_varlen_attn()).parameters)

    def _varlen(self, query, key, value, params):
        """THD [t, heads or groups, d] through the variable-length kernel, causal within each sequence."""
        kernel = _varlen_attn()
        # megatron-core's GQA value is a strided view of the fused qkv output: the kernel takes dense [t, h, d]
        query, key, value = (x.contiguous() for x in (query, key, value))
        gqa = self.groups != self.heads
        if gqa and not _takes_enable_gqa(kernel):  # torch < 2.13: as many KV heads as query heads
            key, value = (x.repeat_interleave(self.heads // self.groups, dim=1) for x in (key, value))
        extra = {"enable_gqa": True} if gqa and _takes_enable_gqa(kernel) else {}
        out = kernel(query, key, value, params.cu_seqlens_q, params.cu_seqlens_kv, params.max_seqlen_q,
                     params.max_seqlen_kv, scale=self.softmax_scale, **extra, **_causal_kwargs())
        return out.reshape(out.shape[0], -1)

    def forward(self, query, key, value, attention_mask, attn_mask_type: AttnMaskType | None = None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention takes no attention_bias")
        mask_type = attn_mask_type or self.attn_mask_type
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, mask_type)
        sq, b = query.shape[:2]
        mask, causal = self._mask(mask_type, attention_mask, sq, key.shape[0], query.device)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
        if self.rope_theta is not None:
            positions = torch.arange(sq, device=q.device)[None]
            q, k = self._rotate(positions, q, k)
        out = self._sdpa(q, k, v, mask, causal)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
