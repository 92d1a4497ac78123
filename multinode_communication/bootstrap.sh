#!/usr/bin/env bash
# Start hpcbert training on this node of a multi-node job: run once per node
# (srun --ntasks-per-node=1 ..., mpiexec -n $NNODES --ppn 1 ..., or by hand with --hosts).
# Nodes, node rank, head host and job id come from Slurm, $PBS_NODEFILE or --hosts; the logic
# lives in hpcbert/launch.py (python -m hpcbert.launch --help), which execs torchrun.
#   bootstrap.sh [--nproc-per-node N] [--hosts h1,h2 --job-id ID] [--ifname IF] -- [hpcbert train options]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT/BERT${PYTHONPATH:+:$PYTHONPATH}"
cd "${PBS_O_WORKDIR:-$PWD}"   # PBS starts jobs in $HOME
# HPCBERT_PYTHON (exported by `hpcbert submit` job scripts) or PYTHON: the interpreter for the launcher
# and torchrun; HPCBERT_WRAPPER: a container prefix put before torchrun (singularity/exec.sh).
exec "${HPCBERT_PYTHON:-${PYTHON:-python3}}" -m hpcbert.launch "$@"
