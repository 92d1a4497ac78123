#!/usr/bin/env bash
# Container prefix: run COMMAND inside an Apptainer/Singularity image, with the job's rendezvous and
# scheduler variables (computed outside, where SLURM_*/PBS_NODEFILE and scontrol exist) passed in.
#
#   singularity/exec.sh [--image IMG] [--bind SRC[:DST[:ro]]]... [--nv|--no-nv] [--no-cleanenv] -- COMMAND...
#
# Defaults from the environment (what job scripts from `hpcbert submit --container` export):
#   HPCBERT_IMAGE   image (.sif or docker://...)         HPCBERT_BINDS  SRC:DST,SRC2:DST2
#   HPCBERT_NV      1, 0 or auto (default: --nv when nvidia-smi lists a GPU or CUDA_VISIBLE_DEVICES is set)
#   HPCBERT_CONTAINER_RUNTIME   apptainer or singularity (default: whichever is on PATH, apptainer first)
#   HPCBERT_CONTAINER_ENV       more variable names to pass in (space-separated)
#
# The host environment is dropped (--cleanenv: host PYTHONPATH, LD_LIBRARY_PATH and conda variables
# poison the image's Python) and the variables the run needs are passed by name as APPTAINERENV_*
# / SINGULARITYENV_* (not --env, which splits values at commas: CUDA_VISIBLE_DEVICES=0,1 would break).
# PYTHONNOUSERSITE=1 keeps ~/.local (bound with $HOME) from shadowing the image's packages.
#
# The hpcbert that runs is this checkout's, the same as the launcher on the host: the checkout is
# bound at its own path and PYTHONPATH=CHECKOUT/BERT is set inside (it comes before the image's
# site-packages, so the image's installed hpcbert is not used); the image provides torch and the
# other dependencies. A copy of this script outside a checkout runs the image's hpcbert, and says so.
set -euo pipefail

die() { echo "singularity/exec.sh: $*" >&2; exit 2; }

image=${HPCBERT_IMAGE:-}
nv=${HPCBERT_NV:-auto}
cleanenv=1
binds=()
if [ -n "${HPCBERT_BINDS:-}" ]; then IFS=, read -r -a binds <<< "$HPCBERT_BINDS"; fi
while [ $# -gt 0 ]; do
  case $1 in
    --image) [ $# -ge 2 ] || die "--image needs a value"; image=$2; shift 2 ;;
    --bind|-B) [ $# -ge 2 ] || die "--bind needs SRC[:DST[:ro]]"; binds+=("$2"); shift 2 ;;
    --nv) nv=1; shift ;;
    --no-nv) nv=0; shift ;;
    --no-cleanenv) cleanenv=0; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) die "unknown option $1 (options go before --, the command after it)" ;;
  esac
done
[ $# -gt 0 ] || die "no command: singularity/exec.sh [options] -- COMMAND..."
[ -n "$image" ] || die "no image: pass --image IMG or set HPCBERT_IMAGE"

runtime=${HPCBERT_CONTAINER_RUNTIME:-}
if [ -z "$runtime" ]; then
  if command -v apptainer >/dev/null 2>&1; then runtime=apptainer
  elif command -v singularity >/dev/null 2>&1; then runtime=singularity
  else die "neither apptainer nor singularity is on PATH (on a cluster: module load apptainer)"
  fi
fi
case $nv in
  1|0) ;;
  auto) nv=0
        if [ -n "${CUDA_VISIBLE_DEVICES:-}" ] || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then nv=1; fi ;;
  *) die "HPCBERT_NV=$nv: use 1, 0 or auto" ;;
esac

args=(exec)
[ "$nv" = 1 ] && args+=(--nv)
[ "$cleanenv" = 1 ] && args+=(--cleanenv)
for b in "${binds[@]}"; do [ -z "$b" ] || args+=(--bind "$b"); done
args+=(--env PYTHONNOUSERSITE=1)
checkout=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -f "$checkout/BERT/hpcbert/__init__.py" ]; then
  case $checkout in *[,:]*) die "the checkout path $checkout holds ',' or ':', which a bind cannot carry; move it" ;; esac
  args+=(--bind "$checkout")
else
  echo "singularity/exec.sh: $checkout/BERT/hpcbert is not there: the image's hpcbert runs" >&2
  checkout=
fi

# Pass the run's variables in by name: rendezvous and torchrun settings, scheduler, hpcbert contract,
# threads, GPUs, communication libraries, the CUDA allocator's settings (a user's; without them
# hpcbert sets its own inside).
case ${runtime##*/} in singularity) prefix=SINGULARITYENV_ ;; *) prefix=APPTAINERENV_ ;; esac
extra=" ${HPCBERT_CONTAINER_ENV:-} "
for v in $(compgen -e); do
  case $v in
    MASTER_ADDR|MASTER_PORT|NODE_RANK|NNODES|NPROC_PER_NODE|WORLD_SIZE|RANK|LOCAL_RANK|LOCAL_WORLD_SIZE|HEAD_NODE|JOB_ID|\
    SLURM_*|PBS_*|HPCBERT_*|PET_*|TORCH_*|TORCHELASTIC_*|NCCL_*|GLOO_*|OMP_NUM_THREADS|MKL_NUM_THREADS|\
    CUDA_VISIBLE_DEVICES|PYTORCH_CUDA_ALLOC_CONF|PYTORCH_ALLOC_CONF|TMPDIR|LOGLEVEL) export "$prefix$v=${!v}" ;;
    *) case $extra in *" $v "*) export "$prefix$v=${!v}" ;; esac ;;
  esac
done
# The checkout's hpcbert first, inside (the host's PYTHONPATH stays out with the rest of its environment).
[ -z "$checkout" ] || export "${prefix}PYTHONPATH=$checkout/BERT"

exec "$runtime" "${args[@]}" "$image" "$@"
