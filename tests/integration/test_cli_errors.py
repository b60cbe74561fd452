"""User mistakes on the command line: exit code 2, one short message, no traceback."""

import pytest

from launch_cli import run_launch

CASES = {
    "model=nope": "unknown model 'nope'; valid choices: deepseek_r1, deepseek_v3, deepseek_v3_2,",
    "trainer.lr=abc": "bad value for 'trainer.lr'",
    "rollout.n_samples_per_prompt=0": "rollout.n_samples_per_prompt must be > 0",
    "trainer.global_batch_size=128": "batch invariant broken",
    "trainer.foo=1": "unknown key 'trainer.foo'; valid keys of trainer: backend, num_ranks, lr",
    "algo.name=nope": "expected one of [grpo, dr_grpo, dapo, gspo, reinforce_pp, reinforce_pp_baseline, rloo, cispo, ppo, opd, sft]",
    "task.kind=file": "task.train_file must be set when task.kind=file",
    "task.reward=nope_module.score": "task.reward=nope_module.score: cannot import it",
    "task.reward=math+0.1*nope": "unknown reward 'nope'",
    "task.label_extractor=latex": "task.label_extractor='latex' is unknown; valid: plain, gsm8k, boxed",
    "task.tools=[calculator]": "task.tools needs rollout.max_turns >= 2",
    "rollout.max_turns=3": "rollout.max_turns > 1 needs task.tools",
    "task.tools=[abacus]": "task.tools: unknown tool 'abacus'",
    "hardware.device=cuda": "hardware.device=cuda needs hardware.gpus_per_node >= 1: for one GPU use hardware=gpu",
    # one way to choose a backend: the old key forms name the new one
    "rollout.engine=vllm": "rollout.engine is not a key to set (the engine is chosen by its group, whose file adds "
                           "the engine's options): use rollout=vllm",
    "trainer.backend=fsdp": "trainer.backend is not a key to set (the trainer backend is chosen by its group, whose "
                            "file adds the backend's options): use trainer=fsdp",
    "debug.check_weight_sync=true": "debug.check_weight_sync is not a key to set (renamed; rollout.check_weight_sync "
                                    "is the per-sync checksum): use debug.compare_weights_tensorwise=true",
    "rollout.vllm.tensor_parallel_size=2": "use rollout.num_gpus_per_engine=2",
    "rollout.vllm.max_num_seqs=16": "use rollout.max_running=16",
    "rollout.vllm.kv_cache_gb=4": "rollout.vllm.kv_cache_gb is an option of rollout=vllm, which this run does not "
                                  "choose (only the chosen backend's options exist): add rollout=vllm",
    "rollout.weight_sync=nope": "expected one of [object_store, broadcast, shared_memory]",
}
if not __import__("torch").cuda.is_available():  # CI: a GPU profile on a machine without one
    CASES["hardware=gpu"] = "but no CUDA device is visible"


@pytest.mark.parametrize("override,expected", CASES.items())
def test_user_mistake_exits_2_with_one_message(tmp_path, override, expected):
    proc = run_launch([override], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.startswith("error: ")


def test_malformed_data_line_names_file_and_line(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": "4"}\n{oops\n')
    proc = run_launch(["task.kind=file", f"task.train_file={data}", "ray.enabled=false"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "prompts.jsonl" in proc.stderr and "line 3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_print_composed_config(tmp_path):
    proc = run_launch(["--cfg", "job", "trainer.lr=3e-4"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0
    assert "lr: 0.0003" in proc.stdout and "name: qwen3_tiny" in proc.stdout
