"""User prompt data: load (prompt, label) examples from .jsonl or .parquet files.

Every record is validated on load, and errors name the file and the 1-based line (JSONL) or
row (Parquet), so a bad dataset fails before any rollout starts rather than mid-training.

The prompt field holds either text or a conversation: a list of {"role", "content"} dicts
(extra keys such as "name" or "tool_calls" are kept). A conversation's last user turn becomes
`Example.prompt`, for logs. The label field is text, a number (converted to str, because rewards
compare text) or a list of strings (joined by newlines, e.g. the test cases of a code task); a
`label_extractor` other than "plain" cuts the final answer out of it (GSM8K's "#### 42", MATH's
last \\boxed{...}). The record's other fields become `Example.fields`, the reward's keyword info.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from miles.data.answers import EXTRACTORS
from miles.data.example import Example

_PREVIEW_CHARS = 80


class DataError(ValueError):
    """A prompt file is missing, unreadable or malformed."""


def _preview(text: str) -> str:
    return repr(text if len(text) <= _PREVIEW_CHARS else text[:_PREVIEW_CHARS] + "...")


def _messages(value: list, key: str, where: str) -> tuple[dict, ...]:
    """The validated conversation held by field `key`."""
    if not value:
        raise DataError(f"{where}: {key!r} is an empty messages list")
    for i, message in enumerate(value, start=1):
        if not isinstance(message, dict):
            raise DataError(f"{where}: {key!r} message {i} is not an object: {message!r}")
        for part in ("role", "content"):
            if not isinstance(message.get(part), str):
                # Tool-calling assistant turns often carry content null; templates want a string.
                hint = ' (use "" for an empty turn)' if part == "content" else ""
                raise DataError(
                    f"{where}: {key!r} message {i} has no string {part!r}{hint}: {message!r}"
                )
    if not any(message["role"] == "user" for message in value):
        roles = [message["role"] for message in value]
        raise DataError(f"{where}: {key!r} has no 'user' message (roles: {roles})")
    return tuple(value)


def _prompt(value: Any, key: str, where: str) -> tuple[str, tuple[dict, ...] | None]:
    """(prompt text, messages or None) of the prompt field."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, list):
        messages = _messages(value, key, where)
        last_user = next(m for m in reversed(messages) if m["role"] == "user")
        return last_user["content"], messages
    raise DataError(f"{where}: value of {key!r} is not a string or a messages list: {value!r}")


def _label_text(value: Any, key: str, where: str) -> str:
    # bool is an int subclass, but str(True) == "True" is never a meant label.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return "\n".join(value)
    if not isinstance(value, str):
        raise DataError(
            f"{where}: value of {key!r} is not a string, number or list of strings: {value!r}"
        )
    return value


def _to_example(
    record: dict[str, Any], prompt_key: str, label_key: str, extractor: str, where: str
) -> Example:
    for key in (prompt_key, label_key):
        if key not in record:
            raise DataError(f"{where}: missing key {key!r} (keys present: {sorted(record)})")
    prompt, messages = _prompt(record[prompt_key], prompt_key, where)
    raw = _label_text(record[label_key], label_key, where)
    fields = {k: v for k, v in record.items() if k not in (prompt_key, label_key)}
    label = raw
    # "plain" keeps the label as written: no stripping, empty labels allowed.
    if extractor != "plain":
        label = EXTRACTORS[extractor](raw)
        if label is None:
            raise DataError(
                f"{where}: label_extractor {extractor!r} found no answer in {label_key!r}: {_preview(raw)}"
            )
        if label != raw:  # the worked solution stays available to the reward
            fields[label_key] = raw
    return Example(prompt=prompt, label=label, messages=messages, fields=fields)


def jsonl_records(path: Path):
    """(where, record) for each non-blank line of a JSONL file, `where` = "<path>, line <n>" for
    error messages; DataError for a line that is not a JSON object."""
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
            yield where, record


def _load_jsonl(path: Path, prompt_key: str, label_key: str, extractor: str) -> list[Example]:
    return [_to_example(record, prompt_key, label_key, extractor, where) for where, record in jsonl_records(path)]


_JSON_SCALARS = (
    pa.types.is_null, pa.types.is_boolean, pa.types.is_integer,
    pa.types.is_floating, pa.types.is_string, pa.types.is_large_string,
)


def _is_json_type(t: pa.DataType) -> bool:
    """Whether to_pylist gives JSON-serializable values for type t (not bytes, dates, decimals)."""
    if pa.types.is_dictionary(t):
        return _is_json_type(t.value_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _is_json_type(t.value_type)
    if pa.types.is_struct(t):
        return all(_is_json_type(t.field(i).type) for i in range(t.num_fields))
    return any(is_scalar(t) for is_scalar in _JSON_SCALARS)


def _without_struct_nulls(messages: Any) -> Any:
    """A list<struct> column gives every message every struct key, None where a message lacks
    it (e.g. "tool_calls" on user turns); drop those so a message reads as it would in JSONL."""
    if not isinstance(messages, list):
        return messages
    return [
        {k: v for k, v in m.items() if v is not None or k in ("role", "content")}
        if isinstance(m, dict) else m
        for m in messages
    ]


def _load_parquet(path: Path, prompt_key: str, label_key: str, extractor: str) -> list[Example]:
    schema = pq.read_schema(path)
    missing = [key for key in (prompt_key, label_key) if key not in schema.names]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; available columns: {schema.names}")
    # Other columns reach the reward as info (possibly as JSON, for a remote reward).
    for column in schema:
        if column.name not in (prompt_key, label_key) and not _is_json_type(column.type):
            raise DataError(
                f"{path}: column {column.name!r} has type {column.type}, which is not "
                "JSON-serializable; drop it from the file or cast it to string"
            )
    examples = []
    for i, record in enumerate(pq.read_table(path).to_pylist(), start=1):
        record[prompt_key] = _without_struct_nulls(record[prompt_key])
        examples.append(_to_example(record, prompt_key, label_key, extractor, f"{path}, row {i}"))
    return examples


def load_prompt_file(
    path: str | os.PathLike,
    prompt_key: str = "prompt",
    label_key: str = "label",
    label_extractor: str = "plain",
) -> list[Example]:
    """Examples from a .jsonl or .parquet file whose records hold prompt_key and label_key."""
    if label_extractor not in EXTRACTORS:
        raise ValueError(f"unknown label_extractor {label_extractor!r}; valid: {sorted(EXTRACTORS)}")
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        examples = _load_jsonl(path, prompt_key, label_key, label_extractor)
    elif suffix == ".parquet":
        examples = _load_parquet(path, prompt_key, label_key, label_extractor)
    else:
        raise DataError(f"{path}: unsupported prompt file type {suffix!r}; use .jsonl or .parquet")
    if not examples:
        raise DataError(f"{path}: contains no examples")
    return examples
