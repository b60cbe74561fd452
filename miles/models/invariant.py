"""Batch-invariant kernels: the numerics of true on-policy mode (`true_on_policy=true`).

A token's log-prob must come out bit for bit the same whether the engine computes it in a decode
step (one query, a KV cache, a batch of whatever rows are live) or the trainer in a full forward
(every position at once, other micro-batch rows). Mathematically equal computations differ in their
reduction order: BLAS picks another kernel for another row count, attention sums a different
number of keys, a vectorized loop evaluates `exp` with another routine in its scalar tail. Inside
`kernels()`, every floating-point reduction the models make runs in one fixed order that depends
on nothing but the reduced values themselves, in the idea of Thinking Machines' batch-invariant ops:

- matmuls (`F.linear`, `@`, `bmm`), sums and means, softmax / log_softmax, attention (SDPA), layer
  norms and the depthwise conv reduce along their axis from index 0 in fixed steps, in float32.
  Terms that are exactly zero (masked keys past a query, padding) leave such a sum unchanged, so a
  decode step over the cache and a full forward over the sequence give the same bits. On the CPU
  the step is one element (a loop of elementwise multiplies and adds, IEEE-exact); on CUDA a
  Triton matmul with one fixed tile shape (miles/models/invariant_triton.py), which needs the keys of
  position p at column p on both sides (the slot decoder's and the padded trainer's layout).
- elementwise transcendental ops (exp, sigmoid, silu, softplus, log, cos, sin, tanh) on the CPU
  run on zero-padded chunks that the vectorized loop covers whole, so every element goes through
  the same SIMD routine wherever it sits in its tensor (CUDA's elementwise kernels already do).
- topk breaks ties by index (a stable sort), whatever the length of the row.

Gradients do not need the fixed order: each op's backward is the autograd of the ordinary torch
op, recomputed from the saved inputs. The mode is a `TorchFunctionMode`, so the model code is the
same in both modes; the cost is speed (docs/benchmarks.md has the measured step-time ratio).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from miles.precision import invariance

# Elementwise CPU chunks: a multiple of 64 elements (two AVX-512 bf16 vectors) and below
# ATen's parallel grain (32768), so one thread runs each chunk and no scalar tail remains.
_ALIGN, _CHUNK = 64, 16384

def active() -> bool:
    """Whether batch-invariant kernels are on (inside `kernels()`)."""
    return invariance.active()


@contextlib.contextmanager
def kernels(enabled: bool = True):
    """Run the enclosed model calls with batch-invariant kernels (a no-op when not `enabled`)."""
    if not enabled:
        yield
        return
    with invariance.on(), _Mode():
        yield


# ------------------------------------------------------------------------------ exact primitives
def matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] (batch dims broadcast), accumulated along K from 0 in one order,
    each output element independent of M, N, the batch and trailing zero terms; -> out_dtype
    (default: a's dtype)."""
    out_dtype = out_dtype or a.dtype
    if a.is_cuda:
        from miles.models.invariant_triton import triton_matmul

        return triton_matmul(a, b, out_dtype)
    # One product per step, then one rounding add: each element's sum runs in order from k = 0 in
    # float32. (Products summed by ATen's cumsum are one op, but were not invariant: qwen3_next_tiny
    # in fp32 then missed by ~1e-10 at the default batch size.)
    a32, b32 = a.float(), b.float()
    acc = a32[..., :, 0:1] * b32[..., 0:1, :]
    for k in range(1, a.shape[-1]):
        acc.add_(a32[..., :, k:k + 1] * b32[..., k:k + 1, :])
    return acc.to(out_dtype)


