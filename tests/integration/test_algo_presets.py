"""Every algorithm preset runs 2 RL steps end to end (in-process, the same loop Ray drives)."""

import json
from pathlib import Path

import pytest

from conftest import run_launch

pytestmark = pytest.mark.slow
PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "algo").glob("*.yaml"))


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "sft"])
def test_preset_runs_two_steps(tmp_path, preset):
    proc = run_launch(
        [f"algo={preset}", "ray.enabled=false", "steps=2", "eval.interval=2", "task.eval_size=8",
         "warm_start.enabled=false", "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
         "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "tracking.log_samples=0"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "step    2/2" in proc.stdout
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    assert f"name: {preset}" in (run_dir / "resolved.yaml").read_text()
    assert json.loads((run_dir / "checkpoint" / "config.json").read_text())["model_type"] == "qwen3"
