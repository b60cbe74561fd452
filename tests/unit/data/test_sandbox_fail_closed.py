"""Where the box cannot be built, model-written code does not run: the sandbox raises, validation
reports it (exit 2) naming what is missing and the key accepting the risk; isolation=none runs the
code unboxed and warns once. Checked with bwrap off PATH and with a bwrap that cannot build boxes,
as root and as an unprivileged user."""

import dataclasses
import logging
from types import SimpleNamespace

import pytest

from miles.config.schema import SandboxCfg, TaskCfg
from miles.config.rules import reward_problems
from miles.data import sandbox
from miles.data.sandbox import SandboxUnavailable, run_python, sandbox_problems
from miles.rollout.tools import build_toolbox

LIMITS = SandboxCfg(wall_time_s=3.0, cpu_time_s=1)


@pytest.fixture
def no_bwrap(tmp_path, monkeypatch):
    """PATH with the interpreter's usual directories but no bwrap in any of them."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


@pytest.fixture
def broken_bwrap(shared_dir, monkeypatch):
    """A `bwrap` that fails as a real one does where namespaces are refused (in a directory the
    dropped uid reaches too)."""
    fake = shared_dir / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(shared_dir))


def test_without_bwrap_nothing_runs_and_the_error_says_what_to_do(run_as, no_bwrap):
    with pytest.raises(SandboxUnavailable) as error:
        run_as("print('ran')", LIMITS)
    message = str(error.value)
    assert "bwrap" in message and "apt-get install -y bubblewrap" in message
    assert "task.sandbox.isolation=none" in message


def test_a_bwrap_that_cannot_build_the_box_fails_closed_with_its_reason(run_as, broken_bwrap):
    with pytest.raises(SandboxUnavailable) as error:
        run_as("print('ran')", LIMITS)
    assert "No permissions to create new namespace" in str(error.value)
    assert "task.sandbox.isolation=none" in str(error.value)


def test_validation_stops_the_code_reward_and_the_python_tool(no_bwrap):
    problems = reward_problems(SimpleNamespace(task=TaskCfg(name="t", reward="code")))
    assert len(problems) == 1 and "task.sandbox.isolation=none" in problems[0]
    assert reward_problems(SimpleNamespace(task=TaskCfg(name="t", reward="exact_match"))) == []  # no code, no box
    with pytest.raises(ValueError, match="task.sandbox.isolation=none"):
        build_toolbox(["python"], LIMITS)  # tool_problems reports this ValueError
    build_toolbox(["calculator"], LIMITS)


def test_an_unknown_isolation_is_a_config_problem():
    problems = sandbox_problems(dataclasses.replace(LIMITS, isolation="docker"))
    assert problems == ["task.sandbox.isolation must be one of bwrap, none (got 'docker')"]


def test_isolation_none_accepts_the_risk_runs_unboxed_and_warns_once(no_bwrap, caplog):
    sandbox._warn_unisolated.cache_clear()
    unboxed = dataclasses.replace(LIMITS, isolation="none")
    assert sandbox_problems(unboxed) == []
    with caplog.at_level(logging.WARNING, logger="miles.data.sandbox"):
        first, second = run_python("print('ran')", unboxed), run_python("print('ran')", unboxed)
    assert first.stdout == second.stdout == "ran\n"
    warnings = [r for r in caplog.records if "WITHOUT the sandbox's box" in r.getMessage()]
    assert len(warnings) == 1