def reduce_sum(x: torch.Tensor, dim: int, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum over one dim in the fixed order (float32 accumulation), as `matmul` with a ones vector."""
    dim = dim % x.dim()
    moved = x.movedim(dim, -1)
    if x.is_cuda:  # every other dim as rows of one matmul with a ones column
        ones = torch.ones(moved.shape[-1], 1, dtype=moved.dtype, device=x.device)
        out = matmul(moved.reshape(-1, moved.shape[-1]), ones, torch.float32).view(moved.shape[:-1])
    else:  # in order from index 0 (see matmul)
        out = moved[..., 0].float().clone()
        for k in range(1, moved.shape[-1]):
            out.add_(moved[..., k])
    out = out.to(dtype or (x.dtype if x.is_floating_point() else torch.float32))
    return out.unsqueeze(dim) if keepdim else out


def pointwise(op, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """op(x, ...) elementwise with every element through the same vectorized routine (CPU)."""
    if not x.is_floating_point() or x.device.type != "cpu" or x.numel() == 0:
        return op(x, *args, **kwargs)
    flat = x.reshape(-1)
    n = flat.numel()
    if n % _ALIGN:
        flat = torch.cat((flat, flat.new_zeros(_ALIGN - n % _ALIGN)))
    out = torch.cat([op(chunk, *args, **kwargs) for chunk in flat.split(_CHUNK)])
    return out[:n].view(x.shape)


def softmax_parts(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x - max, sum of exp(x - max)) in float32 along dim (kept as size 1)."""
    x = x.float()
    z = x - x.amax(dim, keepdim=True)
    return z, reduce_sum(pointwise(torch.exp, z), dim, keepdim=True, dtype=torch.float32)


def softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    z, total = softmax_parts(x, dim)
    return (pointwise(torch.exp, z) / total).to(dtype or x.dtype)


def log_softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    z, total = softmax_parts(x, dim)
    return (z - pointwise(torch.log, total)).to(dtype or x.dtype)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype a matmul computes in: autocast's where it is on, else the inputs' promotion."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    dtype = _compute_dtype(x, weight)
    out = matmul(x.to(dtype).reshape(-1, x.shape[-1]), weight.to(dtype).t()).view(*x.shape[:-1], -1)
    return out if bias is None else out + bias.to(dtype)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dtype = _compute_dtype(a, b)
    if a.dim() == 1:
        return mm(a[None], b)[..., 0, :]
    if b.dim() == 1:
        return mm(a, b[:, None])[..., 0]
    return matmul(a.to(dtype), b.to(dtype))


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA: softmax(q k^T * scale + mask) v with q [..., H, T, D], k / v [..., Hkv, S, D]."""
    if dropout_p:
        raise ValueError("batch-invariant attention has no dropout")
    dtype = _compute_dtype(q, k, v)  # autocast casts SDPA's inputs (QK-norm may leave q, k in fp32)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if k.shape[-3] != q.shape[-3]:  # grouped query heads: query head h reads KV head h // (H / Hkv)
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = matmul(q, k.transpose(-1, -2), torch.float32) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    t, s = q.shape[-2], k.shape[-2]
    if is_causal:
        attn_mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    return matmul(softmax(scores, -1, q.dtype), v)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    if len(normalized_shape) != 1:
        raise ValueError("batch-invariant layer_norm normalizes over the last dim only")
    h = x.float()
    mean = reduce_sum(h, -1, keepdim=True) / h.shape[-1]
    centered = h - mean
    var = reduce_sum(centered * centered, -1, keepdim=True) / h.shape[-1]
    out = (centered * torch.rsqrt(var + eps)).to(x.dtype)
    if weight is not None:
        out = out * weight
    return out if bias is None else out + bias


def conv1d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """Depthwise causal-style conv (groups == channels, stride / dilation 1): the taps summed in order."""
    channels, taps = weight.shape[0], weight.shape[-1]
    if groups != channels or weight.shape[1] != 1 or stride not in (1, (1,)) or dilation not in (1, (1,)):
        raise ValueError("batch-invariant conv1d covers depthwise convs with stride 1 and dilation 1")
    pad = padding[0] if isinstance(padding, (tuple, list)) else padding
    x = F.pad(x, (pad, pad)) if pad else x
    length = x.shape[-1] - taps + 1
    w = weight[:, 0].float()
    out = x[..., 0:length].float() * w[:, 0:1]
    for j in range(1, taps):
        out = out + x[..., j:j + length].float() * w[:, j:j + 1]
    out = out.to(torch.promote_types(x.dtype, weight.dtype))
    return out if bias is None else out + bias[:, None]


def topk(x, k, dim=-1, largest=True, sorted=True):
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    if ord != 2 or dim is None or (isinstance(dim, (tuple, list)) and len(dim) != 1):
        raise ValueError("batch-invariant norm covers the 2-norm over one dim")
    dim = dim[0] if isinstance(dim, (tuple, list)) else dim
    return torch.sqrt(reduce_sum(x * x, dim, keepdim, dtype))


# ------------------------------------------------------------------ dispatch and autograd
class _Exact(torch.autograd.Function):
    """Forward: the fixed-order implementation. Backward: the autograd of the ordinary op,
    recomputed from the saved inputs under the forward's autocast state."""

    @staticmethod
    def forward(ctx, exact, reference, args, kwargs, *tensors):
        ctx.reference, ctx.args, ctx.kwargs = reference, args, kwargs
        device = tensors[0].device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(*tensors)
        return exact(*args, **kwargs)

    @staticmethod
    def backward(ctx, *grads):
        tensors = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        it = iter(tensors)
        args = [next(it) if isinstance(a, torch.Tensor) else a for a in ctx.args]
        device, enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            out = ctx.reference(*args, **ctx.kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        wanted = [t for t in tensors if t.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
        found = iter(found)
        return (None, None, None, None, *[next(found) if t.requires_grad else None for t in tensors])


def _differentiable(exact, reference):
    """`exact` in the forward; through `_Exact` where an input needs a gradient."""
    def call(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return _Exact.apply(exact, reference, args, kwargs, *tensors)
        return exact(*args, **kwargs)
    return call


def _reduction(exact_fn):
    """sum / mean: the fixed order over one float dim; other calls (all dims, ints) unchanged."""
    def impl(original, x, dim=None, keepdim=False, *, dtype=None):
        one = isinstance(dim, int) or (isinstance(dim, (tuple, list)) and len(dim) == 1)
        if not (one and isinstance(x, torch.Tensor) and x.is_floating_point()):
            return original(x, dim, keepdim, dtype=dtype) if dim is not None else original(x, dtype=dtype)
        d = dim if isinstance(dim, int) else dim[0]
        return _differentiable(lambda t: exact_fn(t, d, keepdim, dtype),
                               lambda t: original(t, d, keepdim, dtype=dtype))(x)
    return impl


def _sum(x, dim, keepdim, dtype):
    return reduce_sum(x, dim, keepdim, dtype)


def _mean(x, dim, keepdim, dtype):
    return reduce_sum(x, dim, keepdim, torch.float32).div(x.shape[dim]).to(dtype or x.dtype)


def _softmax_like(exact_fn):
    """torch.softmax(x, dim, dtype), Tensor.softmax(dim, dtype) and F.softmax(x, dim, _stacklevel, dtype)."""
    def impl(original, x, dim=None, *rest, dtype=None, **_):
        dim = -1 if dim is None else dim
        dtype = next((r for r in rest if isinstance(r, torch.dtype)), dtype)
        return _differentiable(lambda t: exact_fn(t, dim, dtype), lambda t: original(t, dim, dtype=dtype))(x)
    return impl


def _wrap(exact):
    """An op whose exact version takes the ordinary op's arguments."""
    def impl(original, *args, **kwargs):
        return _differentiable(exact, original)(*args, **kwargs)
    return impl


def _elementwise(original, x, *args, **kwargs):
    return _differentiable(lambda t, *a: pointwise(original, t, *a, **kwargs),
                           lambda t, *a: original(t, *a, **kwargs))(x, *args)


def _vector_norm(original, x, ord=2, *args, **kwargs):
    if ord in (float("inf"), -float("inf")):  # a max (the FP8 quantizers' amax): exact in any order
        return original(x, ord, *args, **kwargs)
    return _differentiable(vector_norm, original)(x, ord, *args, **kwargs)


def _table() -> dict:
    table = {
        F.linear: _wrap(linear),
        torch.matmul: _wrap(mm),
        torch.Tensor.matmul: _wrap(mm),
        torch.Tensor.__matmul__: _wrap(mm),
        torch.mm: _wrap(mm),
        torch.bmm: _wrap(mm),
        torch.Tensor.bmm: _wrap(mm),
        F.scaled_dot_product_attention: _wrap(attention),
        F.layer_norm: _wrap(layer_norm),
        F.conv1d: _wrap(conv1d),
        torch.topk: lambda original, *a, **k: topk(*a, **k),
        torch.Tensor.topk: lambda original, *a, **k: topk(*a, **k),
        torch.linalg.vector_norm: _vector_norm,
    }
    for fn in (torch.sum, torch.Tensor.sum):
        table[fn] = _reduction(_sum)
    for fn in (torch.mean, torch.Tensor.mean):
        table[fn] = _reduction(_mean)
    for fn in (torch.softmax, torch.Tensor.softmax, F.softmax):
        table[fn] = _softmax_like(softmax)
    for fn in (torch.log_softmax, torch.Tensor.log_softmax, F.log_softmax):
        table[fn] = _softmax_like(log_softmax)
    for name in ("exp", "sigmoid", "log", "log1p", "cos", "sin", "tanh"):
        table[getattr(torch, name)] = _elementwise
        table[getattr(torch.Tensor, name)] = _elementwise
    for fn in (F.silu, F.softplus, torch.sigmoid):
        table[fn] = _elementwise
    return table


_TABLE: dict = {}


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not _TABLE:
            _TABLE.update(_table())
        impl = _TABLE.get(func)
        if impl is None:
            return func(*args, **(kwargs or {}))
        return impl(func, *args, **(kwargs or {}))
