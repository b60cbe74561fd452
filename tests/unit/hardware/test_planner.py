"""Planner figures against hand-computed values on a small case, layout choice, refusals."""

import pytest

from miles.config.errors import PlanRefused
from miles.hardware import check_plan
from miles.hardware.footprint import kv_bytes_per_token, param_groups
from miles.hardware.planner import TrainLayout, make_plan, model_arch, resolve_memory_choices, rollout_usage, train_usage
from miles.validate import validate

# qwen3_tiny with a 100-token vocabulary: embed 100 x 128 (tied) = 12,800; per layer q 128x128,
# k and v 128x64 each, o 128x128, q/k norms 32 each, MLP 3 x 128x384, two layer norms 128 each
# = 196,928; 3 layers + final norm 128 -> 603,712 parameters.
TINY = ["model.vocab_size=100", "precision=bf16", "hardware=h100"]
TOTAL, EMBED = 603_712, 12_800


def test_param_groups_by_hand(compose):
    cfg = compose(TINY)
    groups = param_groups(cfg.model.arch(100), cfg.precision)
    assert (groups.total, groups.embed, groups.routed) == (TOTAL, EMBED, 0)
    # quantizable: the >= 2-D weights of the decoder layers = total - embedding - norms
    assert groups.quantizable == TOTAL - EMBED - 3 * (32 + 32 + 128 + 128) - 128


def test_train_usage_by_hand(compose):
    cfg = compose(TINY + ["trainer.pack_sequences=false"])  # padded: micro_batch_size rows (packed: test_micro_batches.py)
    groups = param_groups(cfg.model.arch(100), cfg.precision)
    usage = train_usage(cfg, groups, TrainLayout(tp=2, pp=1, ep=1), gpus=8)
    per_gpu = EMBED / 2 + (TOTAL - EMBED) / 2  # TP=2 shards everything, PP=1
    assert usage["weights"] == per_gpu * 2  # bf16 compute copy
    assert usage["gradients"] == per_gpu * 4  # fp32 accumulation
    assert usage["optimizer"] == per_gpu * 12 / 4  # fp32 master + 2 moments over DP = 8 / 2
    tokens = 128 * (64 + 8)  # micro-batch x (max_prompt_len + max_new_tokens)
    assert usage["activations"] == 3 * tokens * 128 * 34 / 2
    assert usage["logits"] == tokens * 100 * 4 * 2 / 2


