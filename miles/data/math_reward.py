"""The `math` and `format` rewards: final answers checked by math-verify, and their presence.

    math_reward("... so \\boxed{\\frac{1}{2}}", "0.5")  -> 1.0   (equal as math, not as text)
    format_reward("... #### 42", "")                    -> 1.0   (an answer in the expected form)
"""

from __future__ import annotations

import threading

from miles.data.answers import extract_boxed, extract_gsm8k

_PARSE_TIMEOUT_S = 5  # math-verify's own limits on one parse / one comparison (sympy can hang)


def math_reward(response: str, label: str, **info) -> float:
    """1.0 when the response's final answer equals the label as math (math-verify), else 0.0.

    The response's last \\boxed{...} is its answer; without one, math-verify takes the last
    answer it finds. The label is an answer ("42", "\\frac{1}{2}", "x^2+1"), read as LaTeX.
    """
    from math_verify import parse, verify  # imported on first use: it loads sympy (~0.4 s)

    # math-verify times itself out with SIGALRM, which only the main thread may use; elsewhere
    # (a worker thread) it runs without, and the caller's timeout is the bound.
    timeout = _PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    boxed = extract_boxed(response)
    target = parse(response if boxed is None else f"${boxed}$", parsing_timeout=timeout)
    # A bare label is wrapped in $...$ so LaTeX without delimiters (x^2+1, \sqrt{2}) is parsed.
    gold = parse(label if "$" in label else f"${label}$", parsing_timeout=timeout) or parse(
        label, parsing_timeout=timeout)
    return 1.0 if verify(gold, target, timeout_seconds=timeout) else 0.0


def format_reward(response: str, label: str, **info) -> float:
    """1.0 when the response carries a final answer in the expected form (\\boxed{...} or "#### ..."), else 0.0."""
    return 1.0 if extract_boxed(response) is not None or extract_gsm8k(response) is not None else 0.0
