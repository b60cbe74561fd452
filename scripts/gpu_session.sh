#!/usr/bin/env bash
# The GPU machine's work list, in parts that each fit one 600 s device call; logs under $OUT (or ./gpu-logs).
#   bash scripts/gpu_session.sh 1        # on the GPU node, from the repo root, wheelhouse/ carried
#   STEPS=megatron bash scripts/gpu_session.sh 1                 # only the named steps of the part
# Each part installs what the node lacks from wheelhouse/ first (docs/offline-install.md) and keeps
# going after a failing step (each step's exit status is in its log's last line), so one failure
# does not cost the rest of a call. Parts (most urgent: 24 (rollout.memory_saver: its GPU test, then the
# colocated 0.6B step with and without it), 7 (LoRA at the 4B shape: the trainer side, then
# STEPS=lora_4b_decode), 10's windows test). Run each step's
# command by hand only after `rm -rf /tmp/tmp*` (a cut 4B run's files filled the disk once). The parts:
#   1  the GPU tests of what changed last: the fixes of 2026-12-06 (the chunked LM head's backward
#      after the batch-invariant mode, the compiled ops' written-out backward, Megatron's RoPE in the
#      core attention) with the tests that found them (true on-policy per recipe, tests/megatron on CUDA,
#      the trainer contract; all passed on an H100, 2026-12-06)
#   2  the engine and trainer end to end on CUDA (rollout, determinism, true on-policy, multi-LoRA,
#      fp8's default scheme w8a16 with its mismatch, recompute under the recipes)
#   3  decode benchmarks: MoE and MLA shapes, the low-precision recipes at 64 rows on the 4B shape
#   4  the GRPO step per recipe on the 4B shape (bf16 with fp8 = w8a16, bf16 with int4_qat: step, mismatch)
#   5  where a 64-row decode step goes per recipe (profile), the weight-only GEMM variants
#   6  the training speed targets: where a native step goes (profile; the fused LM-head softmax and the
#      bf16 residual stream on and off), Megatron-core against the native trainer, padded and packed
#      (0.6B shape)
#   7  LoRA against full fine-tuning (4B): the trainer side and the sync, then (lora_4b_decode, a call
#      of its own) the engines' decode too. Out of memory three times on an H100 before the engines
#      ran one at a time; on 2026-12-07 (thirteenth session) the trainer side printed nothing within
#      200 s and the whole script nothing within 330 s, so each phase now prints as it ends
#   8  the optimizer state in host memory (test, the 4B GRPO step per recipe), Megatron's step
#      profiled, the bf16 / fp8 mismatch over 3 steps (ran 2026-12-06)
#   9  the Megatron tier on CUDA, first half (its files passed on CUDA 2026-12-06, in pieces)
#  10  the memory phase windows; where the fp8 recipes' mismatch comes from (mismatch_sources.py; ran
#      2026-12-06 except the windows' test)
#  11  a DeepSeek-V3-shaped model with fewer layers and experts through Megatron, against native (ran
#      2026-12-06)
#  12  the w8a16 decode GEMMs' mismatch side by side; Megatron against native, profiled (both ran
#      2026-12-06)
#  13  split-K in the int4 decode kernel: its mismatch, and one K slice's decode cost for both recipes
#      (ran 2026-12-06, fifth session)
#  14  both weight-only decode kernels' tiles in one K slice, with their bits against the prefill GEMM
#      (w8a16 ran 2026-12-06, fifth session)
#  16  the W8A16 tiles chosen from it: their bits, the 4B decode (ran 2026-12-06, sixth session)
#  15  the Megatron tier on CUDA, second half, with tests/gpu/test_megatron_cuda.py (all passed on an
#      H100, 2026-12-06, seventh session)
#  17  the INT4 decode tiles from part 14's w4a16 sweep, each recipe's 4B decode, the fp8 4B GRPO step
#      (ran 2026-12-06, seventh session)
#  18  the weight-only kernels at 256-1024 rows (large swapped tiles), each recipe's 4B decode at 512 rows
#      (ran 2026-12-06, seventh session; benchmarks/dequant_cost.py ran beside it)
#  19  the warp-specialized W8A16 / W4A16 GEMMs (miles/precision/weight_only_ws.py, Gluon) against cuBLAS,
#      the fused kernels and the one-pass dequantization + cuBLAS (dequant_triton.py) at 256-4096 rows
#      with their bits, their CUDA tests; the CUDA-graph tests that moved to gpu_runs.captured; Megatron
#      QLoRA's held codes on CUDA (ran 2026-12-06, eighth session; a 512-row decode through the
#      warp-specialized kernel hit its 150 s limit, and the engine no longer calls that kernel)
#  20  the trainer's experts as grouped GEMMs (test, one layer against the loop), the GRPO step, bf16 and
#      fp8, on 4 Qwen3-30B-A3B layers (ran on an H100, 2026-12-07, thirteenth session: bf16 5.10 s,
#      fp8 0.93x)
#  21  the FP8 / INT4 engines' MoE experts held quantized: the grouped kernels on codes and scales
#      (tests), the decode of 4 Qwen3-30B-A3B layers per recipe; the one-pass dequantization's GEMMs
#  22  the FP8 backward (precision.fp8_backward=fp8) and the weight-only engines' dense copies: their CUDA
#      tests, one 4B linear's forward + backward per path (ran on an H100, 2026-12-07, fourteenth session:
#      the FP8 backward 0.97-1.91x the bf16 backward's time); then (STEPS=grpo_4b_fast, a call of its own)
#      the 4B GRPO step, fp8 with dense copies against bf16 (ran on an H100, 2026-12-07, fifteenth session:
#      fp8 1.17x, its rollout 0.99x); (STEPS=train_4b_fp8_backward) the 4B trainer per recipe
#  23  Megatron's and the native trainer's memory at 64 x 384, held between steps and at the peak
#      (issue 29: Megatron's peak was 0.8 GB above native's there; ran on an H100, 2026-12-07: held 10.1 vs
#      9.0 GB, peak 23.1 vs 22.3)
#  24  rollout.memory_saver (pausable weights and slot cache: the decode graphs kept through the trainer's
#      turn): its GPU test with the colocation tests, then the colocated 0.6B step without and with it
#      (the capture was 2.3 s of that step on an H100, 2026-12-07)
set -u
PART=${1:?usage: gpu_session.sh PART (1-24)}
LOGS=$(realpath -m "${OUT:-gpu-logs}")
mkdir -p "$LOGS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # scripts run from benchmarks/ import miles too
rm -rf /tmp/tmp* 2>/dev/null  # a warm machine keeps the previous call's temporaries
python3 -m pip install -q --no-index --find-links wheelhouse -r requirements/gpu-node.txt > "$LOGS/pip.log" 2>&1

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log, record the exit status
    local name=$1 limit=$2
    shift 2
    [[ -z "${STEPS:-}" || " $STEPS " == *" $name "* ]] || return 0
    echo "== $name ($(date +%T))"
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    echo "exit $rc" >> "$LOGS/$name.log"
    echo "   exit $rc, $(tail -n 3 "$LOGS/$name.log" | head -n 2 | tr '\n' ' ')"
}

