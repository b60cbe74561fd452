"""Miles entry point: compose the Hydra config, validate it, record the run, build, loop.

    python launch.py                                   # default: GRPO on arithmetic, qwen3_tiny, CPU
    python launch.py algo=sft steps=300                # train the base policy
    python launch.py -m trainer.lr=1e-4,3e-4 steps=2   # a sweep: one MLflow parent run, a child per job
    python launch.py --cfg job                         # print the composed config
    python launch.py model=kimi_k2 hardware=h200 dry_run=true  # memory plan only: exit 0 fits, 3 refused
    python launch.py +experiment=cpu_moe                # a preset (conf/experiment/)
    python launch.py -m +sweep=tpe_lr_clip              # an Optuna TPE sweep (sweeps/sweep/)
    python launch.py +reproduce=outputs/2026-01-01/12-00-00   # run a recorded run again (or an MLflow run id)
"""

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from miles.config.errors import exit_on_user_error, refuse_old_forms
from miles.config.store import register_configs
from miles.tracking.reproduce import expand_argv

register_configs()


@hydra.main(config_path=str(Path(__file__).parent / "conf"), config_name="config", version_base="1.3")
def main(dcfg: DictConfig) -> float:
    from miles.validate import check
    from miles.hardware import check_plan
    from miles.orchestrate.run import run

    # Raised here, a user mistake would reach Hydra's job runner, which adds its own error line.
    with exit_on_user_error():
        hydra_cfg = HydraConfig.get()
        dcfg.output_dir = hydra_cfg.runtime.output_dir
        cfg = OmegaConf.to_object(dcfg)  # typed dataclasses from here on
        check(cfg)  # every cross-field problem at once
        check_plan(cfg)  # memory per device under the chosen layout; exit 3 if it cannot fit
        if cfg.dry_run:
            return 0.0
        resolved = OmegaConf.to_yaml(dcfg, resolve=True)
        return run(cfg, cfg.output_dir, list(hydra_cfg.overrides.task), resolved)


if __name__ == "__main__":
    # Let composition errors reach us: user mistakes exit 2 with one message, bugs keep their traceback.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    # conf/config.yaml's hydra.searchpath: the sweep group beside this file, whatever the working directory.
    os.environ.setdefault("MILES_SWEEPS_DIR", str(Path(__file__).resolve().parent / "sweeps"))
    with exit_on_user_error():
        sys.argv = expand_argv(sys.argv)  # +reproduce=<run>: that run's recorded overrides, before composing
        refuse_old_forms(sys.argv[1:])  # rollout.engine=vllm, trainer.backend=fsdp, ...: exit 2 naming the new form
        main()
