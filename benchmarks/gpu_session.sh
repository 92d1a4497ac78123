#!/usr/bin/env bash
# One session on a lent GPU machine, in one call: the GPU benchmarks (benchmarks/gpu.py), then the
# GPU tests (pytest -m gpu). Each part has its own time limit, so one that hangs leaves the rest;
# the JSON files, the generated README and the logs go to $OUT (default gpu-out/).
#
#   bash benchmarks/gpu_session.sh [GLUE_DIR] [TOKENIZER_DIR]
#
# Without network access on the machine: the GLUE data and a tokenizer folder are passed as
# arguments (benchmarks/gpu_data.sh gathers them and the pre-training data into .gpudata/ to
# carry), and Python packages missing there can be put as wheels in .whl/ (installed to
# /tmp/site with --no-deps --no-index). HPCBERT_COMMIT names the commit the tree was copied from.
# benchmarks/gpu_queue.sh runs the next session's queued measurements through this script by name.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
GLUE=${1:-../shared/data/glue}
TOK=${2:-}
export PYTHONPATH=$PWD/BERT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
    # the CUDA allocator's settings the parts start with (hpcbert's default where none: expandable segments)
    echo "PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-} PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-}"
    nproc; free -g | head -2
} > "$OUT/info.txt" 2>&1
cat "$OUT/info.txt"
tok=(); [ -n "$TOK" ] && tok=(--tokenizer "$TOK")
part() {  # part SECONDS NAME COMMAND...
    local limit=$1 name=$2; shift 2
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@"
    echo "== $name: exit $? after $((SECONDS - t0)) s (limit $limit s)"
}
# The default parts fit one 10-minute call; throughput (the Trainer three ways) takes a call of its own
# (PARTS=throughput), and a later call can rerun some of the others; profile is opt-in
PARTS=" ${PARTS:-mfu large tests} "
# the Trainer plain, padding to multiples of 8, compiled (the compiled run last: a time cut loses it alone)
[[ $PARTS == *" throughput "* ]] && part "${T_THROUGHPUT:-300}" throughput \
    python3 benchmarks/gpu.py throughput --data-dir "$GLUE" "${tok[@]}" ${THROUGHPUT_ARGS:---repeats 1} --results-dir "$OUT"
# MFU eager, then compiled (MFU_COMPILE=off skips the compile; its first steps compile, left out),
# each with the LayerNorms in bf16 and in fp32 (MFU_NORMS=low: bf16 only), MFU_TOKEN_MULTIPLE=1,64: without and
# with filler rows
[[ $PARTS == *" mfu "* ]] && part "${T_MFU:-180}" mfu python3 benchmarks/gpu.py mfu "${tok[@]}" \
    --compile "${MFU_COMPILE:-off,on}" --norm-precision "${MFU_NORMS:-low,fp32}" --batches "${MFU_BATCHES:-256}" --token-multiple "${MFU_TOKEN_MULTIPLE:-auto}" \
    --results-dir "$OUT"
# MFU on masked-LM pre-training (PARTS=mfu-mlm): PRETRAIN_DATA is a folder hpcbert prepare-pretraining
# wrote (the machine may have no raw text: prepare it beside the checkout and carry it)
[[ $PARTS == *" mfu-mlm "* ]] && part "${T_MFU_MLM:-180}" mfu-mlm python3 benchmarks/gpu.py mfu "${tok[@]}" \
    --task mlm --data-dir "${PRETRAIN_DATA:-.gpudata/pretrain}" \
    --compile "${MFU_COMPILE:-off,on}" --norm-precision "${MFU_NORMS:-low}" --batches "${MFU_BATCHES:-256}" --token-multiple "${MFU_TOKEN_MULTIPLE:-auto}" \
    --results-dir "$OUT"
# where the eager step's time goes (torch.profiler, a run of its own; PROFILE_COMPILE=off,on adds compiled;
# PARTS=profile-mlm: the pre-training step's)
[[ $PARTS == *" profile "* ]] && part "${T_PROFILE:-60}" profile python3 benchmarks/gpu.py profile "${tok[@]}" \
    --compile "${PROFILE_COMPILE:-off}" --results-dir "$OUT"
[[ $PARTS == *" profile-mlm "* ]] && part "${T_PROFILE:-60}" profile-mlm python3 benchmarks/gpu.py profile "${tok[@]}" \
    --task mlm --data-dir "${PRETRAIN_DATA:-.gpudata/pretrain}" --compile "${PROFILE_COMPILE:-off}" --results-dir "$OUT"
