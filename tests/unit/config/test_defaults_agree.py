"""The defaults are written twice: in the schema (miles/config/schema.py, what a component built in
code gets) and, with a comment each, in the YAML files (what a run gets). Every value of the default
files equals the schema's default, and a backend's group file sets nothing but its backend's name,
its own options and the few defaults it changes on purpose (listed here)."""

import dataclasses
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from miles.config.schema import RunCfg

CONF = Path(__file__).resolve().parents[3] / "conf"
# The files a default run composes (config.yaml's defaults list), bar the model and hardware
# profiles (their values are the model's and the machine's, not defaults).
DEFAULT_FILES = {"config.yaml": None, "rollout/native.yaml": "rollout", "trainer/torch.yaml": "trainer",
                 "tracking/mlflow.yaml": "tracking", "algo/grpo.yaml": "algo", "precision/fp32.yaml": "precision",
                 "task/arithmetic.yaml": "task"}
# Values the YAML writes differently on purpose: an interpolation, names the schema leaves MISSING.
ALLOWED = {"warm_start.cache_dir": "${oc.env:MILES_CACHE_DIR,.cache/miles}"}
# What each backend's group file may set besides its own options block (rollout.vllm.*, ...).
BACKEND_FILES = {
    "rollout/vllm.yaml": ("rollout", {"engine": "vllm"}),
    "rollout/sglang.yaml": ("rollout", {"engine": "sglang"}),
    "trainer/fsdp.yaml": ("trainer", {"backend": "fsdp", "num_ranks": 2}),
    "trainer/megatron.yaml": ("trainer", {"backend": "megatron", "pack_sequences": False}),
}


def _node(hint):
    """The dataclass behind a field's type (Optional[VLLMCfg] -> VLLMCfg), or None."""
    if typing.get_origin(hint) is typing.Union:
        hint = next((a for a in typing.get_args(hint) if a is not type(None)), None)
    return hint if dataclasses.is_dataclass(hint) else None


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "<no default>"
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return value.value if hasattr(value, "value") else value


def _differences(cls, raw: dict, prefix: str) -> tuple[int, list[str]]:
    """(values equal to the schema's default, 'key: yaml vs schema' for each that is not)."""
    hints, fields = typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}
    same, out = 0, []
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key == "defaults" or full == "hydra":
            continue
        assert key in fields, f"{full} is in the YAML, not in the schema"
        if (node := _node(hints[key])) is not None and isinstance(value, dict):
            s, o = _differences(node, value, full + ".")
            same, out = same + s, out + o
        elif ALLOWED.get(full, object()) == value or (key == "name" and _default(fields[key]) == "???"):
            continue
        elif value == _default(fields[key]):
            same += 1
        else:
            out.append(f"{full}: YAML {value!r} vs schema {_default(fields[key])!r}")
    return same, out


def _raw(path: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / path))


def test_the_default_files_agree_with_the_schema():
    hints, total, problems = typing.get_type_hints(RunCfg), 0, []
    for path, section in DEFAULT_FILES.items():
        cls = RunCfg if section is None else _node(hints[section])
        same, differ = _differences(cls, _raw(path), "" if section is None else f"{section}.")
        total, problems = total + same, problems + [f"{path}: {d}" for d in differ]
    assert problems == []
    assert total > 120  # every key of the default files is compared (130 today)


@pytest.mark.parametrize("path", sorted(BACKEND_FILES))
def test_a_backend_file_sets_its_name_and_its_own_options_only(path):
    section, allowed = BACKEND_FILES[path]
    raw = {k: v for k, v in _raw(path).items() if k != "defaults"}
    name = allowed.get("engine", allowed.get("backend"))
    own = raw.pop(name, None)  # rollout/vllm.yaml: the vllm block
    assert raw == allowed
    if own is not None:  # its options agree with the schema's defaults of that block
        cls = _node(typing.get_type_hints(_node(typing.get_type_hints(RunCfg)[section]))[name])
        assert _differences(cls, own, f"{section}.{name}.")[1] == []


def test_the_base_rollout_file_holds_no_backend_options():
    raw = _raw("rollout/native.yaml")
    assert "vllm" not in raw and "sglang" not in raw
