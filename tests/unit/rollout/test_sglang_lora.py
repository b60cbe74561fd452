"""LoRA through SGLang's adapter API (miles/rollout/sglang_lora.py) against the local STAND-IN server
(sglang_standin.py), NOT SGLang: SGLang cannot run on this CPU machine, so the stand-in implements the
documented /load_lora_adapter, /unload_lora_adapter and /generate `lora_path` schemas and errors over the
native engine's LoRA module. What these tests hold the adapter to: the requests and their order (load the
new version under a new name, then unload the last), what every /generate names, the launch flags, the
checked sync, and outputs equal to the native engine holding the same adapters (the stand-in computes
with the native kernels, so this checks the adapters arrive where they belong, not SGLang's numerics)."""

import sys

import pytest
import torch

import sglang_standin as standin
from miles.config.schema import DType, LoRACfg, RolloutCfg
from miles.rollout.native import NativeEngine
from miles.rollout.sglang_engine import SGLangEngine, SGLangError, server_command
from miles.transport.checksum import WeightSyncError, checksum
from sglang_fixtures import ckpt, serve  # noqa: F401  (fixtures: the tiny dense checkpoint, stand-in servers)

PROMPTS = ["1+2=", "35+47=", "9+9=", "12+3="]
CFG = RolloutCfg(max_new_tokens=6)
LORA = LoRACfg(rank=4, alpha=16.0)  # scaling 4
SERVER_LORA = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"])  # wider than the adapter: padded


def random_adapters(native: NativeEngine, seed: int, scale=0.2):
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(t.shape, generator=g) for k, t in native.lora.tensors().items()}


def greedy(engine):
    return [s.response_ids for s in engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=0.0)]


def logprobs(engine):
    return torch.tensor([lp for s in engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=0.0)
                         for lp in s.rollout_logprobs])


def test_adapters_load_by_name_and_every_generate_names_the_current_one(ckpt, serve):
    server = serve(ckpt, **SERVER_LORA)
    engine = SGLangEngine(ckpt, CFG, url=server.url, lora=LORA)
    native = NativeEngine(ckpt, CFG, DType.fp32, seed=0, lora=LORA)
    base = greedy(engine)  # no sync yet: no lora_path, the base model (the trainer's B starts at 0)
    assert "lora_path" not in server.bodies("/generate")[-1] and base == greedy(native)

    first = random_adapters(native, 1)
    assert engine.update_weights(first, checksum(first)) == checksum(first)
    native.update_weights(first)
    (load,) = server.bodies("/load_lora_adapter")
    assert load["lora_name"] == "miles-lora-1" and engine.adapters.current.path.is_dir()
    after = greedy(engine)
    assert server.bodies("/generate")[-1]["lora_path"] == ["miles-lora-1"] * len(PROMPTS)
    assert after == greedy(native) and after != base  # the adapter changed what both generate
    assert (logprobs(engine) - logprobs(native)).abs().max() < 1e-5  # zero-padded to rank 8, alpha / r in B

    second = random_adapters(native, 2)
    old = engine.adapters.current.path
    engine.update_weights(second, checksum(second))
    native.update_weights(second)
    paths = [path for _, path, _ in server.log if "lora_adapter" in path]
    assert paths == ["/load_lora_adapter", "/load_lora_adapter", "/unload_lora_adapter"]  # the new one first
    assert server.bodies("/unload_lora_adapter") == [{"lora_name": "miles-lora-1"}]
    assert list(server.adapters) == ["miles-lora-2"] and not old.exists()
    assert greedy(engine) == greedy(native)
    assert engine.health()["lora_adapter"] == "miles-lora-2"
    engine.shutdown()  # an external server: left running, the adapter directories removed
    assert not engine.adapters.dirs.root.exists()


