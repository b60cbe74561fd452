"""`ray.address=auto` joins a Ray cluster started outside Miles (`ray start --head`) instead of
starting its own; the actors then live on that cluster."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from launch_cli import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.serial]
RAY = str(Path(sys.executable).parent / "ray")


@pytest.fixture
def ray_head():
    # Ray's socket paths must fit AF_UNIX's 107 bytes: pytest's tmp_path is too deep for them.
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    start = subprocess.run(
        [RAY, "start", "--head", "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={temp}",
         "--disable-usage-stats"],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "RAY_worker_niceness": "0"},  # as docs/scale-out.md tells users to start theirs
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


@pytest.fixture
def two_node_cluster():
    """ray.cluster_utils.Cluster: a head and a second node (own raylets, 2 CPUs each) on this machine."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "_system_config": {"worker_niceness": 0}})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def test_trainer_ranks_and_engines_across_two_nodes(tmp_path, two_node_cluster):
    """2 FSDP2 ranks and 2 engines are 4 one-CPU actors: with 2 CPUs per node they cannot share a
    node, so the run places them over both (the ranks' placement group packs them on one node and
    the engines land on the other), and gloo and the weight sync cross between the nodes."""
    args = [f"ray.address={two_node_cluster.address}", "steps=2", "eval.interval=2", "task.eval_size=8", "warm_start.enabled=false",
            "rollout.batch_size=2", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=8",
            "trainer.micro_batch_size=4", "trainer=fsdp", "trainer.num_ranks=2", "rollout.num_engines=2",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "step    2/2" in proc.stdout
