"""Every rollout engine backend, and the router in front of several, has the protocol's methods
(miles/rollout/protocol.py); a class that lacks one is named with what it lacks. Their behaviour
against the contract: tests/engine_contract.py, run by test_engine_contract.py (native, SGLang over a
stand-in server) and by the vLLM tier (tests/vllm)."""

import pytest

from miles.rollout.native import NativeEngine
from miles.rollout.protocol import METHODS, check_engine
from miles.rollout.router import EngineFleet
from miles.rollout.sglang_engine import SGLangEngine


@pytest.mark.parametrize("cls", [NativeEngine, SGLangEngine, EngineFleet])
def test_backends_implement_the_protocol(cls):
    check_engine(cls)


def test_a_class_without_the_methods_is_named():
    class Half:
        def generate(self):
            pass

    with pytest.raises(TypeError, match="Half is not a rollout engine: it lacks update_weights, release_memory"):
        check_engine(Half)
    assert METHODS[0] == "generate"
