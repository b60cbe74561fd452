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
