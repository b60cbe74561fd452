"""Sandbox fixtures: run_python as root and as an unprivileged user, and a directory both can use.

CI runs as root, where the sandbox takes its root path (privileged bwrap, a uid of the box's own).
The unprivileged path (bwrap in a user namespace) is exercised there by running run_python itself
in a subprocess under a dropped uid, with an interpreter that uid can run; as a normal user the
root case is skipped and the unprivileged one runs in-process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from miles.data.sandbox import SandboxResult, SandboxUnavailable, run_python

REPO = Path(__file__).resolve().parents[3]
NOBODY = 65534

# Loads miles.data.sandbox without the package __init__s (their dependencies live in the venv, which
# the unprivileged uid may not be able to reach): only the standard library is needed.
_DRIVER = r"""
import dataclasses, json, sys, types
repo, args = sys.argv[1], json.loads(sys.stdin.read())
for name in ("miles", "miles.data"):
    module = sys.modules[name] = types.ModuleType(name)
    module.__path__ = [repo + "/" + name.replace(".", "/")]
from miles.data.sandbox import SandboxUnavailable, run_python
try:
    result = run_python(args["code"], types.SimpleNamespace(**args["limits"]), args["stdin"])
except SandboxUnavailable as error:
    print(json.dumps({"unavailable": str(error)}))
else:
    print(json.dumps(dataclasses.asdict(result)))
"""


def _unprivileged_python() -> str | None:
    for python in (sys.executable, shutil.which("python3", path="/usr/bin:/bin")):
        try:
            if python and subprocess.run([python, "-I", "-c", "import json"], user=NOBODY, group=NOBODY,
                                         extra_groups=[], cwd="/", capture_output=True).returncode == 0:
                return python
        except PermissionError:  # e.g. a venv under /root
            pass
    return None


def run_dropped(python: str, code: str, limits, stdin: str = "") -> SandboxResult:
    """run_python under uid/gid 65534 (no supplementary groups), this process's PATH."""
    args = json.dumps({"code": code, "limits": dataclasses.asdict(limits), "stdin": stdin})
    proc = subprocess.run([python, "-I", "-c", _DRIVER, str(REPO)], input=args, user=NOBODY, group=NOBODY,
                          extra_groups=[], cwd="/", env={"PATH": os.environ.get("PATH", "")},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    reply = json.loads(proc.stdout)
    if "unavailable" in reply:
        raise SandboxUnavailable(reply["unavailable"])
    return SandboxResult(**reply)


@pytest.fixture(params=["root", "unprivileged"])
def run_as(request):
    """run_python(code, limits, stdin="") as root or as an unprivileged user."""
    if request.param == "root":
        if os.geteuid() != 0:
            pytest.skip("not running as root (CI does): the root path is checked there")
        return run_python
    if os.geteuid() != 0:
        return run_python
    python = _unprivileged_python()
    if python is None:
        pytest.skip("no Python interpreter that an unprivileged uid can run")
    return lambda code, limits, stdin="": run_dropped(python, code, limits, stdin)


@pytest.fixture
def shared_dir():
    """A host directory outside the box that both root and the dropped uid may read and write, so
    that only the box stands between the program and its files."""
    path = Path(tempfile.mkdtemp(prefix="miles-sandbox-test-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)