case $PART in
1)
    step fixes 240 python3 -m pytest -q -rf tests/unit/trainer/test_chunked_ce_triton.py \
        tests/unit/models/test_fused_ops.py tests/gpu/test_fp8_invariant_cuda.py \
        tests/gpu/test_true_on_policy_cuda.py::test_true_on_policy_step_takes_the_eager_head_in_backward
    step megatron 300 python3 -m pytest -q -rf tests/megatron tests/gpu/test_megatron_cuda.py \
        tests/gpu/test_trainer_contract_cuda.py -k "not grpo_run"
    ;;
2)
    step engine_cuda 300 python3 -m pytest -q tests/gpu/test_rollout_cuda.py tests/gpu/test_determinism_cuda.py \
        tests/gpu/test_true_on_policy_cuda.py tests/gpu/test_multi_lora_cuda.py
    # -s: the w8a16 file prints the bf16 / w8a16 mismatch on the GPU (issue 33)
    step fp8_w8a16 200 python3 -m pytest -q -s -rf tests/gpu/test_fp8_w8a16_cuda.py
    step recompute 60 python3 -m pytest -q -rf tests/gpu/test_recompute_cuda.py
    ;;
3)  # each engine's first call compiles and captures: 60 s per MoE / MLA case was too short (2026-12-05),
    # 170 s too for MoE with the padded engine (2026-12-06); the script prints its progress
    step decode_moe 330 python3 benchmarks/rollout_speed.py --device cuda --dtype bf16 --model qwen3_30b_a3b_8l \
        --rows 64 256 --repeats 2 --skip-hf --no-padded
    step decode_mla 170 python3 benchmarks/rollout_speed.py --device cuda --dtype bf16 --model deepseek_v3_dense_4l \
        --rows 64 256 --repeats 2 --skip-hf
    (cd benchmarks && step decode_recipes 250 python3 precision_decode.py --model qwen3_4b --rows 64 \
        --recipes bf16 fp8_w8a16 int4 --variants fused --repeats 2)
    ;;
