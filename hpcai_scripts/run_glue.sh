#!/usr/bin/env bash
# Fine-tune (and evaluate) on GLUE: every option goes to `hpcbert train` unchanged; there is nothing
# to edit here. The kit's BERT_DIR / GLUE_DIR / RESULTS_DIR become options:
#   hpcai_scripts/run_glue.sh --task mnli --data-dir "$GLUE_DIR" --model "$BERT_DIR" --out "$RESULTS_DIR/mnli"
# Gradient checkpointing is an option (--grad-ckpt alternate), not an import to edit. Several
# processes: torchrun --nproc-per-node 4 -m hpcbert.cli train ...; a batch job: hpcbert submit.
set -euo pipefail
# Runs from a checkout without `pip install`; an installed hpcbert is the same code.
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)/BERT${PYTHONPATH:+:$PYTHONPATH}"
exec "${HPCBERT_PYTHON:-python3}" -m hpcbert.cli train "$@"
