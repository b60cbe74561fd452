"""Tensors through Ray's object store, every dtype: raw bytes plus dtype / shape, no torch pickle.

Why: Ray serializes task arguments and return values with cloudpickle (protocol 5), and a
torch.Tensor pickles through `Tensor.__reduce_ex__`. For the dtypes that have no typed storage
class (`torch.storage._new_dtypes()`: float8_e4m3fn / e5m2 / ..., uint16-64, complex32, bits*),
torch reduces the tensor to `_rebuild_tensor_v3` over an `UntypedStorage`, and
`UntypedStorage.__reduce__` is `torch.save(self, legacy format)` -> `_load_from_bytes`. The
legacy writer records the storage type as `UntypedStorage`; the legacy reader
(torch/serialization.py, `_legacy_load.persistent_load`) then does `dtype = storage_type.dtype`,
which only the typed storage classes have:

    AttributeError: type object 'torch.storage.UntypedStorage' has no attribute 'dtype'

raised in the process that *loads* (the engine actor, deserializing update_weights' argument),
never in the trainer that pickled it. Plain `pickle.loads(pickle.dumps(fp8_tensor))` fails the
same way (torch 2.13); torch.save's zip format (checkpoints) is not affected. bf16, fp32 and
uint8 (packed INT4) have typed storages and survived, but through two extra host copies
(torch.save into a BytesIO, then bytes into the object store).

The fix: `register()` (called in the driver and in every actor `spawn` starts) installs a
cloudpickle reducer for torch.Tensor in that process. A plain strided tensor travels as a uint8
numpy view of its bytes (pickle 5 out-of-band: no copy in the sender; Ray copies it once into the
object store) plus its dtype name, shape and device; `restore` reinterprets the bytes on the
other side, so the result is bit-identical and a checksum over the bytes (checksum.checksum,
rollout_checksum) is the same on both sides. The bytes Ray hands over are a read-only view of
the shared object store: `restore` copies them once into a private, writable tensor (the engine
keeps and later overwrites what it receives in place; a view would also pin the object).
Anything else (tensors that require grad, sparse / quantized / meta tensors) keeps torch's own
reduction.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def encodable(tensor: torch.Tensor) -> bool:
    """True: `tensor` travels as raw bytes (a plain dense tensor that needs no autograd state)."""
    return (tensor.layout == torch.strided and not tensor.is_quantized and not tensor.requires_grad
            and tensor.device.type != "meta")


def encode(tensor: torch.Tensor) -> tuple[np.ndarray, str, tuple[int, ...], str]:
    """(uint8 view of the bytes, dtype name, shape, device): no copy for a contiguous CPU tensor."""
    host = tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    return host.reshape(-1).view(torch.uint8).numpy(), str(tensor.dtype).removeprefix("torch."), \
        tuple(tensor.shape), str(tensor.device)


def restore(data: np.ndarray, dtype: str, shape: tuple[int, ...], device: str) -> torch.Tensor:
    """The tensor `encode` described, in memory of its own (writable, not a view of the store)."""
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise TypeError(f"a tensor of unknown dtype {dtype!r} arrived through Ray (torch {torch.__version__})")
    raw = torch.from_numpy(data if data.flags.writeable else data.copy())
    # numpy may give a 0- or 1-byte array stride 0; view(dtype) needs a unit stride.
    tensor = raw.as_strided((raw.numel(),), (1,)).view(torch_dtype).reshape(shape)
    return tensor if device == "cpu" else tensor.to(device)


def reduce_tensor(tensor: torch.Tensor):
    """cloudpickle reducer of torch.Tensor (exact type: nn.Parameter reduces to its .data tensor)."""
    if not encodable(tensor):
        return tensor.__reduce_ex__(5)
    return restore, encode(tensor)


def register() -> None:
    """Make this process's Ray serialization send tensors through `reduce_tensor` (idempotent).
    Only senders need it: what it pickles names `restore`, which any process imports."""
    import ray.cloudpickle

    # What ray.util.register_serializer does underneath (a process-wide cloudpickle dispatch entry),
    # without its single-argument deserializer and without requiring a connected worker.
    ray.cloudpickle.CloudPickler.dispatch[torch.Tensor] = reduce_tensor


def with_tensor_transport(cls: type) -> type:
    """`cls` whose instances, built in a Ray worker, first install this module's reducer in
    that process: what the actor returns or sends (FP8 / INT4 sync payloads, any tensor) then
    crosses the object store as raw bytes + dtype, which torch's own pickle cannot do for float8.
    Same name, so the actor's process title stays ray::<cls>."""
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        register()
        cls.__init__(self, *args, **kwargs)

    return type(cls)(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                            "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
