"""`dry_run=true` answers the memory question from the command line: exit 0 with the plan when the
run fits, exit 3 with what to change when it does not (issue contract; sizes in docs/precision.md)."""

import pytest

from launch_cli import run_launch

pytestmark = pytest.mark.slow
KIMI = ["model=kimi_k2", "hardware=h200", "hardware.num_nodes=32", "rollout.num_gpus_per_engine=8", "dry_run=true"]


def test_kimi_k2_int4_qat_plans_on_32_h200_nodes(tmp_path):
    out = run_launch([*KIMI, "precision=int4_qat"], tmp_path, env_extra={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "fits" in out.stdout and "int4 (+ scales); 32 engine(s) x 8 GPU(s)" in out.stdout


def test_kimi_k2_bf16_is_refused_because_one_engine_cannot_hold_it(tmp_path):
    out = run_launch([*KIMI, "precision=bf16"], tmp_path, env_extra={"COLUMNS": "200"})
    assert out.returncode == 3
    assert "one rollout engine's weights do not fit 8 GPUs" in out.stderr
    assert "precision=int4_qat" in out.stdout and "rollout.num_gpus_per_engine=32" in out.stdout  # the fixes


def test_qwen3_30b_a3b_plans_on_one_h100_node(tmp_path):
    out = run_launch(["model=qwen3_30b_a3b", "hardware=h100", "dry_run=true"], tmp_path, env_extra={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "(8 GPUs, 72.0 GB usable each" in out.stdout


def test_glm5_fp8_plans_on_a_gb300_rack(tmp_path):
    out = run_launch(["model=glm5", "precision=fp8", "hardware=gb300", "dry_run=true"], tmp_path,
                     env_extra={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "(64 GPUs, 259.2 GB usable each" in out.stdout and "fp8 (+ scales)" in out.stdout


def test_a_launched_run_checks_the_same_plan(tmp_path):
    out = run_launch(["model=qwen3_32b", "steps=1"], tmp_path, env_extra={"COLUMNS": "200"})
    assert out.returncode == 3 and "training state does not fit" in out.stderr
    assert not (tmp_path / "mlruns").exists()  # refused before anything started


def test_a_one_gpu_math_preset_plans_packed_micro_batches_on_an_h200(tmp_path):
    out = run_launch(["+experiment=qwen3_4b_math_gpu", "dry_run=true", "model.hf_checkpoint=null",
                      "hardware.memory_gb=141"], tmp_path, env_extra={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "(1 GPU, 126.9 GB usable" in out.stdout and ": fits" in out.stdout
    assert "packed: 8,192 tokens (max_tokens_per_micro_batch) of 2,560-token sequences" in out.stdout
    assert "holds 304 sequences of 2560 tokens; 256 per engine per step" in out.stdout
