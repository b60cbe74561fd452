"""Whether batch-invariant numerics are on (true on-policy mode), as one flag both floors read.

miles/models/invariant.py turns it on around the model calls (`kernels()`); the quantized GEMMs here
read it to pick row-count invariant kernels. It lives in miles.precision because precision never
imports miles.models (GPU nodes run it alone)."""

from __future__ import annotations

import contextlib

_depth = 0


def active() -> bool:
    return _depth > 0


@contextlib.contextmanager
def on():
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
