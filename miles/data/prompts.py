"""User prompt data: load (prompt, label) examples from .jsonl or .parquet files.

Every record is validated on load, and errors name the file and the 1-based line (JSONL) or
row (Parquet), so a bad dataset fails before any rollout starts rather than mid-training.
Labels may be numbers (e.g. {"label": 42}); they are converted to str because rewards compare
text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from miles.data.arithmetic import Example


class DataError(ValueError):
    """A prompt file is missing, unreadable or malformed."""


def _to_example(
    record: dict[str, Any], prompt_key: str, label_key: str, where: str
) -> Example:
    for key in (prompt_key, label_key):
        if key not in record:
            raise DataError(f"{where}: missing key {key!r} (keys present: {sorted(record)})")
    prompt, label = record[prompt_key], record[label_key]
    if not isinstance(prompt, str):
        raise DataError(f"{where}: value of {prompt_key!r} is not a string: {prompt!r}")
    # bool is an int subclass, but str(True) == "True" is never a meant label.
    if isinstance(label, (int, float)) and not isinstance(label, bool):
        label = str(label)
    if not isinstance(label, str):
        raise DataError(f"{where}: value of {label_key!r} is not a string or number: {label!r}")
    return Example(prompt=prompt, label=label)


def _load_jsonl(path: Path, prompt_key: str, label_key: str) -> list[Example]:
    examples = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            examples.append(_to_example(record, prompt_key, label_key, where))
    return examples


def _load_parquet(path: Path, prompt_key: str, label_key: str) -> list[Example]:
    columns = pq.read_schema(path).names
    missing = [key for key in (prompt_key, label_key) if key not in columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; available columns: {columns}")
    table = pq.read_table(path, columns=[prompt_key, label_key])
    return [
        _to_example(record, prompt_key, label_key, f"{path}, row {i}")
        for i, record in enumerate(table.to_pylist(), start=1)
    ]


def load_prompt_file(
    path: str | os.PathLike, prompt_key: str = "prompt", label_key: str = "label"
) -> list[Example]:
    """Examples from a .jsonl or .parquet file whose records hold prompt_key and label_key."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        examples = _load_jsonl(path, prompt_key, label_key)
    elif suffix == ".parquet":
        examples = _load_parquet(path, prompt_key, label_key)
    else:
        raise DataError(f"{path}: unsupported prompt file type {suffix!r}; use .jsonl or .parquet")
    if not examples:
        raise DataError(f"{path}: contains no examples")
    return examples
