"""The rollout protocol's contract suite (tests/engine_contract.py) against the native engine and against
the SGLang adapter (miles/rollout/sglang_engine.py) over a STAND-IN server (sglang_standin.py): the stand-in
implements SGLang 0.5.23's documented HTTP API over the native engine; no live SGLang runs here, so the
SGLang side checks the adapter's use of that API, not SGLang itself (docs/sglang.md). The same suite runs
against real vLLM in tests/vllm/test_vllm_contract.py (`make test-vllm`)."""

import pytest

pytest.register_assert_rewrite("engine_contract")

from engine_contract import *  # noqa: E402,F401,F403  (the suite's tests)
from engine_contract import Contract  # noqa: E402
from miles.config.schema import DType, RolloutCfg  # noqa: E402
from sglang_fixtures import StandIns, ckpt  # noqa: E402,F401  (ckpt: the tiny dense checkpoint fixture)

CFG = RolloutCfg(max_new_tokens=6)


@pytest.fixture(scope="module", params=["native", "sglang"])
def contract(request, ckpt):  # noqa: F811
    from miles.rollout.native import NativeEngine
    from miles.rollout.sglang_engine import SGLangEngine, SGLangServerGone

    if request.param == "native":
        yield Contract(NativeEngine(ckpt, CFG, DType.fp32, seed=1), "native", ckpt,
                       build=lambda cfg: NativeEngine(ckpt, cfg, DType.fp32))
        return
    servers, served = StandIns(), {}

    def build(cfg):
        # The suite's seed tests need seeded sampling: SGLang honours sampling_seed only with this flag
        # (the stand-in, as 0.5.23, ignores seeds without it; test_sglang_engine.py checks that case).
        server = servers.start(ckpt, enable_deterministic_inference=True)
        engine = SGLangEngine(ckpt, cfg, DType.fp32, url=server.url)
        served[id(engine)] = server
        return engine

    def kill(engine):
        served[id(engine)].kill()

    try:
        yield Contract(build(CFG), "sglang", ckpt, build, kill, dead=SGLangServerGone, dead_match="gone")
    finally:
        servers.kill_all()
