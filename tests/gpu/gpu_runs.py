"""In-process runs of the GPU tests (a module of its own: tests/gpu has no conftest of its own)."""

import json

import torch


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


# Slot-decode comparisons: 12 arithmetic prompts x 4 samples over 24 slots (refills and compaction).
PROMPTS = [f"{a}+{b}=" for a, b in zip(range(10, 90, 7), range(33, 99, 5))]


def slot_engines(checkpoint: str, dtype, engine_kwargs: dict | None = None, **overrides):
    """(graphs, eager slots, padded) native engines on CUDA over one checkpoint: the slot decoder with
    its steps captured in CUDA graphs, the same decoder stepping eagerly, and the padded path."""
    from dataclasses import replace

    from miles.config.schema import RolloutCfg
    from miles.rollout.native import NativeEngine

    cfg = replace(RolloutCfg(max_new_tokens=24, max_prompt_len=16, max_running=24, sync_every=4), **overrides)

    def build(**kw):
        return NativeEngine(checkpoint, replace(cfg, **kw), dtype, device="cuda", seed=0, **(engine_kwargs or {}))

    return build(cuda_graphs=True), build(cuda_graphs=False), build(slot_decode=False)


def responses(engine, n=4, temperature=0.0):
    return engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=n, temperature=temperature)


def max_lp_diff(a, b) -> float:
    """Largest |log-prob difference| over two runs' samples, token by token."""
    return max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.rollout_logprobs, t.rollout_logprobs))


def captured(fn):
    """fn() captured once in a CUDA graph, after a warm-up call on a side stream (kernels compile
    outside the capture): (the graph, the output tensor its replays rewrite)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
