"""The box around one sandboxed program: a bubblewrap command line and, as root, a uid of its own.

Bubblewrap (Debian's `bubblewrap`, the sandbox under Flatpak) builds the namespaces and the mount
tree; we only say what goes in. Chosen over raw namespaces (unshare + mounts + pivot_root by hand,
the fiddly part bwrap exists to get right and to keep maintained) and over Landlock (it restricts
filesystem access but leaves the host's processes, PID space and other mounts in view, needs a
5.13+ kernel with the LSM enabled, and bounds nothing about processes).

    argv = box_argv(bwrap, python, code_fd, limits)      # then: bwrap ... -- python -I -S -c BOOTSTRAP

Inside the box the program sees:
  /usr, /bin, /lib*, /sbin (read-only, or their merged-/usr symlinks), /etc/ld.so.cache,
  the interpreter's own prefix (read-only, at its host path), a minimal /dev,
  /tmp: a fresh tmpfs of its own (cwd, HOME, TMPDIR; holds main.py), gone when the box exits;
and nothing else: no /proc, no home, no repository, no run directory, no host /tmp.
Namespaces: mount, PID (the program is its pid 1; when it exits or is killed, the kernel kills
every process left in the box, new sessions included), network (only a loopback of its own), IPC,
UTS, cgroup.

Who runs it. Not root: bwrap makes an unprivileged user namespace (and forbids nested ones);
RLIMIT_NPROC then counts the box's own processes. Root: RLIMIT_NPROC does not bind uid 0, even
mapped into a user namespace, so bwrap runs privileged (no user namespace) and the bootstrap drops
to a uid of the box's own (`uid_slot`, one per running box, so boxes do not share a process count)
before the program starts; that uid owns nothing on the host.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Iterator

SCRATCH = "/tmp"  # the box's writable directory (a tmpfs of its own)
_SYSTEM = ("/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin")
ROOT_UID_BASE = 1_900_000_000  # root: box uids are ROOT_UID_BASE + slot (far above any real account)
_ROOT_SLOTS = 4096
_SLOTS_DIR = Path(tempfile.gettempdir(), "miles-sandbox-uids")  # root-only lock files, one per slot


def interpreter() -> tuple[str, list[str]]:
    """The real interpreter (a venv's base one: the venv itself lives in the repository) and the
    directories it needs that are not under /usr."""
    python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    dirs = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(python))}
    outside = [d for d in sorted(dirs) if not any(d == s or d.startswith(s + "/") for s in _SYSTEM)]
    # A prefix inside another is bound with it.
    return python, [d for d in outside if not any(d.startswith(o + "/") for o in outside)]


def box_argv(bwrap: str, python: str, prefixes: list[str], code_fd: int, tmpfs_bytes: int) -> list[str]:
    """The bwrap command line up to (not including) the program's own argv."""
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent",  # the box dies with the reward worker that started it
            # The program is the box's pid 1: bwrap then waits for it, and the kernel kills and reaps
            # the rest of the box before that wait returns. (With bwrap's own init, bwrap returns as
            # soon as the program exits, while the box is still being torn down, and its init is left
            # a zombie of whoever reaps orphans.) No --new-session: the caller starts bwrap in a new
            # session already (no controlling terminal), and a wall-time kill of bwrap's process
            # group then reaches pid 1 too.
            "--as-pid-1"]
    if os.geteuid() == 0:
        # Privileged bwrap drops every capability but these two, which the bootstrap needs to
        # switch to the box's uid (after which it holds none).
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    for path in _SYSTEM:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for prefix in prefixes:
        argv += _parents(prefix) + ["--ro-bind", prefix, prefix]
    if os.path.exists("/etc/ld.so.cache"):  # the loader finds libraries without it, only slower
        argv += ["--perms", "0755", "--dir", "/etc", "--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    argv += ["--dev", "/dev",
             "--size", str(tmpfs_bytes), "--perms", "1777", "--tmpfs", SCRATCH,
             "--perms", "0644", "--file", str(code_fd), f"{SCRATCH}/main.py",
             "--chdir", SCRATCH, "--clearenv"]
    for key, value in env().items():
        argv += ["--setenv", key, value]
    return argv + ["--", python]


def env() -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": SCRATCH, "TMPDIR": SCRATCH}


def _parents(path: str) -> list[str]:
    # bwrap would create them with the host's modes (/root is 0700): the box's uid could not reach
    # the interpreter. They are empty directories of the box's own root, so 0755 shows nothing.
    argv, parts = [], Path(path).parts[1:-1]
    for i in range(len(parts)):
        argv += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i + 1])]
    return argv


@contextlib.contextmanager
def uid_slot() -> Iterator[int]:
    """Root only: a uid no other running box holds (an flock per slot, released with the fd, so a
    crashed worker frees its slot). The box is fully gone before the caller releases it."""
    _SLOTS_DIR.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(_SLOTS_DIR)
    if st.st_uid != 0 or not os.path.isdir(_SLOTS_DIR) or os.path.islink(_SLOTS_DIR) or st.st_mode & 0o022:
        raise PermissionError(f"{_SLOTS_DIR} must be a directory owned by root, not writable by others")
    start = random.randrange(_ROOT_SLOTS)  # spreads concurrent workers over the slots
    for i in range(_ROOT_SLOTS):
        slot = (start + i) % _ROOT_SLOTS
        fd = os.open(_SLOTS_DIR / f"slot-{slot}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield ROOT_UID_BASE + slot
        finally:
            os.close(fd)
        return
    raise RuntimeError(f"all {_ROOT_SLOTS} sandbox uid slots are in use")
