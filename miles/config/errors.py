"""User mistakes: the exceptions that carry them, and one short message for each; launch.py prints it
and exits with code 2.

`user_error_message(ex)` returns None for anything that is not a user mistake, so real bugs keep
their traceback. Covered: an unknown group option, an unknown key, a value of the wrong type or
outside an enum, bad override syntax, `validate()` problems, malformed data files, an output
directory Hydra cannot create, and the old forms of renamed keys (`old_form_problems`).

The lowest module of miles.config: it imports neither validate nor Hydra at import time, so any
component can raise ConfigError (GPU machines may lack Hydra).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import traceback
import typing


class ConfigError(ValueError):
    """A user mistake in the config: launch.py prints it without a traceback and exits 2."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(f"  - {p}" for p in problems))


# Keys of an older config tree -> (why, the new form of `key=value`). A backend is chosen one way,
# by its group (rollout=vllm, trainer=fsdp), and one quantity has one key.
OLD_KEYS = {
    "rollout.engine": ("the engine is chosen by its group, whose file adds the engine's options",
                       lambda v: f"rollout={v}"),
    "trainer.backend": ("the trainer backend is chosen by its group, whose file adds the backend's options",
                        lambda v: f"trainer={v}"),
    "debug.check_weight_sync": ("renamed; rollout.check_weight_sync is the per-sync checksum",
                                lambda v: f"debug.compare_weights_tensorwise={v}"),
    "rollout.vllm.tensor_parallel_size": ("one key for the GPUs of every engine",
                                          lambda v: f"rollout.num_gpus_per_engine={v}"),
    "rollout.vllm.max_num_seqs": ("one key for the sequences every engine decodes at once",
                                  lambda v: f"rollout.max_running={v}"),
}


def old_form_message(key: str, value: str | None = None) -> str | None:
    """The message for an old key (None for any other): names the new form, with `value` if known."""
    if key not in OLD_KEYS:
        return None
    why, new = OLD_KEYS[key]
    return f"{key} is not a key to set ({why}): use {new(value if value is not None else '<value>')}"


def old_form_problems(overrides: list[str]) -> list[str]:
    """One message per command-line override that uses an old key (`rollout.engine=vllm`, ...)."""
    problems = []
    for override in overrides:
        key, eq, value = override.lstrip("+~").partition("=")
        if eq and (message := old_form_message(key.strip(), value.strip())):
            problems.append(message)
    return problems


def backend_sections() -> dict[str, str]:
    """Config sections that exist only when their backend is chosen -> the group override that adds
    them ({"rollout.vllm": "rollout=vllm", ...}): each side's fields named after one of its backends."""
    from miles.config.schema import EngineName, RolloutCfg, TrainerBackend, TrainerCfg

    return {f"{side}.{name.value}": f"{side}={name.value}"
            for side, node, names in (("rollout", RolloutCfg, EngineName), ("trainer", TrainerCfg, TrainerBackend))
            for name in names if name.value in {f.name for f in dataclasses.fields(node)}}


def _unchosen_backend_options(overrides: list[str]) -> str | None:
    """OmegaConf cannot set a key below a None node (an unchosen backend's options); name the group."""
    sections = backend_sections()
    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        for section, choice in sections.items():
            if key.startswith(section + "."):
                return (f"{key} is an option of {choice}, which this run does not choose (only the chosen "
                        f"backend's options exist): add {choice}, or drop {key}")
    return None


def refuse_old_forms(overrides: list[str]) -> None:
    """Raise ConfigError (exit 2) naming the new form of every old key among `overrides`."""
    if problems := old_form_problems(overrides):
        raise ConfigError(problems)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def valid_keys(full_key: str) -> tuple[str, list[str]]:
    """The section holding `full_key` ("trainer.foo" -> "trainer") and that section's schema keys."""
    from miles.config.schema import RunCfg

    node: type = RunCfg
    parts = full_key.split(".")[:-1]
    for part in parts:
        hints = typing.get_type_hints(node)
        hint = hints.get(part)
        if typing.get_origin(hint) is typing.Union:  # Optional[VLLMCfg]: a backend's options
            hint = next((a for a in typing.get_args(hint) if a is not type(None)), None)
        if hint is None or not dataclasses.is_dataclass(hint):
            return ".".join(parts), []
        node = hint
    return ".".join(parts) or "the root config", [f.name for f in dataclasses.fields(node)]


def _unknown_key(cause: BaseException) -> str:
    full_key = getattr(cause, "full_key", None) or "?"
    if (message := old_form_message(full_key)) is not None:
        return message
    section, keys = valid_keys(full_key)
    hint = f"; valid keys of {section}: {', '.join(keys)}" if keys else ""
    return f"unknown key '{full_key}'{hint}"


def _output_dir_error(ex: BaseException) -> str | None:
    """Hydra creates the run / sweep dir before any Miles code runs: an OSError raised there (the
    first frame outside pathlib / os is Hydra's) is a path the user chose."""
    if not isinstance(ex, OSError) or ex.filename is None:
        return None
    for frame in reversed(traceback.extract_tb(ex.__traceback__)):
        if os.path.basename(frame.filename) in ("pathlib.py", "os.py"):
            continue
        if f"{os.sep}hydra{os.sep}" in frame.filename:
            return f"cannot write the run's output directory: {ex.filename}: {ex.strerror} (see hydra.run.dir / hydra.sweep.dir)"
        return None
    return None


def user_error_message(ex: BaseException) -> str | None:
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    # A DataError exists only once miles.data.prompts is imported; importing it here would load miles.data
    # and torch with it (~2 s) in a launch.py that only refuses its command line.
    prompts = sys.modules.get("miles.data.prompts")

    if isinstance(ex, ConfigError):
        return "invalid config:\n" + str(ex)
    if isinstance(ex, UserError):
        return str(ex)
    if prompts is not None and isinstance(ex, prompts.DataError):
        return str(ex)
    if (message := _output_dir_error(ex)) is not None:
        return message
    if isinstance(ex, AssertionError) and "Unexpected type for root: NoneType" in str(ex):
        return _unchosen_backend_options(sys.argv[1:])
    if isinstance(ex, MissingConfigException) and ex.missing_cfg_file and ex.options is not None:
        group, _, name = ex.missing_cfg_file.rpartition("/")
        return f"unknown {group or 'config'} '{name}'; valid choices: {', '.join(sorted(ex.options))}"
    if isinstance(ex, OverrideParseException):
        return f"bad override syntax: {_first_line(str(ex))} (see `python launch.py --help`)"
    cause = ex.__cause__
    if isinstance(ex, HydraException) and isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        return _unknown_key(cause)
    if isinstance(ex, HydraException) and isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None)
        return f"bad value for '{key}': {_first_line(str(cause))}" if key else _first_line(str(cause))
    if isinstance(ex, (ConfigAttributeError, ConfigKeyError)):
        return _unknown_key(ex)
    if isinstance(ex, (HydraException, OmegaConfBaseException)):
        return _first_line(str(ex))
    return None


class UserError(Exception):
    """A mistake the user can fix, whose message says how (e.g. a +reproduce source that is not a run)."""


class PlanRefused(Exception):
    """The memory plan does not fit (the table is already printed): exit code 3."""


@contextlib.contextmanager
def exit_on_user_error():
    """Print a user mistake as `error: ...` and exit 2 (3 for a refused memory plan); let anything
    else propagate."""
    try:
        yield
    except PlanRefused as ex:
        print(f"error: {ex}", file=sys.stderr)
        raise SystemExit(3) from None
    except Exception as ex:
        message = user_error_message(ex)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
