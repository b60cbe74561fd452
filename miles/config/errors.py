"""Turns user mistakes into one short message; launch.py prints it and exits with code 2.

`user_error_message(ex)` returns None for anything that is not a user mistake, so real bugs keep
their traceback. Covered: an unknown group option, an unknown key, a value of the wrong type or
outside an enum, bad override syntax, `validate()` problems, malformed data files, and an output
directory Hydra cannot create.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import traceback
import typing

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from miles.config.schema import RunCfg
from miles.config.validate import ConfigError
from miles.data.prompts import DataError


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def valid_keys(full_key: str) -> tuple[str, list[str]]:
    """The section holding `full_key` ("trainer.foo" -> "trainer") and that section's schema keys."""
    node: type = RunCfg
    parts = full_key.split(".")[:-1]
    for part in parts:
        hints = typing.get_type_hints(node)
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            return ".".join(parts), []
        node = hints[part]
    return ".".join(parts) or "the root config", [f.name for f in dataclasses.fields(node)]


def _unknown_key(cause: OmegaConfBaseException) -> str:
    full_key = getattr(cause, "full_key", None) or "?"
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
    if isinstance(ex, ConfigError):
        return "invalid config:\n" + str(ex)
    if isinstance(ex, UserError):
        return str(ex)
    if isinstance(ex, DataError):
        return str(ex)
    if (message := _output_dir_error(ex)) is not None:
        return message
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
