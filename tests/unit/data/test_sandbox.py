"""Each sandbox limit holds: CPU, wall time, memory, processes, file size, environment, cwd, network."""

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from miles.config.schema import SandboxCfg
from miles.data.sandbox import run_python

LIMITS = SandboxCfg(wall_time_s=3.0, cpu_time_s=1, memory_mb=256, max_processes=16, max_file_mb=1)


def test_a_program_runs_and_its_output_comes_back():
    result = run_python("print(input()[::-1])", LIMITS, stdin="olleh\n")
    assert result.ok and result.stdout == "hello\n" and result.stderr == ""
    failed = run_python("raise SystemExit(3)", LIMITS)
    assert failed.returncode == 3 and not failed.ok and not failed.timed_out


def test_output_is_truncated():
    result = run_python("print('x' * 100_000)", SandboxCfg(max_output_chars=50))
    assert result.ok and result.stdout == "x" * 50


def test_an_infinite_loop_is_killed_by_the_cpu_limit():
    start = time.perf_counter()
    result = run_python("while True: pass", LIMITS)
    assert result.returncode < 0 and not result.timed_out  # SIGXCPU / SIGKILL from RLIMIT_CPU
    assert time.perf_counter() - start < 2.5


def test_a_sleeping_program_is_killed_at_wall_time_with_its_children():
    code = ("import subprocess, time\n"
            "subprocess.Popen(['sleep', '30'])\n"  # a child in the same process group
            "print('started', flush=True)\n"
            "time.sleep(30)\n")
    start = time.perf_counter()
    result = run_python(code, SandboxCfg(wall_time_s=0.5))
    assert result.timed_out and not result.ok and result.stdout == "started\n"
    assert time.perf_counter() - start < 2.0


def test_allocating_2gb_fails_under_256mb():
    result = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", LIMITS)
    assert result.returncode != 0 and "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_writing_50mb_fails_under_1mb():
    result = run_python("open('big', 'wb').write(b'x' * (50 << 20))", LIMITS)
    assert result.returncode != 0 and "File too large" in result.stderr


def test_the_environment_has_no_parent_variables(monkeypatch):
    monkeypatch.setenv("MILES_SANDBOX_MARKER", "secret")
    result = run_python("import os, json; print(json.dumps(dict(os.environ)))", LIMITS)
    env = __import__("json").loads(result.stdout)
    assert "MILES_SANDBOX_MARKER" not in env and set(env) <= {"PATH", "LANG", "HOME", "TMPDIR"}


def test_the_cwd_is_a_fresh_temp_dir_that_is_gone_afterwards(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("parent's file")
    result = run_python("import os; print(os.getcwd()); print(sorted(os.listdir())); print(os.environ['HOME'])",
                        LIMITS)
    cwd, listing, home = result.stdout.splitlines()
    assert listing == "['main.py']" and home == cwd and Path(cwd) != tmp_path
    assert not Path(cwd).exists()


def _forks(n: int) -> str:
    return (f"import os\nfor _ in range({n}):\n"
            "    if os.fork() == 0:\n        import time; time.sleep(1); os._exit(0)\n"
            "print('forked')\n")


def test_forking_100_processes_fails_under_max_processes():
    if os.geteuid() != 0:
        result = run_python(_forks(100), LIMITS)
        assert "BlockingIOError" in result.stderr and "forked" not in result.stdout
        return
    # The kernel does not apply RLIMIT_NPROC to root: check it as an unprivileged user instead, with
    # an interpreter that user can run (this module only needs the standard library).
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None or subprocess.run([python, "-c", ""], user=65534).returncode != 0:
        pytest.skip("running as root (RLIMIT_NPROC does not bind root) and no python for an unprivileged user")
    module = importlib.util.find_spec("miles.data.sandbox").origin
    script = (f"import importlib.util, sys, types\n"
              f"spec = importlib.util.spec_from_file_location('sandbox', {module!r})\n"
              "m = sys.modules['sandbox'] = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(m)\n"
              "limits = types.SimpleNamespace(wall_time_s=3.0, cpu_time_s=1, memory_mb=256, max_processes=16,"
              " max_file_mb=1, max_output_chars=4096)\n"
              f"many, few = m.run_python({_forks(100)!r}, limits), m.run_python({_forks(5)!r}, limits)\n"
              "print('BlockingIOError' in many.stderr and 'forked' not in many.stdout, few.ok)\n")
    proc = subprocess.run([python, "-c", script], user=65534, cwd="/", capture_output=True, text=True, timeout=20)
    assert proc.stdout.split() == ["True", "True"], proc.stderr


@pytest.fixture
def local_server():
    server = socket.create_server(("127.0.0.1", 0))  # listening: the kernel completes connections
    yield server.getsockname()[1]
    server.close()


def test_no_network_when_the_namespace_is_available(local_server):
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {local_server}), timeout=1)\nprint('connected')"
    result = run_python(code, LIMITS)
    if not result.network_isolated:
        pytest.skip("this OS refuses an unprivileged user + network namespace: the sandbox keeps the network")
    assert result.returncode != 0 and "connected" not in result.stdout and "OSError" in result.stderr
    # The same connection from outside the sandbox works: the server was really there.
    socket.create_connection(("127.0.0.1", local_server), timeout=1).close()
