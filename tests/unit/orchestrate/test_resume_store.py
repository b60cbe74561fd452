"""Checkpoint store: atomic publication, keep_last, the identity check, writability; component state."""

import json

import numpy as np
import pytest
import torch

from miles.config.schema import AlgoCfg, AlgoName, ModelCfg, RolloutCfg, TrainerCfg, PrecisionCfg
from miles.config.errors import ConfigError
from miles.orchestrate.checkpoints import random_checkpoint
from miles.orchestrate.resume import (CheckpointStore, flat_config, identity_diff, load_component_state,
                                      load_driver_rng, save_component_state, save_driver_rng)


def meta(cfg):
    return {"objective": 0.5, "source": {}, "config": flat_config(cfg)}


def test_save_publishes_atomically_and_keeps_the_newest(tmp_path, compose):
    store = CheckpointStore(tmp_path / "ck", keep_last=2)
    cfg = compose()

    def crash(tmp):
        (tmp / "half.bin").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError):
        store.save(1, crash, meta(cfg))
    assert store.latest() is None  # the half-written temp dir is never picked up
    for step in (1, 2, 3):
        store.save(step, lambda tmp: (tmp / "w.bin").write_bytes(b"w"), meta(cfg))
    assert [p.name for p in store.checkpoints()] == ["step_000002", "step_000003"]
    store.save(3, lambda tmp: (tmp / "w.bin").write_bytes(b"again"), meta(cfg))  # same step: replaced
    assert (store.latest() / "w.bin").read_bytes() == b"again"
    assert json.loads((store.latest() / "meta.json").read_text())["step"] == 3


def test_identity_diff_names_model_algo_task_keys_only(compose):
    saved = flat_config(compose())
    now = flat_config(compose(["algo.eps_clip=0.3", "model.hidden_size=64", "trainer.lr=1e-3", "steps=7",
                               "task.eval_size=16"]))
    assert identity_diff(saved, now) == ["algo.eps_clip: 0.2 -> 0.3", "model.hidden_size: 128 -> 64"]


def test_prepare_refuses_another_config_and_a_checkpoint_past_steps(tmp_path, compose):
    cfg = compose([f"checkpoint.dir={tmp_path / 'ck'}", "steps=4"])
    store = CheckpointStore.prepare(cfg, tmp_path / "run")
    store.save(3, lambda tmp: None, meta(cfg))
    assert CheckpointStore.prepare(cfg, tmp_path / "run").latest().name == "step_000003"
    with pytest.raises(ConfigError, match=r"algo\.kl_coef: 0\.0 -> 0\.1"):
        CheckpointStore.prepare(compose([f"checkpoint.dir={tmp_path / 'ck'}", "steps=4", "algo.kl_coef=0.1"]),
                                tmp_path / "run")
    with pytest.raises(ConfigError, match="past steps=2"):
        CheckpointStore.prepare(compose([f"checkpoint.dir={tmp_path / 'ck'}", "steps=2"]), tmp_path / "run")


def test_prepare_reports_unwritable_dirs(tmp_path, compose):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = compose([f"checkpoint.dir={blocker}/ck", f"debug.save_rollouts={blocker}/r"])
    with pytest.raises(ConfigError) as err:
        CheckpointStore.prepare(cfg, tmp_path / "run")
    assert len(err.value.problems) == 2 and "checkpoint.dir=" in err.value.problems[0]


def test_component_state_round_trip(tmp_path):
    model = ModelCfg(name="t", hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=16, max_position_embeddings=64)
    ckpt = str(random_checkpoint(model, "0123456789+=", 0, tmp_path / "init"))
    from miles.rollout.native import NativeEngine
    from miles.trainer.torch_trainer import TorchTrainer

    def trainer():
        return TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), TrainerCfg(), PrecisionCfg(name="fp32"))

    a, engine = trainer(), NativeEngine(ckpt, RolloutCfg(), seed=3)
    loss = sum(p.sum() for p in a.model.parameters())
    loss.backward()
    a.optimizer.step()
    engine.generator.manual_seed(42)
    save_component_state(a, str(tmp_path), "trainer")
    save_component_state(engine, str(tmp_path), "engine")

    b, engine2 = trainer(), NativeEngine(ckpt, RolloutCfg(), seed=3)
    load_component_state(b, str(tmp_path), "trainer")
    load_component_state(engine2, str(tmp_path), "engine")
    for (name, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(pa, pb), name
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)
    assert torch.equal(engine.generator.get_state(), engine2.generator.get_state())


def test_driver_rng_round_trip(tmp_path):
    import random

    save_driver_rng(tmp_path / "d.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    load_driver_rng(tmp_path / "d.pt")
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
