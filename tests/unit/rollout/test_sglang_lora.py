"""LoRA through SGLang's adapter API (miles/rollout/sglang_lora.py) against the local STAND-IN server
(sglang_standin.py), NOT SGLang: SGLang cannot run on this CPU machine, so the stand-in implements the
documented /load_lora_adapter, /unload_lora_adapter and /generate `lora_path` schemas and errors over the
native engine's LoRA module. What these tests hold the adapter to: the requests and their order (load the
new version under a new name, then unload the last), what every /generate names, the launch flags, the
checked sync, and outputs equal to the native engine holding the same adapters (the stand-in computes
with the native kernels, so this checks the adapters arrive where they belong, not SGLang's numerics).
Several adapters (trainer.lora.adapters), SGLang still MOCKED: each loaded under its own name, every
/generate row naming its prompt's adapter in `lora_path` (the stand-in computes each row with the
adapter it names), per-version load / unload, the checked sync over all of them."""

import sys
from pathlib import Path

import pytest
import torch

import sglang_standin as standin
from miles.config.schema import DType, LoRACfg, RolloutCfg
from miles.rollout.native import NativeEngine
from miles.rollout.sglang_engine import SGLangEngine, SGLangError, server_command
from miles.rollout.sglang_lora import server_lora_args
from miles.transport.checksum import WeightSyncError, checksum
from sglang_fixtures import ckpt, serve  # noqa: F401  (fixtures: the tiny dense checkpoint, stand-in servers)

PROMPTS = ["1+2=", "35+47=", "9+9=", "12+3="]
CFG = RolloutCfg(max_new_tokens=6)
LORA = LoRACfg(rank=4, alpha=16.0)  # scaling 4
SERVER_LORA = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"])  # wider than the adapter: padded
TWO = LoRACfg(rank=4, alpha=16.0, adapters=["add", "mul"])
ROUTE = [0, 1, 1, 0]  # PROMPTS' adapters: a batch that mixes them


def random_adapters(native: NativeEngine, seed: int, scale=0.2):
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(t.shape, generator=g) for k, t in native.lora.tensors().items()}


def greedy(engine, **routed):
    return [s.response_ids for s in engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=0.0, **routed)]


def logprobs(engine, **routed):
    return torch.tensor([lp for s in engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=0.0, **routed)
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
    assert load["lora_name"] == "miles-lora-1" and engine.adapters.versions.current[0].path.is_dir()
    after = greedy(engine)
    assert server.bodies("/generate")[-1]["lora_path"] == ["miles-lora-1"] * len(PROMPTS)
    assert after == greedy(native) and after != base  # the adapter changed what both generate
    assert (logprobs(engine) - logprobs(native)).abs().max() < 1e-5  # zero-padded to rank 8, alpha / r in B

    second = random_adapters(native, 2)
    old = engine.adapters.versions.current[0].path
    engine.update_weights(second, checksum(second))
    native.update_weights(second)
    paths = [path for _, path, _ in server.log if "lora_adapter" in path]
    assert paths == ["/load_lora_adapter", "/load_lora_adapter", "/unload_lora_adapter"]  # the new one first
    assert server.bodies("/unload_lora_adapter") == [{"lora_name": "miles-lora-1"}]
    assert list(server.adapters) == ["miles-lora-2"] and not old.exists()
    assert greedy(engine) == greedy(native)
    assert engine.health()["lora_adapters"] == ["miles-lora-2"]
    engine.shutdown()  # an external server: left running, the adapter directories removed
    assert not engine.adapters.versions.dirs.root.exists()


def test_several_adapters_each_row_served_by_its_own(ckpt, serve):
    server = serve(ckpt, **SERVER_LORA)
    engine = SGLangEngine(ckpt, CFG, url=server.url, lora=TWO)
    native = NativeEngine(ckpt, CFG, DType.fp32, seed=0, lora=TWO)
    first = random_adapters(native, 1)  # "add/<module>..." and "mul/<module>...", as the trainer sends them
    assert engine.update_weights(first, checksum(first)) == checksum(first)
    native.update_weights(first)
    assert [b["lora_name"] for b in server.bodies("/load_lora_adapter")] == ["miles-lora-add-1", "miles-lora-mul-2"]

    samples = engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=2, temperature=0.0, adapters=ROUTE)
    names = ["miles-lora-add-1", "miles-lora-mul-2"]
    assert server.bodies("/generate")[-1]["lora_path"] == [names[k] for k in ROUTE for _ in range(2)]
    assert [s.adapter for s in samples] == [k for k in ROUTE for _ in range(2)]
    mixed = greedy(engine, adapters=ROUTE)
    assert mixed == greedy(native, adapters=ROUTE)  # the native engine's one routed batch
    assert (logprobs(engine, adapters=ROUTE) - logprobs(native, adapters=ROUTE)).abs().max() < 1e-5
    for i, k in enumerate(ROUTE):  # each prompt alone with its adapter
        alone = engine.generate(PROMPTS[i:i + 1], ["?"], n=1, temperature=0.0, adapters=[k])[0]
        assert alone.response_ids == mixed[i]
    assert mixed != greedy(engine, adapters=[1 - k for k in ROUTE])  # the adapters differ, so routing shows

    second = random_adapters(native, 2)
    old = [a.path for a in engine.adapters.versions.current]
    engine.update_weights(second, checksum(second))
    native.update_weights(second)
    calls = [(path, body["lora_name"]) for _, path, body in server.log if "lora_adapter" in path][2:]
    assert calls == [("/load_lora_adapter", "miles-lora-add-3"), ("/unload_lora_adapter", "miles-lora-add-1"),
                     ("/load_lora_adapter", "miles-lora-mul-4"), ("/unload_lora_adapter", "miles-lora-mul-2")]
    assert list(server.adapters) == ["miles-lora-add-3", "miles-lora-mul-4"] and not any(p.exists() for p in old)
    assert greedy(engine, adapters=ROUTE) == greedy(native, adapters=ROUTE)
    assert engine.health()["lora_adapters"] == ["miles-lora-add-3", "miles-lora-mul-4"]
    with pytest.raises(ValueError, match="one LoRA adapter id per prompt"):
        greedy(engine)
    with pytest.raises(ValueError, match=r"adapter ids \[2\] out of range"):
        greedy(engine, adapters=[0, 1, 2, 0])


