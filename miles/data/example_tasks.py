"""The data of the shipped CPU example tasks (conf/experiment/gsm8k_cpu.yaml, tool_calc_cpu.yaml, and
the two-adapter LoRA run of docs/lora.md).

Both are seeded and small enough for a tiny model on a laptop CPU, in the formats real datasets
use, so the same config keys carry over to GSM8K or a tool-use dataset:

- `gsm8k`: word problems with two-digit addition / subtraction, GSM8K records (`question`, and
  `answer` = a worked solution ending in "#### <number>"); train and test share no problem.
- `tool_calc`: "What is 123*45?" (too hard for a tiny model to compute, one calculator call
  away): `messages` records whose reference reply (for the SFT warm start) calls the calculator in
  a quarter of them and answers from memory in the rest, so RL has a tool-call rate to raise.
- `two_tasks`: two arithmetic tasks in one file, "12+34=" and "7*12=", each record naming its task in
  an `adapter` field ("add" / "mul"): one LoRA adapter per task (trainer.lora.adapters=[add,mul],
  trainer.lora.adapter_key=adapter).

    python -m miles.data.example_tasks examples/data     # rewrites the shipped files
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay")
ITEMS = ("pens", "cups", "books", "coins")
PROBLEMS = (  # (question, the operation it asks for)
    ("{name} has {a} {item} and gets {b} more. How many {item} now?", "+"),
    ("{name} had {a} {item} and gave away {b}. How many {item} are left?", "-"),
    ("One box has {a} {item}, another has {b}. How many {item} in all?", "+"),
)
TOOL_SHARE = 0.25  # reference replies of tool_calc that call the calculator


def gsm8k_records(seed: int = 0, train: int = 2000, test: int = 200) -> tuple[list[dict], list[dict]]:
    """(train, test) GSM8K-format records; test problems (operands and operation) never in train."""
    rng = np.random.default_rng(seed)
    seen: set[tuple] = set()
    splits = []
    for size in (test, train):
        records = []
        while len(records) < size:
            a, b = (int(x) for x in rng.integers(10, 100, 2))
            question, op = PROBLEMS[int(rng.integers(len(PROBLEMS)))]
            if op == "-" and a < b:
                a, b = b, a
            if (a, op, b) in seen:
                continue
            seen.add((a, op, b))
            c = a + b if op == "+" else a - b
            name, item = NAMES[int(rng.integers(len(NAMES)))], ITEMS[int(rng.integers(len(ITEMS)))]
            records.append({"question": question.format(name=name, item=item, a=a, b=b),
                            "answer": f"{a} {op} {b} = {c}\n#### {c}"})
        splits.append(records)
    test_records, train_records = splits
    return train_records, test_records


def tool_calc_records(seed: int = 0, train: int = 1000, test: int = 100) -> tuple[list[dict], list[dict]]:
    """(train, test) messages records; train ones carry a reference reply, test ones the question only."""
    rng = np.random.default_rng(seed)
    seen: set[tuple] = set()
    splits = []
    for size, with_reply in ((test, False), (train, True)):
        records = []
        while len(records) < size:
            a, b = int(rng.integers(100, 1000)), int(rng.integers(10, 100))
            if (a, b) in seen:
                continue
            seen.add((a, b))
            expression, value = f"{a}*{b}", str(a * b)
            messages = [{"role": "user", "content": f"What is {expression}?"}]
            if with_reply and rng.random() < TOOL_SHARE:
                arguments = json.dumps({"expression": expression})
                messages += [{"role": "assistant", "content": "", "tool_calls": [
                                 {"type": "function", "function": {"name": "calculator", "arguments": arguments}}]},
                             {"role": "tool", "content": value}, {"role": "assistant", "content": value}]
            elif with_reply:
                messages.append({"role": "assistant", "content": value})
            records.append({"messages": messages, "label": value})
        splits.append(records)
    test_records, train_records = splits
    return train_records, test_records


def two_tasks_records(seed: int = 0, train: int = 1000, test: int = 100) -> tuple[list[dict], list[dict]]:
    """(train, test) prompt / label records, half addition of two-digit numbers ("add"), half a digit
    times a two-digit number ("mul"), alternating; test problems never in train."""
    rng = np.random.default_rng(seed)
    seen: set[tuple] = set()
    splits = []
    for size in (test, train):
        records = []
        while len(records) < size:
            adapter = ("add", "mul")[len(records) % 2]
            a = int(rng.integers(10, 100)) if adapter == "add" else int(rng.integers(2, 10))
            b = int(rng.integers(10, 100))
            if (adapter, a, b) in seen:
                continue
            seen.add((adapter, a, b))
            op, value = ("+", a + b) if adapter == "add" else ("*", a * b)
            records.append({"prompt": f"{a}{op}{b}=", "label": str(value), "adapter": adapter})
        splits.append(records)
    test_records, train_records = splits
    return train_records, test_records


def write_jsonl(records: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_parquet(records: list[dict], path: Path) -> None:
    # Messages as a JSON-free list-of-struct column; tool-call arguments stay a JSON string (as
    # OpenAI-format datasets store them) so every struct has the same fields.
    pq.write_table(pa.Table.from_pylist(records), path, compression="zstd")


def write_all(out: Path) -> list[Path]:
    """Writes the example files under `out`; returns their paths."""
    (out / "gsm8k_cpu").mkdir(parents=True, exist_ok=True)
    (out / "tool_calc").mkdir(parents=True, exist_ok=True)
    (out / "two_tasks").mkdir(parents=True, exist_ok=True)
    gsm_train, gsm_test = gsm8k_records()
    tool_train, tool_test = tool_calc_records()
    two_train, two_test = two_tasks_records()
    files = [(write_parquet, gsm_train, out / "gsm8k_cpu" / "train.parquet"),
             (write_jsonl, gsm_test, out / "gsm8k_cpu" / "test.jsonl"),
             (write_parquet, tool_train, out / "tool_calc" / "train.parquet"),
             (write_jsonl, tool_test, out / "tool_calc" / "test.jsonl"),
             (write_jsonl, two_train, out / "two_tasks" / "train.jsonl"),
             (write_jsonl, two_test, out / "two_tasks" / "test.jsonl")]
    for write, records, path in files:
        write(records, path)
    return [path for _, _, path in files]


if __name__ == "__main__":
    for path in write_all(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/data")):
        print(f"{path}: {path.stat().st_size / 1024:.1f} KB")