4)  # an 80 GB card needs recompute at this shape (the plan refuses it without; the optimizer state
    # goes to host memory); int4_qat has never run end to end on a GPU. Two recipes took ~300 s on an
    # H100 (2026-12-06; 290 s and, 2026-12-07, 330 s cut fp8's summary line), so each pair is a step of
    # its own, one per call: STEPS=grpo_4b, then STEPS=grpo_4b_more
    (cd benchmarks && step grpo_4b 420 python3 grpo_step.py --model qwen3_4b --steps 2 \
        --recipes bf16,trainer.recompute=true fp8,trainer.recompute=true)
    (cd benchmarks && step grpo_4b_more 330 python3 grpo_step.py --model qwen3_4b --steps 2 \
        --recipes bf16,trainer.recompute=true int4_qat,trainer.recompute=true)
    ;;
5)  # two recipes took over 100 s on an H100 (2026-12-05)
    (cd benchmarks && step decode_profile 300 python3 decode_profile.py --model qwen3_4b --rows 64 \
        --recipes bf16 fp8_w8a16 int4 --variants fused --new-tokens 64)
    step weight_only_variants 280 python3 benchmarks/weight_only_variants.py
    ;;
6)
    # before both changes, the fused LM-head softmax alone, and with the bf16 residual stream too;
    # the last one profiled (where the step goes now)
    for flags in "--fp32-residual --eager-ce" "--fp32-residual" "--profile 25"; do
        step "train_speed$(echo "$flags" | tr -d ' -')" 100 python3 benchmarks/train_speed.py --model qwen3_0_6b \
            --device cuda --cases fixed,seq-2k --configs packed --repeats 3 $flags
    done
    # Megatron against native, padded and packed (its RoPE in the project's core attention)
    step train_megatron 240 python3 benchmarks/train_speed.py --model qwen3_0_6b --device cuda \
        --configs padded-chunked,megatron,packed,megatron-packed --cases fixed,seq-2k --repeats 3 --warmup 2
    ;;
8)  # the 2026-12-06 (second) session's changes: the optimizer state in host memory, the 4B GRPO step
    # that ran out of memory without it (recompute on: the plan refuses 80 GB without), where Megatron's
    # step goes, and the bf16 / fp8 mismatch over 3 steps
    step host_optimizer 120 python3 -m pytest -q -s -rf tests/gpu/test_host_optimizer_cuda.py
    (cd benchmarks && step grpo_4b_offload 330 python3 grpo_step.py --model qwen3_4b \
        --recipes bf16,trainer.recompute=true fp8,trainer.recompute=true --steps 2)
    step megatron_profile 120 python3 benchmarks/train_speed.py --model qwen3_0_6b --device cuda \
        --configs megatron --cases seq-2k --repeats 2 --profile 30
    step mismatch_steps 150 python3 benchmarks/mismatch_study.py --models qwen3_0_6b --precisions bf16 fp8 \
        --modes none --steps 3 --extra hardware=gpu rollout.batch_size=32 rollout.n_samples_per_prompt=8 \
        trainer.global_batch_size=256 trainer.micro_batch_size=128 rollout.max_new_tokens=128
    ;;
9)  # the Megatron tier on CUDA, first half (with the compiled RMSNorm the whole tier ran ~2x longer
    # than its 220 s of 2026-12-06: 300 s reached half of it), -v: a cut step still names its passes
    step megatron_a 570 python3 -m pytest -v -rf --durations=15 --timeout=200 tests/megatron/test_core_attention.py \
        tests/megatron/test_megatron_contract.py tests/megatron/test_megatron_dsa.py \
        tests/megatron/test_megatron_lora.py tests/megatron/test_megatron_mla.py tests/megatron/test_megatron_packed.py \
        tests/megatron/test_megatron_precision.py tests/megatron/test_megatron_qlora.py
    ;;