def test_several_adapters_checked_sync_and_a_failed_swap(ckpt, serve, monkeypatch):
    server = serve(ckpt, **SERVER_LORA, max_loaded_loras=3)  # the least that serves 2: a sync holds 3 for a moment
    engine = SGLangEngine(ckpt, CFG, url=server.url, lora=TWO)
    native = NativeEngine(ckpt, CFG, DType.fp32, seed=0, lora=TWO)
    first = random_adapters(native, 1)
    engine.update_weights(first, checksum(first))
    native.update_weights(first)
    # The second adapter's file differs from what was sent: refused before anything loads.
    import miles.rollout.adapter_files as files

    write = files.write_peft

    def corrupt_mul(tensors, rank, alpha, arch, path, *args):
        bump = float(Path(path).name == "v4")  # this sync's second version: "mul"'s
        return write({k: v + bump for k, v in tensors.items()}, rank, alpha, arch, path, *args)

    monkeypatch.setattr(files, "write_peft", corrupt_mul)
    second = random_adapters(native, 2)
    with pytest.raises(WeightSyncError, match="hold other values"):
        engine.update_weights(second, checksum(second))
    monkeypatch.undo()
    assert len(server.bodies("/load_lora_adapter")) == 2 and list(server.adapters) == ["miles-lora-add-1",
                                                                                       "miles-lora-mul-2"]
    # The server refuses a load (its --max-loaded-loras reached by someone else's adapter): the sync raises,
    # the engine still serves the last versions, and the versions not loaded leave no directory behind.
    extra = str(engine.adapters.versions.current[0].path)
    engine._post_ok("/load_lora_adapter", {"lora_name": "someone-else", "lora_path": extra})
    with pytest.raises(SGLangError, match="Maximum number of loaded LoRA adapters is 3"):
        engine.update_weights(second, checksum(second))
    assert [a.name for a in engine.adapters.versions.current] == ["miles-lora-add-1", "miles-lora-mul-2"]
    assert sorted(p.name for p in engine.adapters.versions.dirs.root.iterdir()) == ["v1", "v2"]
    assert greedy(engine, adapters=ROUTE) == greedy(native, adapters=ROUTE)


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
    with pytest.raises(WeightSyncError, match="hold other values"):
        engine.update_weights(adapters, checksum(adapters))
    assert server.bodies("/load_lora_adapter") == [] and not list(engine.adapters.versions.dirs.root.iterdir())
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
    with pytest.raises(ValueError, match="v_proj --max-loras-per-batch 2$"):  # several adapters: one batch holds all
        SGLangEngine(ckpt, CFG, url=server.url, lora=TWO)
    full = serve(ckpt, **SERVER_LORA, max_loaded_loras=2)
    with pytest.raises(ValueError, match="a sync holds 3 adapter versions for a moment: start it with "
                                         "--max-loaded-loras 3"):
        SGLangEngine(ckpt, CFG, url=full.url, lora=TWO)


