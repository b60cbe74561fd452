"""docs/configuration.md's config tree is what scripts/config_tree.py prints from conf/ (regenerate:
`python scripts/config_tree.py --write`)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _script():
    spec = importlib.util.spec_from_file_location("config_tree", ROOT / "scripts" / "config_tree.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_tree_matches_conf():
    script = _script()
    block = script.doc_block((ROOT / "docs" / "configuration.md").read_text())
    assert block is not None, "docs/configuration.md lost the tree marker"
    assert block == script.tree(), "stale tree: run `python scripts/config_tree.py --write`"


def test_the_tree_lists_every_option_of_every_group():
    tree = _script().tree()
    for group in ("rollout", "trainer"):
        for option in sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml")):
            assert option in tree
    assert "native*, sglang, vllm" in tree and "fsdp, megatron, torch*" in tree
