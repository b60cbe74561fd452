"""Backends are chosen by registries keyed by their Enum names (miles/rollout/engines.py,
miles/trainer/backends.py), not by `if`s in the orchestration: every name has exactly one entry, each
entry builds that backend's class, and miles/orchestrate/run.py names no backend."""

import ast
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from miles.config.schema import EngineName, TrainerBackend
from miles.rollout.engines import ENGINES, engine_backend, engine_class
from miles.rollout.protocol import check_engine
from miles.trainer.backends import STARTERS, TrainerStart, start_trainer
from miles.trainer.protocol import check_trainer

ORCHESTRATE = Path(__file__).resolve().parents[3] / "miles" / "orchestrate"
ENGINE_CLASSES = {EngineName.native: "NativeEngine", EngineName.vllm: "VLLMEngine", EngineName.sglang: "SGLangEngine"}
ONE_PROCESS_TRAINERS = {TrainerBackend.torch: "TorchTrainer", TrainerBackend.megatron: "MegatronTrainer"}
# The modules that define a backend: an orchestration module that imports one chose a backend itself.
BACKEND_MODULES = {"miles.rollout.native", "miles.rollout.vllm_engine", "miles.rollout.sglang_engine",
                   "miles.trainer.torch_trainer", "miles.trainer.fsdp", "miles.trainer.fsdp_group",
                   "miles.trainer.megatron.trainer"}


def test_every_engine_name_has_one_entry():
    assert list(ENGINES) == list(EngineName)


@pytest.mark.parametrize("name", list(EngineName))
def test_each_entry_builds_its_engine_class(name):
    cls = engine_class(name)
    assert cls.__name__ == ENGINE_CLASSES[name]
    check_engine(cls)


@pytest.mark.parametrize("engine", list(EngineName))
def test_an_engine_gets_the_options_its_group_adds(compose, engine):
    rollout = compose([f"rollout={engine.value}"]).rollout
    cls, options = engine_backend(rollout)
    assert cls.__name__ == ENGINE_CLASSES[engine]
    assert options == ({} if engine == EngineName.native else asdict(getattr(rollout, engine.value)))


def test_every_trainer_backend_has_one_starter():
    assert list(STARTERS) == list(TrainerBackend)


@pytest.mark.parametrize("backend", list(ONE_PROCESS_TRAINERS))
def test_a_one_process_backend_spawns_its_class(backend):
    spawned = []
    handle = start_trainer(backend, TrainerStart(("ckpt",), {"seed": 0}, num_ranks=1,
                                                 spawn=lambda cls: spawned.append(cls) or "handle"))
    assert handle == "handle" and [cls.__name__ for cls in spawned] == [ONE_PROCESS_TRAINERS[backend]]
    check_trainer(spawned[0])


def test_fsdp_starts_its_own_group_of_ranks(monkeypatch):
    import miles.trainer.fsdp_group as fsdp_group

    class Group:
        def __init__(self, num_ranks, *args, **kwargs):
            self.started = (num_ranks, args, kwargs)

    monkeypatch.setattr(fsdp_group, "FSDPGroup", Group)
    start = TrainerStart(("ckpt", "algo"), {"seed": 3}, num_ranks=2, spawn=lambda cls: pytest.fail("spawned"))
    group = start_trainer(TrainerBackend.fsdp, start)
    assert isinstance(group, Group) and group.started == (2, ("ckpt", "algo"), {"seed": 3})


def test_choosing_imports_no_backend_until_built():
    """vLLM, SGLang and Megatron-core are optional: validating a run and importing the orchestration
    import no backend's module (in a fresh interpreter: this one has imported them all)."""
    probe = ("import sys, miles.validate, miles.orchestrate.run; "
             f"print(sorted({BACKEND_MODULES!r} & set(sys.modules)))")
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"


def _modules(node) -> list[str]:
    return [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]


def _code_text(path: Path) -> str:
    """The identifiers and string constants of a module, its docstrings and comments left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(n) is not None}
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.append(node.value)
        elif isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            words += _modules(node) + [a.name for a in node.names]
    return "\n".join(words)


def test_run_names_no_backend():
    code = _code_text(ORCHESTRATE / "run.py")
    assert not re.search("vllm|sglang|fsdp|megatron", code, re.IGNORECASE)
    # native and torch, the in-house pair: their classes, modules and Enum members (torch is also the library)
    assert not re.search(r"NativeEngine|TorchTrainer|rollout\.native|torch_trainer", code)
    assert not re.search(r"^(native|torch)$|=(native|torch)\b", code, re.MULTILINE)  # "torch", EngineName.native


# The warm start (checkpoints.py) is the in-house fp32 SFT whatever the run's backends: it builds the
# reference engine and trainer (native, torch) by design, like the tests' reference side.
@pytest.mark.parametrize("path", [p for p in sorted(ORCHESTRATE.glob("*.py")) if p.name != "checkpoints.py"],
                         ids=lambda p: p.name)
def test_orchestration_imports_no_backend_module(path):
    imported = [m for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))
                for m in _modules(n)]
    assert not BACKEND_MODULES & set(imported)
