"""SGLangEngine (miles/rollout/sglang_engine.py) against a local STAND-IN server (sglang_standin.py), not a
live SGLang: the stand-in implements the documented 0.5.23 request / response schemas over the native
engine and refuses any request off that schema, so these tests check the adapter's requests and its
reading of the documented answers; SGLang's own behaviour is unverified here (docs/sglang.md).
The protocol's contract (groups, log-probs, lengths, stops, seeds, greedy, weights, memory, health) is
the shared suite's, run over the same stand-in in test_engine_contract.py; this file has what is SGLang's."""

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
from miles.orchestrate.weight_sync import WeightSyncError, checksum
from miles.rollout.sglang_engine import SGLangEngine, SGLangServerGone, sample_seed, server_command
from miles.types import build_train_batch, moe_layers, stack_routing
from sglang_fixtures import ckpt, serve  # noqa: F401  (fixtures: the tiny dense checkpoint, stand-in servers)

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
PROMPTS = ["1+2=", "35+47=", "9+9=", "12+3="]
CFG = RolloutCfg(max_new_tokens=6)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    moe = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / "qwen3_moe_tiny.yaml")))
    return str(random_checkpoint(moe, DEFAULT_ALPHABET, 0, tmp_path_factory.mktemp("moe")))


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


def test_sample_seeds_are_distinct_int64s():
    """A group seed and a sample's index -> its row's sampling_seed: distinct per sample, a non-negative int64."""
    seeds = [sample_seed(s, i) for s in (-3, 0, 7, 8, 2 ** 70) for i in range(3)]
    assert len(set(seeds)) == len(seeds) and all(0 <= x < 2 ** 63 for x in seeds)


def test_stop_tokens_with_trimmed_output_ids(ckpt, serve):
    server = serve(ckpt)
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
@pytest.mark.parametrize("route,model", [("disk", "dense"), ("tensor", "dense"), ("disk", "moe"), ("tensor", "moe")])
def test_update_weights_verified_by_read_back(route, model, ckpt, moe_ckpt, serve):
    path = ckpt if model == "dense" else moe_ckpt
    server = serve(path)
    engine = SGLangEngine(path, CFG, url=server.url, weight_update=route)
    weights = perturbed(server.engine.model.state_dict())
    assert engine.update_weights(weights, checksum(weights)) == checksum(weights)
    assert checksum(server.engine.model.state_dict()) == checksum(weights)  # what the server holds
    assert server.weight_version == "1"
    if route == "tensor":  # inside one weight update session
        paths = [p for _, p, _ in server.log if "weight" in p and p != "/get_weights_by_name"]
        assert paths == ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
    # a server that loads one tensor wrong is caught by the read-back, full or sampled
    server.corrupt = next(iter(weights))
    with pytest.raises(WeightSyncError, match="SGLang"):
        engine.update_weights(weights, checksum(weights))
    engine.verify = "sample"
    server.corrupt = next(iter(weights))
    with pytest.raises(WeightSyncError, match="SGLang holds"):
        engine.update_weights(weights, checksum(weights))
    # a payload that is not what the trainer sent is caught before anything is sent
    with pytest.raises(WeightSyncError, match="trainer sent"):
        engine.update_weights(perturbed(weights), checksum(weights))


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
    assert engine.held_checksum() == checksum(weights)
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
    assert {"--skip-tokenizer-init", "--enable-return-routed-experts", "--enable-memory-saver"} <= set(argv)
    assert "--skip-server-warmup" not in argv
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"miles\[gpu\]"):
        SGLangEngine(ckpt, CFG)


def test_launched_server_serves_and_its_death_is_transient(ckpt):
    """The launch path end to end, with the stand-in's CLI (launch_server's flags) as the server process."""
    engine = SGLangEngine(ckpt, CFG, launcher=[sys.executable, standin.__file__], startup_timeout_s=120)
    try:
        assert len(engine.generate(PROMPTS[:2], ["?"] * 2, n=2)) == 4
        engine.process.kill()
        engine.process.wait()
        with pytest.raises(SGLangServerGone, match="exited") as caught:
            engine.health()
        assert Fault.of(caught.value).transient
    finally:
        process = engine.process
        engine.shutdown()
    assert process.poll() is not None and engine.process is None
    port = int(engine.url.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
