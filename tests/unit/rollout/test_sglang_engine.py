"""SGLangEngine (miles/rollout/sglang_engine.py) against a local STAND-IN server (sglang_standin.py), not a
live SGLang: the stand-in implements the documented 0.5.23 request / response schemas over the native
engine and refuses any request off that schema, so these tests check the adapter's requests and its
reading of the documented answers; SGLang's own behaviour is unverified here (docs/sglang.md)."""

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
from miles.algo.losses import token_logprobs
from miles.config.schema import DType, ModelCfg, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET, encode_prompt
from miles.orchestrate.checkpoints import random_checkpoint
from miles.orchestrate.supervise import Fault
from miles.orchestrate.weight_sync import WeightSyncError, checksum
from miles.rollout.native import NativeEngine
from miles.rollout.protocol import check_engine
from miles.rollout.sglang_engine import SGLangEngine, SGLangServerGone, sample_seed, server_command
from miles.types import build_train_batch, moe_layers, stack_routing

TINY = ModelCfg(name="t", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, max_position_embeddings=64)
CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
PROMPTS = ["1+2=", "35+47=", "9+9=", "12+3="]
CFG = RolloutCfg(max_new_tokens=6)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(random_checkpoint(TINY, DEFAULT_ALPHABET, 0, tmp_path_factory.mktemp("dense")))


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    moe = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / "qwen3_moe_tiny.yaml")))
    return str(random_checkpoint(moe, DEFAULT_ALPHABET, 0, tmp_path_factory.mktemp("moe")))


@pytest.fixture
def serve():
    """serve(ckpt, **server_args) -> a running stand-in; killed after the test."""
    servers = []

    def start(path, **args):
        servers.append(standin.StandInServer(path, **args).start())
        return servers[-1]

    yield start
    for server in servers:
        server.kill()


@pytest.fixture(scope="module")
def shared(ckpt):
    """One stand-in + adapter for the read-only generate tests."""
    server = standin.StandInServer(ckpt).start()
    yield server, SGLangEngine(ckpt, CFG, url=server.url, seed=1)
    server.kill()


def full_forward_logprobs(model, sample, temperature):
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    return token_logprobs(model(ids[:, :-1]), ids[:, 1:], temperature)[0][len(sample.prompt_ids) - 1:]


def perturbed(state, delta=0.01):
    return {k: (v.float() + delta).to(v.dtype) for k, v in state.items()}


# ----------------------------------------------------------------------------- generate
def test_generate_contract_and_request_schema(shared):
    server, engine = shared
    check_engine(SGLangEngine)
    samples = engine.generate(PROMPTS, ["3", "82", "18", "15"], n=3, temperature=0.7)
    assert len(samples) == 12 and [s.group for s in samples] == [g for g in range(4) for _ in range(3)]
    eos = engine.tok.eos_id
    for s in samples:
        assert s.prompt_ids == encode_prompt(engine.tok, s.prompt) and s.prompt == PROMPTS[s.group]
        assert 1 <= len(s.response_ids) == len(s.rollout_logprobs) <= CFG.max_new_tokens
        lp = torch.tensor(s.rollout_logprobs)
        assert torch.isfinite(lp).all() and (lp <= 0).all()
        assert (s.finish_reason.value == "stop") == (s.response_ids[-1] == eos) and eos not in s.response_ids[:-1]
        # the log-probs of the sampled tokens under softmax(logits / T), as the trainer recomputes them
        torch.testing.assert_close(lp, full_forward_logprobs(server.engine.model, s, 0.7), atol=1e-5, rtol=1e-5)
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


def test_greedy_equals_the_native_engine(shared, ckpt):
    _, engine = shared
    native = NativeEngine(ckpt, CFG).generate(PROMPTS, ["?"] * 4, n=2, temperature=0.0)
    remote = engine.generate(PROMPTS, ["?"] * 4, n=2, temperature=0.0)
    assert [s.response_ids for s in remote] == [s.response_ids for s in native]
    assert [s.finish_reason for s in remote] == [s.finish_reason for s in native]
    for r, s in zip(remote, native):
        torch.testing.assert_close(torch.tensor(r.rollout_logprobs), torch.tensor(s.rollout_logprobs),
                                   atol=1e-5, rtol=1e-5)


def test_group_seeds_and_lengths(shared):
    _, engine = shared
    a = engine.generate(PROMPTS, ["?"] * 4, n=4, seeds=[5, 6, 7, 8], max_new_tokens=4)
    b = engine.generate(PROMPTS[2:], ["?"] * 2, n=4, seeds=[7, 8], max_new_tokens=4)
    assert [s.response_ids for s in a[8:]] == [s.response_ids for s in b]  # a group ignores its companions
    assert all(len(s.response_ids) <= 4 for s in a)
    assert len({tuple(s.response_ids) for s in a[:4]}) > 1  # n samples of one prompt differ
    assert sample_seed(7, 0) != sample_seed(7, 1) and 0 <= sample_seed(-3, 2) < 2 ** 63


def test_stop_tokens_with_trimmed_output_ids(ckpt, serve):
    server = serve(ckpt)
    engine = SGLangEngine(ckpt, replace(CFG, stop_tokens=list(DEFAULT_ALPHABET)), url=server.url)
    samples = engine.generate(PROMPTS, ["?"] * 4, n=2)
    stops = set(engine.stop_ids)  # every character: a response ends at its first one (specials may precede)
    assert all(s.finish_reason.value == "stop" and s.response_ids[-1] in stops and not stops & set(s.response_ids[:-1])
               for s in samples)
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
def test_release_resume_pause_and_health(ckpt, serve):
    server = serve(ckpt)
    engine = SGLangEngine(ckpt, CFG, url=server.url)
    before = engine.generate(PROMPTS, ["?"] * 4, n=2, seeds=[1, 2, 3, 4])
    weights = server.engine.model.state_dict()
    weights = {k: v.clone() for k, v in weights.items()}
    assert engine.health()["resident"] == ["weights", "kv_cache"]
    engine.release_memory()
    engine.release_memory()  # released already: no request
    assert server.bodies("/release_memory_occupation") == [{"tags": ["weights", "kv_cache", "cuda_graph"]}]
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(PROMPTS, ["?"] * 4)
    engine.resume_memory(("weights",))
    assert server.bodies("/resume_memory_occupation") == [{"tags": ["weights"]}]
    engine.update_weights(weights, checksum(weights))  # weights resumed without a host copy: undefined until pushed
    engine.resume_memory(("kv_cache",))
    assert server.bodies("/resume_memory_occupation")[-1] == {"tags": ["kv_cache", "cuda_graph"]}
    after = engine.generate(PROMPTS, ["?"] * 4, n=2, seeds=[1, 2, 3, 4])
    assert [s.response_ids for s in after] == [s.response_ids for s in before]
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
    assert [p for _, p, _ in server.log].count("/health_generate") == 2


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
