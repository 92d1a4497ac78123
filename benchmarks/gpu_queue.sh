#!/usr/bin/env bash
# The GPU measurements queued for the next session (benchmarks/README.md, "For the next GPU
# session"), by name, so a lent machine's few minutes go to measuring and not to typing. Each step is
# one benchmarks/gpu_session.sh run into its own folder, packed into one file (the device tool brings
# back only a handful of files a call):
#
#   HPCBERT_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_queue.sh STEP [STEP...]
#
#   planner-base   bert-base, length 512, 8 GiB: each policy's planned batch against the probed one
#                  (gpu.py large), then the dropped-step leak test and the planner's GPU tests, the
#                  evaluation's peak too (~5 min)
#   planner-large  bert-large, length 512, 16 GiB: the same probes, no tests (~1 min)
#   mlm            the masked-LM loss against torch's (bench_mlm_loss.py), then masked-LM pre-training
#                  MFU and the compiled step's profile at batch 1024, with TORCH_LOGS=recompiles: the
#                  guard behind the short last batch's recompile
#   attention      attention kernels on one batch (Q, K and V as views too), then tests/test_unpad.py
#   autotune       MFU at batch 1024, compiled by default and with max-autotune (minutes of compile)
#
# planner-base and planner-large fit one 10-minute call together (their parts' limits sum to 570 s);
# each of the others wants a call of its own. Results: $OUT/STEP.tar.gz (OUT: the device tool's
# folder; default gpu-out). The data arguments of gpu_session.sh default to .gpudata/glue and
# .gpudata/vocab (benchmarks/gpu_data.sh).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
SESSION=${SESSION:-benchmarks/gpu_session.sh}
GLUE=${GLUE:-.gpudata/glue}
TOK=${TOK:-.gpudata/vocab}
STEPS="planner-base planner-large mlm attention autotune"
[ $# -gt 0 ] || { echo "usage: gpu_queue.sh STEP [STEP...]; steps: $STEPS" >&2; exit 2; }
for step in "$@"; do
    [[ " $STEPS " == *" $step "* ]] || { echo "gpu_queue.sh: unknown step '$step'; steps: $STEPS" >&2; exit 2; }
done
for step in "$@"; do
    case $step in  # gpu_session.sh's settings for the step
        planner-base) vars=(PARTS="large tests" T_LARGE=180 T_TESTS=240
            LARGE_ARGS="--model bert-base --length 512 --memory 8GiB --steps 1 --policies none,selective,alternate,all --name large-base-8g-expandable"
            TEST_PATHS="tests/test_gpu.py::test_a_step_dropped_before_backward_leaves_nothing_allocated tests/test_plan.py::test_predicted_largest_batch_against_probing_on_the_gpu tests/test_plan.py::test_predicted_evaluation_peak_against_the_allocator_on_the_gpu") ;;
        planner-large) vars=(PARTS="large" T_LARGE=150
            LARGE_ARGS="--memory 16GiB --steps 2 --policies none,selective,alternate,all --name large-bert-large-16g-expandable") ;;
        mlm) vars=(PARTS="mlm-loss mfu-mlm profile" MFU_COMPILE=on MFU_BATCHES=1024 PROFILE_COMPILE=on TORCH_LOGS=recompiles
            T_MLM_LOSS=90 T_MFU_MLM=300 T_PROFILE=150) ;;
        attention) vars=(PARTS="attention tests" TEST_PATHS="tests/test_unpad.py" T_TESTS=200) ;;
        autotune) vars=(PARTS="mfu" MFU_COMPILE=on,max-autotune-no-cudagraphs MFU_BATCHES=1024 MFU_NORMS=low T_MFU=540) ;;
    esac
    env "${vars[@]}" OUT="$OUT/$step" PACK="$OUT/$step.tar.gz" bash "$SESSION" "$GLUE" "$TOK"
    echo "== gpu_queue.sh $step: $OUT/$step.tar.gz"
done
