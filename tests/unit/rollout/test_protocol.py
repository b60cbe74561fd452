"""Every rollout engine backend, and the router in front of several, has the protocol's methods and
takes their arguments as the callers pass them (miles/rollout/protocol.py); a class that lacks one is
named with what it lacks. Their behaviour
against the contract: tests/engine_contract.py, run by test_engine_contract.py (native, SGLang over a
stand-in server) and by the vLLM tier (tests/vllm)."""

import pytest

from miles.rollout.native import NativeEngine
from miles.rollout.protocol import METHODS, check_engine
from miles.rollout.router import EngineFleet
from miles.rollout.sglang_engine import SGLangEngine
from miles.rollout.vllm_engine import VLLMEngine


@pytest.mark.parametrize("cls", [NativeEngine, VLLMEngine, SGLangEngine, EngineFleet])
def test_backends_implement_the_protocol(cls):
    check_engine(cls)


def test_a_class_without_the_methods_is_named():
    class Half:
        def generate(self):
            pass

    with pytest.raises(TypeError, match="Half is not a rollout engine: it lacks update_weights, update_draft_weights, "
                                        "release_memory"):
        check_engine(Half)
    assert METHODS[0] == "generate"


def test_a_method_without_the_arguments_callers_pass_is_named():
    """Callers go through handles by method name (`handle.call("release_memory", keep_weights=False)`),
    so an argument a method lacks only fails when that call runs: check_engine names it up front
    (issue 25: VLLMEngine.release_memory took no keep_weights, which colocation passes)."""
    class Drifted(NativeEngine):
        def release_memory(self, tags=("weights", "kv_cache")):  # no keep_weights
            pass

        def generate(self, prompts, labels, temperature=None, n=1, **kwargs):  # n moved: called positionally
            pass

    with pytest.raises(TypeError, match=r"take the protocol's arguments generate\(n\), generate\(temperature\), "
                                        r"generate\(max_new_tokens\), release_memory\(keep_weights\)$"):
        check_engine(Drifted)

    class Forwarding(NativeEngine):  # *args / **kwargs take whatever is passed (a fleet forwards them)
        def release_memory(self, *args, **kwargs):
            pass

    check_engine(Forwarding)