15) # the Megatron tier on CUDA, second half (test_megatron_cuda.py: not run since the RMSNorm change)
    step megatron_b 570 python3 -m pytest -v -rf --durations=15 --timeout=200 tests/gpu/test_megatron_cuda.py \
        tests/megatron/test_megatron_routing.py tests/megatron/test_megatron_run.py tests/megatron/test_megatron_sync.py \
        tests/megatron/test_megatron_trainer.py tests/megatron/test_multi_tensor.py \
        tests/gpu/test_trainer_contract_cuda.py -k "not grpo_run"
    ;;
10) # not yet run on a GPU: the memory phase windows, where the fp8 recipes' mismatch comes from
    step colocated_peaks 150 python3 -m pytest -q -s -rf tests/gpu/test_colocated_offload_run.py
    (cd benchmarks && step mismatch_sources 300 python3 mismatch_sources.py --device cuda --model qwen3_0_6b \
        --recipes bf16 fp8 fp8,precision.fp8_scheme=w8a8)
    ;;
11) # issue 29's second target: a DeepSeek-V3-shaped model (its widths; 3 layers, 8 experts, a 32k
    # vocabulary: ~2.2B parameters) trains through Megatron (MLA, the DeepSeek router), against native
    step train_megatron_mla 300 python3 benchmarks/train_speed.py --model deepseek_v3 --device cuda \
        --set num_layers=3 moe.first_k_dense=1 moe.num_experts=8 moe.num_experts_per_tok=2 moe.n_group=4 \
        moe.topk_group=2 mtp_layers=0 vocab_size=32768 \
        --configs padded-chunked,megatron --cases fixed --repeats 3 --warmup 2
    ;;
12) # where w8a16's extra mismatch came from (split-K in the fused decode kernel: off since 2026-12-06),
    # each decode GEMM side by side; Megatron against native with its step profiled
    for kernel in fused split dequant; do
        (cd benchmarks && step "mismatch_$kernel" 150 python3 mismatch_sources.py --device cuda --model qwen3_0_6b \
            --recipes bf16 fp8 --w8a16-kernel $kernel)
    done
    step train_megatron 240 python3 benchmarks/train_speed.py --model qwen3_0_6b --device cuda \
        --configs padded-chunked,megatron --cases fixed,seq-2k --repeats 3 --warmup 2 --profile 30
    ;;
13) # does split-K raise int4's mismatch as it did w8a16's, and what does one K slice cost in decode
    # (both recipes' kernels on the 4B shape, each run against its own bf16 row); first, whether the
    # one-slice W8A16 decode rows come out as the prefill GEMM gives them (-s prints the counts)
    step w8a16_rows 60 python3 -m pytest -q -s -rf tests/gpu/test_fp8_w8a16_cuda.py -k decode_rows_count
    (cd benchmarks && step mismatch_int4 130 python3 mismatch_sources.py --device cuda --model qwen3_0_6b \
        --recipes bf16 int4_qat)
    (cd benchmarks && step mismatch_int4_unsplit 110 python3 mismatch_sources.py --device cuda --model qwen3_0_6b \
        --recipes int4_qat --w4a16-kernel unsplit)
    for flag in "" "--w8a16-split-k --w4a16-unsplit"; do
        (cd benchmarks && step "decode_slices$(echo "$flag" | tr -d ' -')" 140 python3 precision_decode.py \
            --model qwen3_4b --rows 64 --recipes bf16 fp8_w8a16 int4 --repeats 2 --new-tokens 128 $flag)
    done
    ;;
14) # both weight-only decode kernels' tiles in one K slice (split-K cost 0.86x -> 0.59x bf16 for W8A16 at
    # 64 rows on the 4B shape, H100 2026-12-06): each config's ms and its outputs off the prefill GEMM's
    # bits, the fastest bit-exact config per 4B layer; rows print as they come (a cut step keeps them)
    (cd benchmarks && step sweep_w8a16_decode 250 python3 kernel_sweep.py w8a16 --decode)
    (cd benchmarks && step sweep_w4a16_decode 250 python3 kernel_sweep.py w4a16 --decode)
    ;;
16) # the one-slice W8A16 tiles from part 14's sweep: still the prefill GEMM's bits, and the 4B decode
    step w8a16_tiles 60 python3 -m pytest -q -s -rf tests/gpu/test_fp8_w8a16_cuda.py -k "decode_rows_count or graph or real_shape"
    (cd benchmarks && step decode_tiles 170 python3 precision_decode.py --model qwen3_4b --rows 64 256 \
        --recipes bf16 fp8_w8a16 --repeats 2 --new-tokens 128)
    ;;
