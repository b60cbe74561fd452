"""One way to choose a backend (DESIGN rule 10): each side's backends are the options of one group,
`rollout=native|vllm|sglang` and `trainer=torch|fsdp|megatron`; only the chosen backend's options
exist in the composed config; the names are Enums; the old key forms are refused naming the new."""

import pytest
from hydra.errors import HydraException

from miles.config.errors import OLD_KEYS, ConfigError, old_form_problems, refuse_old_forms
from miles.config.schema import EngineName, SpeculativeKind, TrackingBackend, TrainerBackend, VLLMCfg
from miles.transport.protocol import TransportName
from miles.validate import validate


@pytest.mark.parametrize("engine", list(EngineName))
def test_rollout_group_chooses_the_engine_and_carries_only_its_options(compose, engine):
    cfg = compose([f"rollout={engine.value}"])
    assert cfg.rollout.engine is engine and cfg.rollout.engine == engine.value  # a str Enum
    assert (cfg.rollout.vllm is not None) == (engine == EngineName.vllm)
    assert (cfg.rollout.sglang is not None) == (engine == EngineName.sglang)
    assert validate(cfg) == []


@pytest.mark.parametrize("backend", list(TrainerBackend))
def test_trainer_group_chooses_the_backend(compose, backend):
    extra = ["hardware=h200", "hardware.gpus_per_node=1", "dry_run=true"] if backend == TrainerBackend.megatron else []
    cfg = compose([f"trainer={backend.value}", *extra])
    assert cfg.trainer.backend is backend
    assert cfg.trainer.num_ranks == (2 if backend == TrainerBackend.fsdp else 1)
    assert validate(cfg) == []


def test_choices_print_as_their_names():
    assert f"rollout={EngineName.vllm}" == "rollout=vllm" and str(TrainerBackend.fsdp) == "fsdp"
    assert {"mtp": 1}.get(SpeculativeKind.mtp) == 1 and f"{TransportName.broadcast}" == "broadcast"
    assert [m.value for m in TrackingBackend] == ["mlflow"]


@pytest.mark.parametrize("override", ["rollout.weight_sync=nope", "rollout.speculative.kind=eagle",
                                      "tracking.backend=wandb", "trainer=deepspeed", "rollout=trtllm",
                                      "precision.forward_weights=bf16", "rollout=sglang rollout.sglang.weight_update=ftp"])
def test_unknown_names_are_refused_at_composition(compose, override):
    with pytest.raises(HydraException):
        compose(override.split())


def test_a_hand_set_engine_without_its_group_is_refused(compose):
    problems = validate(compose(["rollout.engine=sglang"]))
    assert problems == ["rollout.engine=sglang with options rollout.<none>: choose the engine with its group, "
                        "rollout=sglang (conf/rollout/sglang.yaml adds its options)"]


def test_unchosen_backend_options_do_not_exist(compose):
    with pytest.raises(Exception):
        compose(["rollout.vllm.kv_cache_gb=2"])  # launch.py: "add rollout=vllm" (test_cli_errors)


@pytest.mark.parametrize("override, new", [
    ("rollout.engine=vllm", "use rollout=vllm"),
    ("trainer.backend=fsdp", "use trainer=fsdp"),
    ("trainer.backend=torch,fsdp", "use trainer=torch,fsdp"),  # a sweep over backends
    ("debug.check_weight_sync=true", "use debug.compare_weights_tensorwise=true"),
    ("+rollout.vllm.tensor_parallel_size=2", "use rollout.num_gpus_per_engine=2"),
    ("rollout.vllm.max_num_seqs=64", "use rollout.max_running=64"),
])
def test_old_forms_name_the_new_form(override, new):
    [problem] = old_form_problems([override, "trainer.lr=1e-3"])
    assert problem.endswith(new) and problem.startswith(override.lstrip("+").split("=")[0])
    with pytest.raises(ConfigError):
        refuse_old_forms([override])


def test_removed_keys_are_gone_from_the_schema(compose):
    import dataclasses

    assert {"tensor_parallel_size", "max_num_seqs"}.isdisjoint(f.name for f in dataclasses.fields(VLLMCfg))
    cfg = compose(["debug.compare_weights_tensorwise=true"])
    assert cfg.debug.compare_weights_tensorwise and not hasattr(cfg.debug, "check_weight_sync")
    for key in OLD_KEYS:
        assert old_form_problems([f"{key}=1"])

