"""Which LoRA adapter each prompt trains (trainer.lora.adapters, trainer.lora.adapter_key; docs/lora.md).

    routing = AdapterRouting(("add", "mul"), "adapter")
    routing.problems(examples, "train.jsonl")    # every record names an adapter of the run, or a line each
    routing.of(example)                          # 1 for a record {"prompt": ..., "adapter": "mul"}

An adapter's number is its place in trainer.lora.adapters: the engine's and the trainer's adapters
are built in that order. Without a key (one named adapter) every prompt is that adapter's.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.data.example import Example

# Records named in one error message; the rest are counted.
SHOWN = 5


@dataclass(frozen=True)
class AdapterRouting:
    names: tuple[str, ...]
    key: str  # the record field whose value names the prompt's adapter ("": every prompt to the one adapter)

    def of(self, example: Example) -> int:
        return self.names.index(example.fields[self.key]) if self.key else 0

    def problems(self, examples: list[Example], where: str) -> list[str]:
        """One line per record of `where` (a prompt file) that names no adapter of the run."""
        if not self.key:
            return []
        bad = []
        for i, example in enumerate(examples, start=1):
            if self.key not in example.fields:
                bad.append(f"{where}, record {i}: no field {self.key!r} (trainer.lora.adapter_key; its fields: "
                           f"{sorted(example.fields)})")
            elif example.fields[self.key] not in self.names:
                bad.append(f"{where}, record {i}: {self.key}={example.fields[self.key]!r} is not one of "
                           f"trainer.lora.adapters={list(self.names)}")
        if len(bad) > SHOWN:
            bad = bad[:SHOWN] + [f"{where}: {len(bad) - SHOWN} more records name no adapter of the run"]
        return bad
