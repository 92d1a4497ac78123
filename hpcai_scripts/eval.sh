#!/usr/bin/env bash
# Evaluation results. Every training run evaluates on the dev split(s) when it ends, with gradient
# checkpointing off (no lines to comment out) and every dev example scored exactly once; the
# metrics are in RUN_DIR/summary.json. This prints them, with throughput, as a table:
#   hpcai_scripts/eval.sh runs/                   # every run under runs/
#   hpcai_scripts/eval.sh runs/a runs/b --format csv
# Options go to `hpcbert report` unchanged (see hpcbert report --help).
set -euo pipefail
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)/BERT${PYTHONPATH:+:$PYTHONPATH}"
exec "${HPCBERT_PYTHON:-python3}" -m hpcbert.cli report "$@"