def test_rollout_usage_and_kv_by_hand(compose):
    cfg = compose(TINY)
    arch = cfg.model.arch(100)
    assert kv_bytes_per_token(arch) == 3 * 2 * 2 * 32 * 2  # layers x (K, V) x kv heads x head_dim x bf16
    groups = param_groups(arch, cfg.precision)
    usage, kv_seqs, per_seq = rollout_usage(cfg, groups, gpus_per_engine=2, capacity=10e9)
    assert usage["weights"] == TOTAL * 2 / 2
    assert per_seq == 768 * 72 / 2
    assert kv_seqs == int((10e9 - TOTAL - 4e9) // per_seq)


def test_int4_and_fp8_rollout_weights(compose):
    cfg = compose(TINY + ["precision.rollout_quant=int4", "precision.int4_group_size=32"])
    groups = param_groups(cfg.model.arch(100), cfg.precision)
    usage, _, _ = rollout_usage(cfg, groups, 1, 10e9)
    assert usage["weights"] == pytest.approx(groups.kept * 2 + groups.quantizable * (0.5 + 4 / 32))
    cfg = compose(TINY + ["precision.rollout_quant=fp8"])
    usage, _, _ = rollout_usage(cfg, groups, 1, 10e9)
    assert usage["weights"] == pytest.approx(groups.kept * 2 + groups.quantizable * (1 + 4 / 128**2))


def test_small_model_picks_pure_data_parallel(compose):
    plan = make_plan(compose(TINY))
    assert plan.fits and plan.layout == TrainLayout(1, 1, 1, 1, False) and plan.gpus_per_engine == 1


def test_big_dense_model_needs_model_parallelism_on_one_node(compose):
    plan = make_plan(compose(["model=qwen3_32b", "precision=bf16", "hardware=h100"]))
    assert plan.fits
    assert plan.layout.tp * plan.layout.pp > 1 or plan.layout.offload
    assert plan.train_total <= plan.capacity and plan.kv_sequences >= 1


def test_pinned_layout_that_cannot_fit_is_refused_with_a_fix(compose):
    # fp32: 131 GB of rollout weights on one 80 GB GPU; unsharded training state on each GPU.
    plan = make_plan(compose(["model=qwen3_32b", "precision=fp32", "hardware=h100", "trainer.tp=1", "trainer.pp=1",
                              "trainer.offload_optimizer=false", "rollout.num_gpus_per_engine=1"]))
    assert not plan.fits
    assert any("one rollout engine's weights do not fit 1 GPU" in p for p in plan.problems)
    assert any(p.startswith("training state does not fit") for p in plan.problems)
    assert any(s.startswith("rollout.num_gpus_per_engine=2") for s in plan.suggestions)


def test_unsupported_number_format_is_a_config_error(compose):
    problems = validate(compose(["precision=bf16", "hardware=h100", "hardware.precisions=[fp32]", "dry_run=true"]))
    assert problems == ["precision=bf16 uses bf16, which hardware=h100 does not support (it runs fp32); "
                        "pick another precision recipe or hardware profile"]


def test_lora_counts_the_frozen_base_without_optimizer_state(compose):
    """trainer.lora: the base in the training dtype with no gradient or AdamW state; the adapters
    (rank 8 on every projection: 8 x (in + out) = 8 x 2432 per layer, 3 layers) in fp32 with both."""
    cfg = compose(TINY + ["trainer.pack_sequences=false", "trainer.lora.rank=8"])
    groups = param_groups(cfg.model.arch(100), cfg.precision)
    usage = train_usage(cfg, groups, TrainLayout(tp=2, pp=1, ep=1), gpus=8)
    adapters = 3 * 8 * 2432 / 2  # TP=2
    assert usage["weights"] == (EMBED / 2 + (TOTAL - EMBED) / 2) * 2 + adapters * 4
    assert usage["gradients"] == adapters * 4
    assert usage["optimizer"] == adapters * 8
    # Three adapters (trainer.lora.adapters): three times the adapters' weights, gradients and moments.
    three = compose(TINY + ["trainer.pack_sequences=false", "trainer.lora.rank=8", "trainer.lora.adapters=[a,b,c]"])
    usage3 = train_usage(three, groups, TrainLayout(tp=2, pp=1, ep=1), gpus=8)
    assert usage3["weights"] - usage["weights"] == 2 * adapters * 4
    assert (usage3["gradients"], usage3["optimizer"]) == (3 * adapters * 4, 3 * adapters * 8)


def test_lora_fits_where_full_fine_tuning_does_not(compose):
    pinned = ["model=qwen3_14b", "precision=bf16", "hardware=h100", "trainer.tp=1", "trainer.pp=1",
              "trainer.offload_optimizer=false", "trainer.recompute=true"]
    assert not make_plan(compose(pinned), suggest=False).fits
    plan = make_plan(compose(pinned + ["trainer.lora.rank=16"]), suggest=False)
    assert plan.fits, plan.problems


# Qwen3-4B, bf16, 64 x 8 samples of 320 tokens on one H200: the trainer's state (weights, master,
# moments: ~56 GB) plus the engine's weights and 512-slot KV cache do not fit beside the training
# peak (~108 GB) unless one side gives its memory back (measured: step 2 ran out of memory).
H200_4B = ["model=qwen3_4b", "precision=bf16", "hardware=gpu", "hardware.memory_gb=139",
           "rollout.max_new_tokens=256", "ray.enabled=false"]


def test_colocated_sides_that_stay_resident_must_fit_together(compose):
    cfg = compose(H200_4B + ["rollout.offload=false", "trainer.offload=false"])
    plan = make_plan(cfg)
    assert not plan.fits and plan.offload == (False, False)
    assert any(p.startswith("colocated, the engine keeps") for p in plan.problems), plan.problems
    assert plan.suggestions[0] == "rollout.offload=true (the sides take turns on the GPU)"


def test_null_offload_is_decided_by_the_plan(compose):
    cfg = compose(H200_4B)
    assert cfg.rollout.offload is None and cfg.trainer.offload is None
    plan = make_plan(cfg)
    assert plan.fits and plan.offload == (True, False)  # the fewest moves: the engine releases, the trainer stays
    resolved = resolve_memory_choices(cfg)
    assert (resolved.rollout.offload, resolved.trainer.offload) == (True, False)
    # The KV budget is what the trainer's resident state leaves.
    alone = make_plan(compose(H200_4B + ["rollout.offload=true", "trainer.offload=true"]))
    trainer_state = sum(plan.train[k] for k in ("weights", "optimizer"))
    per_seq = rollout_usage(cfg, param_groups(model_arch(cfg), cfg.precision), 1, 0.0)[2]
    assert alone.kv_sequences - plan.kv_sequences == pytest.approx(trainer_state / per_seq, abs=1)


def test_small_runs_and_the_cpu_keep_both_sides_resident(compose):
    small = make_plan(compose([*H200_4B, "model=qwen3_0_6b"]))
    assert small.fits and small.offload == (False, False)
    assert resolve_memory_choices(compose([])).rollout.offload is False  # CPU: nothing to release


def test_backends_that_cannot_release_are_not_chosen(compose):
    cfg = compose(H200_4B + ["rollout.offload=false"])
    assert make_plan(cfg).offload == (False, True)  # the engine pinned resident: the trainer moves
    fsdp = compose(H200_4B + ["trainer=fsdp", "ray.enabled=true", "rollout.offload=false"])
    assert make_plan(fsdp).offload[1] is False  # FSDP ranks do not offload


def test_true_on_policy_trains_padded_micro_batches(compose):
    # The trainer runs its batch-invariant kernels on padded rows whatever trainer.pack_sequences says
    # (an fp8 true-on-policy 0.6B run planned as packed ran out of memory on an H200).
    shape = make_plan(compose(H200_4B + ["model=qwen3_0_6b", "true_on_policy=true"])).micro_batch
    assert shape.tokens == 128 * (64 + 256) and shape.how.endswith("padded")


def test_true_on_policy_engine_holds_fp32_weights_and_keys(compose):
    small = H200_4B + ["model=qwen3_0_6b", "rollout.offload=true", "trainer.offload=true"]
    normal, exact = make_plan(compose(small)), make_plan(compose(small + ["true_on_policy=true"]))
    assert exact.rollout["weights"] == 2 * normal.rollout["weights"]  # the trainer's fp32 masters, not bf16
    room = normal.capacity - normal.rollout_total  # what the KV cache gets; fp32 keys take twice the bytes
    assert exact.kv_sequences == pytest.approx(normal.kv_sequences / 2 * (normal.capacity - exact.rollout_total)
                                               / room, abs=1)


# Qwen3-4B, bf16, 4K-token responses on an 80 GB GPU: the packed micro-batch's activations are what
# does not fit (the weights, gradients and the offloaded optimizer would).
LONG_4B = ["model=qwen3_4b", "precision=bf16", "hardware=gpu", "hardware.memory_gb=80", "rollout.max_new_tokens=4096",
           "ray.enabled=false"]


def test_activations_that_do_not_fit_name_recompute_or_a_smaller_micro_batch(compose):
    plan = make_plan(compose(LONG_4B + ["trainer.max_tokens_per_micro_batch=16384"]))
    assert not plan.fits and plan.suggestions == [
        "trainer.recompute=true (each layer's activations recomputed in backward)"]
    assert make_plan(compose(LONG_4B + ["trainer.max_tokens_per_micro_batch=16384", "trainer.recompute=true"])).fits
    # Twice the tokens: recompute alone is not enough (72.9 of 72 GB), half the micro-batch with it is.
    plan = make_plan(compose(LONG_4B + ["trainer.max_tokens_per_micro_batch=32768"]))
    change = "trainer.max_tokens_per_micro_batch=16384 trainer.recompute=true"
    assert not plan.fits and plan.suggestions == [f"{change} (the largest halving of the micro-batch that fits)"]
    assert make_plan(compose(LONG_4B + change.split())).fits
    with pytest.raises(PlanRefused, match=f"; change: {change}"):  # what the refusal prints names it too
        check_plan(compose(LONG_4B + ["trainer.max_tokens_per_micro_batch=32768"]))


H100_4B = ["model=qwen3_4b", "hardware=gpu", "hardware.memory_gb=80", "precision=bf16", "rollout.max_new_tokens=256"]


def test_offload_optimizer_moves_the_moments_and_is_chosen_only_where_needed(compose):
    # An 80 GB card: the 4B shape's AdamW moments (8 bytes per parameter) must leave it; the fp32
    # master (4 bytes) stays, as the torch trainer keeps it (miles/trainer/host_optimizer.py).
    cfg = compose(H100_4B + ["trainer.recompute=true"])
    total = param_groups(model_arch(cfg), cfg.precision).total
    resolved = resolve_memory_choices(cfg)
    assert resolved.trainer.offload_optimizer is True
    plan = make_plan(cfg)
    assert plan.fits and plan.layout.offload
    assert plan.train["optimizer"] == pytest.approx(total * 4)
    assert plan.host_needed == pytest.approx(total * 8)
    # Without recomputation the moments' 32 GB are not enough: refused, recompute named.
    refused = make_plan(compose(H100_4B))
    assert not refused.fits and refused.suggestions[0].startswith("trainer.recompute=true")
    # Room enough, the CPU, and backends that do not stream their state: not chosen.
    assert resolve_memory_choices(compose(H100_4B + ["hardware.memory_gb=141"])).trainer.offload_optimizer is False
    assert resolve_memory_choices(compose([])).trainer.offload_optimizer is False
    megatron = compose(H100_4B + ["trainer=megatron", "trainer.recompute=true", "ray.enabled=false"])
    assert not make_plan(megatron).layout.offload


def test_a_launch_refuses_a_plan_that_splits_the_model(compose):
    """No trainer backend runs TP / PP / EP yet: a plan that fits only so sizes a cluster (dry_run=true)
    and a launch is refused with what to change; a layout a backend runs is preferred (the moments in
    host memory before a model split)."""
    from miles.hardware import _not_runnable, check_plan

    big = ["model=qwen3_32b", "hardware=h100", "precision=bf16", "ray.enabled=true", "warm_start.enabled=false"]
    sized = check_plan(compose([*big, "dry_run=true"]))
    assert sized.layout.model_parallel
    with pytest.raises(PlanRefused, match=r"fits only with the model split over GPUs \(TP=\d .*trainer=torch trains in "
                                          r"one process on one GPU.*trainer.recompute=true"):
        check_plan(compose(big))
    # FSDP ranks shard the policy (the plan does not model them): not refused on that ground
    assert _not_runnable(compose([*big, "trainer=fsdp", "trainer.num_ranks=8"]), sized) == ""
    # 8B on 8 x 80 GB with recompute: TP=2 would fit without the offload, one GPU's layout with it;
    # the latter is the one a backend runs
    node = ["model=qwen3_8b", "hardware=gpu", "hardware.memory_gb=80", "hardware.gpus_per_node=8", "precision=bf16",
            "trainer.recompute=true", "rollout.max_new_tokens=256"]
    assert make_plan(compose([*node, "trainer.offload_optimizer=false"])).layout.model_parallel
    plan = make_plan(compose(node))
    assert not plan.layout.model_parallel and plan.layout.offload
    # ... its master sharded over 8 data-parallel GPUs, which one process does not have: refused at launch
    with pytest.raises(PlanRefused, match=r"fits only with the optimizer state sharded over 8 GPUs.*training needs "
                                          r"\d+\.\d GB of 72\.0 usable"):
        check_plan(compose(node))
    assert check_plan(compose([*node, "hardware.gpus_per_node=1", "model=qwen3_4b"])).layout.offload  # one GPU: runs
