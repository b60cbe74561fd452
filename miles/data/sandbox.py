"""Run untrusted Python (model-written code) in a box, under resource limits.

    result = run_python("print(1 + 1)", task.sandbox)   # SandboxResult(stdout='2\\n', returncode=0, ...)
    run_python(code)                                     # a user reward: the default limits

The one box for the code reward, the python tool and user rewards (docs/sandbox.md says exactly
what it guarantees). With `task.sandbox.isolation=bwrap` (the default) the program runs under
bubblewrap (sandbox_box.py): a read-only view of /usr and the interpreter, a tmpfs of its own as
cwd / HOME / TMPDIR, no other host files, its own PID namespace (nothing it starts outlives it,
new sessions included), no network, a process bound that holds as root. Plus, in every mode:
- a scrubbed environment (PATH, LANG, HOME, TMPDIR) and `python -I`;
- rlimits set in the box before the program starts: CPU seconds, address space, processes, file
  size, open files, no core dumps; a wall-time kill of the whole box.

Fail closed: where bwrap is missing or cannot build its box, `run_python` raises SandboxUnavailable
and `sandbox_problems` (config validation) reports it, naming what is missing and the key that
accepts the risk, `task.sandbox.isolation=none`: the old, weaker sandbox (same limits and network
namespace where allowed, but the host's files in reach and no bound as root), warned once a process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miles.data import sandbox_box

if TYPE_CHECKING:
    from miles.config.schema import SandboxCfg

ISOLATIONS = ("bwrap", "none")
_ACCEPT = "task.sandbox.isolation=none"
_log = logging.getLogger(__name__)

# Runs first in the box (`python -I -S -c`: no site import, it only needs these modules), then
# replaces itself with the program. Limits are set here rather than in a preexec_fn, which is
# unsafe in a threaded parent (the reward pool). Order matters: the namespaces first (RLIMIT_NPROC
# then counts this box's processes), the limits, then the uid (RLIMIT_NPROC binds from there on).
_BOOTSTRAP = r"""
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
if cfg["net_fd"] is not None:  # isolation=none: a user + network namespace where the kernel allows
    import ctypes  # os.unshare is Python 3.12+
    try:
        ok = ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) == 0  # NEWUSER|NEWNET
    except (OSError, AttributeError):
        ok = False
    os.write(cfg["net_fd"], b"1" if ok else b"0")
    os.close(cfg["net_fd"])
for name, value in cfg["rlimits"].items():
    kind = getattr(resource, name)
    hard = resource.getrlimit(kind)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (value, value))
