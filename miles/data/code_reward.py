"""The `code` reward: the response's program, with the label's tests appended, run in the sandbox.

    label = "assert add(2, 3) == 5"
    code_reward("```python\\ndef add(a, b):\\n    return a + b\\n```", label, limits=task.sandbox) -> 1.0
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from miles.data.sandbox import run_python

if TYPE_CHECKING:
    from miles.config.schema import SandboxCfg

_FENCED = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last ```python fenced block, else the whole response (a model that answers in bare code)."""
    blocks = _FENCED.findall(response)
    return blocks[-1] if blocks else response


def code_reward(response: str, label: str, *, limits: SandboxCfg, **info) -> float:
    """1.0 when the code plus the label's test code exits 0 within the sandbox limits, else 0.0."""
    return 1.0 if run_python(f"{extract_code(response)}\n\n{label}\n", limits).ok else 0.0
