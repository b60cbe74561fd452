"""Final answers out of worked solutions: GSM8K's "#### 42" and MATH's last \\boxed{...}.

Used on dataset labels (`task.label_extractor`) and on model responses (the math and format
rewards), so both sides are cut the same way.

    extract_gsm8k("3 + 4 = 7\\n#### 7")                 -> "7"
    extract_boxed("so the answer is $\\boxed{\\frac{1}{2}}$") -> "\\frac{1}{2}"
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_gsm8k(text: str) -> str | None:
    """The text after the last "####", stripped, with thousands separators removed (None if absent)."""
    head, sep, tail = text.rpartition("####")
    if not sep:
        return None
    answer = tail.strip().split("\n")[0].strip()
    answer = re.sub(r"(?<=\d),(?=\d{3}\b)", "", answer)
    return answer or None


def extract_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} (or \\fbox{...}), braces balanced (None if absent)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start : i - 1].strip()
    return None


EXTRACTORS = {"plain": lambda text: text.strip() or None, "gsm8k": extract_gsm8k, "boxed": extract_boxed}