if cfg["uid"] is not None:  # root: the box's own uid; setresuid away from 0 clears every capability
    os.setgroups([])
    os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
    os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    import ctypes  # the uid change cleared bwrap's --die-with-parent signal: set it again
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
os.environ.pop("PWD", None)  # bwrap's --chdir sets it; the program gets the scrubbed environment only
os.execv(sys.executable, [sys.executable, "-I", "main.py"])
"""

_MAX_OPEN_FILES = 64  # enough for the interpreter and a few files; stops descriptor exhaustion


class SandboxUnavailable(ValueError):
    """The box cannot be built on this machine (a ValueError: config validation reports it)."""


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


def run_python(code: str, limits: SandboxCfg | None = None, stdin: str = "") -> SandboxResult:
    """Run `code` as a script in the box under `limits` (default: SandboxCfg()); its output is cut
    to limits.max_output_chars. Raises SandboxUnavailable where the box cannot be built."""
    if limits is None:
        from miles.config.schema import SandboxCfg

        limits = SandboxCfg()
    isolation = getattr(limits, "isolation", "bwrap")
    if isolation == "none":
        _warn_unisolated()
        return _run(code, limits, stdin, boxed=False)
    check_sandbox(limits)
    return _run(code, limits, stdin, boxed=True)


def check_sandbox(limits: SandboxCfg) -> None:
    """Raise SandboxUnavailable unless `limits.isolation` can be honoured here (a user reward can call
    it at import: validation then stops the run before anything starts)."""
    problem = _problem(getattr(limits, "isolation", "bwrap"), shutil.which("bwrap"))
    if problem:
        raise SandboxUnavailable(problem)


def sandbox_problems(limits: SandboxCfg) -> list[str]:
    """Config validation: [] when the sandbox can run as configured, else what to change."""
    try:
        check_sandbox(limits)
    except SandboxUnavailable as error:
        return [str(error)]
    return []


@functools.lru_cache(maxsize=None)
def _problem(isolation: str, bwrap: str | None) -> str | None:
    # Once a process per (isolation, bwrap found): the probe is one real, tiny box.
    if isolation not in ISOLATIONS:
        return f"task.sandbox.isolation must be one of {', '.join(ISOLATIONS)} (got {isolation!r})"
    if isolation == "none":
        return None
    if bwrap is None:
        return ("task.sandbox.isolation=bwrap: the sandbox for model-written code needs bubblewrap, and no "
                "`bwrap` is on PATH (Debian / Ubuntu: apt-get install -y bubblewrap; Fedora: dnf install "
                f"bubblewrap). To run that code without the box, on your own risk: {_ACCEPT}")
    from types import SimpleNamespace

    probe = SimpleNamespace(wall_time_s=10.0, cpu_time_s=5, memory_mb=512, max_processes=16, max_file_mb=1,
                            max_output_chars=2000)
    result = _run("import sys; sys.stdout.write('ok')", probe, "", boxed=True, bwrap=bwrap)
    if result.ok and result.stdout == "ok":
        return None
    who = "root (privileged bwrap)" if os.geteuid() == 0 else "an unprivileged user (bwrap needs user namespaces)"
    return (f"task.sandbox.isolation=bwrap: {bwrap} could not build the sandbox here, running as {who}: "
            f"{(result.stderr.strip() or f'exit status {result.returncode}')[:500]}. "
            f"Fix that, or run model-written code without the box, on your own risk: {_ACCEPT}")


@functools.lru_cache(maxsize=1)
def _warn_unisolated() -> None:
    _log.warning("%s: model-written code runs WITHOUT the sandbox's box: it can read, change and delete "
                 "whatever this user can, and processes it starts in a new session can outlive it "
                 "(docs/sandbox.md)", _ACCEPT)


def _run(code: str, limits, stdin: str, *, boxed: bool, bwrap: str | None = None) -> SandboxResult:
    rlimits = {
        "RLIMIT_CPU": int(limits.cpu_time_s),
        "RLIMIT_AS": int(limits.memory_mb) << 20,
        "RLIMIT_NPROC": int(limits.max_processes),
        "RLIMIT_FSIZE": int(limits.max_file_mb) << 20,  # also bounds what stdout / stderr can write
        "RLIMIT_NOFILE": _MAX_OPEN_FILES,
        "RLIMIT_CORE": 0,
    }
    # Output goes to files, not pipes: nothing to drain while it runs, and RLIMIT_FSIZE caps it.
    with tempfile.TemporaryFile() as src, tempfile.TemporaryFile() as inp, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        for file, text in ((src, code), (inp, stdin)):
            file.write(text.encode())
            file.seek(0)
        if boxed:
            python, prefixes = sandbox_box.interpreter()
            tmpfs = max(16, 4 * int(limits.max_file_mb)) << 20  # a few files of the largest size it may write
            argv = sandbox_box.box_argv(bwrap or shutil.which("bwrap"), python, prefixes, src.fileno(), tmpfs)
            with _box_uid() as uid:  # held until the box is gone (_wait reaps it)
                cfg = json.dumps({"rlimits": rlimits, "uid": uid, "net_fd": None})
                proc = subprocess.Popen(argv + ["-I", "-S", "-c", _BOOTSTRAP, cfg], stdin=inp, stdout=out,
                                        stderr=err, env=sandbox_box.env(), cwd="/", start_new_session=True,
                                        pass_fds=(src.fileno(),))
                timed_out = _wait(proc, limits.wall_time_s)
            returncode, network_isolated = _signal_status(proc.returncode), True
        else:
            with tempfile.TemporaryDirectory(prefix="miles-sandbox-") as cwd:
                Path(cwd, "main.py").write_text(code)
                status_r, status_w = os.pipe()
                try:
                    cfg = json.dumps({"rlimits": rlimits, "uid": None, "net_fd": status_w})
                    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOTSTRAP, cfg], stdin=inp,
                                            stdout=out, stderr=err, cwd=cwd,
                                            env={**sandbox_box.env(), "HOME": cwd, "TMPDIR": cwd},
                                            start_new_session=True, pass_fds=(status_w,))
                finally:
                    os.close(status_w)
                timed_out = _wait(proc, limits.wall_time_s)
                with os.fdopen(status_r, "rb") as status:
                    returncode, network_isolated = proc.returncode, status.read() == b"1"
        return SandboxResult(_read(out, limits.max_output_chars), _read(err, limits.max_output_chars),
                             returncode, timed_out, network_isolated)


def _box_uid():
    # Root: a uid of the box's own (RLIMIT_NPROC does not bind uid 0). Otherwise the user's own,
    # inside the user namespace bwrap makes.
    return sandbox_box.uid_slot() if os.geteuid() == 0 else contextlib.nullcontext(None)


def _wait(proc: subprocess.Popen, wall_time_s: float) -> bool:
    """Wait up to the wall time, then kill the group; True when it ran out of time."""
    try:
        proc.wait(timeout=wall_time_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    # Also after a normal exit. Boxed: bwrap leads the group, with the program (the box's pid 1), and
    # bwrap returns once pid 1 and with it every process of the box is gone. Unboxed: the program's
    # own group (a process in a new session escapes it: isolation=none says so).
    _kill_group(proc.pid)
    proc.wait()
    return timed_out


def _signal_status(code: int) -> int:
    # bwrap reports a program killed by signal N as exit status 128 + N (so an exit(129..192) of the
    # program's own reads as a signal too: both are failures).
    return -(code - 128) if 128 < code <= 128 + 64 else code


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is already gone
        pass


def _read(file, max_chars: int) -> str:
    file.seek(0)
    return file.read(4 * max_chars).decode(errors="replace")[:max_chars]  # utf-8: at most 4 bytes a char
