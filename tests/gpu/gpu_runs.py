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


def full_forward_mismatch(samples, checkpoint: str, dtype) -> float:
    """Mean over samples of the mean |engine log-prob - full-forward log-prob| of their response
    tokens: what the trainer recomputes (one forward over prompt + response, the checkpoint in
    `dtype` on CUDA) against what the engine reported while decoding."""
    import torch

    from miles.models import from_pretrained

    model = from_pretrained(checkpoint, dtype=torch.float32).cuda().to(dtype)
    diffs = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(model(ids)[0, :-1].float(), -1)
        start = len(s.prompt_ids) - 1
        full = logp[start:start + len(s.response_ids)].gather(1, ids[0, start + 1:, None]).squeeze(1)
        diffs.append((full - torch.tensor(s.rollout_logprobs, device="cuda")).abs().mean().item())
    return sum(diffs) / len(diffs)
