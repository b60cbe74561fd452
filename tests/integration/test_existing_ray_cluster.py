"""`ray.address=auto` joins a Ray cluster started outside Miles (`ray start --head`) instead of
starting its own; the actors then live on that cluster."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_launch

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).parent / "ray")


@pytest.fixture
def ray_head(tmp_path):
    temp = tmp_path / "ray"
    start = subprocess.run(
        [RAY, "start", "--head", "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={temp}",
         "--disable-usage-stats"],
        capture_output=True, text=True, timeout=180,
    )
    assert start.returncode == 0, start.stderr[-2000:]
    yield temp
    subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)


def test_join_existing_cluster(tmp_path, ray_head):
    proc = run_launch(
        ["ray.address=auto", "steps=1", "eval.interval=1", "task.eval_size=8", "warm_start.enabled=false",
         "rollout.batch_size=2", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=8",
         "trainer.micro_batch_size=8"],
        cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # The driver attached to the cluster's session folder rather than creating its own.
    sessions = list(ray_head.glob("session_2*"))
    assert len(sessions) == 1
    assert any(sessions[0].glob("logs/worker-*")), "no worker of ours ran on the external cluster"
