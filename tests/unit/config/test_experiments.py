"""Every preset (conf/experiment/, +experiment=<name>) composes, validates and plans on its hardware;
every sweep definition (sweeps/sweep/, -m +sweep=<name>) composes as a single run too (a reproduced
sweep job composes it that way)."""

from pathlib import Path

import pytest

from miles.validate import validate
from miles.hardware.planner import make_plan

ROOT = Path(__file__).resolve().parents[3]
CONF = ROOT / "conf"
GROUPS = {"experiment": CONF / "experiment", "sweep": ROOT / "sweeps" / "sweep"}


@pytest.fixture(autouse=True)
def sweeps_from_any_cwd(monkeypatch):
    # What launch.py sets; the config's default (a path relative to the cwd) fits only the repo root.
    monkeypatch.setenv("MILES_SWEEPS_DIR", str(ROOT / "sweeps"))


def options(group):
    return sorted(p.stem for p in GROUPS[group].glob("*.yaml"))


def needs_user_values(name):
    """Presets with `<your ...>` placeholders (checkpoint, data): test_math_gpu_presets.py gives them values."""
    return "<your " in (GROUPS["experiment"] / f"{name}.yaml").read_text()


def test_the_presets_the_docs_name_exist():
    assert {"qwen3_30b_a3b_fp8_h200", "glm5_int4_gb300", "deepseek_v3_h100", "kimi_k2_int4_h200",
            "cpu_smoke", "cpu_moe", "qwen3_0_6b_math_gpu", "qwen3_1_7b_math_gpu", "qwen3_4b_math_gpu",
            } <= set(options("experiment"))


@pytest.mark.parametrize("name", [n for n in options("experiment") if not needs_user_values(n)])
def test_every_preset_composes_validates_and_fits(compose, name):
    # GPU presets plan here (dry_run): running them needs their GPUs
    on_cpu = "cpu" in name.split("_") or name == "shape_count_vlm"  # cpu_smoke, gsm8k_cpu, the visual task, ...
    cfg = compose([f"+experiment={name}"] + ([] if on_cpu else ["dry_run=true"]))
    assert validate(cfg) == []
    plan = make_plan(cfg)  # what dry_run=true prints; launch.py exits 0 exactly when it fits
    assert plan.fits, plan.problems
    if on_cpu:
        assert cfg.hardware.name == "cpu" and cfg.model.name.endswith("_tiny")
    else:
        assert cfg.hardware.device == "cuda" and not cfg.warm_start.enabled  # full-size: from a checkpoint


def test_preset_values_win_over_the_root_config_and_the_command_line_wins_over_both(compose):
    cfg = compose(["+experiment=cpu_smoke"])
    assert cfg.steps == 2 and cfg.trainer.global_batch_size == 16
    cfg = compose(["+experiment=cpu_moe", "steps=3", "model=deepseek_v3_tiny"])
    assert cfg.steps == 3 and cfg.model.name == "deepseek_v3_tiny" and cfg.rollout.batch_size == 16


def test_the_sweeps_the_docs_name_exist():
    assert {"lr_grid", "tpe_lr_clip", "gsm8k_lr", "tool_calc_lr"} <= set(options("sweep"))


@pytest.mark.parametrize("name", options("sweep"))
def test_every_sweep_composes_as_a_single_run(compose, name):
    assert validate(compose([f"+sweep={name}"])) == []


def test_optuna_sweeps_maximize_the_objective():
    """launch.py's main returns the held-out accuracy: Optuna must maximize it (its default minimizes)."""
    from hydra import compose, initialize_config_dir

    from miles.config.store import register_configs

    register_configs()
    for name in options("sweep"):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            sweeper = compose("config", [f"+sweep={name}"], return_hydra_config=True).hydra.sweeper
        if "optuna" in sweeper._target_:
            assert sweeper.direction == "maximize" and sweeper.params, name
