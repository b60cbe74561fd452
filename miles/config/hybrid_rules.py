"""`ray.hybrid`: the rollout engine and the trainer in one Ray actor (miles/orchestrate/hybrid.py), and
when a run gets it. `null` (the default) turns it on wherever it applies; `true` asks for it and is
refused, with the key to change, where it does not apply; `false` keeps an actor each.

It applies to a synchronous Ray run of one native engine and a one-process trainer taking turns on the
same devices. One process runs one call at a time, so an asynchronous rollout (generating while the
trainer trains) and a disaggregated run (each side on GPUs of its own) keep their actors. An FSDP
trainer's ranks are actors of their own, a fleet's engines too.
"""

from __future__ import annotations

from miles.config.schema import EngineName, RunCfg, TrainerBackend
from miles.transport.protocol import TransportName


def _blockers(cfg: RunCfg) -> list[tuple[str, str]]:
    """(the key, why it keeps the engine and the trainer in actors of their own) for each that does."""
    r, t, d = cfg.rollout, cfg.trainer, cfg.debug
    out = []
    if not cfg.ray.enabled:
        out.append(("ray.enabled", "an in-process run has no actors"))
    if d.rollout_only or d.train_only:
        out.append(("debug.rollout_only / debug.train_only", "the run has one of the two components only"))
    if r.engine != EngineName.native:
        out.append(("rollout", f"rollout={r.engine.value} runs its own engine process"))
    if r.num_engines != 1:
        out.append(("rollout.num_engines", f"{r.num_engines} engines are a fleet of actors"))
    if t.backend == TrainerBackend.fsdp:
        out.append(("trainer", "trainer=fsdp's ranks are actors of their own"))
    if r.asynchronous:
        out.append(("rollout.asynchronous", "an actor runs one call at a time: it would not generate while training"))
    if not r.colocate:
        out.append(("rollout.colocate", "a disaggregated run keeps each side on devices of its own"))
    if r.weight_sync != TransportName.object_store:
        out.append(("rollout.weight_sync", f"one process shares the weights directly, not through {r.weight_sync.value}"))
    return out


def hybrid_actor(cfg: RunCfg) -> bool:
    """Whether this run puts its engine and trainer in one Ray actor (ray.hybrid resolved)."""
    return cfg.ray.hybrid is not False and not _blockers(cfg)


def hybrid_problems(cfg: RunCfg) -> list[str]:
    """ray.hybrid=true where it cannot apply: each reason, naming the key (called by config_problems)."""
    if cfg.ray.hybrid is not True or not cfg.ray.enabled:  # in-process runs ignore it, as they ignore ray.*
        return []
    return [f"ray.hybrid=true puts the engine and the trainer in one Ray actor, but {why}: change {key} "
            "or set ray.hybrid=null (one actor where it applies)" for key, why in _blockers(cfg)]
