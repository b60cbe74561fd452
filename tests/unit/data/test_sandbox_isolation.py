"""The box holds the program in, one test per row of issue 32's table, as root and as an
unprivileged user (conftest.py: run_as). Where a row has a cheap control, the same program runs
with task.sandbox.isolation=none and does reach the host: the box, not file modes, stopped it.
The table's memory and environment rows are test_sandbox.py's 2 GB and environment tests."""

import dataclasses
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from miles.config.schema import SandboxCfg
from miles.data.sandbox import run_python

# Wall-clock limits and kills are asserted: make test runs this file alone, after the parallel part.
pytestmark = pytest.mark.serial

LIMITS = SandboxCfg(wall_time_s=5.0, cpu_time_s=2, memory_mb=256, max_processes=16, max_file_mb=1)
UNBOXED = dataclasses.replace(LIMITS, isolation="none")
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def secret(shared_dir):
    path = shared_dir / "secret.txt"
    path.write_text("hunter2")
    path.chmod(0o666)
    return path


def test_a_planted_secret_outside_is_not_readable(run_as, secret):
    code = (f"import os\nfor path in [{str(secret)!r}, {str(REPO / 'pyproject.toml')!r}]:\n"
            "    try:\n        print(open(path).read())\n    except OSError as error:\n"
            "        print(type(error).__name__)\n"
            f"print(os.path.exists({str(REPO)!r}), os.path.exists({str(secret.parent)!r}), os.listdir('/tmp'))\n")
    result = run_as(code, LIMITS)
    assert result.ok, result.stderr
    assert "hunter2" not in result.stdout and "[project]" not in result.stdout
    assert result.stdout.splitlines() == ["FileNotFoundError", "FileNotFoundError", "False False ['main.py']"]
    assert "hunter2" in run_python(code, UNBOXED).stdout  # control: without the box it is read


def test_a_new_file_outside_is_not_written(run_as, shared_dir):
    targets = [shared_dir / "written.txt", REPO / f"sandbox-wrote-{uuid.uuid4().hex}",
               Path("/usr/lib", f"sandbox-wrote-{uuid.uuid4().hex}")]  # the last is in view, read-only
    code = (f"for path in {[str(t) for t in targets]!r}:\n"
            "    try:\n        open(path, 'w').write('pwned')\n        print('wrote')\n"
            "    except OSError as error:\n        print(type(error).__name__)\n")
    result = run_as(code, LIMITS)
    assert result.ok, result.stderr
    assert "wrote" not in result.stdout and not any(t.exists() for t in targets)
    assert result.stdout.splitlines()[-1] in ("OSError", "PermissionError")  # EROFS (or EACCES as non-root)
    control = f"open({str(targets[0])!r}, 'w').write('pwned')"
    assert run_python(control, UNBOXED).ok and targets[0].exists()  # control: without the box it is written


def test_a_file_outside_is_not_deleted(run_as, secret):
    code = (f"import os, shutil\nfor remove in (lambda: os.remove({str(secret)!r}), "
            f"lambda: shutil.rmtree({str(secret.parent)!r})):\n"
            "    try:\n        remove()\n        print('deleted')\n"
            "    except OSError as error:\n        print(type(error).__name__)\n")
    result = run_as(code, LIMITS)
    assert result.ok and "deleted" not in result.stdout, result.stdout + result.stderr
    assert secret.read_text() == "hunter2"
    assert run_python(f"import os; os.remove({str(secret)!r})", UNBOXED).ok and not secret.exists()  # control


def _alive(marker: str) -> list[str]:
    """Host processes (any user) whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:  # gone meanwhile
            pass
    return found


def test_a_process_in_a_new_session_does_not_outlive_the_box(run_as, shared_dir):
    """A child that calls setsid and writes a file 3 s later (the issue's 15 s, shortened): nothing of
    it is left after the box, neither after the program exits nor after a wall-time kill."""
    marker = f"miles-survivor-{uuid.uuid4().hex}"
    late = shared_dir / "late.txt"
    spawn = ("import subprocess, sys\n"
             "subprocess.Popen([sys.executable, '-c', 'import sys, time; time.sleep(3); "
             "open(sys.argv[1], \"w\").write(\"survived\")', "
             f"{str(late)!r}, {marker!r}], start_new_session=True)\nprint('spawned', flush=True)\n")
    exits = run_as(spawn, LIMITS)
    killed = run_as(spawn + "import time; time.sleep(30)\n", dataclasses.replace(LIMITS, wall_time_s=1.0))
    assert exits.ok and exits.stdout == "spawned\n", exits.stderr
    assert killed.timed_out and killed.stdout == "spawned\n"
    # The kernel tears the box's pid namespace down as bwrap exits: on a loaded machine the last
    # process can take a moment to go (seen once in a suite run), still well before its 3 s write.
    deadline = time.monotonic() + 2.0
    while _alive(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive(marker) == []
    time.sleep(3.5)  # past the child's delay: had it lived, it would have written by now
    assert _alive(marker) == [] and not late.exists()


def _forks(n: int) -> str:
    return (f"import os\nfor _ in range({n}):\n"
            "    if os.fork() == 0:\n        import time; time.sleep(1); os._exit(0)\n"
            "print('forked')\n")


def test_forking_200_children_is_bounded_by_max_processes(run_as):
    many = run_as(_forks(200), LIMITS)
    assert "BlockingIOError" in many.stderr and "forked" not in many.stdout
    assert run_as(_forks(5), LIMITS).ok  # under the bound, forking works
    if os.geteuid() == 0:  # control: root unboxed is exempt from RLIMIT_NPROC (the 200 forked)
        assert "forked" in run_python(_forks(200), UNBOXED).stdout


@pytest.fixture
def local_server():
    server = socket.create_server(("127.0.0.1", 0))  # listening: the kernel completes connections
    yield server.getsockname()[1]
    server.close()


def test_a_loopback_listener_cannot_be_reached(run_as, local_server):
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {local_server}), timeout=1)\nprint('connected')"
    result = run_as(code, LIMITS)
    assert result.network_isolated
    assert result.returncode != 0 and "connected" not in result.stdout and "Error" in result.stderr
    socket.create_connection(("127.0.0.1", local_server), timeout=1).close()  # the server was really there


def test_no_descriptors_leak_in_and_no_privileges_can_be_gained(run_as):
    code = ("import ctypes, os\nopen_fds = []\nfor fd in range(3, 64):\n"
            "    try:\n        os.fstat(fd)\n        open_fds.append(fd)\n    except OSError:\n        pass\n"
            "no_new_privs = ctypes.CDLL(None).prctl(39, 0, 0, 0, 0)\n"  # PR_GET_NO_NEW_PRIVS
            "print(open_fds, no_new_privs, os.getuid() != 0, os.path.exists('/proc/1'))\n")
    result = run_as(code, LIMITS)
    assert result.ok, result.stderr
    # No host descriptor (an fd outside the mount namespace would be a way out), setuid bits ignored,
    # not root, no /proc of the host.
    assert result.stdout == "[] 1 True False\n"
