"""SGLangEngine (miles/rollout/sglang_engine.py) against a local STAND-IN server (sglang_standin.py), not a
live SGLang: the stand-in implements the documented 0.5.23 request / response schemas over the native
engine and refuses any request off that schema, so these tests check the adapter's requests and its
reading of the answers. Where a real 0.5.23 server was seen to differ from the documents (issue 25:
/get_weights_by_name fails for Qwen3 / Qwen3-MoE / DeepSeek, sampling_seed is ignored without
--enable-deterministic-inference, /model_info names the last weights directory), the stand-in does what
0.5.23's source does, and these tests hold the adapter to it (docs/sglang.md).
The protocol's contract (groups, log-probs, lengths, stops, seeds, greedy, weights, memory, health) is
the shared suite's, run over the same stand-in in test_engine_contract.py; this file has what is SGLang's."""

import logging
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import sglang_standin as standin
from miles.config.schema import DType, ModelCfg, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint
from miles.orchestrate.supervise import Fault
from miles.transport.checksum import WeightSyncError, checksum
from miles.rollout.sglang_engine import SGLangEngine, SGLangServerGone, sample_seed, server_command
from miles.rollout.sglang_weights import cpu_tensor_hash, gpu_tensor_hash, sglang_layout
from miles.types import build_train_batch, moe_layers, stack_routing
from sglang_fixtures import ckpt, serve  # noqa: F401  (fixtures: the tiny dense checkpoint, stand-in servers)

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
PROMPTS = ["1+2=", "35+47=", "9+9=", "12+3="]
CFG = RolloutCfg(max_new_tokens=6)