17) # the INT4 decode tiles of 2026-12-06 (BK 128 where 17-64 rows fill the SMs), each recipe's 4B decode,
    # and the fp8 4B GRPO step alone (the pair does not fit 330 s; bf16's step: part 4, same machine kind)
    step int4_tiles 90 python3 -m pytest -q -rf tests/gpu/test_int4_triton_cuda.py
    (cd benchmarks && step decode_recipes 150 python3 precision_decode.py --model qwen3_4b --rows 64 \
        --recipes bf16 fp8_w8a16 int4 --repeats 2 --new-tokens 128)
    (cd benchmarks && step grpo_4b_fp8 220 python3 grpo_step.py --model qwen3_4b --steps 2 \
        --recipes fp8,trainer.recompute=true)
    ;;
18) # compute-bound weight-only GEMMs (256-1024 rows: a GRPO rollout decodes 512 at once): the swapped
    # large tiles against the current picks, and each recipe's 4B decode at 512 rows
    (cd benchmarks && step sweep_w8a16_large 200 python3 kernel_sweep.py w8a16 --rows 256 512 1024)
    (cd benchmarks && step sweep_w4a16_large 200 python3 kernel_sweep.py w4a16 --rows 256 512 1024)
    (cd benchmarks && step decode_512 150 python3 precision_decode.py --model qwen3_4b --rows 512 \
        --recipes bf16 fp8_w8a16 int4 --repeats 2 --new-tokens 128)
    step dequant_cost 90 python3 benchmarks/dequant_cost.py
    ;;
19) # the warp-specialized weight-only GEMMs (Gluon). A wrong barrier phase would hang, so a small checked
    # GEMM runs first under a short limit; if it fails, the kernel's steps are skipped
    step ws_smoke 60 python3 benchmarks/weight_only_ws.py --smoke
    step dequant_one_pass 60 python3 -m pytest -q -rf tests/unit/precision/test_dequant_triton.py
    if [[ ! -f "$LOGS/ws_smoke.log" ]] || grep -qx "exit 0" "$LOGS/ws_smoke.log"; then
        step ws_tests 120 python3 -m pytest -q -rf tests/gpu/test_weight_only_ws_cuda.py
        step weight_only_ws 150 python3 benchmarks/weight_only_ws.py
    else  # the one-pass dequantization without the warp-specialized configs
        step weight_only_ws 100 python3 benchmarks/weight_only_ws.py --no-ws
    fi
    # Megatron QLoRA holding the engine's INT4 / FP8 codes in its linears (held_base.py), on CUDA (104 s)
    step megatron_qlora 150 python3 -m pytest -q -rf tests/megatron/test_megatron_qlora.py
    step graph_helper 90 python3 -m pytest -q -rf tests/gpu/test_decode_attention_cuda.py \
        tests/gpu/test_fp8_w8a16_cuda.py tests/gpu/test_int4_triton_cuda.py tests/gpu/test_moe_graph_decode_cuda.py \
        -k "captured or capture"
    ;;
20) # bf16 and fp8 GRPO steps on 4 of Qwen3-30B-A3B's layers (the FP8 engine holds the experts
    # quantized, decoded by the grouped kernels on codes). An H100 (2026-12-07, twelfth session): bf16
    # ~150 s, step 35.7 s (33.6 s training); fp8 ran out of memory in step 2's device checksum, since
    # reduced in blocks; the trainer's expert loop since unbinds its stacks (11.6x on the CPU).
    # (The 4B shape's fp8 step is part 4's grpo_4b.) Through this script only: it clears /tmp/tmp*
    # first, and a warm machine's leftover 4B checkpoints filled the disk once (bf16's final save).
    # Since then dense bf16 expert stacks train through two grouped GEMMs (torch._grouped_mm); their
    # test against the loop runs first, then one layer of them against the loop (forward + backward).
    step moe_grouped_gemm 80 python3 -m pytest -q -rf tests/gpu/test_moe_grouped_gemm_cuda.py
    step moe_train_speed 60 python3 benchmarks/moe_train_speed.py
    step grpo_moe 400 python3 benchmarks/grpo_step.py --model qwen3_30b_a3b --steps 2 \
        --recipes bf16,model.num_layers=4,trainer.recompute=true fp8,model.num_layers=4,trainer.recompute=true
    ;;
