"""rollout=sglang through the RL loop: `launch.py`'s run (in-process) drives the SGLang adapter against
a local STAND-IN server (tests/unit/rollout/sglang_standin.py, not SGLang: it implements the documented
0.5.23 request / response schemas over the native engine; SGLang cannot run here). The first checked
sync loads the trainer's weights into the server, every step syncs through /update_weights_from_disk
checked as the default rollout.check_weight_sync=true asks, and the server's log-probs equal the
trainer's (both are the native kernels in fp32). The stand-in answers /get_weights_by_name with HTTP 400
for this Qwen3 model, as SGLang 0.5.23 does (issue 25: that made every checked sync fail): the check
goes through /weights_checker's per-tensor checksums."""

import sys
from pathlib import Path

import pytest
from runs import TINY, journal_metrics, run_inprocess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "rollout"))
import sglang_standin as standin  # noqa: E402

pytestmark = pytest.mark.slow


def test_grpo_steps_through_the_sglang_adapter(tmp_path, monkeypatch, compose):
    from miles.data.tokenizer import DEFAULT_ALPHABET
    from miles.orchestrate.checkpoints import random_checkpoint

    monkeypatch.chdir(tmp_path)
    # Another seed than the run's initial weights: only the first sync makes the server hold them.
    served = random_checkpoint(compose([]).model, DEFAULT_ALPHABET, seed=123, out=tmp_path / "served")
    server = standin.StandInServer(str(served)).start()
    try:
        run_inprocess(compose, [*TINY, "steps=2", "rollout=sglang", f"rollout.sglang.url={server.url}"],
                      tmp_path / "run")
    finally:
        server.kill()
    metrics = journal_metrics(tmp_path / "run")
    assert sorted(metrics) == [0, 1, 2]
    for step in (1, 2):
        assert metrics[step]["mismatch/logprob_abs_diff"] < 1e-5
        assert metrics[step]["perf/weight_sync_s"] > 0
    paths = [path for _, path, _ in server.log]
    assert paths.count("/update_weights_from_disk") == 3  # the first sync, then one per step
    assert "/generate" in paths and "/get_weights_by_name" not in paths
    assert paths.count("/weights_checker") == 3  # every sync checked, through SGLang's checksums
    assert Path(server.model_path).is_dir()  # /model_info names the last weights directory: it is still there


def test_lora_steps_through_the_sglang_adapter_api(tmp_path, monkeypatch, compose):
    """trainer.lora.rank=8 with rollout=sglang, SGLang MOCKED by the stand-in (it cannot run on this CPU
    machine): every sync is /load_lora_adapter of a new PEFT directory, then /unload_lora_adapter of the
    last one; the base weights never travel. The server serves the run's initial checkpoint (the frozen
    base: the random init of the run's seed), as a launched server would. Step 2's rollouts come from the
    adapters step 1 trained: their log-probs equal the trainer's (measured 1.0e-7; with /generate
    not naming the adapter, i.e. serving the base model, 0.147)."""
    from miles.data.tokenizer import DEFAULT_ALPHABET
    from miles.orchestrate.checkpoints import random_checkpoint

    monkeypatch.chdir(tmp_path)
    cfg = compose([])
    served = random_checkpoint(cfg.model, DEFAULT_ALPHABET, seed=cfg.seed, out=tmp_path / "served")
    server = standin.StandInServer(str(served), enable_lora=True, max_lora_rank=8, lora_target_modules=["all"]).start()
    try:
        run_inprocess(compose, [*TINY, "steps=2", "rollout=sglang", f"rollout.sglang.url={server.url}",
                                "trainer.lora.rank=8", "trainer.lr=3e-3"], tmp_path / "run")
    finally:
        server.kill()
    metrics = journal_metrics(tmp_path / "run")
    for step in (1, 2):
        assert metrics[step]["mismatch/logprob_abs_diff"] < 1e-5
    paths = [path for _, path, _ in server.log]
    assert paths.count("/load_lora_adapter") == 3 and paths.count("/unload_lora_adapter") == 2  # first sync + 2 steps
    assert "/update_weights_from_disk" not in paths and "/weights_checker" not in paths
    assert list(server.adapters) == ["miles-lora-3"]
    assert server.bodies("/generate")[-1]["lora_path"][0] == "miles-lora-3"
