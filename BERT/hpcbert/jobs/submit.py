"""`hpcbert submit`: render a batch job script for PBS Pro, Torque or Slurm, and submit it.

    hpcbert submit --scheduler slurm --nodes 2 --gpus-per-node 4 --walltime 00:30:00 -- --task mnli ...
    hpcbert submit --scheduler pbs --preset optimized --dry-run -- --lr 1e-4

Everything after `--` is passed to `hpcbert train` unchanged, as quoted words (the job script holds
no hyperparameters of its own). A train option that is exactly `$NAME` or `${NAME...}` is expanded
when the job runs, so a script can name its data by variable: `--data-dir '${GLUE_DIR:?set GLUE_DIR}'`.

A job script is a scheduler header (`templates/slurm.sh`, or `templates/pbs.sh` for PBS Pro and
Torque: same shell, different directives) followed by `templates/body.sh`. Templates are
`string.Template` text with `@@name` placeholders (`$` belongs to the shell). The directives, the
checks that refuse what a scheduler does not understand, and the presets live here.

The script cds to the submit directory, sets OMP_NUM_THREADS per worker, exports the contract with
the training loop (HPCBERT_JOB_DEADLINE, HPCBERT_STOP_FILE) and starts one
`multinode_communication/bootstrap.sh` per node (which derives nodes, head and job id and starts
torchrun), through srun, mpiexec, pbsdsh or ssh.

The run directory is `--out`, or `runs/JOB_NAME`: named after the job, never the job id, so that
submitting the same script again continues the run from its newest checkpoint (training resumes
by default under a scheduler). One job at a time holds a run directory (a lock in it).

A CPU-only job (--gpus-per-node 0) without --cpus-per-node gets whole nodes (Slurm --exclusive,
PBS Pro place=excl), and the threads per worker are the node's cores, read when the job starts,
divided by the workers.

What a site asks for beyond these (a QOS, a memory request, a GPU type, PBS Pro's storage= on
Gadi) is a --directive, written as it is after hpcbert's own lines; one that would change what
hpcbert writes itself (nodes, cores, walltime, names, output) is refused, naming the option that
sets it. What a site needs run before the launch (module load, a venv) is a --setup line, run in
the batch shell; the launchers pass its environment on to every node.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import string
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

SCHEDULERS = ("pbs", "torque", "slurm")
FLAVOUR_NAMES = {"pbs": "PBS Pro", "torque": "Torque", "slurm": "Slurm"}
# First one is the default. srun only under Slurm; mpiexec/pbsdsh/ssh only under PBS.
LAUNCHERS = {"pbs": ("mpiexec", "pbsdsh", "ssh"), "torque": ("pbsdsh", "mpiexec", "ssh"), "slurm": ("srun",)}
SUBMIT_COMMAND = {"pbs": "qsub", "torque": "qsub", "slurm": "sbatch"}
SCRIPT_SUFFIX = {"pbs": ".pbs", "torque": ".pbs", "slurm": ".sbatch"}
TEMPLATES = Path(__file__).resolve().parent / "templates"

# A train option that the job's shell expands: `$NAME` or `${NAME}`, `${NAME:-default}`,
# `${NAME:?message}` ... The text after the operator may not hold characters that are special inside
# double quotes, so the word is safe to render as "...".
ENV_WORD = re.compile(r"\$(?:[A-Za-z_]\w*|\{[A-Za-z_]\w*(?::?[-=?+][^\"$`\\}]*)?\})")


@dataclass(frozen=True)
class Preset:
    """A named run: resources plus `hpcbert train` options (the user's options come after, and win)."""
    description: str
    resources: dict
    train: dict


# The replaced kit's two configurations (APAC HPC-AI 2020, MNLI, BERT-Large, seq 128, LAMB, 20-minute
# box): baseline 1 node x 1 GPU, batch 24, no checkpointing; optimized 2 nodes x 4 GPUs, batch 48 per
# GPU with checkpointing on alternate layers. $BERT_DIR names pretrained weights (an HF-format
# directory); unset, the published bert-large shape with random weights runs (throughput only).
_KIT = dict(task="mnli", data_dir="${GLUE_DIR:?set GLUE_DIR to the GLUE directory}",
            model="${BERT_DIR:-bert-large}", max_seq_length=128, optimizer="lamb", time_budget="20m",
            lr_horizon="time-budget")  # the LR decays to zero inside the box, not over 3 planned epochs
PRESETS = {
    "baseline": Preset("1 GPU, batch 24, no gradient checkpointing (the kit's baseline)",
                       dict(nodes=1, gpus_per_node=1, cpus_per_node=5, walltime="00:30:00"),
                       dict(_KIT, batch_size=24, grad_ckpt="none")),
    "optimized": Preset("2 nodes x 4 GPUs, batch 48, checkpointing on alternate layers (the kit's optimized run)",
                        dict(nodes=2, gpus_per_node=4, cpus_per_node=20, walltime="00:30:00"),
                        dict(_KIT, batch_size=48, grad_ckpt="alternate")),
    # Masked-LM pre-training phase 1 as NVIDIA's and DeepSpeed's BERT-Large recipe: seq 128, LAMB at a
    # global batch of 65,536 (64 x 8 GPUs x 128 accumulation), LR 6e-3, 28.43% warm-up, polynomial
    # decay power 0.5, 7,038 steps; $PRETRAIN_DATA is hpcbert prepare-pretraining's output and
    # $BERT_VOCAB the vocabulary it was prepared with (unset: minilm-l6's uncased one). The job
    # checkpoints every 30 minutes; submitting it again continues the run. Phase 2 is the same command
    # with --max-seq-length 512 --init-from runs/bert-pretrain (see the README).
    "pretrain": Preset("2 nodes x 4 GPUs, masked-LM pre-training phase 1 (seq 128, LAMB, global batch 65536, "
                       "checkpointing on alternate layers)",
                       dict(nodes=2, gpus_per_node=4, cpus_per_node=20, walltime="12:00:00"),
                       dict(task="mlm", data_dir="${PRETRAIN_DATA:?set PRETRAIN_DATA to the prepared data}",
                            model="${BERT_MODEL:-bert-large}", tokenizer="${BERT_VOCAB:-}", max_seq_length=128,
                            optimizer="lamb", lr=6e-3, warmup_ratio=0.2843, lr_decay="poly", poly_power=0.5,
                            max_steps=7038, batch_size=64, grad_accum=128, grad_ckpt="alternate",
                            checkpoint_every="30m", eval_every="1000")),
}


def preset_argv(train: dict) -> list[str]:
    """{'batch_size': 24, 'compile': True} -> ['--batch-size', '24', '--compile']."""
    from ..config import to_argv

    return to_argv(train)


@dataclass
class JobSpec:
    scheduler: str
    nodes: int
    gpus_per_node: int
    walltime: str
    procs_per_node: int | None = None   # default: GPUs per node, 1 without GPUs
    cpus_per_node: int | None = None    # default: one per process with GPUs; CPU-only: None = whole node
    project: str | None = None
    queue: str | None = None
    account: str | None = None
    launcher: str | None = None         # default: the scheduler's first in LAUNCHERS
    container: str | None = None
    binds: list[str] = field(default_factory=list)
    job_name: str = "hpcbert"
    stop_margin: int | None = None      # seconds before the walltime at which training must stop
    train_args: list[str] = field(default_factory=list)
    extra_directives: list[str] = field(default_factory=list)  # site options, after hpcbert's own
    setup: list[str] = field(default_factory=list)             # shell lines run before the launch

    def __post_init__(self) -> None:
        validate(self)

    @property
    def whole_node(self) -> bool:
        """A CPU-only job without --cpus-per-node: every core of each node, counted at run time."""
        return self.cpus_per_node is None

    @property
    def walltime_s(self) -> int:
        h, m, s = (int(x) for x in self.walltime.split(":"))
        return h * 3600 + m * 60 + s


def _refuse(spec: JobSpec, option: str, why: str) -> ValueError:
    return ValueError(f"{option} is not accepted with --scheduler {spec.scheduler} "
                      f"({FLAVOUR_NAMES[spec.scheduler]}): {why}")


def validate(spec: JobSpec) -> None:
    """Fill defaults; refuse, naming option and scheduler, what the scheduler would drop or misread."""
    if spec.scheduler not in SCHEDULERS:
        raise ValueError(f"--scheduler: {spec.scheduler!r} is not accepted; choose one of {', '.join(SCHEDULERS)}")
    if not re.fullmatch(r"\d+:[0-5]\d:[0-5]\d", spec.walltime or "") or spec.walltime_s == 0:
        raise ValueError(f"--walltime: {spec.walltime!r} is not a positive HH:MM:SS duration (e.g. 01:30:00)")
    for name, low in (("nodes", 1), ("gpus_per_node", 0)):
        if getattr(spec, name) < low:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= {low}, got {getattr(spec, name)}")
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]{0,62}", spec.job_name):
        raise ValueError(f"--job-name: {spec.job_name!r}: use letters, digits, '_', '.', '-' (starting with a letter)")
    if spec.procs_per_node is None:
        spec.procs_per_node = spec.gpus_per_node or 1
    elif spec.procs_per_node < 1:
        raise ValueError(f"--procs-per-node: must be >= 1, got {spec.procs_per_node}")
    elif spec.gpus_per_node and spec.procs_per_node != spec.gpus_per_node:
        raise ValueError(f"--procs-per-node: {spec.procs_per_node} with --gpus-per-node {spec.gpus_per_node}: "
                         f"training runs one process per GPU; --procs-per-node is for CPU-only jobs")
    if spec.cpus_per_node is None:
        if spec.gpus_per_node:
            spec.cpus_per_node = spec.procs_per_node
        elif spec.scheduler == "torque":
            raise ValueError("--cpus-per-node: a CPU-only Torque job needs it (e.g. the node's core count): "
                             "Torque gives a job the ppn cores it asks for and has no whole-node request "
                             "that Slurm's #PBS reader accepts, so it would run one thread per process")
        # else None: whole nodes (Slurm --exclusive, PBS Pro place=excl), cores read at run time
    elif spec.cpus_per_node < spec.procs_per_node:
        raise ValueError(f"--cpus-per-node: {spec.cpus_per_node} is fewer than the {spec.procs_per_node} "
                         f"processes per node; each needs at least one core")
    if spec.stop_margin is None:  # a tenth of the walltime, 60 s to 10 min, at most half of it
        spec.stop_margin = min(max(60, spec.walltime_s // 10), 600, spec.walltime_s // 2)
    if not 0 < spec.stop_margin < spec.walltime_s:
        raise ValueError(f"--stop-margin: {spec.stop_margin} s must be positive and below the walltime "
                         f"({spec.walltime_s} s)")
    accepted = LAUNCHERS[spec.scheduler]
    if spec.launcher is None:
        spec.launcher = accepted[0]
    elif spec.launcher not in accepted:
        raise _refuse(spec, f"--launcher {spec.launcher}",
                      "srun is Slurm's launcher; PBS starts one process per node with mpiexec, pbsdsh or ssh"
                      if spec.launcher == "srun" else
                      "the Slurm job starts one bootstrap per node with srun (the only launcher that Slurm "
                      "tracks, signals and cleans up)" if spec.scheduler == "slurm" else
                      f"choose one of {', '.join(accepted)}")
    if spec.project is not None:
        if spec.scheduler == "torque":
            raise _refuse(spec, "--project", "Torque's qsub -P means 'run as this proxy user', not a project; "
                                             "use --account for the allocation to charge")
        if spec.scheduler == "slurm":
            raise _refuse(spec, "--project", "Slurm has no project attribute (Slurm's qsub wrapper turns -P "
                                             "into a wckey); use --account")
    if spec.binds and not spec.container:
        raise ValueError("--bind: needs --container IMAGE (bind mounts are container options)")
    for b in spec.binds:
        if not b or "," in b:
            raise ValueError(f"--bind: {b!r}: give one SRC[:DST[:ro]] per --bind (a comma would split it)")
    for name in ("project", "queue", "account"):
        value = getattr(spec, name)
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_.@+-]+", value):
            raise ValueError(f"--{name}: {value!r} holds characters a directive line cannot carry")
    spec.extra_directives = [check_directive(spec.scheduler, d) for d in spec.extra_directives]
    for line in spec.setup:
        if not line.strip() or "\n" in line or "\r" in line or "\0" in line:
            raise ValueError(f"--setup: {line!r}: give one shell line per --setup (not empty, no line break)")
    check_train_args(spec.train_args)


# The options hpcbert's own directive lines set, and the hpcbert option that sets each: a site's
# --directive may not set them again (the scheduler would take the last one, and the script's
# threads, launch and deadline would no longer match what the job was given).
_SLURM_OWN = {"job-name": "--job-name", "nodes": "--nodes", "ntasks-per-node": "--procs-per-node",
              "ntasks": "--nodes and --procs-per-node", "cpus-per-task": "--cpus-per-node",
              "gpus-per-node": "--gpus-per-node", "gpus": "--gpus-per-node", "gres": "--gpus-per-node",
              "time": "--walltime", "signal": "--stop-margin", "partition": "--queue", "account": "--account",
              "exclusive": "--cpus-per-node (leave it out for whole nodes)", "output": "the script (%x-%j.out)"}
_SLURM_SHORT = {"J": "job-name", "N": "nodes", "n": "ntasks", "c": "cpus-per-task", "G": "gpus", "t": "time",
                "p": "partition", "A": "account", "o": "output"}
_PBS_OWN = {"N": "--job-name", "P": "--project", "A": "--account", "q": "--queue", "j": "the script (-j oe)"}
_PBS_OWN_RESOURCES = {"select": "--nodes, --cpus-per-node and --gpus-per-node", "place": "--cpus-per-node",
                      "nodes": "--nodes and --cpus-per-node", "walltime": "--walltime",
                      "ncpus": "--cpus-per-node", "ngpus": "--gpus-per-node", "mpiprocs": "the script (1 per node)"}


def check_directive(scheduler: str, text: str) -> str:
    """A site's --directive: one scheduler option ('--qos=high', '-l mem=64GB'; '#SBATCH --qos=high'
    and '#PBS -l mem=64GB' as well), returned without its prefix. Refused, with the reason: a line
    break, another scheduler's prefix, text that is not an option, and an option hpcbert sets itself."""
    given = text
    if "\n" in text or "\r" in text or "\0" in text:
        raise ValueError(f"--directive: {given!r}: one directive per --directive (no line break)")
    prefix = "#SBATCH" if scheduler == "slurm" else "#PBS"
    m = re.match(r"\s*(#SBATCH|#PBS)\b\s*", text)
    if m:
        if m.group(1) != prefix:
            raise ValueError(f"--directive: {given!r} is a {m.group(1)} line; a {FLAVOUR_NAMES[scheduler]} "
                             f"script takes {prefix} lines")
        text = text[m.end():]
    text = text.strip()
    if not text.startswith("-"):
        raise ValueError(f"--directive: {given!r} is not a scheduler option; give it as it follows {prefix}, "
                         f"e.g. " + ("'--qos=high'" if scheduler == "slurm" else "'-l mem=64GB'"))
    if scheduler == "slurm":
        long_ = re.match(r"--([A-Za-z][\w-]*)", text)
        if long_:
            name = long_.group(1)
            # sbatch takes any unambiguous abbreviation of a long option (getopt_long): --part=gpu
            owned = [o for o in _SLURM_OWN if o == name or (len(name) >= 2 and o.startswith(name))]
            if owned == ["gres"] and "gpu" not in text[long_.end():]:
                owned = []  # a generic resource other than GPUs (--gres=lscratch:100): the site's own
        else:
            owned = [o for o in (_SLURM_SHORT.get(text[1:2]),) if o]
        if owned:
            raise ValueError(f"--directive: {given!r} sets --{owned[0]}, which hpcbert writes from "
                             f"{_SLURM_OWN[owned[0]]}; give that instead")
        return text
    option = text[1:2]
    if option in _PBS_OWN:
        raise ValueError(f"--directive: {given!r} sets -{option}, which hpcbert writes from {_PBS_OWN[option]}; "
                         f"give that instead")
    if option == "l":
        for resource in re.split(r"[,:]", text[2:].strip()):
            name = resource.split("=", 1)[0].strip()
            if name in _PBS_OWN_RESOURCES:
                raise ValueError(f"--directive: {given!r} sets -l {name}, which hpcbert writes from "
                                 f"{_PBS_OWN_RESOURCES[name]}; give that instead")
    return text


def check_train_args(argv: list[str]):
    """Parse the train options as `hpcbert train` would, and refuse an option of another task, so a
    typo fails now rather than after the queue wait (files are not read: their paths may be the
    container's). Returns the RunConfig."""
    from .. import config, objectives

    p = argparse.ArgumentParser(prog="hpcbert submit ... --", add_help=False, exit_on_error=False)
    config.add_arguments(p)
    try:
        ns, unknown = p.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(f"train option {e}") from None
    if unknown:
        raise ValueError(f"train options: not `hpcbert train` options: {' '.join(unknown)} "
                         f"(see hpcbert train --help)")
    cfg = config.from_namespace(ns)
    objectives.refuse_unread(cfg)
    return cfg


# --- rendering ---------------------------------------------------------------------------------

class _Template(string.Template):
    delimiter = "@@"


def _template(name: str) -> _Template:
    return _Template((TEMPLATES / name).read_text())


def sh_word(word: str) -> str:
    """One shell word: "$NAME"-style words are expanded by the job's shell, the rest quoted literally."""
    return f'"{word}"' if ENV_WORD.fullmatch(word) else shlex.quote(word)


def _dq(text: str) -> str:
    """Text for inside "...": escape what the shell would expand."""
    return re.sub(r'(["$`\\])', r"\\\1", text)


def _train_lines(argv: list[str]) -> str:
    """One option (and its values) per line, each word quoted."""
    lines: list[list[str]] = []
    for w in argv:
        if not lines or (w.startswith("--") and len(w) > 2):
            lines.append([])
        lines[-1].append(sh_word(w))
    return "\n".join("  " + " ".join(words) for words in lines)


SLURM_SIGNAL_EARLY_S = 60  # man sbatch: "the signal may be sent up to 60 seconds earlier than specified"


def directives(spec: JobSpec) -> list[str]:
    if spec.scheduler == "slurm":
        d = [f"--job-name={spec.job_name}", f"--nodes={spec.nodes}", "--ntasks-per-node=1"]
        if spec.gpus_per_node:
            d.append(f"--gpus-per-node={spec.gpus_per_node}")
        # A whole node: every core goes to the one task (the bootstrap) per node.
        d.append("--exclusive" if spec.whole_node else f"--cpus-per-task={spec.cpus_per_node}")
        d.append(f"--time={spec.walltime}")
        # USR1 to the batch shell only (B:), stop_margin s before the end. Slurm may send it up to
        # 60 s earlier than asked, so on a walltime that leaves less than that early window plus a
        # minute of work it would stop every (re)submission at once: the job's own deadline
        # (HPCBERT_JOB_DEADLINE, same walltime and margin) stops those runs instead.
        if spec.walltime_s - spec.stop_margin >= SLURM_SIGNAL_EARLY_S + 60:
            d.append(f"--signal=B:USR1@{spec.stop_margin}")
        if spec.queue:
            d.append(f"--partition={spec.queue}")
        if spec.account:
            d.append(f"--account={spec.account}")
        d.append("--output=%x-%j.out")
        return [f"#SBATCH {x}" for x in d + spec.extra_directives]
    d = [f"-N {spec.job_name}"]
    if spec.scheduler == "pbs":
        # One chunk per node with mpiprocs=1: PBS_NODEFILE lists each node once, so pbsdsh starts one
        # task per node. place=scatter gets its own line: on the select line Slurm's sbatch rejects it.
        # A whole node: the chunk asks for one core per process and place=excl keeps the node to
        # this job; the threads come from the cores the job can use (nproc) when it starts.
        gpus = f":ngpus={spec.gpus_per_node}" if spec.gpus_per_node else ""
        ncpus = spec.procs_per_node if spec.whole_node else spec.cpus_per_node
        d += [f"-l select={spec.nodes}:ncpus={ncpus}{gpus}:mpiprocs=1",
              "-l place=scatter:excl" if spec.whole_node else "-l place=scatter"]
    else:
        gpus = f":gpus={spec.gpus_per_node}" if spec.gpus_per_node else ""
        d.append(f"-l nodes={spec.nodes}:ppn={spec.cpus_per_node}{gpus}")
    d.append(f"-l walltime={spec.walltime}")
    if spec.project:
        d.append(f"-P {spec.project}")
    if spec.account:
        d.append(f"-A {spec.account}")
    if spec.queue:
        d.append(f"-q {spec.queue}")
    d.append("-j oe")
    return [f"#PBS {x}" for x in d + spec.extra_directives]


# The job's variables pbsdsh and ssh pass on to every node (they start with a bare environment;
# srun and mpiexec pass the whole of it): hpcbert's and PBS's, the interpreter's, the communication
# libraries' and torch's, and the CUDA allocator's settings (a user's; without them hpcbert sets its own);
# and every variable the --setup lines set or changed (their names in HPCBERT_SETUP_ENV).
_NODE_ENV = ("HPCBERT_*|PBS_*|OMP_NUM_THREADS|PATH|PYTHONPATH|LD_LIBRARY_PATH|VIRTUAL_ENV|NCCL_*|GLOO_*|TORCH_*|"
             "PYTORCH_CUDA_ALLOC_CONF|PYTORCH_ALLOC_CONF")
# The case statement that adds $v to what pbsdsh or ssh passes on when it is one of those (`add`: how).
_NODE_ENV_CASE = """\
    case $v in
      @@node_env) {add} ;;
      *) case " ${{HPCBERT_SETUP_ENV-}} " in *" $v "*) {add} ;; esac ;;
    esac"""

# How PBS starts one bootstrap per node (Slurm: srun, in templates/slurm.sh).
_PBS_LAUNCH = {
    "mpiexec": """\
# One bootstrap per node: PBS Pro/Cray PALS, MPICH and Intel MPI syntax (Open MPI: --map-by ppr:1:node).
launch_cmd() { LAUNCH=(mpiexec -n @@nodes --ppn 1); }""",
    "pbsdsh": """\
# One bootstrap per node. pbsdsh starts tasks in $HOME with a bare environment: cd back here and
# pass the job's environment on as `env NAME=value` words.
node_env() {
  local v
  for v in $(compgen -e); do
""" + _NODE_ENV_CASE.format(add='LAUNCH+=("$v=${!v}")') + """
  done
}
launch_cmd() { LAUNCH=(pbsdsh @@pbsdsh_opts-- /bin/bash -c 'cd "$1" && shift && exec env "$@"' hpcbert-node "$PWD"); node_env; }""",
    "ssh": """\
# One bootstrap per node over ssh (needs passwordless ssh between the job's nodes; PBS does not
# track these processes, prefer mpiexec or pbsdsh). The remote shell gets this directory and the
# job's environment; the nodes are PBS_NODEFILE's distinct lines.
on_each_node() {
  local host cmd pids=() rc=0 v
  cmd="cd $(printf %q "$PWD") && exec env"
  for v in $(compgen -e); do
""" + _NODE_ENV_CASE.format(add='cmd+=" $(printf %q "$v=${!v}")"') + """
  done
  cmd+=" $(printf '%q ' "$@")"
  for host in $(awk '!seen[$0]++' "$PBS_NODEFILE"); do
    ssh -o BatchMode=yes "$host" "$cmd" & pids+=($!)
  done
  for v in "${pids[@]}"; do wait "$v" || rc=$?; done
  return "$rc"
}
launch_cmd() { LAUNCH=(on_each_node); }""",
}


def setup_block(lines: list[str]) -> str:
    """The --setup lines as the job runs them: in order, in the batch shell, each failure stopping
    the job before anything starts and naming the command that failed."""
    if not lines:
        return ""
    return "\n".join([
        "# --- site set-up (--setup): run here before anything starts; the launchers pass the environment",
        "# it leaves on to every node (srun and mpiexec all of it; pbsdsh and ssh the variables launch_cmd",
        "# names and every one these lines set or change, listed in HPCBERT_SETUP_ENV) ---",
        "declare -A _hpcbert_env=()",
        'for _v in $(compgen -e); do _hpcbert_env[$_v]=${!_v}; done',
        "trap 'status=$?; echo \"hpcbert job: --setup failed (status $status): $BASH_COMMAND\" >&2' ERR",
        "set -E +u  # the message also for a failure inside a shell function (module); module, conda and",
        "          # venv scripts may read unset variables",
        *lines,
        "set +E -u",
        "trap - ERR",
        "HPCBERT_SETUP_ENV=",
        "for _v in $(compgen -e); do",
        '  [[ ${_hpcbert_env[$_v]+set} && ${_hpcbert_env[$_v]} == "${!_v}" ]] || HPCBERT_SETUP_ENV+=" $_v"',
        "done",
        'export HPCBERT_SETUP_ENV=${HPCBERT_SETUP_ENV# }',
        "unset _hpcbert_env _v",
        "", ""])


def render(spec: JobSpec, command: str, *, workdir: str | None = None, python: str | None = None,
           kit: str | None = None) -> str:
    """The job script. workdir/python/kit None: placeholders ($PWD, python3, the submit directory)
    instead of this machine's paths, for scripts that are committed or copied elsewhere."""
    run_cfg = check_train_args(spec.train_args)
    gave_out = run_cfg.out is not None
    if spec.container:
        python = None  # the image's interpreter, not this machine's
        lines = ["# --- container: the bootstrap runs torchrun through this wrapper (singularity/exec.sh) ---",
                 'export HPCBERT_WRAPPER="${HPCBERT_WRAPPER:-$HPCBERT_KIT/singularity/exec.sh}"',
                 f"export HPCBERT_IMAGE={sh_word(spec.container)}"]
        if spec.binds:
            lines.append(f"export HPCBERT_BINDS={shlex.quote(','.join(spec.binds))}")
        if spec.gpus_per_node:
            lines.append("export HPCBERT_NV=1")
        container = "\n".join(lines)
    else:
        container = "# (no container: torchrun runs on the host)"
    run_dir = sh_word(run_cfg.out) if gave_out else f'"runs/{spec.job_name}"'
    values = dict(
        summary=f"{spec.nodes} node(s) x {spec.procs_per_node} process(es), "
                f"{'all' if spec.whole_node else spec.cpus_per_node} core(s) per node, walltime {spec.walltime}",
        command=command, flavour_name=FLAVOUR_NAMES[spec.scheduler],
        directives="\n".join(directives(spec)), launcher=spec.launcher,
        nodes=spec.nodes, procs=spec.procs_per_node,
        cores='${SLURM_CPUS_ON_NODE:-$(nproc)}' if spec.whole_node else spec.cpus_per_node,
        cores_note="the whole node's, when the job starts (nproc: the cores it may use)" if spec.whole_node
        else "--cpus-per-node",
        walltime=spec.walltime, walltime_s=spec.walltime_s, stop_margin_s=spec.stop_margin,
        workdir=_dq(workdir) if workdir else "$PWD",
        kit=_dq(kit) if kit else "$PWD",
        python=_dq(python) if python else "python3",
        container=container,
        setup=setup_block(spec.setup),
        train_args=_train_lines(spec.train_args),
        run_dir=run_dir,
        run_dir_note=(str(run_cfg.out).replace("\n", "\\n") + " (--out)" if gave_out else
                      f"runs/{spec.job_name} (named after the job, not the job id)"),
        out_arg="" if gave_out else ' --out "$RUN_DIR"',
        pbsdsh_opts="-u " if spec.scheduler == "torque" else "",  # Torque: once per distinct node
        node_env=_NODE_ENV,
    )
    if spec.scheduler == "slurm":
        head = _template("slurm.sh").substitute(values)
    else:
        launch = _Template(_PBS_LAUNCH[spec.launcher]).substitute(values)
        head = _template("pbs.sh").substitute(values, launch_function=launch)
    return head + _template("body.sh").substitute(values)


# --- command line ------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpcbert submit", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="hpcbert submit --scheduler {pbs,torque,slurm} [options] [-- TRAIN_OPTIONS...]",
        description=__doc__.split("\n\n")[0] + "\n\n" + "\n".join(
            f"  preset {k}: {v.description}" for k, v in PRESETS.items()))
    p.add_argument("--scheduler", required=True, choices=SCHEDULERS,
                   help="pbs (PBS Pro/OpenPBS: select/place/-P), torque (nodes=:ppn=), slurm")
    p.add_argument("--preset", choices=sorted(PRESETS), help="named resources + train options; "
                   "options given here and after -- override it")
    p.add_argument("--nodes", type=int, help="nodes (one bootstrap -> torchrun per node)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node; one training process per GPU")
    p.add_argument("--procs-per-node", type=int, help="training processes per node of a CPU-only job "
                   "(--gpus-per-node 0); default: one per GPU, or 1")
    p.add_argument("--cpus-per-node", type=int, help="cores per node (default: one per process with GPUs; "
                   "CPU-only: whole nodes, Slurm --exclusive or PBS place=excl, cores counted when the job "
                   "starts; Torque: required); OMP_NUM_THREADS = cores / processes")
    p.add_argument("--walltime", help="HH:MM:SS")
    p.add_argument("--stop-margin", type=int, help="seconds before the walltime by which training stops "
                   "and checkpoints (default: a tenth of the walltime, 60 s to 10 min)")
    p.add_argument("--project", help="PBS Pro project (-P); refused by torque and slurm")
    p.add_argument("--queue", help="queue (PBS -q) or partition (Slurm)")
    p.add_argument("--account", help="account to charge (PBS -A, Slurm --account)")
    p.add_argument("--directive", action="append", default=[], metavar="OPTION",
                   help="a site's own scheduler option, written after hpcbert's directives (repeatable): "
                        "--directive=--qos=high, --directive '-l mem=64GB' (a '#SBATCH ' or '#PBS ' prefix "
                        "may be given); options hpcbert writes itself are refused, naming the option to use")
    p.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="a shell line the job runs before the launch (repeatable, in order): "
                        "'module load apptainer', 'source /apps/venv/bin/activate'")
    p.add_argument("--launcher", choices=("mpiexec", "pbsdsh", "ssh", "srun"),
                   help="how one bootstrap per node starts; pbs: mpiexec (default), pbsdsh, ssh; "
                        "torque: pbsdsh (default), mpiexec, ssh; slurm: srun")
    p.add_argument("--container", metavar="IMAGE", help="run torchrun inside this Apptainer/Singularity "
                   "image (singularity/exec.sh); '${HPCBERT_IMAGE:-hpcbert.sif}' is expanded by the job")
    p.add_argument("--bind", action="append", default=[], metavar="SRC[:DST[:ro]]",
                   help="container bind mount (repeatable)")
    p.add_argument("--job-name", help="job name (default: hpcbert, or bert-PRESET); also the run directory "
                   "runs/JOB_NAME unless the train options give --out: a job submitted again under the same "
                   "name continues that run")
    p.add_argument("--portable", action="store_true",
                   help="no paths of this machine in the script: the submit directory falls back to $PWD, "
                        "the interpreter is python3, the hpcbert checkout is the submit directory")
    p.add_argument("--dry-run", action="store_true", help="print the script (and write --out-script), "
                   "do not submit")
    p.add_argument("--out-script", metavar="FILE", help="where the script is written (default when "
                   "submitting: ./JOB_NAME.pbs or .sbatch)")
    return p


