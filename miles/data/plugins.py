"""User functions named in the config by dotted path (`task.reward`, `task.tools`)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable


def import_dotted(spec: str, key: str) -> Callable:
    """`pkg.module.fn` -> the function, importable from the Python path or the working directory
    (a user's module beside the data, run from its folder); `key` names the config key in errors."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    module, _, name = spec.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"{key}={spec}: cannot import it ({error})") from None
    if not callable(fn):
        raise ValueError(f"{key}={spec}: {type(fn).__name__} is not a function")
    return fn
