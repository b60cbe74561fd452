"""miles/config sits below the components it configures: none of its modules imports rollout/, trainer/
or anything above them, lazily either (a rule that needs a component's knowledge lives in that
component and miles/validate.py runs it)."""

import ast
from pathlib import Path

import pytest

CONFIG = Path(__file__).resolve().parents[3] / "miles" / "config"
ABOVE = ("miles.rollout", "miles.trainer", "miles.orchestrate", "miles.hardware", "miles.tracking", "miles.validate")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted(CONFIG.glob("*.py")), ids=lambda p: p.name)
def test_config_imports_nothing_above_itself(path):
    upward = sorted(m for m in imported_modules(path) if m.startswith(ABOVE))
    assert not upward, f"miles/config/{path.name} imports {upward}"
