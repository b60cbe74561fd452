"""Run untrusted Python (model-written code) in an isolated, resource-limited subprocess.

    result = run_python("print(1 + 1)", task.sandbox)   # SandboxResult(stdout='2\\n', returncode=0, ...)

Isolation, each a layer that fails closed where it can:
- its own temporary directory as cwd, HOME and TMPDIR, deleted afterwards;
- a scrubbed environment (only PATH, LANG, HOME, TMPDIR) and `python -I` (no PYTHON* variables,
  no user site-packages, no script directory on sys.path);
- a new session: on wall timeout the whole process group is killed;
- rlimits set in the child (task.sandbox): CPU seconds, address space, processes, file size, plus
  a few open files and no core dumps;
- no network where the kernel allows an unprivileged user + network namespace (only a loopback
  that is down); `SandboxResult.network_isolated` says whether it was cut.

Inside its user namespace RLIMIT_NPROC counts only the sandbox's own processes (outside one, all
of the user's); the kernel does not apply it to root. Not a container: the code runs as the same
user, reads what that user can read, and a process that starts its own session outlives the kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config.schema import SandboxCfg

# Runs first in the child (`python -I -c`), then replaces itself with the user's program. Limits
# are set here rather than in a preexec_fn, which is unsafe in a threaded parent (the reward pool).
# The namespaces come before the rlimits: RLIMIT_NPROC then counts only this sandbox's processes.
_BOOTSTRAP = r"""
import ctypes, json, os, resource, sys
limits, status_fd = json.loads(sys.argv[1]), int(sys.argv[2])
try:  # ctypes: os.unshare is Python 3.12+
    isolated = ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) == 0  # NEWUSER|NEWNET
except (OSError, AttributeError):
    isolated = False
os.write(status_fd, b"1" if isolated else b"0")
os.close(status_fd)
for name, value in limits.items():
    kind = getattr(resource, name)
    hard = resource.getrlimit(kind)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (value, value))
os.execv(sys.executable, [sys.executable, "-I", "main.py"])
"""

_MAX_OPEN_FILES = 64  # enough for the interpreter and a few files; stops descriptor exhaustion


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int  # negative: killed by that signal (e.g. -9 on wall timeout, -24 SIGXCPU)
    timed_out: bool  # killed at limits.wall_time_s
    network_isolated: bool  # ran in its own network namespace (no network at all)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def run_python(code: str, limits: SandboxCfg, stdin: str = "") -> SandboxResult:
    """Run `code` as a script under `limits`; its output is cut to limits.max_output_chars."""
    rlimits = {
        "RLIMIT_CPU": int(limits.cpu_time_s),
        "RLIMIT_AS": int(limits.memory_mb) << 20,
        "RLIMIT_NPROC": int(limits.max_processes),
        "RLIMIT_FSIZE": int(limits.max_file_mb) << 20,  # also bounds what stdout / stderr can write
        "RLIMIT_NOFILE": _MAX_OPEN_FILES,
        "RLIMIT_CORE": 0,
    }
    with tempfile.TemporaryDirectory(prefix="miles-sandbox-") as cwd, \
            tempfile.TemporaryFile() as inp, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        Path(cwd, "main.py").write_text(code)
        inp.write(stdin.encode())
        inp.seek(0)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": cwd, "TMPDIR": cwd}
        status_r, status_w = os.pipe()
        try:
            # Output goes to files, not pipes: nothing to drain while it runs, and RLIMIT_FSIZE caps it.
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOTSTRAP, json.dumps(rlimits), str(status_w)],
                stdin=inp, stdout=out, stderr=err, cwd=cwd, env=env,
                start_new_session=True, pass_fds=(status_w,),
            )
        finally:
            os.close(status_w)
        try:
            proc.wait(timeout=limits.wall_time_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc.pid)  # also after a normal exit: nothing it started outlives it
        proc.wait()
        with os.fdopen(status_r, "rb") as status:
            network_isolated = status.read() == b"1"
        return SandboxResult(_read(out, limits.max_output_chars), _read(err, limits.max_output_chars),
                             proc.returncode, timed_out, network_isolated)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is already gone
        pass


def _read(file, max_chars: int) -> str:
    file.seek(0)
    return file.read(4 * max_chars).decode(errors="replace")[:max_chars]  # utf-8: at most 4 bytes a char
