"""The checksum both sides of a weight sync compute, the engine's dtypes, and the error of a mismatch.

The checksum is a SHA-256 over parameter names, dtypes, shapes and raw bytes, so "equal checksum"
means bitwise-equal weights in the engine's dtype. Through Ray the payload travels as those raw
bytes plus dtype and shape (miles/transport/ray_tensors.py), so the trainer's checksum of what it
sent and the engine's of what it loaded hash the same bytes. Device-side integrity checks of
in-process syncs (no host round trip) are miles/transport/flat.py's.

Keyed by the DType names as strings ("fp32", "bf16"): `miles.config.schema.DType` is a str Enum, so
its members look these up as they are, and the lowest floor of the house needs no config import.
"""

from __future__ import annotations

import hashlib

import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def to_dtype(state_dict: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """Host copies of the tensors in the rollout dtype `dtype` (a DType or its name)."""
    target = TORCH_DTYPES[dtype]
    return {k: v.detach().to("cpu", target).contiguous() for k, v in state_dict.items()}


def checksum(state_dict: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    hash_tensors(h, state_dict)
    return h.hexdigest()


def hash_tensors(h, tensors: dict[str, torch.Tensor]) -> None:
    """Feed `checksum`'s bytes of these tensors into `h` (names sorted): a sender that hashes its
    buckets one by one, in name order, ends with the checksum of the whole state dict."""
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        # The numpy view itself (buffer protocol): the same bytes hashed, without the bytes copy that
        # .tobytes() made of every tensor (2.4 MB per side of a Ray sync of the default model).
        h.update(t.reshape(-1).view(torch.uint8).numpy())


class WeightSyncError(RuntimeError):
    """The engine's weights differ from what the trainer sent."""