21) # the FP8 / INT4 engines' MoE experts held quantized (quant_experts.py): the grouped kernels reading
    # codes and scales, their bits against the dequantized stacks, the captured MoE decode tests; the
    # one-pass dequantization's tests; the grouped kernels per format against the roofline; the decode of
    # 4 Qwen3-30B-A3B layers per recipe; last, the one-pass dequantization's GEMMs. An H100 (2026-12-07,
    # twelfth session, INT4 without int-to-float conversions and with pipelined byte loads): the experts
    # FP8 1.03-1.45x bf16, INT4 1.12-1.41x, bit-exact; the 4-layer decode fp8 0.85x, int4 0.77x. A
    # candidate kernels file runs beside these with `moe_grouped_speed.py --alt FILE`.
    step moe_quant_tests 260 python3 -m pytest -q -rf tests/unit/models/test_quant_experts.py \
        tests/unit/models/test_moe_grouped.py tests/gpu/test_moe_graph_decode_cuda.py
    step dequant_one_pass 45 python3 -m pytest -q -rf tests/unit/precision/test_dequant_triton.py \
        tests/gpu/test_fp8_w8a16_cuda.py -k "not mismatch"
    step moe_grouped_speed 60 python3 benchmarks/moe_grouped_speed.py
    (cd benchmarks && step moe_decode 220 python3 precision_decode.py --model qwen3_30b_a3b_4l --rows 64 \
        --recipes bf16 fp8_w8a16 int4 --repeats 2 --new-tokens 64)
    step one_pass_gemms 90 python3 benchmarks/weight_only_ws.py --no-ws
    ;;
7)
    step lora_4b 540 python3 benchmarks/lora_speed.py --model qwen3_4b --device cuda --samples 32 \
        --warmup 1 --repeats 3 --recompute --micro-batch 8 --skip-decode --offload-optimizer
    step lora_4b_decode 570 python3 benchmarks/lora_speed.py --model qwen3_4b --device cuda --samples 32 \
        --warmup 1 --repeats 2 --recompute --micro-batch 8 --prompts 16 --new-tokens 128 --offload-optimizer
    ;;
22)
    step fp8_backward_tests 150 python3 -m pytest -q -s -rf tests/gpu/test_fp8_backward_cuda.py \
        tests/unit/precision/test_fp8_backward.py tests/gpu/test_fp8_fused_cuda.py -k "not mismatch"
    step dense_copy_tests 200 python3 -m pytest -q -rf tests/gpu/test_dense_copy_cuda.py \
        tests/unit/precision/test_dense_copy.py
    # the 4B decode at 512 rows with and without the copies, one engine at a time (three together ran out of memory)
    (cd benchmarks && step decode_512_dense 300 python3 precision_decode.py --model qwen3_4b --rows 512 \
        --recipes bf16 fp8_w8a16 int4 --variants triton dense --repeats 2 --new-tokens 128 --one-at-a-time)
    step fp8_backward_speed 80 python3 benchmarks/fp8_backward_speed.py
    # a call of its own (STEPS=grpo_4b_fast): fp8 with the dense copies (auto: on at 512 rows), then bf16;
    # the bf16 4B run alone took ~200 s on an H100 (2026-12-07), so the pair may need the whole call
    (cd benchmarks && step grpo_4b_fast 560 python3 grpo_step.py --model qwen3_4b --steps 2 \
        --recipes fp8,trainer.recompute=true,rollout.dense_weight_copies=null bf16,trainer.recompute=true)
    step train_4b_fp8_backward 260 python3 benchmarks/train_speed.py --model qwen3_4b --device cuda --cases fixed \
        --recompute --offload-optimizer --precisions bf16 fp8,fp8_backward=fp8 --warmup 1 --repeats 2
    ;;
23)
    step megatron_memory 150 python3 benchmarks/train_speed.py --model qwen3_0_6b --device cuda \
        --configs padded-chunked,megatron --cases fixed --repeats 2 --warmup 1
    ;;
24)
    step memory_saver_tests 200 python3 -m pytest -q -s -rf tests/gpu/test_memory_saver_cuda.py \
        tests/gpu/test_colocate_memory.py tests/unit/rollout/test_memory_release.py
    (cd benchmarks && step grpo_memory_saver 300 python3 grpo_step.py --steps 3 \
        --recipes bf16,rollout.offload=true,trainer.offload=true \
        bf16,rollout.offload=true,trainer.offload=true,rollout.memory_saver=true)
    ;;
*)
    echo "unknown part $PART (1-24)" >&2
    exit 2
    ;;
esac
