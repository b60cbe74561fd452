"""Print the config tree of conf/ (and sweeps/): each group, what it picks, its options (* marks the
default of the defaults list). docs/configuration.md holds this output; tests/unit/config/
test_config_tree.py checks that it matches.

    python scripts/config_tree.py            # print the tree
    python scripts/config_tree.py --write    # rewrite the block in docs/configuration.md
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
MARKER = "<!-- the tree below is `python scripts/config_tree.py` (checked by tests/unit/config/test_config_tree.py) -->"
WIDTH, INDENT = 104, 23

# Groups outside the defaults list: applied with a `+` (they add to the run rather than replace a default).
EXTRA = {"experiment": "presets, applied with +experiment=<name> (docs/experiments.md)"}
SWEEPS = "multirun definitions, -m +sweep=<name>: grid and Optuna TPE (on Hydra's search path)"


def _defaults(config: Path) -> list[tuple[str, str, str]]:
    """(group, default option, comment) of each `- group: option  # comment` line of the defaults list."""
    out = []
    for line in config.read_text().splitlines():
        m = re.match(r"\s*-\s*(\w+):\s*(\w+)\s*#\s*(.*)", line)
        if m:
            out.append((m[1], m[2], re.sub(r"\s*\(conf/\w+/\)$", "", m[3])))
    return out


def _run_keys(config: Path) -> list[str]:
    """The root config's own keys (not the defaults list, not hydra)."""
    keys = [m[1] for line in config.read_text().splitlines() if (m := re.match(r"^(\w+):", line))]
    return [k for k in keys if k not in ("defaults", "hydra")]


def _entry(name: str, about: str, options: list[str], margin: int = 2) -> list[str]:
    lines = [f"{' ' * margin}{name:<{INDENT - margin}}{about}"]
    if options:
        lines += textwrap.wrap(", ".join(options), WIDTH, initial_indent=" " * INDENT,
                               subsequent_indent=" " * INDENT, break_on_hyphens=False)
    return lines


def tree(root: Path = ROOT) -> str:
    conf = root / "conf"
    config = conf / "config.yaml"
    about = "the defaults list (one option per group; * below) and the run-level keys:"
    lines = ["conf/", *_entry("config.yaml", about, _run_keys(config))]
    for group, default, about in _defaults(config):
        options = sorted(p.stem for p in (conf / group).glob("*.yaml"))
        lines += _entry(f"{group}/", about, [o + "*" if o == default else o for o in options])
    for group, about in EXTRA.items():
        lines += _entry(f"{group}/", about, sorted(p.stem for p in (conf / group).glob("*.yaml")))
    sweeps = sorted(p.stem for p in (root / "sweeps" / "sweep").glob("*.yaml"))
    lines += _entry("sweeps/sweep/", SWEEPS, sweeps, margin=0)
    return "\n".join(lines) + "\n"


BLOCK = re.compile(re.escape(MARKER) + r"\n```\n(.*?)```\n", re.S)


def doc_block(text: str) -> str | None:
    """The fenced block right after MARKER in docs/configuration.md (None: no marker there)."""
    m = BLOCK.search(text)
    return m[1] if m else None


def main() -> None:
    out = tree()
    if "--write" in sys.argv:
        text = DOC.read_text()
        if doc_block(text) is None:
            raise SystemExit(f"{DOC}: no tree block after the marker line {MARKER}")
        DOC.write_text(BLOCK.sub(lambda m: f"{MARKER}\n```\n{out}```\n", text, count=1))
    else:
        print(out, end="")


if __name__ == "__main__":
    main()