def tiny(name: str, out) -> str:
    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / f"{name}.yaml")))
    return str(random_checkpoint(model, DEFAULT_ALPHABET, 0, out))


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return tiny("qwen3_moe_tiny", tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def deepseek_ckpt(tmp_path_factory):
    return tiny("deepseek_v3_tiny", tmp_path_factory.mktemp("deepseek"))


def perturbed(state, delta=0.01):
    return {k: (v.float() + delta).to(v.dtype) for k, v in state.items()}


# ----------------------------------------------------------------------------- generate
def test_generate_request_schema(ckpt, serve):
    server = serve(ckpt)
    engine = SGLangEngine(ckpt, CFG, url=server.url, seed=1)
    samples = engine.generate(PROMPTS, ["3", "82", "18", "15"], n=3, temperature=0.7)
    eos = engine.tok.eos_id
    # what crossed HTTP: one batched /generate, each prompt n times, sampling params one to one
    body = server.bodies("/generate")[-1]
    assert body["input_ids"] == [s.prompt_ids for s in samples] and body["return_logprob"] is True
    p = body["sampling_params"][0]
    assert (p["temperature"], p["top_p"], p["top_k"], p["max_new_tokens"]) == (0.7, 1.0, -1, 6)
    assert eos in p["stop_token_ids"] and len({q["sampling_seed"] for q in body["sampling_params"]}) == 12
    # the stand-in is strict: off-schema requests are refused, so the adapter's drift would be caught
    for bad in ({"input_ids": [[1, 4]], "sampling_params": {"temprature": 1.0}},
                {"input_ids": [[1, 4]], "return_logprobs": True},
                {"input_ids": [[1, 4]], "sampling_params": {"frequency_penalty": 0.5}}):
        with pytest.raises(standin.BadRequest):
            server.handle("POST", "/generate", bad)


def test_seeds_need_the_deterministic_flag(ckpt, serve, caplog):
    """SGLang 0.5.23 uses sampling_seed only under --enable-deterministic-inference (sampling_batch_info.py):
    the stand-in without the flag ignores seeds as the real server does; the adapter reads the flag from
    /server_info at start, warns without it, and refuses seeded sampling (what a fleet needs) rather than
    return samples that do not follow their seeds. Greedy and unseeded calls still work."""
    body = {"input_ids": [[1, 4, 5]] * 4, "return_logprob": True,
            "sampling_params": [{"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 7 + i % 2} for i in range(4)]}
    plain, seeded = serve(ckpt), serve(ckpt, enable_deterministic_inference=True)

    def tokens(server):
        return [out["output_ids"] for out in server.handle("POST", "/generate", body)]

    assert tokens(seeded) == tokens(seeded) and tokens(seeded)[0] == tokens(seeded)[2]  # the seed decides
    runs = [tokens(plain) for _ in range(3)]
    assert runs[0] != runs[1] or runs[1] != runs[2]  # the seed is ignored
    with caplog.at_level(logging.WARNING, logger="miles.rollout.sglang_engine"):
        engine = SGLangEngine(ckpt, CFG, url=plain.url)
    assert "--enable-deterministic-inference" in caplog.text and engine.health()["seeded_sampling"] is False
    with pytest.raises(ValueError, match="ignores sampling_seed.*--enable-deterministic-inference"):
        engine.generate(PROMPTS, ["?"] * 4, n=2, temperature=1.0, seeds=[1, 2, 3, 4])
    assert len(engine.generate(PROMPTS, ["?"] * 4, n=2, temperature=1.0)) == 8
    assert len(engine.generate(PROMPTS, ["?"] * 4, n=2, temperature=0.0, seeds=[1, 2, 3, 4])) == 8
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="miles.rollout.sglang_engine"):
        engine = SGLangEngine(ckpt, CFG, url=seeded.url)
    assert "deterministic" not in caplog.text and engine.health()["seeded_sampling"] is True
    a, b = (engine.generate(PROMPTS, ["?"] * 4, n=2, temperature=1.0, seeds=[1, 2, 3, 4]) for _ in range(2))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]


def test_sample_seeds_are_distinct_int64s():
    """A group seed and a sample's index -> its row's sampling_seed: distinct per sample, a non-negative int64."""
    seeds = [sample_seed(s, i) for s in (-3, 0, 7, 8, 2 ** 70) for i in range(3)]
    assert len(set(seeds)) == len(seeds) and all(0 <= x < 2 ** 63 for x in seeds)


def test_stop_tokens_with_trimmed_output_ids(ckpt, serve):
    server = serve(ckpt, enable_deterministic_inference=True)  # the same request twice: the same samples
    engine = SGLangEngine(ckpt, replace(CFG, stop_tokens=list(DEFAULT_ALPHABET)), url=server.url)
    samples = engine.generate(PROMPTS, ["?"] * 4, n=2)  # each ends at a stop (test_engine_contract.py)
    assert samples[0].finish_reason.value == "stop"
    # a server that trims the matched stop token from output_ids: the log-prob record still has it
    body = dict(server.bodies("/generate")[-1])
    body["sampling_params"] = [dict(p, no_stop_trim=False) for p in body["sampling_params"]]
    out = server.handle("POST", "/generate", body)
    assert out[0]["output_ids"] == samples[0].response_ids[:-1]
    assert engine._sample(out[0], "", "", samples[0].prompt_ids, 0).response_ids == samples[0].response_ids


# ----------------------------------------------------------------------------- R3
def test_routed_experts_round_trip(moe_ckpt, serve):
    server = serve(moe_ckpt, enable_return_routed_experts=True)
    engine = SGLangEngine(moe_ckpt, replace(CFG, stop_tokens=list("0123")), url=server.url, record_routing=True)
    samples = engine.generate(PROMPTS, ["?"] * 4, n=2, temperature=1.0)
    assert server.bodies("/generate")[-1]["return_routed_experts"] is True
    model, cfg = server.engine.model, server.engine.model.config
    assert len({len(s.response_ids) for s in samples}) > 1
    for s in samples:
        record = {}
        model(torch.tensor([s.prompt_ids + s.response_ids])[:, :-1], routing_record=record)
        assert s.routed_experts.dtype == torch.uint8
        assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, len(moe_layers(cfg)),
                                          cfg.moe.num_experts_per_tok)
        assert torch.equal(s.routed_experts, stack_routing(record, moe_layers(cfg), torch.uint8)[0])
    assert build_train_batch(samples, torch.zeros(len(samples)), 0).routed_experts.shape[0] == len(samples)
    plain = serve(moe_ckpt)  # a server without --enable-return-routed-experts
    with pytest.raises(ValueError, match="enable-return-routed-experts"):
        SGLangEngine(moe_ckpt, CFG, url=plain.url, record_routing=True)


# ----------------------------------------------------------------------------- weights
def test_get_weights_by_name_fails_for_these_families_as_in_sglang_0_5_23(ckpt, moe_ckpt, deepseek_ckpt, serve):
    """A real 0.5.23 server answers /get_weights_by_name with HTTP 400 "Get parameter by name failed" for
    Qwen3, Qwen3-MoE and DeepSeek (only llama, granite, exaone4, opt implement it): the stand-in does too,
    and the adapter's checked sync does not use it."""
    for path in (ckpt, moe_ckpt, deepseek_ckpt):
        server = serve(path)
        with pytest.raises(standin.BadRequest, match="Get parameter by name failed"):
            server.handle("POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 1})
        engine = SGLangEngine(path, CFG, url=server.url)
        weights = perturbed(server.engine.model.state_dict())
        assert engine.update_weights(weights, checksum(weights)) == checksum(weights)
        assert "/get_weights_by_name" not in [p for _, p, _ in server.log]


def test_weights_checker_answers_in_sglangs_layout(ckpt, moe_ckpt, serve):
    """/weights_checker's answer (http_server.py check_weights): one rank's per-tensor hashes under
    SGLang's fused names; the adapter's prediction of that layout names the same tensors and hashes them
    alike, on a CPU server (SHA-256) and on a CUDA one (the Triton kernel's arithmetic)."""
    for path, fused in ((ckpt, ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")),
                        (moe_ckpt, ("self_attn.qkv_proj.weight", "mlp.experts.w13_weight", "mlp.experts.w2_weight"))):
        server = serve(path)
        answer = server.handle("POST", "/weights_checker", {"action": "checksum"})
        (rank,) = answer["ranks"]
        assert answer["success"] and rank["parallelism_info"][0]["role"] == "target" and answer["per_engine_checksum"]
        held = rank["checksums"]
        assert all(f"model.layers.0.{name}" in held for name in fused)
        assert not any(name.endswith((".q_proj.weight", ".gate_proj.weight", ".up_proj.weight")) for name in held)
        engine = SGLangEngine(path, CFG, url=server.url)
        hf = engine._to_hf(server.engine.model.state_dict())
        predicted = dict(sglang_layout(hf, engine.arch.tie_word_embeddings))
        assert set(predicted) == set(held)
        assert predicted["model.embed_tokens.weight"].shape[0] == 64  # vocabulary rows padded to 64
        assert all(f"{cpu_tensor_hash(t):016x}" == held[n] for n, t in predicted.items())
        assert engine.check_held(server.engine.model.state_dict()) == {"checked": len(held), "unchecked": []}
    gpu = serve(ckpt, device="cuda")  # what a CUDA server hashes with
    held = gpu.handle("POST", "/weights_checker", {})["ranks"][0]["checksums"]
    assert held["model.norm.weight"] == f"{gpu_tensor_hash(predicted_norm(gpu)):016x}"
    engine = SGLangEngine(ckpt, CFG, url=gpu.url)
    weights = perturbed(gpu.engine.model.state_dict())
    assert engine.update_weights(weights, checksum(weights)) == checksum(weights)


def predicted_norm(server) -> torch.Tensor:
    return server.engine.model.state_dict()["norm.weight"]


def test_gpu_tensor_hash_equals_sglangs_triton_kernel():
    """Known answers of SGLang 0.5.23's gpu_tensor_hash (kernels/ops/memory/gpu_tensor_hash.py, the Triton
    kernel, run on an H200), against Miles' torch version (any device) and the stand-in's numpy one.
    Multi-tile, partial-tile and non-word-sized inputs; the CPU hash is SHA-256's first 8 bytes."""
    cases = {
        (torch.arange(24581, dtype=torch.float32) * 0.5): KNOWN["arange_f32_24581"],
        torch.arange(3, dtype=torch.float32).to(torch.bfloat16): KNOWN["arange_bf16_3"],
        ((torch.arange(64 * 96) % 97 - 48) / 8).reshape(64, 96).to(torch.bfloat16): KNOWN["ramp_bf16_64x96"],
        (torch.arange(8193) % 251 - 125).to(torch.int8): KNOWN["int8_8193"],
    }
    for tensor, want in cases.items():
        assert gpu_tensor_hash(tensor) == want == standin._gpu_tensor_hash(tensor)
        assert gpu_tensor_hash(tensor, chunk_tiles=1) == want  # chunked over tiles alike
    import hashlib

    t = torch.arange(5, dtype=torch.float32)
    assert cpu_tensor_hash(t) == int.from_bytes(hashlib.sha256(t.numpy().tobytes()).digest()[:8], "big")


# SGLang 0.5.23's Triton gpu_tensor_hash of the tensors above, run on an H200 (issue 25)
KNOWN = {"arange_f32_24581": 0x9725653EDFC1ACB5, "arange_bf16_3": 0x9331854FCB107F49,
         "ramp_bf16_64x96": 0x22FA16AFD93B7B77, "int8_8193": 0x9CA3DA7C5073EAAA}


@pytest.mark.parametrize("route,model", [("disk", "dense"), ("tensor", "dense"), ("disk", "moe"), ("tensor", "moe")])
def test_update_weights_verified_by_the_weights_checker(route, model, ckpt, moe_ckpt, serve):
    path = ckpt if model == "dense" else moe_ckpt
    server = serve(path)
    engine = SGLangEngine(path, CFG, url=server.url, weight_update=route)
    weights = perturbed(server.engine.model.state_dict())
    assert engine.update_weights(weights, checksum(weights)) == checksum(weights)
    assert checksum(server.engine.model.state_dict()) == checksum(weights)  # what the server holds
    assert server.weight_version == "1" and server.bodies("/weights_checker")[-1] == {"action": "checksum",
                                                                                      "selector": "target"}
    if route == "tensor":  # inside one weight update session
        paths = [p for _, p, _ in server.log if "weight" in p and p != "/weights_checker"]
        assert paths == ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
    # a server that loads one tensor wrong is caught, and the tensor named in SGLang's layout
    for name, fused in ((next(iter(weights)), "model.embed_tokens.weight"),
                        ("layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.qkv_proj.weight")):
        server.corrupt = name
        with pytest.raises(WeightSyncError, match=rf"SGLang holds other values than were sent in 1 tensors.*{fused}"):
            engine.update_weights(weights, checksum(weights))
    # a payload that is not what the trainer sent is caught before anything is sent
    with pytest.raises(WeightSyncError, match="trainer sent"):
        engine.update_weights(perturbed(weights), checksum(weights))
    # unchecked syncs send no /weights_checker
    count = len(server.bodies("/weights_checker"))
    assert engine.update_weights(weights) == "" and len(server.bodies("/weights_checker")) == count


@pytest.mark.parametrize("fusion", [False, True])
def test_deepseek_layout_with_and_without_shared_experts_fusion(fusion, deepseek_ckpt, serve):
    """DeepSeek (MLA + MoE): q_a_proj and kv_a_proj_with_mqa fused, the MoE gate's fp32 correction bias,
    and SGLang's shared-experts fusion (the shared expert as the last fused expert), which the adapter
    recognises from the server's names."""
    server = serve(deepseek_ckpt, shared_experts_fusion=fusion)
    held = server.handle("POST", "/weights_checker", {})["ranks"][0]["checksums"]
    assert "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight" in held
    assert any(".shared_experts." in n for n in held) is not fusion
    engine = SGLangEngine(deepseek_ckpt, CFG, url=server.url, weight_update="tensor")
    weights = perturbed(server.engine.model.state_dict())
    assert engine.update_weights(weights, checksum(weights)) == checksum(weights)
    server.corrupt = next(n for n in weights if "shared_experts" in n)
    with pytest.raises(WeightSyncError, match="w13_weight" if fusion else "shared_experts.gate_up_proj"):
        engine.update_weights(weights, checksum(weights))


def test_a_layout_miles_does_not_predict_fails_the_check_clearly(ckpt, serve):
    """A server whose tensors are not where the prediction puts them (here: a name missing, as with a
    kernel that renames or repacks) fails the checked sync with what to do, not silently."""
    server = serve(ckpt)
    engine = SGLangEngine(ckpt, CFG, url=server.url)
    weights = dict(server.engine.model.state_dict())
    real = server._weights_checker

    def renamed(body):
        answer = real(body)
        held = answer["ranks"][0]["checksums"]
        held["model.layers.0.self_attn.qkv_proj.weight_packed"] = held.pop("model.layers.0.self_attn.qkv_proj.weight")
        return answer

    server._weights_checker = renamed
    with pytest.raises(WeightSyncError, match=r"reports no tensor named.*qkv_proj.*check_weight_sync=false"):
        engine.update_weights(weights, checksum(weights))


def test_disk_updates_keep_the_directory_the_server_names(ckpt, serve, tmp_path):
    """After /update_weights_from_disk the server's /model_info names the directory it loaded (as
    0.5.23's TokenizerManager does): the adapter keeps it until the next update has loaded, then removes
    the previous one; an external server keeps the last one after shutdown()."""
    server = serve(ckpt)
    engine = SGLangEngine(ckpt, CFG, url=server.url, weights_dir=str(tmp_path))
    weights = perturbed(server.engine.model.state_dict())
    engine.update_weights(weights)
    first = Path(engine.health()["model_path"])
    assert first.parent == tmp_path and (first / "model.safetensors").exists() and (first / "config.json").exists()
    assert first == engine.weights_path
    engine.update_weights(perturbed(weights), None)
    second = Path(engine.health()["model_path"])
    assert second != first and not first.exists() and (second / "model.safetensors").exists()
    server.corrupt = "norm.weight"  # a failed check after the load: the server still names the new one
    with pytest.raises(WeightSyncError):
        engine.update_weights(weights, checksum(weights))
    assert Path(engine.health()["model_path"]).exists()
    engine.shutdown()  # an external server: its directory stays
    assert Path(server.model_path).exists()


def test_tensor_payload_passes_the_safe_unpickler_and_refuses_foreign_classes():
    from miles.rollout.sglang_engine import serialize_named_tensors

    payload, _ = serialize_named_tensors([("model.norm.weight", torch.arange(4.0))])
    assert torch.equal(standin.deserialize(payload)[0][1], torch.arange(4.0))
    import base64
    import pickle

    foreign = base64.b64encode(pickle.dumps([("x", DType.fp32)])).decode()
    with pytest.raises(standin.BadRequest, match="not allowed"):
        standin.deserialize(foreign)


def test_distributed_update_from_a_broadcast_bucket(ckpt, serve):
    """The trainer side as miles/transport/broadcast.py would do it: rank 0 of a gloo group, one bucket."""
    import datetime

    from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

    from miles.transport.broadcast import pack, plan_buckets

    server = serve(ckpt)
    engine = SGLangEngine(ckpt, CFG, url=server.url)
    weights = perturbed(server.engine.model.state_dict(), 0.02)
    store = TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    joined = threading.Thread(target=engine.init_weights_update_group,
                              args=("127.0.0.1", store.port, 1, 2, "miles-pp_0", "gloo"))
    joined.start()
    group = ProcessGroupGloo(PrefixStore("miles-pp_0", store), 0, 2, datetime.timedelta(seconds=30))
    joined.join()
    (bucket,) = plan_buckets({n: (t.dtype, tuple(t.shape)) for n, t in weights.items()}, 1 << 30)
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
    pack(buffer, bucket, weights)
    received = threading.Thread(target=engine.update_weights_from_bucket, args=(bucket, "miles-pp_0"))
    received.start()
    opts = BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([buffer], opts).wait()
    received.join()
    assert checksum(server.engine.model.state_dict()) == checksum(weights)
    assert engine.check_held(weights)["checked"] > 0  # the server's checksums match what was broadcast
    body = server.bodies("/update_weights_from_distributed")[-1]
    assert body["load_format"] == "flattened_bucket" and body["names"][0].startswith("model.")
    engine.destroy_weights_update_group("miles-pp_0")


# ----------------------------------------------------------------------------- memory, control, health
def test_memory_pause_and_health_requests(ckpt, serve):
    """What the memory calls send (the protocol's order of calls and their effect on generate:
    test_engine_contract.py), pause / continue, flush and health's requests."""
    server = serve(ckpt)
    engine = SGLangEngine(ckpt, CFG, url=server.url)
    weights = {k: v.clone() for k, v in server.engine.model.state_dict().items()}
    engine.release_memory()
    engine.release_memory()  # released already: no request
    assert server.bodies("/release_memory_occupation") == [{"tags": ["weights", "kv_cache", "cuda_graph"]}]
    engine.health()  # while released: no /health_generate
    engine.resume_memory(("weights",))
    assert server.bodies("/resume_memory_occupation") == [{"tags": ["weights"]}]
    engine.update_weights(weights, checksum(weights))  # weights resumed without a host copy: undefined until pushed
    engine.resume_memory(("kv_cache",))
    assert server.bodies("/resume_memory_occupation")[-1] == {"tags": ["kv_cache", "cuda_graph"]}
    # pause: new requests wait until continue
    engine.pause_generation("retract")
    done = []
    worker = threading.Thread(target=lambda: done.append(engine.generate(PROMPTS[:1], ["?"])))
    worker.start()
    time.sleep(0.3)
    assert not done
    engine.continue_generation()
    worker.join(10)
    assert len(done[0]) == 1
    assert server.bodies("/pause_generation") == [{"mode": "retract"}]
    assert server.bodies("/continue_generation") == [{"torch_empty_cache": True}]
    engine.flush_cache()
    health = engine.health()
    assert health["engine"] == "sglang" and health["weight_version"] == "1"
    assert [p for _, p, _ in server.log].count("/health_generate") == 1
    # keep_weights=False: the caller reloads them, whatever the server keeps
    backup = serve(ckpt, enable_weights_cpu_backup=True)
    engine = SGLangEngine(ckpt, CFG, url=backup.url)
    engine.release_memory()
    engine.resume_memory()
    engine.generate(PROMPTS[:1], ["?"])  # kept by the server's host copy
    engine.release_memory(keep_weights=False)
    engine.resume_memory()
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(PROMPTS[:1], ["?"])


def test_a_dead_server_is_a_transient_fault(ckpt, serve):
    server = serve(ckpt)
    engine = SGLangEngine(ckpt, CFG, url=server.url)
    server.kill()
    for call in (lambda: engine.generate(PROMPTS, ["?"] * 4), engine.health):
        with pytest.raises(SGLangServerGone) as caught:
            call()
        assert isinstance(caught.value, ConnectionError) and Fault.of(caught.value).transient


# ----------------------------------------------------------------------------- launching
def test_launch_command_and_missing_sglang(ckpt, monkeypatch):
    argv = server_command(ckpt, "127.0.0.1", 31000, torch.bfloat16, 3, torch.device("cuda:1"), CFG, 64, True,
                          {"mem_fraction_static": 0.7, "skip_server_warmup": False})
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    for pair in (["--model-path", ckpt], ["--dtype", "bfloat16"], ["--random-seed", "3"], ["--base-gpu-id", "1"],
                 ["--max-running-requests", "64"], ["--mem-fraction-static", "0.7"]):
        assert argv[argv.index(pair[0]) + 1] == pair[1]
    assert {"--skip-tokenizer-init", "--enable-return-routed-experts", "--enable-memory-saver",
            "--enable-deterministic-inference"} <= set(argv)  # seeded sampling on CUDA
    assert "--skip-server-warmup" not in argv
    off = server_command(ckpt, "h", 1, torch.bfloat16, 0, torch.device("cuda:0"), CFG, None, False,
                         {"enable_deterministic_inference": False})
    cpu = server_command(ckpt, "h", 1, torch.float32, 0, torch.device("cpu"), CFG, None, False, None)
    # the CPU backend has none of the attention backends 0.5.23 allows with the flag
    assert "--enable-deterministic-inference" not in off + cpu
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"miles\[gpu\]"):
        SGLangEngine(ckpt, CFG)


def test_launched_server_serves_and_its_death_is_transient(ckpt):
    """The launch path end to end, with the stand-in's CLI (launch_server's flags) as the server process."""
    engine = SGLangEngine(ckpt, CFG, launcher=[sys.executable, standin.__file__], startup_timeout_s=120)
    try:
        assert len(engine.generate(PROMPTS[:2], ["?"] * 2, n=2)) == 4
        from miles.models import from_pretrained

        weights = {k: v + 0.01 for k, v in from_pretrained(ckpt, dtype=torch.float32).state_dict().items()}
        engine.update_weights(weights, checksum(weights))
        served = engine.weights_path
        assert served is not None and served.exists()
        engine.process.kill()
        engine.process.wait()
        with pytest.raises(SGLangServerGone, match="exited") as caught:
            engine.health()
        assert Fault.of(caught.value).transient
    finally:
        process = engine.process
        engine.shutdown()
    assert process.poll() is not None and engine.process is None
    assert not served.exists()  # a launched server's weights directory goes with it
    port = int(engine.url.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
