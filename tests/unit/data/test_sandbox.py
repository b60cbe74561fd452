"""Each sandbox limit holds, as root and as an unprivileged user: CPU, wall time, memory, file size,
open files, output size, environment, a fresh scratch directory (conftest.py: run_as)."""

import json
import time

import pytest

from miles.config.schema import SandboxCfg

# Wall-clock limits and kills are asserted: make test runs this file alone, after the parallel part.
pytestmark = pytest.mark.serial
LIMITS = SandboxCfg(wall_time_s=3.0, cpu_time_s=1, memory_mb=256, max_processes=16, max_file_mb=1)


def test_a_program_runs_and_its_output_comes_back(run_as):
    result = run_as("print(input()[::-1])", LIMITS, "olleh\n")
    assert result.ok and result.stdout == "hello\n" and result.stderr == ""
    failed = run_as("raise SystemExit(3)", LIMITS)
    assert failed.returncode == 3 and not failed.ok and not failed.timed_out


def test_output_is_truncated(run_as):
    result = run_as("print('x' * 100_000)", SandboxCfg(max_output_chars=50))
    assert result.ok and result.stdout == "x" * 50


def test_an_infinite_loop_is_killed_by_the_cpu_limit(run_as):
    start = time.perf_counter()
    result = run_as("while True: pass", LIMITS)
    assert result.returncode < 0 and not result.timed_out  # SIGXCPU / SIGKILL from RLIMIT_CPU
    assert time.perf_counter() - start < 2.9  # before the 3 s wall time


def test_a_sleeping_program_is_killed_at_wall_time_with_its_children(run_as):
    code = ("import subprocess, time\n"
            "subprocess.Popen(['sleep', '30'])\n"
            "print('started', flush=True)\n"
            "time.sleep(30)\n")
    start = time.perf_counter()
    result = run_as(code, SandboxCfg(wall_time_s=0.5))
    assert result.timed_out and not result.ok and result.stdout == "started\n"
    assert time.perf_counter() - start < 2.0


def test_allocating_2gb_fails_under_256mb(run_as):
    result = run_as("x = bytearray(2 * 1024**3)\nprint('allocated')", LIMITS)
    assert result.returncode != 0 and "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_writing_50mb_fails_under_1mb(run_as):
    result = run_as("open('big', 'wb').write(b'x' * (50 << 20))", LIMITS)
    assert result.returncode != 0 and "File too large" in result.stderr


def test_opening_100_files_fails_under_the_open_files_limit(run_as):
    code = "files = [open(f'f{i}', 'w') for i in range(100)]\nprint('opened')"
    result = run_as(code, LIMITS)
    assert result.returncode != 0 and "Too many open files" in result.stderr and "opened" not in result.stdout
    assert run_as("files = [open(f'f{i}', 'w') for i in range(20)]", LIMITS).ok  # a few are fine


def test_the_environment_has_no_parent_variables(run_as, monkeypatch):
    monkeypatch.setenv("MILES_SANDBOX_MARKER", "secret")
    result = run_as("import os, json; print(json.dumps(dict(os.environ)))", LIMITS)
    env = json.loads(result.stdout)
    assert "MILES_SANDBOX_MARKER" not in env and set(env) <= {"PATH", "LANG", "HOME", "TMPDIR"}


def test_the_cwd_is_a_scratch_dir_of_its_own_each_run(run_as):
    code = ("import os\nprint(os.getcwd(), os.environ['HOME'], os.environ['TMPDIR'], sorted(os.listdir()))\n"
            "open('left-behind', 'w').write('x')\n")
    first, second = run_as(code, LIMITS), run_as(code, LIMITS)
    assert first.ok and second.ok
    assert first.stdout == second.stdout == "/tmp /tmp /tmp ['main.py']\n"  # nothing of the last run
