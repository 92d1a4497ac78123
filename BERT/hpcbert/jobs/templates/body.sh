
@@setup# --- environment of every node (the launchers and the container wrapper pass it on) ---
# The hpcbert checkout (bootstrap, container wrapper) and the interpreter that runs torchrun + hpcbert.
export HPCBERT_KIT="${HPCBERT_KIT:-@@kit}"
export HPCBERT_PYTHON="${HPCBERT_PYTHON:-@@python}"
# Threads per worker = cores per node / @@procs worker(s), set explicitly: PBS exports OMP_NUM_THREADS =
# every core of the chunk, and @@procs worker(s) x every core would oversubscribe the node.
CORES=@@cores  # @@cores_note
export OMP_NUM_THREADS=$(( CORES > @@procs ? CORES / @@procs : 1 ))
@@container
# --- the walltime: training stops itself, with a checkpoint, before the scheduler kills it ---
# deadline (epoch seconds) = job start + walltime @@walltime (@@walltime_s s) - margin @@stop_margin_s s
export HPCBERT_JOB_DEADLINE=$(( $(date +%s) + @@walltime_s - @@stop_margin_s ))

# --- the run: the train options given to `hpcbert submit`, then any given to this script ---
TRAIN_ARGS=(
@@train_args
)
RUN_DIR=@@run_dir
case $RUN_DIR in /*) ;; *) RUN_DIR=$PWD/$RUN_DIR ;; esac
export HPCBERT_STOP_FILE=$RUN_DIR/STOP  # touched on a stop request; training polls it between steps
mkdir -p "$RUN_DIR"
# One job at a time in a run directory (a second job of the same name would write the same
# checkpoints): a lock held until this job and what it starts end. A file system without locks
# (Lustre mounted without -o flock) cannot check this, and says so.
if command -v flock >/dev/null 2>&1; then
  exec 9>>"$RUN_DIR/job.lock"
  lock_status=0
  flock -n -E 75 9 || lock_status=$?
  if [ "$lock_status" = 75 ]; then
    echo "hpcbert job: $RUN_DIR is in use by job $(cat "$RUN_DIR/job.lock" 2>/dev/null || echo '?'); wait for it," \
         "or give this job another --job-name or --out" >&2
    exit 2
  elif [ "$lock_status" != 0 ]; then
    echo "hpcbert job: warning: cannot lock $RUN_DIR/job.lock (status $lock_status): no check that this job" \
         "is the only one in $RUN_DIR" >&2
  else
    echo "$JOB_ID" > "$RUN_DIR/job.lock"
  fi
fi
rm -f "$HPCBERT_STOP_FILE"              # left by an earlier job of this run: no request to this one
BOOTSTRAP=${HPCBERT_BOOTSTRAP:-$HPCBERT_KIT/multinode_communication/bootstrap.sh}
if [ ! -x "$BOOTSTRAP" ]; then
  echo "hpcbert job: $BOOTSTRAP is missing or not executable; set HPCBERT_KIT to the hpcbert checkout" >&2
  exit 2
fi

# Stop requests reach this shell: Slurm's --signal=B:USR1 before the walltime, SIGTERM at it (and on
# scancel/qdel). Both only touch the stop file: the scheduler signals every process of the job itself,
# and USR1 sent on to torchrun would kill the agent and orphan its workers.
stop_request() {
  echo "[hpcbert job] $1 at $(date -u +%FT%TZ): stop requested ($HPCBERT_STOP_FILE)" >&2
  touch "$HPCBERT_STOP_FILE" || true
}
trap 'stop_request USR1' USR1
trap 'stop_request TERM' TERM

echo "[hpcbert job] job $JOB_ID: @@nodes node(s) x @@procs process(es) x $OMP_NUM_THREADS thread(s), deadline" \
     "$(date -u -d "@$HPCBERT_JOB_DEADLINE" +%FT%TZ), run directory $RUN_DIR" >&2
launch_cmd
"${LAUNCH[@]}" "$BOOTSTRAP" --nproc-per-node @@procs -- "${TRAIN_ARGS[@]}"@@out_arg "$@" &
launcher=$!
# `wait` returns early when a trapped signal arrives: wait again until the launcher is gone, so
# training can finish its checkpoint within the scheduler's grace period.
while :; do
  status=0
  wait "$launcher" || status=$?
  kill -0 "$launcher" 2>/dev/null || break
done
stopped_by=$(grep -o '"stopped_by": *"[^"]*"' "$RUN_DIR/summary.json" 2>/dev/null || true)
echo "[hpcbert job] launcher exited with status $status${stopped_by:+ ($stopped_by)}" >&2
exit "$status"
