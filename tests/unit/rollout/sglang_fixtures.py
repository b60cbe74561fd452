"""Fixtures shared by the SGLang adapter's tests (test_sglang_engine.py) and the contract suite's unit tier
(test_engine_contract.py): the tiny dense checkpoint and stand-in servers (sglang_standin.py, NOT SGLang:
SGLang 0.5.23's documented HTTP API over the native engine). A test module imports the fixtures it uses."""

import pytest

import sglang_standin as standin
from miles.config.schema import ModelCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint

TINY = ModelCfg(name="t", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, max_position_embeddings=64)


class StandIns:
    """Stand-in servers started for a test (or a module), all killed by kill_all()."""

    def __init__(self):
        self.servers: list[standin.StandInServer] = []

    def start(self, path: str, **server_args) -> standin.StandInServer:
        self.servers.append(standin.StandInServer(path, **server_args).start())
        return self.servers[-1]

    def kill_all(self) -> None:
        for server in self.servers:
            server.kill()
        self.servers.clear()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A seeded random TINY (dense, the char tokenizer of DEFAULT_ALPHABET)."""
    return str(random_checkpoint(TINY, DEFAULT_ALPHABET, 0, tmp_path_factory.mktemp("dense")))


@pytest.fixture
def serve():
    """serve(ckpt, **server_args) -> a running stand-in; killed after the test."""
    servers = StandIns()
    yield servers.start
    servers.kill_all()