def test_the_checked_sync_covers_payload_files_and_answer(ckpt, serve, monkeypatch):
    server = serve(ckpt, **SERVER_LORA)
    engine = SGLangEngine(ckpt, CFG, url=server.url, lora=LORA)
    adapters = random_adapters(NativeEngine(ckpt, CFG, DType.fp32, lora=LORA), 3)
    with pytest.raises(WeightSyncError, match="different from what the trainer sent"):
        engine.update_weights(adapters, "0" * 64)
    with pytest.raises(ValueError, match="wrong shapes"):
        engine.update_weights({k: v[:2] if "lora_A" in k else v for k, v in adapters.items()})
    # The file the server reads differs from what was sent (a corrupted write): refused before it loads.
    import miles.rollout.adapter_files as files

    write = files.write_peft

    def corrupt(tensors, *args):
        return write({k: v + (k == min(tensors)) for k, v in tensors.items()}, *args)

    monkeypatch.setattr(files, "write_peft", corrupt)
    with pytest.raises(WeightSyncError, match="holds other values"):
        engine.update_weights(adapters, checksum(adapters))
    assert server.bodies("/load_lora_adapter") == [] and not list(engine.adapters.dirs.root.iterdir())
    monkeypatch.undo()
    # A server that answers with another adapter than the one asked for.
    monkeypatch.setattr(server, "_lora_reply", lambda error: {"success": True, "error_message": "",
                                                              "loaded_adapters": {"miles-lora-1": "/elsewhere"}})
    with pytest.raises(WeightSyncError, match="loaded_adapters"):
        engine.update_weights(adapters, checksum(adapters))


def test_a_server_without_lora_is_refused_naming_the_flags(ckpt, serve):
    server = serve(ckpt)
    with pytest.raises(ValueError, match="start it with --enable-lora --max-lora-rank 4 --lora-target-modules "
                                         "down_proj gate_proj k_proj o_proj q_proj up_proj v_proj"):
        SGLangEngine(ckpt, CFG, url=server.url, lora=LORA)
    narrow = serve(ckpt, enable_lora=True, max_lora_rank=2, lora_target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"--max-lora-rank 2 < trainer.lora.rank=4.*not \['down_proj'"):
        SGLangEngine(ckpt, CFG, url=narrow.url, lora=LORA)


def test_the_stand_in_refuses_as_sglang_does(ckpt, serve):
    """SGLang's own errors (io_struct / lora_registry / tokenizer_manager), which the adapter surfaces."""
    plain = SGLangEngine(ckpt, CFG, url=serve(ckpt).url)
    with pytest.raises(SGLangError, match="LoRA is not enabled"):
        plain._post_ok("/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"})
    server = serve(ckpt, **SERVER_LORA)
    engine = SGLangEngine(ckpt, CFG, url=server.url, lora=LORA)
    adapters = random_adapters(NativeEngine(ckpt, CFG, DType.fp32, lora=LORA), 4)
    engine.update_weights(adapters, checksum(adapters))
    path = str(engine.adapters.current.path)
    with pytest.raises(SGLangError, match="LoRA with name miles-lora-1 already exists"):
        engine._post_ok("/load_lora_adapter", {"lora_name": "miles-lora-1", "lora_path": path})
    with pytest.raises(SGLangError, match="LoRA with name gone does not exist"):
        engine._post_ok("/unload_lora_adapter", {"lora_name": "gone"})
    with pytest.raises(SGLangError, match="requested LoRA adapters are not loaded"):
        engine._post("/generate", {"input_ids": [[1, 2]], "sampling_params": {"max_new_tokens": 1},
                                   "lora_path": ["gone"]})


def test_launched_server_gets_the_lora_flags(ckpt):
    argv = server_command(ckpt, "h", 1, torch.float32, 0, torch.device("cpu"), CFG, None, False,
                          {"enable_lora": True, "max_lora_rank": 4, "lora_target_modules": ["q_proj", "v_proj"]})
    assert argv[argv.index("--enable-lora") + 1].startswith("--")
    assert argv[argv.index("--max-lora-rank") + 1] == "4"
    i = argv.index("--lora-target-modules")
    assert argv[i + 1: i + 3] == ["q_proj", "v_proj"]
    # End to end with the stand-in's CLI (launch_server's flags) as the server process.
    engine = SGLangEngine(ckpt, CFG, launcher=[sys.executable, standin.__file__], startup_timeout_s=120, lora=LORA)
    try:
        native = NativeEngine(ckpt, CFG, DType.fp32, seed=0, lora=LORA)
        adapters = random_adapters(native, 5)
        engine.update_weights(adapters, checksum(adapters))
        native.update_weights(adapters)
        assert greedy(engine) == greedy(native)
    finally:
        engine.shutdown()