def test_the_stand_in_refuses_as_sglang_does(ckpt, serve):
    """SGLang's own errors (io_struct / lora_registry / tokenizer_manager), which the adapter surfaces."""
    plain = SGLangEngine(ckpt, CFG, url=serve(ckpt).url)
    with pytest.raises(SGLangError, match="LoRA is not enabled"):
        plain._post_ok("/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"})
    server = serve(ckpt, **SERVER_LORA)
    engine = SGLangEngine(ckpt, CFG, url=server.url, lora=LORA)
    adapters = random_adapters(NativeEngine(ckpt, CFG, DType.fp32, lora=LORA), 4)
    engine.update_weights(adapters, checksum(adapters))
    path = str(engine.adapters.versions.current[0].path)
    with pytest.raises(SGLangError, match="LoRA with name miles-lora-1 already exists"):
        engine._post_ok("/load_lora_adapter", {"lora_name": "miles-lora-1", "lora_path": path})
    with pytest.raises(SGLangError, match="LoRA with name gone does not exist"):
        engine._post_ok("/unload_lora_adapter", {"lora_name": "gone"})
    with pytest.raises(SGLangError, match="requested LoRA adapters are not loaded"):
        engine._post("/generate", {"input_ids": [[1, 2]], "sampling_params": {"max_new_tokens": 1},
                                   "lora_path": ["gone"]})


@pytest.mark.parametrize("lora, routed", [(LORA, {}), (TWO, {"adapters": ROUTE})], ids=["one", "two"])
def test_launched_server_gets_the_lora_flags(ckpt, lora, routed):
    argv = server_command(ckpt, "h", 1, torch.float32, 0, torch.device("cpu"), CFG, None, False,
                          server_lora_args(lora, {"q_proj.lora_A.weight": (4, 32), "v_proj.lora_A.weight": (4, 32)}))
    assert argv[argv.index("--enable-lora") + 1].startswith("--")
    assert argv[argv.index("--max-lora-rank") + 1] == "4"
    i = argv.index("--lora-target-modules")
    assert argv[i + 1: i + 3] == ["q_proj", "v_proj"]
    assert ("--max-loras-per-batch" in argv) == bool(lora.adapters)  # SGLang's default (8) serves one adapter
    if lora.adapters:
        assert argv[argv.index("--max-loras-per-batch") + 1] == "2"
    # End to end with the stand-in's CLI (launch_server's flags) as the server process.
    engine = SGLangEngine(ckpt, CFG, launcher=[sys.executable, standin.__file__], startup_timeout_s=120, lora=lora)
    try:
        native = NativeEngine(ckpt, CFG, DType.fp32, seed=0, lora=lora)
        adapters = random_adapters(native, 5)
        engine.update_weights(adapters, checksum(adapters))
        native.update_weights(adapters)
        assert greedy(engine, **routed) == greedy(native, **routed)
    finally:
        engine.shutdown()


def test_a_rebuilt_engine_replaces_the_versions_its_predecessor_left(ckpt, serve):
    """The supervisor rebuilds a failed engine against the same running server: the new engine numbers
    its versions from 1 again and meets a name the old one left loaded ("already exists"); it unloads
    that leftover and loads its own, and serves it (stand-in, SGLang mocked)."""
    server = serve(ckpt, **SERVER_LORA)
    native = NativeEngine(ckpt, CFG, DType.fp32, seed=0, lora=LORA)
    old = SGLangEngine(ckpt, CFG, url=server.url, lora=LORA)
    for seed in (1, 2):
        synced = random_adapters(native, seed)
        old.update_weights(synced, checksum(synced))
    old.shutdown()
    assert list(server.adapters) == ["miles-lora-2"]  # left on the server by the old engine

    new = SGLangEngine(ckpt, CFG, url=server.url, lora=LORA)
    for seed in (3, 4):  # versions 1 and 2 again
        synced = random_adapters(native, seed)
        assert new.update_weights(synced, checksum(synced)) == checksum(synced)
    native.update_weights(synced)
    assert list(server.adapters) == ["miles-lora-2"]
    assert server.adapters["miles-lora-2"][0] == str(new.adapters.versions.current[0].path)  # (path, tensors)
    assert greedy(new) == greedy(native)
    new.shutdown()