def spec_from_args(ns: argparse.Namespace, train: list[str]) -> JobSpec:
    preset = PRESETS[ns.preset] if ns.preset else None
    res = dict(preset.resources) if preset else {}
    for name in ("nodes", "gpus_per_node", "procs_per_node", "cpus_per_node", "walltime"):
        if getattr(ns, name) is not None:
            res[name] = getattr(ns, name)
    missing = [n for n in ("nodes", "gpus_per_node", "walltime") if n not in res]
    if missing:
        raise ValueError("missing " + ", ".join("--" + m.replace("_", "-") for m in missing)
                         + " (or give a --preset: " + ", ".join(PRESETS) + ")")
    return JobSpec(scheduler=ns.scheduler, **res, project=ns.project, queue=ns.queue, account=ns.account,
                   launcher=ns.launcher, container=ns.container, binds=ns.bind, stop_margin=ns.stop_margin,
                   extra_directives=ns.directive, setup=ns.setup,
                   job_name=ns.job_name or (f"bert-{ns.preset}" if preset else "hpcbert"),
                   train_args=(preset_argv(preset_for(preset.train, train)) if preset else []) + train)


def preset_for(preset_train: dict, train: list[str]) -> dict:
    """A preset's train options under the user's: where the user names another task, the preset's
    options that task does not read (the kit's --data-dir under --task synthetic) are left out, as
    the user's options win; the user's own are all kept, and train refuses any its task does not read."""
    from .. import objectives

    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    p.add_argument("--task")
    task = p.parse_known_args(train)[0].task or preset_train.get("task")
    return {k: v for k, v in preset_train.items() if task is None or objectives.task_reads(task, k)}


