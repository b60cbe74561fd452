"""ray.hybrid: which runs put the engine and the trainer in one Ray actor (miles/config/hybrid_rules.py),
and what ray.hybrid=true refuses, naming the key to change."""

import pytest

from miles.config.hybrid_rules import hybrid_actor
from miles.validate import validate


def test_the_default_ray_run_gets_one_actor_and_in_process_runs_none(compose):
    assert hybrid_actor(compose([]))
    assert hybrid_actor(compose(["trainer=megatron"]))  # a one-process trainer like the torch one
    assert hybrid_actor(compose(["algo=ppo"]))  # the critic keeps an actor of its own
    assert not hybrid_actor(compose(["ray.hybrid=false"]))
    assert not hybrid_actor(compose(["ray.enabled=false"]))
    assert validate(compose(["ray.enabled=false", "ray.hybrid=true"])) == []  # ignored, as ray.* is in-process


# Each keeps two actors under ray.hybrid=null, and is refused under ray.hybrid=true with this fix.
BLOCKERS = [
    (["rollout.asynchronous=true"], "change rollout.asynchronous"),
    (["rollout.num_engines=2"], "change rollout.num_engines"),
    (["trainer=fsdp"], "change trainer"),
    (["rollout.colocate=false"], "change rollout.colocate"),
    (["rollout.weight_sync=broadcast"], "change rollout.weight_sync"),
    (["rollout=vllm"], "change rollout"),
    (["debug.rollout_only=true"], "change debug.rollout_only / debug.train_only"),
]


@pytest.mark.parametrize("overrides, fix", BLOCKERS)
def test_what_keeps_two_actors_is_named_when_one_is_asked_for(compose, overrides, fix):
    assert not hybrid_actor(compose(overrides))
    problems = [p for p in validate(compose([*overrides, "ray.hybrid=true"])) if p.startswith("ray.hybrid")]
    assert len(problems) == 1 and f"{fix} or set ray.hybrid=null" in problems[0], problems