# the plan's activation and workspace counts against real tensors and peaks (opt-in, ~1 min a model;
# ACTIVATION_MODELS=bert-base,bert-large, ACTIVATION_TASKS=synthetic)
[[ $PARTS == *" activation "* ]] && part "${T_ACTIVATION:-120}" activation \
    python3 benchmarks/gpu_activation_check.py "${ACTIVATION_TASKS:-synthetic,mlm}" "${ACTIVATION_MODELS:-bert-base}" \
    > "$OUT/activation.txt" 2>&1
# attention kernels on one batch, forward and backward: flash varlen (the training path) against SDPA's
# backends on the padded layout and torch's varlen_attn (opt-in, ~30 s)
[[ $PARTS == *" attention "* ]] && part "${T_ATTENTION:-90}" attention \
    python3 benchmarks/gpu_attention.py --out "$OUT/attention.json" > "$OUT/attention.txt" 2>&1
# host time per matmul call, a row count met before against a new one (opt-in, ~20 s)
[[ $PARTS == *" hostcost "* ]] && part "${T_HOSTCOST:-60}" hostcost python3 benchmarks/gpu.py hostcost --results-dir "$OUT"
# offload's plan and probe for 8 GiB of host memory: each probe pins its batch's activations anew
# (at 32 GiB, offload's probe of bert-large alone ran past 110 s on an H200)
[[ $PARTS == *" large "* ]] && part "${T_LARGE:-120}" large python3 benchmarks/gpu.py large \
    ${LARGE_ARGS:---memory 16GiB --steps 2 --host-memory 8GiB} \
    --results-dir "$OUT"
# filler rows (--token-multiple) against none, the same batches in one process (opt-in, ~1 min)
[[ $PARTS == *" token-multiple "* ]] && part "${T_TOKEN_MULTIPLE:-120}" token-multiple \
    python3 benchmarks/bench_token_multiple.py ${TOKEN_MULTIPLE_ARGS:-} --out "$OUT/token_multiple"
# the masked-LM loss against torch's F.cross_entropy(logits.float()), the same batches in one process
# (opt-in, ~30 s; bert-base, batch 1024 as the masked-LM MFU runs)
[[ $PARTS == *" mlm-loss "* ]] && part "${T_MLM_LOSS:-90}" mlm-loss \
    python3 benchmarks/bench_mlm_loss.py --device cuda ${MLM_LOSS_ARGS:---models bert-base --batch 1024} --out "$OUT/mlm_loss"
# Not in the default parts (the defaults fill one 10-minute call): PARTS=pareto in a call of its own
[[ $PARTS == *" pareto "* ]] && part "${T_PARETO:-300}" pareto python3 benchmarks/pareto.py --rounds 3 ${PARETO_ARGS:-} \
    --results-dir "$OUT/pareto"
python3 benchmarks/gpu.py render --results-dir "$OUT" >/dev/null
# the last 200 lines of each run's log (hpcbert's and the Trainer's; gpu.py's --work-dir default), so a
# part cut by its limit still says where its run was
if [ -d runs/gpu/logs ]; then
    mkdir -p "$OUT/run-logs"
    for f in runs/gpu/logs/*.log; do [ -e "$f" ] && tail -n 200 "$f" > "$OUT/run-logs/$(basename "$f")"; done
fi
if [[ $PARTS == *" tests "* ]]; then
    each=(); python3 -c "import pytest_timeout" 2>/dev/null && each=(--timeout "${T_EACH_TEST:-120}")  # one hang fails one test
    export HPCBERT_FAILURES_AT_ONCE=1
    part "${T_TESTS:-240}" "pytest -m gpu" python3 -m pytest -m gpu -n 0 -p no:cacheprovider -v -rA --durations 0 \
        "${each[@]}" ${TEST_PATHS:-tests/} > "$OUT/pytest-gpu.log" 2>&1  # TEST_PATHS: files in the order to run
    tail -40 "$OUT/pytest-gpu.log"
fi
cat "$OUT/README.md"
# PACK=FILE.tar.gz: $OUT in one file, the folder removed (a tool that brings back only a few files a
# call brings back this one)
if [ -n "${PACK:-}" ]; then
    tar -C "$(dirname "$OUT")" -czf "$PACK" "$(basename "$OUT")" && rm -rf "$OUT" && echo "== packed into $PACK"
fi
