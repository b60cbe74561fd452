"""In-process runs of the GPU tests (a module of its own: tests/gpu has no conftest of its own)."""

import json


def run_inprocess(compose, tmp_path, overrides) -> dict[int, dict]:
    """A run through miles.orchestrate.run in this process; its metrics per step (from its journal)."""
    from omegaconf import OmegaConf

    from miles.orchestrate.run import run

    overrides = [*overrides, "ray.enabled=false", "tracking.uri=sqlite:///" + str(tmp_path / "mlflow.db")]
    cfg = compose(overrides)
    cfg.output_dir = str(tmp_path / "run")
    run(cfg, tmp_path / "run", overrides, OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    metrics: dict[int, dict] = {}
    for line in (tmp_path / "run" / "mlflow" / "journal.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry["op"] == "metrics":
            metrics.setdefault(entry["step"], {}).update(entry["metrics"])
    return metrics