def _kit_dir() -> str | None:
    """The hpcbert checkout holding multinode_communication/ and singularity/, if this is one."""
    root = Path(__file__).resolve().parents[3]
    return str(root) if (root / "multinode_communication").is_dir() else None


def cli(argv: list[str]) -> int:
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    ns = parser().parse_args(argv[:split])
    train = argv[split + 1:]
    # For the header comment: a newline inside an option must not end the comment line.
    command = ("hpcbert submit " + shlex.join(argv)).replace("\n", "\\n")
    try:
        spec = spec_from_args(ns, train)
        if ns.portable:
            text = render(spec, command)
        else:
            text = render(spec, command, workdir=str(Path.cwd()), python=sys.executable, kit=_kit_dir())
    except ValueError as e:
        print(f"hpcbert submit: error: {e}", file=sys.stderr)
        return 2
    path = Path(ns.out_script) if ns.out_script else None
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)
    if ns.dry_run:
        if not path:
            sys.stdout.write(text)
        else:
            print(f"wrote {path} (not submitted)", file=sys.stderr)
        return 0
    if path is None:
        path = Path(spec.job_name + SCRIPT_SUFFIX[spec.scheduler])
        path.write_text(text)
        path.chmod(0o755)
    tool = SUBMIT_COMMAND[spec.scheduler]
    if shutil.which(tool) is None:
        print(f"hpcbert submit: error: {tool} not found on PATH (not a {FLAVOUR_NAMES[spec.scheduler]} login "
              f"node?); the script is in {path}; --dry-run only writes it", file=sys.stderr)
        return 2
    cmd = [tool, "--parsable", str(path)] if tool == "sbatch" else [tool, str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"hpcbert submit: error: {shlex.join(cmd)} failed ({proc.returncode}): "
              f"{(proc.stderr or proc.stdout).strip()}", file=sys.stderr)
        return proc.returncode
    job_id = proc.stdout.strip().splitlines()[-1].split(";")[0] if proc.stdout.strip() else ""
    print(job_id)
    print(f"submitted {path} with {tool}: job {job_id}", file=sys.stderr)
    return 0
