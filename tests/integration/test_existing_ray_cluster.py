"""`ray.address=auto` joins a Ray cluster started outside Miles (`ray start --head`) instead of
starting its own; the actors then live on that cluster."""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from launch_cli import ROOT

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).parent / "ray")


@pytest.fixture
def ray_head():
    # Ray's socket paths must fit AF_UNIX's 107 bytes: pytest's tmp_path is too deep for them.
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    start = subprocess.run(
        [RAY, "start", "--head", "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={temp}",
         "--disable-usage-stats"],
        capture_output=True, text=True, timeout=180,
    )
    assert start.returncode == 0, start.stderr[-2000:]
    yield temp
    subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)
    shutil.rmtree(temp, ignore_errors=True)


def test_join_existing_cluster(tmp_path, ray_head):
    args = ["ray.address=auto", "steps=1", "eval.interval=1", "task.eval_size=8", "warm_start.enabled=false",
            "rollout.batch_size=2", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=8",
            "trainer.micro_batch_size=8"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), *args], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    # Ray names each driver's log after its pid: ours sits in the external cluster's session folder.
    (session,) = ray_head.glob("session_2*")
    assert list(session.glob(f"logs/python-core-driver-*_{proc.pid}.log")), "launch.py did not join the cluster"
