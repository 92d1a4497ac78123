#!/usr/bin/env python
"""hpcbert vs the Hugging Face Trainer: the same model, task and hyperparameters, in one benchmark.

A measurement, not a test. Every figure it prints or writes comes from runs it starts itself; the
tables in results/compare_hf/README.md are generated from the JSON files (`render`), never typed.

    python benchmarks/compare_hf.py throughput [--steps 40 --repeats 2]   steady seq/s, both sides
    python benchmarks/compare_hf.py accuracy   [--seeds 1,2,3 --epochs 3] MRPC dev F1 / accuracy
    python benchmarks/compare_hf.py policies   [--repeats 3]              hpcbert checkpointing policies
    python benchmarks/compare_hf.py render                                results/compare_hf/README.md

Common settings (both sides): minilm-l6 (pretrained BertModel; the classification head is newly
initialised on both sides), MRPC, max length 128, per-device batch 32, 2 threads, lr 2e-5, AdamW
(betas 0.9/0.999, eps 1e-8), weight decay 0.01 (not on biases and LayerNorm weights), linear
warm-up over round(0.1 x steps) steps then linear decay to 0, max grad norm 1.0, seed 42 (or the
accuracy seeds). Every run (hpcbert or Trainer) is its own subprocess, so each starts clean.
Nothing is downloaded: the model comes from `hpcbert.zoo.minilm_dir()`, the data from --data-dir,
and the Hugging Face hubs are switched off (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HPCBERT_SRC = {"path": str(ROOT / "BERT"), "rev": None}  # set by use_hpcbert() before anything imports hpcbert
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_var] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_DATA = "../shared/data/glue/MRPC"     # relative to the project root
TASK_FOLDERS = {"mrpc": "MRPC", "sst-2": "SST-2"}  # tasks `throughput` and `accuracy` can run
DEFAULT_RESULTS = ROOT / "results" / "compare_hf"
DEFAULT_WORK = ROOT / "runs" / "compare_hf"   # hpcbert run directories, logs, Trainer scratch (git-ignored)
TASK = "mrpc"
MODEL = "minilm-l6"
SEQ_LEN = 128
BATCH = 32
THREADS = 2
LR = 2e-5
WEIGHT_DECAY = 0.01
WARMUP_RATIO = 0.1
MAX_GRAD_NORM = 1.0
ADAM_EPS = 1e-8
SEED = 42
EVAL_BATCH = 64

# Checkpointing-policy targets: (max activation bytes vs none, max step time vs none).
POLICY_TARGETS = {"selective": (0.75, 1.05), "alternate": (0.55, 1.15), "all": (0.10, 1.35)}
POLICIES = ("none", "selective", "alternate", "all")
POLICY_MODELS = {"minilm-l6": 32, "bert-base": 8}  # model -> per-device batch

SPAN_NOTE = (
    "Step span. hpcbert times a step from fetching its first batch (index lookup + collate) to the "
    "end of the optimizer step (after zero_grad). The Trainer fetches and collates the step's "
    "batches in `get_batch_samples` *before* it calls `on_step_begin`, so a callback's "
    "on_step_begin -> on_step_end span leaves the batch fetch out. The HF figure in the main column "
    "is therefore timed from the start of `get_batch_samples` (a Trainer subclass records it) to "
    "`on_step_end` (after optimizer.step, lr_scheduler.step and zero_grad): the same span as "
    "hpcbert's. The callback-only figure is shown beside it. Both spans also hold the Trainer's "
    "per-step bookkeeping (NaN check of the loss, FLOP and token counting), which is part of its cost."
)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def say(msg: str) -> None:
    print(f"[compare_hf {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_json(path: Path, obj) -> None:
    from hpcbert.runfiles import write_json_atomic
    write_json_atomic(path, obj)


def read_json(path: Path) -> dict:
    """A JSON object written by this script or a run; one-line error naming the file otherwise."""
    from hpcbert.runfiles import read_json_object
    return read_json_object(Path(path))


def glue_root(data_dir: str, task: str = TASK) -> Path:
    """--data-dir may be the task's folder (the default: MRPC's) or the GLUE directory holding it; for
    another task than MRPC, the default's parent (the GLUE directory). Returns the GLUE directory
    (what hpcbert's --data-dir expects)."""
    folder = TASK_FOLDERS[task]
    p = Path(data_dir).expanduser()
    if not p.is_absolute():
        p = (Path.cwd() / p) if (Path.cwd() / p).exists() else (ROOT / p)
    p = p.resolve()
    if (p / "train.tsv").is_file() and (p / "dev.tsv").is_file():
        if p.name == folder:
            return p.parent
        if (p.parent / folder / "train.tsv").is_file():  # the MRPC default, another task asked for
            return p.parent
        _bad_data(p, f"holds train.tsv but is not named {folder}; pass the GLUE directory that contains {folder}/",
                  folder)
    if (p / folder / "train.tsv").is_file() and (p / folder / "dev.tsv").is_file():
        return p
    _bad_data(p, "does not exist" if not p.exists() else f"has no {folder} train.tsv/dev.tsv", folder)


def _bad_data(p: Path, why: str, folder: str = "MRPC"):
    sys.exit(f"compare_hf: {folder} data not found: {p} {why}. Pass --data-dir pointing at the {folder} folder "
             f"(train.tsv, dev.tsv) or at a GLUE directory containing {folder}/ (default: {DEFAULT_DATA}, "
             f"relative to the project root {ROOT}).")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def use_hpcbert(rev: str | None) -> None:
    """Which hpcbert the runs use: this checkout's BERT/ (rev None), or the tree of commit `rev`,
    extracted read-only with `git archive` outside the repository, so that edits made to the working
    tree while a long benchmark runs cannot change the code under measurement half-way."""
    if rev is None:
        status = _git("status", "--porcelain", "--untracked-files=no", "--", "BERT")
        HPCBERT_SRC.update(path=str(ROOT / "BERT"), rev=None, commit=_git("rev-parse", "HEAD"),
                           note="working tree" + (" with uncommitted changes under BERT/" if status else ""))
    else:
        sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
        if not sha:
            sys.exit(f"compare_hf: --hpcbert-rev {rev!r} is not a commit of {ROOT}")
        dest = Path(os.environ.get("TMPDIR", "/tmp")) / f"compare_hf-hpcbert-{sha[:12]}"
        if not (dest / "BERT" / "hpcbert" / "__init__.py").is_file():
            dest.mkdir(parents=True, exist_ok=True)
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", sha, "BERT"],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        HPCBERT_SRC.update(path=str(dest / "BERT"), rev=rev, commit=sha, note=f"commit {sha[:12]} ({rev})")
    sys.path.insert(0, HPCBERT_SRC["path"])


def native_bf16() -> bool:
    import torch
    from hpcbert.policies import device_has_native_bf16
    return device_has_native_bf16(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def machine_info(threads: int) -> dict:
    import torch
    from hpcbert.meters import cpu_name
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": threads, "python": platform.python_version(),
            "torch": torch.__version__, "native_bf16": native_bf16(), "hostname": platform.node(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for mod in ("transformers", "accelerate", "datasets", "tokenizers"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    info["hpcbert_source"] = dict(HPCBERT_SRC)
    info["git_commit"] = HPCBERT_SRC.get("commit")
    return info


def command_line() -> str:
    """The command that is running, as a user would type it from the project root: this script or
    one of the others that share these helpers (compare_hf_squad.py, compare_hf_chinese.py, gpu.py)."""
    nice = os.nice(0)
    prefix = f"nice -n {nice} " if nice > 0 else ""
    script = os.path.relpath(Path(sys.argv[0]).resolve(), ROOT)
    return prefix + f"python {script} " + shlex.join(sys.argv[1:])


def header(kind: str, threads: int) -> dict:
    return {"kind": kind, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command_line(), "machine": machine_info(threads)}


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = HPCBERT_SRC["path"] + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = str(threads)  # the same on both sides; each also sets torch threads itself
    try:  # CUDA's allocator as hpcbert train runs it, the same on both sides
        from hpcbert import cuda_allocator_default
    except ImportError:  # an hpcbert commit (--hpcbert-rev) from before it
        return env
    cuda_allocator_default(env)
    return env


def _cpu_busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores, from /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and its finished children (the runs it started)."""
    import resource
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                   resource.getrusage(resource.RUSAGE_CHILDREN)))


def other_cores(seconds: float) -> float:
    """Cores kept busy by other work over the next `seconds` (this process idles meanwhile)."""
    b0, o0, t0 = _cpu_busy_s(), _own_cpu_s(), time.perf_counter()
    time.sleep(seconds)
    return max(0.0, (_cpu_busy_s() - b0 - (_own_cpu_s() - o0)) / (time.perf_counter() - t0))


def wait_quiet(max_wait_s: float, threshold: float = 0.3, sample_s: float = 5.0) -> tuple[float, float | None]:
    """Before a timed run: wait until other work uses < `threshold` cores (sampled over `sample_s`),
    at most `max_wait_s`. Returns (seconds waited, other cores at the last sample)."""
    if max_wait_s <= 0:
        return 0.0, None
    t0 = time.perf_counter()
    while True:
        busy = other_cores(sample_s)
        waited = time.perf_counter() - t0
        if busy < threshold or waited >= max_wait_s:
            if busy >= threshold:
                say(f"machine still busy ({busy:.2f} other cores) after waiting {waited:.0f} s; running anyway")
            return waited, busy
        say(f"other work uses {busy:.2f} cores; waiting for a quieter machine ({waited:.0f}/{max_wait_s:.0f} s)")
        time.sleep(10)


def measured(run_once, a) -> dict:
    """Run a timed run; while other work kept more than --noisy cores busy during it (on average),
    run it again (at most --retries times). Discarded attempts are kept in the record."""
    discarded = []
    for attempt in range(1 + a.retries):
        rec = run_once()
        busy = rec["noise"]["other_cores_during"]
        if busy <= a.noisy or attempt == a.retries:
            break
        say(f"  other work kept {busy:.2f} cores busy during the run (> {a.noisy}); discarded, running it again")
        discarded.append({"steady_sequences_per_sec": rec.get("steady_sequences_per_sec"),
                          "steady_step_time_s": rec.get("steady_step_time_s"), "noise": rec["noise"]})
    rec["discarded_attempts"] = discarded
    return rec


def run_logged(cmd: list[str], log: Path, threads: int, max_wait_s: float = 0.0) -> dict:
    """Run `cmd` from the project root with output to `log`; on failure show the log's tail and stop.
    Returns noise measurements: the wait for a quiet machine, and the cores other work kept busy
    during the run (machine busy CPU time minus the run's own, over the run's wall time)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    waited, before = wait_quiet(max_wait_s)
    b0, o0, t0 = _cpu_busy_s(), _own_cpu_s(), time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(threads), stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-40:]
        sys.exit(f"compare_hf: command failed (exit {proc.returncode}), log {log}:\n" + "\n".join(tail))
    other = max(0.0, (_cpu_busy_s() - b0 - (_own_cpu_s() - o0)) / wall)
    return {"waited_for_quiet_s": waited, "other_cores_before": before, "other_cores_during": other, "wall_s": wall}


def fresh_dir(path: Path) -> Path:
    """Remove a previous run directory of ours (hpcbert appends to metrics.jsonl)."""
    if path.exists():
        shutil.rmtree(path)
    return path


def warmup_steps(total_steps: int) -> int:
    """hpcbert's rule (train.py): round(warmup_ratio x steps); given to the Trainer as an integer."""
    return round(WARMUP_RATIO * total_steps)


def steps_per_epoch(n_train: int, batch: int = BATCH) -> int:
    return math.ceil(n_train / batch)


# ----------------------------------------------------------------------------------------------
# one hpcbert run (subprocess)
# ----------------------------------------------------------------------------------------------

def hpcbert_run(name: str, work: Path, threads: int, args: list[str], max_wait_s: float = 0.0) -> dict:
    out = fresh_dir(work / "hpcbert" / name)
    cmd = [sys.executable, "-m", "hpcbert.cli", "train", *args, "--threads", str(threads), "--out", str(out)]
    say(f"hpcbert {name}: {shlex.join(args)}")
    noise = run_logged(cmd, work / "logs" / f"hpcbert-{name}.log", threads, max_wait_s)
    from hpcbert.runfiles import read_summary
    s = read_summary(out)
    s["_noise"] = noise
    s["_wall_s"] = noise["wall_s"]
    s["_run_dir"] = str(out)
    s["_argv"] = ["hpcbert", "train", *args, "--threads", str(threads)]
    return s


def hpcbert_mrpc_args(glue: Path, precision: str, seed: int, max_steps: int | None = None,
                      epochs: float | None = None, sampler: str | None = None, do_eval: bool = False,
                      warmup_excluded: int | None = None, log_every: int | None = None,
                      task: str = TASK, model: str = MODEL, batch: int = BATCH,
                      tokenizer: str | None = None) -> list[str]:
    a = ["--task", task, "--data-dir", str(glue), "--model", model, "--max-seq-length", str(SEQ_LEN),
         "--batch-size", str(batch), "--lr", str(LR), "--optimizer", "adamw", "--weight-decay", str(WEIGHT_DECAY),
         "--warmup-ratio", str(WARMUP_RATIO), "--max-grad-norm", str(MAX_GRAD_NORM), "--precision", precision,
         "--seed", str(seed), "--eval-batch-size", str(EVAL_BATCH)]
    if tokenizer is not None:
        a += ["--tokenizer", str(tokenizer)]
    if max_steps is not None:
        a += ["--max-steps", str(max_steps)]
    if epochs is not None:
        a += ["--epochs", str(epochs)]
    if sampler is not None:
        a += ["--sampler", sampler]
    a += ["--do-eval" if do_eval else "--no-do-eval"]
    if warmup_excluded is not None:
        a += ["--warmup-steps-excluded", str(warmup_excluded)]
    if log_every is not None:
        a += ["--log-every", str(log_every)]
    return a


def hpcbert_record(s: dict) -> dict:
    """The fields of an hpcbert summary this benchmark reports, plus per-step times and sequences
    from metrics.jsonl when the run logged every step (--log-every 1)."""
    from hpcbert.runfiles import read_metrics
    seq_s = own = s["steady_sequences_per_sec"]
    m = read_metrics(s["_run_dir"])
    per_step = len(m) == s["steps"] and [r["step"] for r in m] == list(range(1, s["steps"] + 1))
    w = s["warmup_steps_excluded"] or 0
    if per_step and any(c["step"] > w for c in s.get("compile_steps") or []):
        # hpcbert leaves a step in which torch.compile compiled out of its steady figures; the
        # Trainer's count every step after the warm-up, compiles included: so does this comparison
        seq_s = sum(r["sequences_per_sec"] * r["step_time_s"] for r in m[w:]) / sum(r["step_time_s"] for r in m[w:])
    return {
        "step_times": [r["step_time_s"] for r in m] if per_step else None,
        "step_sequences": [round(r["sequences_per_sec"] * r["step_time_s"]) for r in m] if per_step else None,
        "step_real_tokens": [round(r["tokens_per_sec"] * r["step_time_s"]) for r in m] if per_step else None,
        "steady_sequences_per_sec": seq_s,
        "padded_tokens_per_seq": (s["padded_tokens_per_sec"] / own) if own else None,
        "real_tokens_per_seq": (s["tokens_per_sec"] / own) if own else None,
        "steady_step_time_s": s["steady_step_time_s"],
        "mean_step_time_s": 1.0 / s["steady_steps_per_sec"] if s["steady_steps_per_sec"] else None,
        "steps": s["steps"], "warmup_steps_excluded": s["warmup_steps_excluded"], "precision": s["precision"],
        "activation_bytes_per_sequence": s["activation_bytes_per_sequence"], "grad_ckpt": s["grad_ckpt"],
        "eval": s["eval"], "final_loss": s["final_loss"], "threads": s["hardware"]["threads"],
        "wall_s": s["_wall_s"], "noise": s["_noise"], "run_dir": os.path.relpath(s["_run_dir"], ROOT), "argv": s["_argv"],
    }


# ----------------------------------------------------------------------------------------------
# one Trainer run (subprocess: this script's hidden `_hf-worker` command)
# ----------------------------------------------------------------------------------------------

def hf_run(name: str, work: Path, threads: int, glue: Path, out_json: Path, *, padding: str, precision: str,
           seed: int, max_steps: int | None = None, epochs: float = 3.0, do_eval: bool = False,
           warmup_excluded: int = 5, optim: str | None = None, max_wait_s: float = 0.0, task: str = TASK,
           order: str = "random", host_allocator: str = "system", model: str = MODEL, batch: int = BATCH,
           tokenizer: str | None = None, torch_compile: bool = False, pad_to_multiple_of: int | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "_hf-worker", "--data-dir", str(glue), "--task", task,
           "--order", order, "--host-allocator", host_allocator, "--model", model, "--batch-size", str(batch),
           "--out", str(out_json), "--scratch", str(work / "hf-scratch" / name), "--padding", padding,
           "--precision", precision, "--seed", str(seed), "--threads", str(threads), "--epochs", str(epochs),
           "--warmup-steps-excluded", str(warmup_excluded)]
    if max_steps is not None:
        cmd += ["--max-steps", str(max_steps)]
    if do_eval:
        cmd += ["--do-eval"]
    if optim:
        cmd += ["--optim", optim]
    if tokenizer:
        cmd += ["--tokenizer", str(tokenizer)]
    if torch_compile:
        cmd += ["--torch-compile"]
    if pad_to_multiple_of:
        cmd += ["--pad-to-multiple-of", str(pad_to_multiple_of)]
    say(f"trainer {name}: padding={padding} order={order} precision={precision} seed={seed} host_allocator={host_allocator} "
        f"torch_compile={torch_compile} pad_to_multiple_of={pad_to_multiple_of} "
        f"{'max_steps=' + str(max_steps) if max_steps else 'epochs=' + str(epochs)}")
    noise = run_logged(cmd, work / "logs" / f"hf-{name}.log", threads, max_wait_s)
    r = read_json(out_json)
    r["wall_s"] = noise["wall_s"]
    r["noise"] = noise
    return r


def timed_trainer_classes():
    """The Trainer-side instruments of every comparison script (compare_hf, compare_hf_squad,
    compare_hf_chinese); transformers is imported here, in the worker, not when the script loads.

    StepTimer     callback: on_step_begin / on_step_end times, and the torch threads in use
    TimedTrainer  records when each step's batch fetch starts (get_batch_samples, before
                  on_step_begin), the batches' shapes and real tokens; evaluates in dataset order
    Deadline      callback for accuracy runs in segments: before a step that would end past the
                  deadline, save a checkpoint and stop (trainer.train(resume_from_checkpoint) goes on)
    """
    import torch
    from transformers import Trainer, TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin, self.end, self.threads = [], [], None

        def on_train_begin(self, args, state, control, **kw):
            self.threads = torch.get_num_threads()

        def on_step_begin(self, args, state, control, **kw):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # hpcbert's step ends on a sync point (float(loss))
            self.end.append(time.perf_counter())

    class TimedTrainer(Trainer):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.fetch_start, self.shapes, self.real_tokens = [], [], []

        def _get_eval_sampler(self, eval_dataset):
            # transformers 5 length-groups evaluation too under train_sampling_strategy="group_by_length",
            # and Trainer.predict then returns predictions in that order, while the examples (run_glue,
            # run_qa's post-processing, run_classification) map them back by position: dataset order.
            return torch.utils.data.SequentialSampler(eval_dataset)

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            t = time.perf_counter()
            batches, n = super().get_batch_samples(epoch_iterator, num_batches, device)
            if batches:
                self.fetch_start.append(t)
                self.shapes.append([tuple(b["input_ids"].shape) for b in batches])
                self.real_tokens.append(sum(int(b["attention_mask"].sum()) for b in batches))
            return batches, n

    class Deadline(TrainerCallback):
        def __init__(self, timer: StepTimer, deadline: float | None):
            self.timer, self.deadline = timer, deadline

        def on_step_end(self, args, state, control, **kw):
            t = self.timer
            per_step = (t.end[-1] - t.begin[0]) / len(t.end) if t.end else 0.0
            if self.deadline and time.time() + 1.5 * per_step > self.deadline and state.global_step < state.max_steps:
                control.should_save = True
                control.should_training_stop = True

    return StepTimer, TimedTrainer, Deadline


def train_resumable(model, tok, train_ds, collator, *, scratch: str, batch: int, lr: float, epochs: float,
                    max_steps: int | None, total: int, seed: int, group_by_length: bool, threads: int,
                    deadline: float | None):
    """The Trainer of compare_hf_squad.py and compare_hf_chinese.py, set up as transformers' example
    scripts do with this script's settings (fused AdamW, weight decay, linear warm-up over hpcbert's
    round(0.1 x steps) then decay, max grad norm 1, nothing evaluated or saved while training), resumed
    from the newest checkpoint in `scratch` and stopped with a checkpoint before `deadline` (epoch
    seconds; None: none). Returns (args, trainer, timer, train_out, t_train, t_done); the deadline
    stopped it when trainer.state.global_step < total."""
    import torch
    from transformers import TrainingArguments
    args = TrainingArguments(
        output_dir=scratch, per_device_train_batch_size=batch, per_device_eval_batch_size=EVAL_BATCH,
        learning_rate=lr, weight_decay=WEIGHT_DECAY, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=ADAM_EPS,
        max_grad_norm=MAX_GRAD_NORM, lr_scheduler_type="linear", warmup_steps=warmup_steps(total),
        num_train_epochs=epochs, max_steps=max_steps if max_steps else -1, eval_strategy="no", save_strategy="no",
        report_to="none", dataloader_num_workers=0, seed=seed, logging_strategy="steps", logging_steps=10,
        disable_tqdm=True, optim="adamw_torch_fused", use_cpu=not torch.cuda.is_available(), save_total_limit=1,
        # group_by_length=True in transformers < 5; the same LengthGroupedSampler here.
        train_sampling_strategy="group_by_length" if group_by_length else "random",
    )
    torch.set_num_threads(threads)  # after anything that might have touched it

    StepTimer, TimedTrainer, Deadline = timed_trainer_classes()
    timer = StepTimer()
    trainer = TimedTrainer(model=model, args=args, train_dataset=train_ds, data_collator=collator,
                           processing_class=tok, callbacks=[timer, Deadline(timer, deadline)])
    ckpts = sorted(Path(scratch).glob("checkpoint-*"), key=lambda q: int(q.name.split("-")[1]))
    t_train = time.perf_counter()
    train_out = trainer.train(resume_from_checkpoint=str(ckpts[-1]) if ckpts else None)
    return args, trainer, timer, train_out, t_train, time.perf_counter()


def trainer_figures(trainer, timer, warmup_excluded: int, train_out, t_process: float, t_train: float,
                    t_done: float) -> dict:
    """A finished run's figures from timed_trainer_classes(): each step timed from its batch fetch to the
    end of its optimizer step (hpcbert's span; the callback's own span beside it), the first
    `warmup_excluded` steps left out of the steady figures. Shared by the Trainer workers of this script,
    compare_hf_squad.py and compare_hf_chinese.py."""
    import numpy as np
    n = len(timer.end)
    assert len(timer.begin) == n and len(trainer.fetch_start) >= n, (len(timer.begin), n, len(trainer.fetch_start))
    w = min(warmup_excluded, max(0, n - 1))
    full = [timer.end[i] - trainer.fetch_start[i] for i in range(n)]
    cb = [timer.end[i] - timer.begin[i] for i in range(n)]
    seqs = [sum(s[0] for s in trainer.shapes[i]) for i in range(n)]
    padded = [sum(s[0] * s[1] for s in trainer.shapes[i]) for i in range(n)]
    steady_seqs = sum(seqs[w:])
    return {
        "steps": n, "warmup_steps_excluded": w, "threads": timer.threads,
        "steady_sequences_per_sec": steady_seqs / sum(full[w:]) if n > w else None,
        "callback_sequences_per_sec": steady_seqs / sum(cb[w:]) if n > w else None,
        "padded_tokens_per_seq": sum(padded[w:]) / steady_seqs if n > w else None,
        "real_tokens_per_seq": sum(trainer.real_tokens[w:n]) / steady_seqs if n > w else None,
        "steady_step_time_s": float(np.median(full[w:])) if n > w else None,
        "step_times": full, "callback_step_times": cb, "step_sequences": seqs, "step_padded_tokens": padded,
        "step_real_tokens": trainer.real_tokens[:n], "startup_s": t_train - t_process, "train_s": t_done - t_train,
        "train_loss": train_out.training_loss,
        "final_loss": next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None),
    }


def hf_worker(argv: list[str]) -> int:
    """Fine-tune with transformers.Trainer as run_glue.py does and write one JSON of measurements."""
    p = argparse.ArgumentParser(prog="compare_hf.py _hf-worker")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--scratch", required=True)
    p.add_argument("--padding", choices=("max_length", "dynamic"), required=True)
    p.add_argument("--precision", choices=("fp32", "bf16"), required=True)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--warmup-steps-excluded", type=int, default=5)
    p.add_argument("--do-eval", action="store_true")
    p.add_argument("--optim", default=None, help="TrainingArguments.optim (default: the Trainer's own default)")
    p.add_argument("--task", default=TASK, choices=tuple(TASK_FOLDERS))
    p.add_argument("--order", choices=("random", "group_by_length", "hpcbert-random"), default="random",
                   help="random: the Trainer's RandomSampler; group_by_length: its LengthGroupedSampler "
                        "(train_sampling_strategy); hpcbert-random: hpcbert's --sampler random order for the "
                        "same seed, so both sides train on the same batches")
    p.add_argument("--host-allocator", choices=("system", "retain"), default="system",
                   help="retain: glibc malloc set as hpcbert sets it for its runs (hpcbert.dist."
                        "tune_host_allocator), to show what of hpcbert's lead that setting alone gives")
    from hpcbert.zoo import RANDOM_SHAPES
    p.add_argument("--model", default=MODEL, choices=("minilm-l6", *RANDOM_SHAPES),
                   help="minilm-l6 (its pretrained weights) or one of hpcbert's random shapes (bert-base, ...): "
                        "transformers' BertForSequenceClassification of that shape, random init")
    p.add_argument("--batch-size", type=int, default=BATCH)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: minilm-l6's)")
    p.add_argument("--torch-compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    p.add_argument("--pad-to-multiple-of", type=int, default=None,
                   help="dynamic padding: DataCollatorWithPadding(pad_to_multiple_of=N), as run_glue.py sets 8 "
                        "under fp16 (fewer distinct shapes, tensor-core multiples)")
    a = p.parse_args(argv)
    if a.pad_to_multiple_of is not None and (a.padding != "dynamic" or a.pad_to_multiple_of < 1):
        p.error("--pad-to-multiple-of: a positive number, with --padding dynamic")
    t_process = time.perf_counter()
    if a.host_allocator == "retain":
        from hpcbert.dist import tune_host_allocator
        if tune_host_allocator() != "glibc-retain":
            sys.exit("compare_hf: --host-allocator retain: the C library is not glibc (or mallopt refused)")

    import numpy as np
    import torch
    import transformers
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                              TrainingArguments, default_data_collator)

    from hpcbert.data.glue import read_split
    from hpcbert.data.metrics import accuracy, f1_binary
    from hpcbert.zoo import minilm_dir

    torch.set_num_threads(a.threads)
    model_dir = str(minilm_dir()) if a.model == "minilm-l6" else None
    train_ex = read_split(a.data_dir, a.task, "train")
    dev_ex = read_split(a.data_dir, a.task, "dev")

    # Tokenise as run_glue.py: tokenizer(*pairs, padding=..., max_length=128, truncation=True);
    # padding="max_length" for its default pad_to_max_length=True, else no padding + DataCollatorWithPadding.
    tok = AutoTokenizer.from_pretrained(a.tokenizer or model_dir or str(minilm_dir()))
    pad = "max_length" if a.padding == "max_length" else False

    pairs = train_ex[0].text_b is not None

    def to_dataset(examples):
        # a list of feature dicts, which the Trainer, its samplers and collators take as a dataset
        # (what run_glue.py's datasets.Dataset.map gives after its text columns are dropped), so the
        # worker needs no `datasets` package (a GPU image may lack it)
        enc = tok([e.text_a for e in examples], *([[e.text_b for e in examples]] if pairs else []), padding=pad,
                  max_length=SEQ_LEN, truncation=True)
        return [{**{k: v[i] for k, v in enc.items()}, "label": int(e.label)} for i, e in enumerate(examples)]

    train_ds, dev_ds = to_dataset(train_ex), to_dataset(dev_ex)
    collator = default_data_collator if a.padding == "max_length" else \
        DataCollatorWithPadding(tok, pad_to_multiple_of=a.pad_to_multiple_of)

    transformers.set_seed(a.seed)  # the new classifier head is drawn from this seed
    if model_dir:
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    else:  # a published shape, random weights (as hpcbert's random models)
        L, H, A, I = RANDOM_SHAPES[a.model]
        model = AutoModelForSequenceClassification.from_config(transformers.BertConfig(
            vocab_size=len(tok), hidden_size=H, num_hidden_layers=L, num_attention_heads=A, intermediate_size=I,
            num_labels=2))
    total = a.max_steps or math.ceil(a.epochs * steps_per_epoch(len(train_ds), a.batch_size))
    warm = warmup_steps(total)
    kwargs = dict(
        output_dir=a.scratch, per_device_train_batch_size=a.batch_size, per_device_eval_batch_size=EVAL_BATCH,
        learning_rate=LR, weight_decay=WEIGHT_DECAY, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=ADAM_EPS,
        max_grad_norm=MAX_GRAD_NORM, lr_scheduler_type="linear", warmup_steps=warm,
        num_train_epochs=a.epochs, max_steps=a.max_steps if a.max_steps else -1,
        eval_strategy="no", save_strategy="no", report_to="none", dataloader_num_workers=0,
        seed=a.seed, bf16=a.precision == "bf16", logging_strategy="steps", logging_steps=10, disable_tqdm=True,
        gradient_accumulation_steps=1,
        train_sampling_strategy="group_by_length" if a.order == "group_by_length" else "random",
        # bf16 on a CPU (autocast, as hpcbert's bf16) needs use_cpu=True: without it TrainingArguments refuses bf16.
        use_cpu=not torch.cuda.is_available(),
    )
    if a.optim:
        kwargs["optim"] = a.optim
    if a.torch_compile:
        kwargs["torch_compile"] = True
    args = TrainingArguments(**kwargs)
    torch.set_num_threads(a.threads)  # after anything that might have touched it

    StepTimer, TimedTrainerBase, _ = timed_trainer_classes()

    class TimedTrainer(TimedTrainerBase):
        def _get_train_sampler(self, train_dataset=None):
            if a.order != "hpcbert-random":
                return super()._get_train_sampler(train_dataset)
            # hpcbert's first-epoch order for this seed (data.features.epoch_order, --sampler random):
            # cut into batches of 32 in order, so both sides train on the same batches.
            from hpcbert.data.features import epoch_order
            order = epoch_order(np.zeros(len(self.train_dataset)), "random", a.seed, 0, a.batch_size).tolist()
            return order  # a list is a valid sampler (an iterable of indices with a length)

    timer = StepTimer()
    trainer = TimedTrainer(model=model, args=args, train_dataset=train_ds, data_collator=collator,
                           processing_class=tok, callbacks=[timer])
    t_train = time.perf_counter()
    train_out = trainer.train()
    t_done = time.perf_counter()

    result = {
        "side": "transformers.Trainer",
        "model": a.model, "batch_size": a.batch_size,
        "padding": a.padding, "precision": a.precision, "seed": a.seed,
        "optim": str(args.optim.value if hasattr(args.optim, "value") else args.optim),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "torch_compile": bool(args.torch_compile), "pad_to_multiple_of": a.pad_to_multiple_of,
        "warmup_steps": warm, "total_steps": total,
        **trainer_figures(trainer, timer, a.warmup_steps_excluded, train_out, t_process, t_train, t_done),
        "eval": {},
    }
    if a.do_eval:
        pred = trainer.predict(dev_ds)
        preds = np.argmax(pred.predictions, axis=-1)
        labels = np.asarray([f["label"] for f in dev_ds])
        result["eval"] = {"dev": {"f1": f1_binary(preds, labels), "accuracy": accuracy(preds, labels)}}
    write_json(Path(a.out), result)
    return 0


# ----------------------------------------------------------------------------------------------
# throughput
# ----------------------------------------------------------------------------------------------

# Throughput comparisons: (name, hpcbert run, Trainer run, what it shows). The first is the headline.
COMPARISONS = [
    ("equal batches", "hp-random", "hf-same-order",
     "the same batches on both sides (hpcbert's random order, given to the Trainer as its sampler): "
     "only the implementations differ"),
    ("own length grouping", "hp-length-grouped", "hf-group-by-length",
     "each side with its own length grouping (hpcbert's length-grouped sampler, the Trainer's "
     "train_sampling_strategy=\"group_by_length\")"),
    ("equal batches, Trainer compiled", "hp-random", "hf-same-order-compiled",
     "as equal batches, the Trainer with `torch_compile=True` (its compile time falls in the steps left out)"),
    ("equal batches, Trainer padding to multiples of 8", "hp-random", "hf-same-order-pad8",
     "as equal batches, the Trainer's collator padding each batch to a multiple of 8 (`pad_to_multiple_of=8`, "
     "run_glue.py's setting under fp16: fewer distinct shapes)"),
    ("equal batches, Trainer with hpcbert's malloc setting", "hp-random", "hf-same-order-retain",
     "as equal batches, the Trainer's process given the host allocator setting hpcbert applies to its own "
     "(hpcbert.dist.tune_host_allocator): what of the lead is that setting"),
    ("own length grouping, Trainer with hpcbert's malloc setting", "hp-length-grouped", "hf-group-by-length-retain",
     "as own length grouping, the Trainer's process given hpcbert's host allocator setting"),
    ("defaults", "hp-defaults", "hf-defaults",
     "each side as shipped: hpcbert's defaults against run_glue.py's (pad to 128, fp32)"),
]


def throughput_runs(matched: str) -> dict[str, dict]:
    """Every run a repeat makes: key -> (side, label, how). hpcbert's defaults are its length-grouped
    run when the matched precision is what its `auto` resolves to (then not run twice)."""
    runs = {
        "hp-random": dict(side="hpcbert", label=f"hpcbert {matched}, dynamic padding, random sampler",
                          precision=matched, sampler="random"),
        "hf-same-order": dict(side="hf", label=f"Trainer {matched}, dynamic padding, hpcbert's random order",
                              padding="dynamic", precision=matched, order="hpcbert-random"),
        "hf-same-order-compiled": dict(side="hf", label=f"Trainer {matched}, dynamic padding, hpcbert's random order, "
                                       "torch_compile", padding="dynamic", precision=matched, order="hpcbert-random",
                                       torch_compile=True),
        "hf-same-order-pad8": dict(side="hf", label=f"Trainer {matched}, dynamic padding to a multiple of 8, "
                                   "hpcbert's random order", padding="dynamic", precision=matched,
                                   order="hpcbert-random", pad_to_multiple_of=8),
        "hf-same-order-retain": dict(side="hf", label=f"Trainer {matched}, dynamic padding, hpcbert's random order, "
                                     "malloc as hpcbert sets it", padding="dynamic", precision=matched,
                                     order="hpcbert-random", host_allocator="retain"),
        "hp-length-grouped": dict(side="hpcbert", label=f"hpcbert {matched}, dynamic padding, length-grouped sampler",
                                  precision=matched, sampler="length-grouped"),
        "hf-group-by-length": dict(side="hf", label=f"Trainer {matched}, dynamic padding, group_by_length",
                                   padding="dynamic", precision=matched, order="group_by_length"),
        "hf-group-by-length-retain": dict(side="hf", label=f"Trainer {matched}, dynamic padding, group_by_length, "
                                          "malloc as hpcbert sets it", padding="dynamic", precision=matched,
                                          order="group_by_length", host_allocator="retain"),
        "hf-defaults": dict(side="hf", label="Trainer, run_glue defaults (pad to 128, fp32, random order)",
                            padding="max_length", precision="fp32", order="random"),
    }
    if ("bf16" if native_bf16() else "fp32") != matched:
        runs["hp-defaults"] = dict(side="hpcbert", label="hpcbert defaults (precision auto, dynamic padding, "
                                   "length-grouped sampler)", precision="auto", sampler=None)
    return runs


def cmd_throughput(a) -> int:
    glue = glue_root(a.data_dir, a.task)
    results, work = Path(a.results_dir), Path(a.work_dir)
    matched = a.matched_precision or ("bf16" if native_bf16() else "fp32")
    why = ("given with --matched-precision" if a.matched_precision else
           f"default: this device {'has' if native_bf16() else 'lacks'} native bf16 "
           "(torch.ops.mkldnn._is_mkldnn_bf16_supported() on CPU)")
    w, steps = a.warmup_excluded, a.steps
    say(f"matched precision: {matched} ({why})")
    settings = {"task": a.task, "steps": steps, "warmup_steps_excluded": w, "batch_size": BATCH,
                "max_seq_length": SEQ_LEN, "threads": a.threads, "matched_precision": matched,
                "matched_precision_reason": why, "seed": SEED, "data_dir": a.data_dir,
                "lr_warmup_steps": warmup_steps(steps), "wait_quiet_s": a.wait_quiet, "noisy_cores": a.noisy,
                "retries": a.retries}
    path = results / throughput_file(a.task, matched)
    doc = header("throughput", a.threads)
    doc["runs"] = []
    if path.is_file():  # resume: runs of the same settings and hpcbert commit are kept, the rest run
        old = read_json(path)
        if old.get("settings", {}) | {"repeats": None} == settings | {"repeats": None} and \
                old["machine"].get("git_commit") == doc["machine"].get("git_commit"):
            doc["runs"] = old["runs"]
            doc["date"], doc["command"] = old["date"], doc["command"]
            say(f"{path.name}: {len(doc['runs'])} run(s) of these settings kept")
    doc["settings"] = {**settings, "repeats": a.repeats}
    doc["notes"] = [SPAN_NOTE, noise_note(a)]
    runs = throughput_runs(matched)
    done = {(r["repeat"], r["key"]) for r in doc["runs"]}
    for rep in range(1, a.repeats + 1):  # interleaved: every configuration once per repeat
        for key, how in runs.items():
            if (rep, key) in done:
                continue
            name = f"tp-{a.task}-{key}-r{rep}"
            if how["side"] == "hpcbert":
                rec = measured(lambda: hpcbert_record(hpcbert_run(
                    name, work, a.threads, hpcbert_mrpc_args(glue, how["precision"], SEED, max_steps=steps,
                                                             sampler=how["sampler"], warmup_excluded=w,
                                                             log_every=1, task=a.task),
                    a.wait_quiet)), a)
                rec.update(sampler=how["sampler"] or "length-grouped (default)", padding="dynamic")
            else:
                rec = measured(lambda: hf_run(
                    name, work, a.threads, glue, work / "hf-json" / f"{name}.json", padding=how["padding"],
                    precision=how["precision"], seed=SEED, max_steps=steps, warmup_excluded=w, optim=a.hf_optim,
                    max_wait_s=a.wait_quiet, task=a.task, order=how["order"],
                    host_allocator=how.get("host_allocator", "system"), torch_compile=how.get("torch_compile", False),
                    pad_to_multiple_of=how.get("pad_to_multiple_of")), a)
                rec.update(sampler=how["order"], host_allocator=how.get("host_allocator", "system"))
            rec.update(repeat=rep, side=how["side"], key=key, label=how["label"])
            doc["runs"].append(rec)
            say(f"  {name}: {rec['steady_sequences_per_sec']:.2f} seq/s "
                f"(other work: {rec['noise']['other_cores_during']:.2f} cores)")
            doc["summary"] = throughput_summary(doc)
            write_json(path, doc)  # after every run: partial results survive, and a rerun resumes
    doc["summary"] = throughput_summary(doc)
    write_json(path, doc)
    print(render_throughput(doc))
    return 0


def throughput_file(task: str, matched: str) -> str:
    """throughput-TASK.json (fp32, the name from before a bf16 host measured it) or throughput-TASK-bf16.json:
    each precision keeps its own file, so measuring one does not replace the other."""
    return f"throughput-{task}.json" if matched == "fp32" else f"throughput-{task}-{matched}.json"


def throughput_title(path: Path) -> str:
    rest = path.stem.split("-", 1)[1]
    task, prec = (rest[:-len("-bf16")], "bf16") if rest.endswith("-bf16") else (rest, "fp32")
    return f"Throughput, {task.upper()}, {prec}"


def throughput_summary(doc: dict) -> list[dict]:
    """Per comparison: seq/s per repeat, the median of per-repeat ratios, best-of-repeats."""
    runs = doc["runs"]
    out = []
    for comparison, hp_key, hf_key, what in COMPARISONS:
        if hp_key == "hp-defaults" and not any(r["key"] == hp_key for r in runs):
            hp_key = "hp-length-grouped"  # auto resolves to the matched precision: the same run
        hp = {r["repeat"]: r for r in runs if r["key"] == hp_key}
        hf = {r["repeat"]: r for r in runs if r["key"] == hf_key}
        reps = sorted(set(hp) & set(hf))
        if not reps:
            continue
        ratios = [hp[i]["steady_sequences_per_sec"] / hf[i]["steady_sequences_per_sec"] for i in reps]
        ratios_cb = [hp[i]["steady_sequences_per_sec"] / hf[i]["callback_sequences_per_sec"] for i in reps]
        row = {
            "comparison": comparison, "what": what, "hpcbert": hp_key, "hf": hf_key,
            "hpcbert_label": hp[reps[0]]["label"], "hf_label": hf[reps[0]]["label"], "repeats": reps,
            "hpcbert_seq_s": [hp[i]["steady_sequences_per_sec"] for i in reps],
            "hf_seq_s": [hf[i]["steady_sequences_per_sec"] for i in reps],
            "ratios": ratios, "ratio_median": statistics.median(ratios),
            "ratio_callback_median": statistics.median(ratios_cb),
            "hpcbert_padded_tokens_per_seq": statistics.mean(hp[i]["padded_tokens_per_seq"] for i in reps),
            "hf_padded_tokens_per_seq": statistics.mean(hf[i]["padded_tokens_per_seq"] for i in reps),
            "hpcbert_precision": hp[reps[0]]["precision"], "hf_precision": hf[reps[0]]["precision"],
        }
        # Same batches on both sides: the steps' real-token counts agree (checked, not assumed).
        a_tok, b_tok = hp[reps[0]].get("step_real_tokens"), hf[reps[0]].get("step_real_tokens")
        row["same_batches_both_sides"] = bool(a_tok and b_tok and a_tok[:len(b_tok)] == b_tok[:len(a_tok)])
        hp_best, hp_same = best_of_repeats([hp[i] for i in reps])
        hf_best, hf_same = best_of_repeats([hf[i] for i in reps])
        row.update(hpcbert_best_seq_s=hp_best, hf_best_seq_s=hf_best, hpcbert_same_batches=hp_same,
                   hf_same_batches=hf_same, ratio_best=(hp_best / hf_best) if (hp_best and hf_best) else None)
        out.append(row)
    return out


def fastest_trainer(rows: list[dict], seq_key: str = "hf_seq_s") -> dict | None:
    """The row whose Trainer configuration has the highest median seq/s (per-repeat figures under
    `seq_key`): the peer at its best. None for no rows."""
    return max(rows, key=lambda c: statistics.median(c[seq_key]), default=None)


def fastest_trainer_on_equal_batches(summary: list[dict]) -> dict | None:
    """Of the comparisons on equal batches, the one with the fastest Trainer configuration."""
    return fastest_trainer([c for c in summary if c["comparison"].startswith("equal batches")])


def best_of_repeats(runs: list[dict]) -> tuple[float | None, bool | None]:
    """Steady seq/s from the fastest time of each step over the repeats (sum of per-step minima).

    With the same seed every repeat trains on the same batches in the same order, so step i does the
    same work in every repeat and its fastest time is the best estimate of its time without other
    work on the machine (contention only ever adds time). Returns (seq/s, whether the repeats' per-step
    token counts agree, i.e. the batches really were the same)."""
    if not runs or any(not r.get("step_times") for r in runs):
        return None, None
    n = min(len(r["step_times"]) for r in runs)
    w = runs[0]["warmup_steps_excluded"]
    if n <= w:
        return None, None
    best = [min(r["step_times"][i] for r in runs) for i in range(w, n)]
    seqs = sum(runs[0]["step_sequences"][w:n])
    same = all(r["step_real_tokens"][:n] == runs[0]["step_real_tokens"][:n] for r in runs)
    return seqs / sum(best), same


def noise_note(a) -> str:
    return (f"Noise control (this machine is shared): before each run the script waits up to {a.wait_quiet:g} s "
            f"until other processes use < 0.3 cores; a run during which other work kept > {a.noisy:g} cores busy "
            f"on average is discarded and run again (at most {a.retries} times), and the last attempt is kept "
            f"whatever its noise.")


def load_line(runs: list[dict], threads: int, cores: int) -> str:
    """How much other work shared the machine during the runs (the main source of noise here);
    `cores`: the measuring machine's (doc["machine"]["cores"]), so rendering again elsewhere gives
    the same text."""
    during = [r["noise"]["other_cores_during"] for r in runs if r.get("noise")]
    if not during:
        return ""
    waited = sum(r["noise"]["waited_for_quiet_s"] for r in runs if r.get("noise"))
    waited += sum(d["noise"]["waited_for_quiet_s"] for r in runs for d in r.get("discarded_attempts", []))
    discarded = sum(len(r.get("discarded_attempts", [])) for r in runs)
    return (f"Other work on the machine during the runs ({cores} cores; each run uses {threads} threads): "
            f"{min(during):.2f} to {max(during):.2f} cores busy with other processes, median "
            f"{statistics.median(during):.2f} (machine busy CPU time minus the run's own, over its wall time); "
            f"{waited:.0f} s spent in total waiting for a quieter machine before runs; {discarded} attempt(s) "
            f"discarded and run again because other work was busy during them.")


def _fmt_list(xs, f="{:.2f}") -> str:
    return ", ".join(f.format(x) for x in xs)


def mean_pm(mean: float, std: float) -> str:
    """mean ± sample std; one seed has no std: the mean alone."""
    return f"{mean:.2f}" if math.isnan(std) else f"{mean:.2f} ± {std:.2f}"


# ----------------------------------------------------------------------------------------------
# shared with compare_hf_squad.py and compare_hf_chinese.py: interleaved (hpcbert, Trainer) pairs
# "dynamic" and "max" in one throughput.json, accuracy runs in resumable segments
# ----------------------------------------------------------------------------------------------

def add_dir_options(sp, results: Path, work: Path, work_help: str) -> None:
    sp.add_argument("--results-dir", default=str(results), help="(default: %(default)s)")
    sp.add_argument("--work-dir", default=str(work), help=f"{work_help} (default: %(default)s)")
    sp.add_argument("--hpcbert-rev", default=None, help="run the hpcbert of this git commit (git archive) "
                    "instead of the working tree's BERT/")


def add_trainer_worker_options(p, *, epochs: float, warmup_excluded: int) -> None:
    """The `_hf-worker` options the two scripts beside this one share (each adds its data's own)."""
    p.add_argument("--out", required=True)
    p.add_argument("--scratch", required=True)
    p.add_argument("--padding", choices=("max_length", "dynamic"), required=True)
    p.add_argument("--group-by-length", action="store_true")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--epochs", type=float, default=epochs)
    p.add_argument("--warmup-steps-excluded", type=int, default=warmup_excluded)
    p.add_argument("--do-eval", action="store_true")
    p.add_argument("--deadline", type=float, default=None,
                   help="epoch seconds: stop training before it with a checkpoint in --scratch and exit 3 "
                        "(the same command resumes from it)")


def trainer_worker_flags(*, group_by_length: bool, max_steps: int | None, do_eval: bool) -> list[str]:
    """The tail of a `_hf-worker` command line: the options add_trainer_worker_options takes as switches."""
    return ((["--group-by-length"] if group_by_length else []) + (["--max-steps", str(max_steps)]
            if max_steps is not None else []) + (["--do-eval"] if do_eval else []))


def trainer_stopped_early(trainer, total: int, say) -> bool:
    """Whether train_resumable's deadline stopped the run before its `total` steps (the worker then exits 3)."""
    if trainer.state.global_step >= total:
        return False
    say(f"stopped at step {trainer.state.global_step}/{total} before the deadline; run again to resume")
    return True


def trainer_result(a, args, model, trainer, timer, total: int, precision: str, timings: tuple, **fields) -> dict:
    """A finished `_hf-worker` run's record (before evaluation): how it ran, `fields` (the data's own
    counts), and trainer_figures; `timings` = (train_out, t_process, t_train, t_done)."""
    return {
        "side": "transformers.Trainer", "padding": a.padding, "group_by_length": a.group_by_length,
        "precision": precision, "seed": a.seed, "optim": str(getattr(args.optim, "value", args.optim)),
        "sampler": args.train_sampling_strategy,
        "attn_implementation": getattr(model.config, "_attn_implementation", None), **fields,
        "warmup_steps": warmup_steps(total), "total_steps": total,
        **trainer_figures(trainer, timer, a.warmup_steps_excluded, *timings),
        "eval": {},
    }


def finished_hpcbert_accuracy_run(out: Path, args: list[str], threads: int) -> tuple[dict, dict] | None:
    """hpcbert's side of an accuracy run in `out` once finished (None while its deadline stopped it):
    (its summary.json, the record's fields the two scripts share)."""
    from hpcbert.runfiles import read_summary
    s = read_summary(out)
    if s["stopped_by"] not in ("epochs", "max_steps"):
        return None
    return s, {"run_dir": os.path.relpath(out, ROOT), "argv": ["hpcbert", "train", *args, "--threads", str(threads)],
               "sampler": "length-grouped", "padding": "dynamic", "resumed_from_step": s["resumed_from_step"]}


def add_pair_options(sp, pairs: dict, *, steps: int | None, steps_help: str, warmup_excluded: int) -> None:
    """The `throughput` command's options: which pair, which repeat, steps per run."""
    sp.add_argument("--pair", choices=tuple(pairs), required=True)
    sp.add_argument("--repeat", type=int, required=True)
    sp.add_argument("--steps", type=int, default=steps, help=steps_help)
    sp.add_argument("--warmup-excluded", type=int, default=warmup_excluded)


def pair_call(a, path: Path, doc: dict, labels: tuple[str, str], threads: int, run_side, say) -> int:
    """One repeat (`a.repeat`) of one interleaved pair (`a.pair`) into throughput.json at `path`:
    `run_side(side, name)` runs one side ("hpcbert" or "hf") and returns its record. The side that runs
    first alternates from repeat to repeat, so slow drift hits both alike; each record is labelled
    (`labels`: hpcbert's, the Trainer's), replaces any earlier one of its (pair, repeat, side), and the
    file is written after each side."""
    call = header("throughput", threads)
    call.update(pair=a.pair, repeat=a.repeat)
    doc["calls"].append(call)
    for side in ("hpcbert", "hf") if a.repeat % 2 else ("hf", "hpcbert"):
        name = f"tp-{a.pair}-{side}-r{a.repeat}"
        rec = run_side(side, name)
        rec["label"] = labels[side != "hpcbert"]
        rec.update(pair=a.pair, repeat=a.repeat, side=side, command=call["command"])
        doc["runs"] = [r for r in doc["runs"] if (r["pair"], r["repeat"], r["side"]) != (a.pair, a.repeat, side)]
        doc["runs"].append(rec)
        say(f"  {name}: {rec['steady_sequences_per_sec']:.3f} seq/s, {rec['padded_tokens_per_seq']:.1f} padded "
            f"tokens/seq (other work: {rec['noise']['other_cores_during']:.2f} cores)")
        write_json(path, doc)
    return 0


def run_segment(cmd: list[str], log: Path, env: dict) -> tuple[int, dict]:
    """Run `cmd` from the project root, appending to `log` (one accuracy run's segments share it);
    returns (exit status, noise) and leaves a failure to the caller."""
    log.parent.mkdir(parents=True, exist_ok=True)
    b0, o0, t0 = _cpu_busy_s(), _own_cpu_s(), time.perf_counter()
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    other = max(0.0, (_cpu_busy_s() - b0 - (_own_cpu_s() - o0)) / wall)
    return rc, {"other_cores_during": other, "wall_s": wall}


def add_accuracy_options(sp, seeds: tuple[int, ...]) -> None:
    sp.add_argument("--side", choices=("hpcbert", "hf"), default=None, help="default: both")
    sp.add_argument("--seed", type=int, default=None, help=f"default: {', '.join(map(str, seeds))}")
    sp.add_argument("--segment-minutes", type=float, default=20,
                    help="training per call; the run checkpoints and the next call resumes (exit 3 until done; "
                         "default: %(default)s)")


def accuracy_calls(a, seeds: tuple[int, ...], threads: int, segment, describe, say) -> int:
    """`accuracy` of compare_hf_squad.py and compare_hf_chinese.py: `segment(side, seed)` (the finished
    run's record, or None) once for each requested (side, seed) run whose results/accuracy/SIDE-seedN.json
    is not written yet; exit 3 while one is unfinished. `describe(record)`: its figures, for the log."""
    sides = [a.side] if a.side else ["hpcbert", "hf"]
    unfinished = 0
    for seed in [a.seed] if a.seed is not None else list(seeds):
        for side in sides:
            path = Path(a.results_dir) / "accuracy" / f"{side}-seed{seed}.json"
            if path.is_file():
                say(f"{path.name}: already done, skipped")
                continue
            rec = segment(side, seed)
            if rec is None:
                unfinished += 1
                say(f"{side} seed {seed}: not finished; run the same command again to continue")
                continue
            write_json(path, {**header("accuracy", threads), **rec})
            say(f"{path.name}: {describe(rec)} ({rec['wall_s']:.0f} s in {rec['segments']} segment(s))")
    return 3 if unfinished else 0


def accuracy_segment_run(name: str, side: str, work: Path, segment_s: float, threads: int, build_cmd,
                         say) -> tuple[int, list[dict], Path]:
    """One segment of the resumable accuracy run `name` (its `side`: "hpcbert" or "hf"): at most
    `segment_s` of training, then a checkpoint (hpcbert: HPCBERT_JOB_DEADLINE and --resume auto in
    work/hpcbert/NAME; the Trainer: its own checkpoint in work/hf-scratch/NAME and
    resume_from_checkpoint), so each call stays short and timed measurements get the machine between
    calls. `build_cmd(folder, deadline)` gives the command; a folder without a checkpoint starts
    afresh. Returns (exit status: 0 finished or 3 not yet, every segment's noise so far from
    work/progress/NAME.json, the folder); any other exit stops with the log's tail."""
    progress_path = work / "progress" / f"{name}.json"
    progress = read_json(progress_path) if progress_path.is_file() else {"segments": []}
    env = child_env(threads)
    env["HPCBERT_JOB_DEADLINE"] = str(time.time() + segment_s)
    if side == "hpcbert":
        folder = work / "hpcbert" / name
        started = (folder / "checkpoints").is_dir()
    else:
        folder = work / "hf-scratch" / name
        started = folder.is_dir() and any(folder.glob("checkpoint-*"))
    if not started:
        fresh_dir(folder)
        progress = {"segments": []}
    cmd = build_cmd(folder, env["HPCBERT_JOB_DEADLINE"])
    say(f"{name}: segment {len(progress['segments']) + 1} ({segment_s / 60:.0f} min of training at most)")
    log = work / "logs" / f"{name}.log"
    rc, noise = run_segment(cmd, log, env)
    if rc not in (0, 3):
        tail = log.read_text().splitlines()[-30:]
        sys.exit(f"{Path(sys.argv[0]).name}: {name} failed (exit {rc}):\n" + "\n".join(tail))
    progress["segments"].append(noise)
    write_json(progress_path, progress)
    return rc, progress["segments"], folder


def pair_summary(doc: dict, combos: list[tuple[str, str, str]]) -> list[dict]:
    """Per comparison (hpcbert's pair, the Trainer's pair, what it compares): the per-repeat ratio
    hpcbert / Trainer of training sequences/s, and its median; "dynamic" against "dynamic" is the headline."""
    by = {(r["pair"], r["side"], r["repeat"]): r for r in doc["runs"]}
    out = []
    for hp_pair, hf_pair, what in combos:
        reps = sorted(r for (p, side, r) in by if p == hp_pair and side == "hpcbert" and (hf_pair, "hf", r) in by)
        if not reps:
            continue
        hp = [by[(hp_pair, "hpcbert", r)] for r in reps]
        hf = [by[(hf_pair, "hf", r)] for r in reps]
        ratios = [x["steady_sequences_per_sec"] / y["steady_sequences_per_sec"] for x, y in zip(hp, hf)]
        out.append({"comparison": what, "hpcbert_label": hp[0]["label"], "hf_label": hf[0]["label"],
                    "repeats": reps, "hpcbert_seq_s": [x["steady_sequences_per_sec"] for x in hp],
                    "hf_seq_s": [y["steady_sequences_per_sec"] for y in hf], "ratios": ratios,
                    "ratio_median": statistics.median(ratios),
                    "hpcbert_padded_tokens_per_seq": statistics.mean(x["padded_tokens_per_seq"] for x in hp),
                    "hf_padded_tokens_per_seq": statistics.mean(y["padded_tokens_per_seq"] for y in hf),
                    "headline": hp_pair == hf_pair == "dynamic"})
    return out


def render_pair_throughput(doc: dict, intro: str, summary: list[dict], seq_fmt: str,
                           target: float | None = None) -> str:
    """The throughput section of the two scripts beside this one: `intro` (what was run and how it is
    timed), the pair table, the headline (equal batches, each side's dynamic padding with length
    grouping; against `target` where there is one), and every run."""
    lines = [intro, "", render_pair_table(summary, seq_fmt)]
    head = next((c for c in summary if c["headline"]), None)
    if head:
        verdict = "" if target is None else \
            f" (target ≥ {target}x): **{'MET' if head['ratio_median'] >= target else 'NOT MET'}**"
        lines += ["", f"Headline (equal batches of {doc['settings']['batch_size']}, each side's dynamic padding "
                      f"with length grouping): **{head['ratio_median']:.2f}x** the Trainer's training "
                      f"sequences/s{verdict}."]
    return "\n".join(lines + render_pair_runs(doc))


def render_pair_table(summary: list[dict], seq_fmt: str) -> str:
    from hpcbert.report import markdown_grid  # imported after use_hpcbert()
    rows = [[c["comparison"], c["hpcbert_label"], c["hf_label"], _fmt_list(c["hpcbert_seq_s"], seq_fmt),
             _fmt_list(c["hf_seq_s"], seq_fmt),
             f"{c['hpcbert_padded_tokens_per_seq']:.1f} / {c['hf_padded_tokens_per_seq']:.1f}",
             _fmt_list(c["ratios"]) + "x", f"**{c['ratio_median']:.2f}x**"] for c in summary]
    return markdown_grid(["comparison", "hpcbert", "Trainer", "hpcbert seq/s per repeat",
                          "Trainer seq/s per repeat", "padded tokens/seq hpcbert / Trainer",
                          "ratio per repeat", "ratio (median)"], rows).rstrip("\n")


def accuracy_machines(runs: list[dict], note: str = "every run in fp32, so the precision is the same on each"
                      ) -> list[str]:
    """The lines before an accuracy table: the one machine its runs were measured on, or, where they
    differ, which runs each machine measured (`note`: why the figures still compare)."""
    machines: dict[str, list[str]] = {}
    for r in sorted(runs, key=lambda r: (r["side"] != "hpcbert", r["seed"])):
        machines.setdefault(_machine_line(r, trainer_packages=False), []).append(
            f"{'hpcbert' if r['side'] == 'hpcbert' else 'Trainer'} seed {r['seed']}")
    if len(machines) == 1:
        return [f"Measured on {next(iter(machines))}.", ""]
    return ([f"Measured on more than one machine ({note}):", ""]
            + [f"- {', '.join(who)}: {line}" for line, who in machines.items()] + [""])


def render_pair_runs(doc: dict) -> list[str]:
    """After a pair table: the load on the machine, the commands, and every run in the order it ran."""
    from hpcbert.report import markdown_grid
    lines = ["", load_line(doc["runs"], doc["settings"]["threads"], doc["calls"][0]["machine"]["cores"])
             if doc["calls"] else ""]
    lines += ["", "Commands (each run with no tests or accuracy runs on the machine; the last column of the "
                  "next table measures whatever else was busy):", ""]
    lines += [f"- `{c['command']}` ({c['date']})" for c in doc["calls"]]
    lines += ["", "Every run, in the order it ran:", "", markdown_grid(
        ["pair", "repeat", "side", "seq/s", "padded tokens/seq", "other-work cores during the run"],
        [[r["pair"], str(r["repeat"]), r["label"], f"{r['steady_sequences_per_sec']:.3f}",
          f"{r['padded_tokens_per_seq']:.1f}", f"{r['noise']['other_cores_during']:.2f}"]
         for r in doc["runs"]]).rstrip("\n")]
    return lines


def render_throughput(doc: dict) -> str:
    from hpcbert.report import MISSING, markdown_grid  # imported after use_hpcbert()
    s = doc["settings"]
    task = s.get("task", TASK).upper()
    summary = throughput_summary(doc)
    lines = [f"Steady sequences/s, {task}, {MODEL}, batch {s['batch_size']}, max length {s['max_seq_length']}, "
             f"{s['threads']} threads; {s['steps']} steps per run, first {s['warmup_steps_excluded']} excluded; "
             f"{s['repeats']} interleaved repeat(s); ratio = median over repeats of hpcbert/Trainer in the same repeat. "
             f"Matched precision: **{s['matched_precision']}** ({s['matched_precision_reason']}).", ""]
    head = next((c for c in summary if c["comparison"] == "equal batches"), None)
    if head:
        lines += [f"**Equal batches: hpcbert {head['ratio_median']:.2f}x the Trainer** (median of per-repeat ratios; "
                  f"{head['ratio_best']:.2f}x best-of-repeats), both sides training on the same batches "
                  f"({'checked: the per-step token counts agree' if head['same_batches_both_sides'] else 'NOT the same batches: the per-step token counts differ'}).", ""]
        best = fastest_trainer_on_equal_batches(summary)
        if best is not head:
            lines += [f"**Against the Trainer's fastest configuration on equal batches** ({best['hf_label']}, "
                      f"median {statistics.median(best['hf_seq_s']):.2f} seq/s): **hpcbert {best['ratio_median']:.2f}x** "
                      f"({best['ratio_best']:.2f}x best-of-repeats).", ""]
    rows = []
    for c in summary:
        best = ([f"{c['hpcbert_best_seq_s']:.2f} / {c['hf_best_seq_s']:.2f}", f"{c['ratio_best']:.2f}x"]
                if c.get("ratio_best") else [MISSING, MISSING])
        rows.append([c["comparison"], c["hpcbert_label"], c["hf_label"], _fmt_list(c["hpcbert_seq_s"]),
                     _fmt_list(c["hf_seq_s"]),
                     f"{c['hpcbert_padded_tokens_per_seq']:.1f} / {c['hf_padded_tokens_per_seq']:.1f}",
                     f"**{c['ratio_median']:.2f}x**", f"{c['ratio_callback_median']:.2f}x", *best])
    lines.append(markdown_grid(
        ["comparison", "hpcbert", "Trainer", "hpcbert seq/s (per repeat)", "Trainer seq/s (per repeat)",
         "padded tokens/seq hpcbert / Trainer", "hpcbert / Trainer (median)", "same, Trainer callback span",
         "best-of-repeats seq/s hpcbert / Trainer", "hpcbert / Trainer, best-of-repeats"], rows).rstrip("\n"))
    lines += [""] + [f"- **{c['comparison']}**: {c['what']}." for c in summary]
    same = [c[k] for c in summary for k in ("hpcbert_same_batches", "hf_same_batches") if c.get(k) is not None]
    lines += ["", "Best-of-repeats: every repeat of a configuration uses the same seed, hence the same batches in "
                  "the same order; for each steady step the fastest of its repeats is taken and the figure is "
                  "sequences / the sum of those times (contention from other work only adds time, so this "
                  "estimates each side on a quiet machine). The repeats' per-step token counts "
              + ("agree for every configuration (same batches)." if same and all(same) else
                 "differ for some configuration, so best-of-repeats mixes different batches there." if same else
                 "were not recorded.")]
    hf_runs = [r for r in doc["runs"] if r["side"] == "hf"]
    if hf_runs:
        r = hf_runs[0]
        diffs = [100 * (r["callback_sequences_per_sec"] / r["steady_sequences_per_sec"] - 1) for r in hf_runs]
        lines += ["", f"Trainer runs: optim `{r['optim']}`, attention `{r['attn_implementation']}`, "
                      f"{r['threads']} torch threads, lr warm-up {r['warmup_steps']} of {r['total_steps']} steps. "
                      f"Leaving the batch fetch out of the Trainer's step (callback span) raises its seq/s by "
                      f"{min(diffs):.1f}% to {max(diffs):.1f}% in these runs."]
    hp_runs = [r for r in doc["runs"] if r["side"] == "hpcbert"]
    if hp_runs:
        lines += [f"hpcbert runs: precision resolved to "
                  f"{', '.join(sorted({r['key'] + ': ' + r['precision'] for r in hp_runs}))}; "
                  f"{hp_runs[0]['threads']} torch threads."]
    lines += ["", load_line(doc["runs"], s["threads"], doc["machine"]["cores"]), "", *doc.get("notes", [])]
    lines += ["", "Every run, in the order it ran:", "", markdown_grid(
        ["repeat", "run", "seq/s", "padded tokens/seq", "other-work cores during the run"],
        [[str(r["repeat"]), r["label"], f"{r['steady_sequences_per_sec']:.2f}",
          f"{r['padded_tokens_per_seq']:.1f}", f"{r['noise']['other_cores_during']:.2f}"] for r in doc["runs"]]).rstrip("\n")]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# accuracy
# ----------------------------------------------------------------------------------------------

def cmd_accuracy(a) -> int:
    glue = glue_root(a.data_dir)
    results, work = Path(a.results_dir), Path(a.work_dir)
    seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
    precision = a.precision or ("bf16" if native_bf16() else "fp32")
    ep = f"{a.epochs:g}"
    doc = header("accuracy", a.threads)
    doc["settings"] = {"epochs": a.epochs, "seeds": seeds, "precision": precision, "batch_size": BATCH,
                       "max_seq_length": SEQ_LEN, "lr": LR, "threads": a.threads, "data_dir": a.data_dir,
                       "hpcbert_sampler": a.hpcbert_sampler, "hf_padding": "dynamic"}
    doc["notes"] = [
        "The Trainer side uses dynamic padding (DataCollatorWithPadding): this comparison is about training "
        "equivalence, and padding does not change the maths (padded positions are masked).",
        f"hpcbert uses its {a.hpcbert_sampler} sampler; the Trainer its random sampler. Both draw the new "
        "classification head and the data order from the seed, but with different generators, so the same "
        "seed is not the same run on both sides: compare the means and spreads.",
        "LR schedule: both warm up over round(0.1 x steps) steps and decay linearly to 0; hpcbert's first "
        "step uses lr x 1/warmup, the Trainer's first step lr 0 (get_linear_schedule_with_warmup), a one-step offset.",
        "Dev F1 and accuracy on both sides come from hpcbert.data.metrics (f1_binary, accuracy) on argmax predictions.",
    ]
    doc["runs"] = []
    doc["settings"]["sides"] = sides = [x for x in a.sides.split(",") if x.strip()]
    acc_dir = results / a.name
    for seed in seeds:  # interleaved by seed so a stop part-way leaves both sides comparable
        for side in sides:
            path = acc_dir / f"{side}-e{ep}-seed{seed}.json"
            if path.is_file():
                rec = read_json(path)
                say(f"{path.name}: already done (dev f1 {rec['f1']:.4f}), skipped")
            else:
                name = f"acc-{side}-e{ep}-seed{seed}"
                if side == "hpcbert":
                    s = hpcbert_run(name, work, a.threads,
                                    hpcbert_mrpc_args(glue, precision, seed, epochs=a.epochs,
                                                      sampler=a.hpcbert_sampler, do_eval=True))
                    r = hpcbert_record(s)
                    rec = {"side": side, "seed": seed, "epochs": a.epochs, "precision": r["precision"],
                           "f1": r["eval"]["dev"]["f1"], "accuracy": r["eval"]["dev"]["accuracy"],
                           "final_loss": r["final_loss"], "steps": r["steps"], "wall_s": r["wall_s"],
                           "run_dir": r["run_dir"], "argv": r["argv"], "sampler": a.hpcbert_sampler,
                           "noise": r["noise"]}
                else:
                    r = hf_run(name, work, a.threads, glue, work / "hf-json" / f"{name}.json", padding="dynamic",
                               precision=precision, seed=seed, epochs=a.epochs, do_eval=True, optim=a.hf_optim)
                    rec = {"side": side, "seed": seed, "epochs": a.epochs, "precision": r["precision"],
                           "f1": r["eval"]["dev"]["f1"], "accuracy": r["eval"]["dev"]["accuracy"],
                           "final_loss": r["final_loss"], "steps": r["steps"], "wall_s": r["wall_s"],
                           "optim": r["optim"], "warmup_steps": r["warmup_steps"], "padding": r["padding"],
                           "noise": r["noise"]}
                rec["date"] = doc["date"]
                rec["hpcbert_source"] = HPCBERT_SRC.get("note")
                write_json(path, rec)
                say(f"{path.name}: dev f1 {rec['f1']:.4f}, accuracy {rec['accuracy']:.4f} ({rec['wall_s']:.0f} s)")
            doc["runs"].append(rec)
            doc["complete"] = False
            write_json(results / f"{a.name}.json", doc)
    doc["complete"] = True
    write_json(results / f"{a.name}.json", doc)
    print(render_accuracy(doc))
    return 0


def render_accuracy(doc: dict) -> str:
    from hpcbert.report import format_value, markdown_grid, mean_std  # imported after use_hpcbert()
    s = doc["settings"]
    runs = doc["runs"]
    lines = [f"MRPC dev, {MODEL}, {s['epochs']:g} epochs, batch {s['batch_size']}, lr {s['lr']:g}, precision "
             f"{s['precision']}, seeds {', '.join(map(str, s['seeds']))}"
             + ("" if doc.get("complete") else " — INCOMPLETE: not every run has finished") + ".", ""]
    rows, stats = [], {}
    src = doc["machine"].get("hpcbert_source", {}).get("note")
    for side, label in (("hpcbert", f"hpcbert ({s['hpcbert_sampler']} sampler{'; ' + src if src else ''})"),
                        ("hf", "transformers.Trainer (dynamic padding)")):
        rs = sorted((r for r in runs if r["side"] == side), key=lambda r: r["seed"])
        if not rs:
            continue
        f1m, f1s = mean_std([100 * r["f1"] for r in rs])
        am, asd = mean_std([100 * r["accuracy"] for r in rs])
        losses = [r["final_loss"] for r in rs if r.get("final_loss") is not None]
        stats[side] = (f1m, am)
        per_seed = ", ".join(f"{r['seed']}: {100 * r['f1']:.2f}" for r in rs)
        rows.append([label, str(len(rs)), per_seed, f"{f1m:.2f} ± {f1s:.2f}", f"{am:.2f} ± {asd:.2f}",
                     format_value(statistics.mean(losses) if losses else None, "{:.4f}")])
    lines.append(markdown_grid(["side", "runs", "dev F1 per seed", "dev F1 mean ± std", "dev accuracy mean ± std",
                                "final train loss mean"], rows).rstrip("\n"))
    if len(stats) == 2:
        lines += ["", f"Difference hpcbert − Trainer: F1 {stats['hpcbert'][0] - stats['hf'][0]:+.2f} points, "
                      f"accuracy {stats['hpcbert'][1] - stats['hf'][1]:+.2f} points (std is the sample std over seeds)."]
    walls = {side: [r["wall_s"] for r in runs if r["side"] == side] for side in ("hpcbert", "hf")}
    lines += ["", "Wall time per run (process start to exit, evaluation included): " + "; ".join(
        f"{side} {statistics.mean(w):.0f} s mean" for side, w in walls.items() if w) + ". "
        + load_line(runs, s["threads"], doc["machine"]["cores"])]
    lines += ["", *doc.get("notes", [])]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# policies
# ----------------------------------------------------------------------------------------------

def cmd_policies(a) -> int:
    """The runs `hpcbert bench` makes (synthetic task, dynamic padding, length-grouped sampler, the
    same seed, so step i trains on the same batch in every run), each policy in processes of its
    own, on a training set of --epoch-batches batches passed over --passes times; only the last pass
    is compared, the statistic is the bench's (best of repeats per step).

    Why passes: a fresh process's heap grows through its first steps, every new batch shape paying
    page faults for memory it has not touched yet, and `none`, which allocates the most, pays the
    most (steps 3 to 10 of a minilm-l6 run: ~120,000 faults under none, ~70,000 under all; the same
    batches again in the same process: ~23,000 and ~0). A 10-step run compares policies in that
    growth and puts all/none ~5% below the steady state a long run (and the bench) is in. With the
    same few batches every pass (the length-grouped sampler sorts the whole set in one mega-batch,
    so each pass has the same batch shapes), the last pass runs on a grown heap."""
    if a.passes < 2 or a.epoch_batches < 1:
        raise SystemExit(f"compare_hf.py policies: --passes {a.passes} --epoch-batches {a.epoch_batches}; accepted: "
                         "--passes 2 or more (the last pass is compared, after the others grew the heap) and "
                         "--epoch-batches 1 or more")
    results, work = Path(a.results_dir), Path(a.work_dir)
    models = [m for m in a.models.split(",") if m.strip()]
    precision = a.precision or ("bf16" if native_bf16() else "fp32")  # what hpcbert's auto resolves to here
    doc = header("policies", a.threads)
    steps, excluded = a.epoch_batches * a.passes, a.epoch_batches * (a.passes - 1)
    doc["settings"] = {"models": {m: POLICY_MODELS[m] for m in models}, "max_seq_length": SEQ_LEN,
                       "epoch_batches": a.epoch_batches, "passes": a.passes,
                       "steps": steps, "warmup_steps_excluded": excluded, "repeats": a.repeats,
                       "threads": a.threads, "task": "synthetic", "precision": precision,
                       "policies": list(POLICIES)}
    doc["notes"] = [
        "Activation bytes per sequence: the run's summary (storages created during forward and alive at its end, "
        "at length 128, batch 2 minus batch 1); deterministic, so the repeats agree.",
        "Step times: the synthetic task's sequences have random lengths (8 to 128) and hpcbert computes on real "
        "tokens only, so steps differ in work; every run uses the same seed, hence the same batches in the same "
        "order (checked: the per-step token counts agree), and runs log every step (--log-every 1, outside the "
        "timed step). A policy's time vs none = sum over the compared steps of each step's fastest time over the "
        "repeats, over the same sum for none (`hpcbert.bench.best_of_repeats`, the statistic `hpcbert bench` uses).",
        f"Each run trains {a.passes} passes (--epochs) over a set of {a.epoch_batches} batches "
        "(--synthetic-train-size = that many batches); the length-grouped sampler sorts so small a set in one "
        "mega-batch, so every pass has the same batch shapes in its own order. Only the last pass is compared: "
        "through its first steps a fresh process's heap grows, each new shape paying page faults for untouched "
        "memory, and none, which allocates the most, pays the most; by the last pass every shape has run twice.",
        "bert-base has random weights (throughput shape only).",
        noise_note(a),
    ]
    doc["settings"].update(wait_quiet_s=a.wait_quiet, noisy_cores=a.noisy, retries=a.retries)
    doc["runs"] = []
    for rep in range(1, a.repeats + 1):
        for model in models:
            order = list(POLICIES[(rep - 1) % len(POLICIES):]) + list(POLICIES[:(rep - 1) % len(POLICIES)])
            for policy in order:
                name = f"pol-{model}-{policy}-r{rep}"
                args = ["--task", "synthetic", "--model", model, "--max-seq-length", str(SEQ_LEN), "--batch-size",
                        str(POLICY_MODELS[model]), "--max-steps", str(steps), "--no-do-eval", "--no-save-model",
                        "--synthetic-train-size", str(a.epoch_batches * POLICY_MODELS[model]),
                        "--warmup-steps-excluded", str(excluded), "--grad-ckpt", policy,
                        "--seed", str(SEED), "--log-every", "1", "--epochs", str(a.passes), "--lr", "5e-05"]
                if a.precision:
                    args += ["--precision", a.precision]
                rec = measured(lambda: hpcbert_record(hpcbert_run(name, work, a.threads, args, a.wait_quiet)), a)
                rec.update(repeat=rep, model=model, policy=policy, batch_size=POLICY_MODELS[model])
                doc["runs"].append(rec)
                say(f"  {name}: {rec['steady_step_time_s']:.3f} s/step (median), "
                    f"{rec['activation_bytes_per_sequence'] / 2**20:.1f} MiB/seq "
                    f"(other work: {rec['noise']['other_cores_during']:.2f} cores)")
                write_json(results / f"policies-{precision}.json", doc)
    print(render_policies(doc))
    return 0


def cmd_compile(a) -> int:
    """hpcbert with --compile on against off: steady throughput (best of repeats per step, the same
    batches in every run), the compile time (the first steps' time beyond the steady step time),
    and how far the losses of the two drift apart (dropout on: compiled dropout draws its masks
    with another generator, so equal losses are not expected; tests/test_trainer.py shows them
    equal without dropout)."""
    glue = glue_root(a.data_dir, a.task)
    results, work = Path(a.results_dir), Path(a.work_dir)
    precision = a.precision or ("bf16" if native_bf16() else "fp32")
    doc = header("compile", a.threads)
    doc["settings"] = {"task": a.task, "steps": a.steps, "warmup_steps_excluded": a.warmup_excluded,
                       "repeats": a.repeats, "precision": precision, "batch_size": BATCH, "sampler": "random",
                       "threads": a.threads}
    doc["notes"] = [noise_note(a)]
    doc["settings"].update(wait_quiet_s=a.wait_quiet, noisy_cores=a.noisy, retries=a.retries)
    doc["runs"] = []
    for rep in range(1, a.repeats + 1):
        for mode in (("off", "on") if rep % 2 else ("on", "off")):
            name = f"compile-{a.task}-{mode}-r{rep}"
            args = hpcbert_mrpc_args(glue, precision, SEED, max_steps=a.steps, sampler="random",
                                     warmup_excluded=a.warmup_excluded, log_every=1, task=a.task)
            rec = measured(lambda: hpcbert_record(hpcbert_run(name, work, a.threads, [*args, "--compile", mode],
                                                              a.wait_quiet)), a)
            from hpcbert.runfiles import read_metrics
            rec.update(repeat=rep, compile=mode,
                       losses=[m["loss"] for m in read_metrics(ROOT / rec["run_dir"])])
            doc["runs"].append(rec)
            say(f"  {name}: {rec['steady_sequences_per_sec']:.2f} seq/s")
            write_json(results / throughput_file(a.task, precision).replace("throughput-", "compile-"), doc)
    print(render_compile(doc))
    return 0


def render_compile(doc: dict) -> str:
    from hpcbert.bench import best_of_repeats
    from hpcbert.report import markdown_grid
    s = doc["settings"]
    w = s["warmup_steps_excluded"]
    rows, best = [], {}
    for mode in ("off", "on"):
        rs = [r for r in doc["runs"] if r["compile"] == mode]
        n = min(len(r["step_times"]) for r in doc["runs"])
        b = best_of_repeats([r["step_times"] for r in rs], w, n)
        seqs = sum(rs[0]["step_sequences"][w:n])
        best[mode] = (seqs / sum(b), b)
        first = [sum(r["step_times"][:w]) - w * statistics.median(r["step_times"][w:]) for r in rs]
        rows.append([mode, _fmt_list([r["steady_sequences_per_sec"] for r in rs]), f"{best[mode][0]:.2f}",
                     _fmt_list(first, "{:.1f}"), _fmt_list([r["wall_s"] for r in rs], "{:.0f}")])
    on = [r["losses"] for r in doc["runs"] if r["compile"] == "on"]
    off = [r["losses"] for r in doc["runs"] if r["compile"] == "off"]
    drift = max(abs(x - y) for a, b in zip(on, off) for x, y in zip(a, b))
    ratio = best["on"][0] / best["off"][0]
    lines = [f"hpcbert `--compile on` against `off`, {s['task'].upper()}, {MODEL}, batch {s['batch_size']}, "
             f"random sampler (the same batches in every run), {s['precision']}, {s['threads']} threads, "
             f"{s['steps']} steps per run, first {w} untimed, {s['repeats']} interleaved repeats.", "",
             f"**compile on / off: {ratio:.2f}x steady throughput** (best of repeats per step); "
             f"`--compile auto` on {'CPU' if not doc['machine'].get('cuda') else 'CUDA'}: "
             f"{'on' if ratio > 1.02 else 'off'} by this measurement.", "",
             markdown_grid(["compile", "steady seq/s (per repeat)", "best-of-repeats seq/s",
                            f"compile time s: first {w} steps beyond the steady step time (per repeat)",
                            "process wall s (per repeat)"], rows).rstrip("\n"), "",
             f"Largest loss difference between an `on` and an `off` run at the same step: {drift:.2e} (dropout on; "
             f"compiled dropout draws other masks). Without dropout the losses are equal within 1e-5 "
             f"(tests/test_trainer.py::test_compile_trains_the_same_losses_as_eager).", "",
             load_line(doc["runs"], s["threads"], doc["machine"]["cores"]), "", *doc.get("notes", [])]
    return "\n".join(lines)


def cmd_breakdown(a) -> int:
    """Where a training step's time goes, per model and precision, measured in this process: forward,
    backward and optimizer step of hpcbert's model at length 128, with dropout as configured and with
    every dropout probability set to 0. Full recomputation repeats the forward (dropout masks included,
    replayed from the saved RNG state), so forward / step is what checkpointing every layer can cost."""
    import dataclasses

    import torch

    from hpcbert import policies
    from hpcbert.model import BertForSequenceClassification
    from hpcbert.optim import make_optimizer
    from hpcbert.config import RunConfig
    from hpcbert.zoo import resolve

    torch.set_num_threads(a.threads)
    results = Path(a.results_dir)
    models = [m for m in a.models.split(",") if m.strip()]
    precisions = [x for x in a.precisions.split(",") if x.strip()]
    doc = header("breakdown", a.threads)
    doc["settings"] = {"models": {m: POLICY_MODELS[m] for m in models}, "precisions": precisions,
                       "max_seq_length": SEQ_LEN, "repeats": a.repeats, "threads": a.threads}
    doc["rows"] = []
    dev = torch.device("cpu")
    wait_quiet(a.wait_quiet)
    for model in models:
        src = resolve(model)
        B = POLICY_MODELS[model]
        g = torch.Generator().manual_seed(SEED)
        ids = torch.randint(1000, 20000, (B, SEQ_LEN), generator=g)
        mask, types = torch.ones_like(ids), torch.zeros_like(ids)
        labels = torch.randint(0, 2, (B,), generator=g)
        for precision in precisions:
            for dropout in (True, False):
                cfg = dataclasses.replace(src.config, num_labels=2)
                if not dropout:
                    cfg = dataclasses.replace(cfg, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
                torch.manual_seed(SEED)
                m = BertForSequenceClassification(cfg).train()
                opt = make_optimizer(RunConfig(), m, 2e-5, dev)
                times = {"forward": [], "backward": [], "optimizer": []}
                for i in range(2 + a.repeats):  # the first two are warm-up
                    t0 = time.perf_counter()
                    with policies.autocast(precision, dev):
                        loss = m.loss_sum(m(ids, mask, types), labels) / B
                    t1 = time.perf_counter()
                    loss.backward()
                    t2 = time.perf_counter()
                    torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_GRAD_NORM)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    t3 = time.perf_counter()
                    if i >= 2:
                        for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                            times[k].append(dt)
                med = {k: statistics.median(v) for k, v in times.items()}
                row = {"model": model, "batch_size": B, "precision": precision, "dropout": dropout,
                       **{f"{k}_s": v for k, v in med.items()}, "step_s": sum(med.values())}
                row["forward_share_of_step"] = med["forward"] / row["step_s"]
                doc["rows"].append(row)
                say(f"  breakdown {model} {precision} dropout={'on' if dropout else 'off'}: forward "
                    f"{med['forward']:.3f} s, backward {med['backward']:.3f} s, optimizer {med['optimizer']:.3f} s "
                    f"(forward {100 * row['forward_share_of_step']:.0f}% of the step)")
                write_json(results / "breakdown.json", doc)
    print(render_breakdown(doc))
    return 0


def render_breakdown(doc: dict) -> str:
    from hpcbert.report import MISSING, markdown_grid  # imported after use_hpcbert()
    s = doc["settings"]
    lines = [f"hpcbert's model in this process, length 128, {s['threads']} threads, batch: "
             + ", ".join(f"{m} {b}" for m, b in s["models"].items())
             + f"; median of {s['repeats']} steps after 2 untimed first steps. Forward / step is the time full "
             "recomputation adds to a step (checkpointing every layer reruns the forward of every layer, "
             "dropout masks redrawn from the saved RNG state), so `all` costs about 1 + that share (on CPU a little "
             "less: each layer's recomputation but the last's stops before its feed-forward's second matmul, "
             "policies.py; `alternate`, which reruns only the attention of every second layer, well under half "
             "of that). Random weights (the time does not depend on their values).", ""]
    rows = doc["rows"]
    cells = []
    for r in rows:
        off = next((x for x in rows if x["model"] == r["model"] and x["precision"] == r["precision"]
                    and not x["dropout"]), None)
        rel = f"{r['forward_s'] / off['forward_s']:.2f}x" if (r["dropout"] and off) else MISSING
        cells.append([r["model"], r["precision"], "on (0.1)" if r["dropout"] else "off", f"{r['forward_s']:.3f}",
                      f"{r['backward_s']:.3f}", f"{r['optimizer_s']:.3f}", f"{r['forward_share_of_step']:.2f}", rel])
    lines.append(markdown_grid(["model", "precision", "dropout", "forward s", "backward s", "optimizer s",
                                "forward / step", "forward with dropout / without"], cells).rstrip("\n"))
    return "\n".join(lines)


def policies_summary(doc: dict) -> list[dict]:
    from hpcbert.bench import best_of_repeats  # the statistic hpcbert bench uses
    runs = doc["runs"]
    out = []
    for model in doc["settings"]["models"]:
        by = {(r["policy"], r["repeat"]): r for r in runs if r["model"] == model}
        pols = [p for p in doc["settings"].get("policies", POLICIES) if any(k[0] == p for k in by)]
        mine = [r for r in runs if r["model"] == model]
        w = max(r["warmup_steps_excluded"] for r in mine)
        n = min(len(r["step_times"]) for r in mine)
        best = {p: best_of_repeats([by[k]["step_times"] for k in by if k[0] == p], w, n) for p in pols}
        for policy in pols:
            rr = sorted(rep for (p, rep) in by if p == policy)
            tokens = [by[(policy, i)]["step_real_tokens"][:n] for i in rr]
            row = {"model": model, "policy": policy, "repeats": rr, "steps_compared": [w + 1, n],
                   "batch_size": by[(policy, rr[0])]["batch_size"],
                   "activation_bytes_per_sequence": by[(policy, rr[0])]["activation_bytes_per_sequence"],
                   "bytes_ratio": by[(policy, rr[0])]["activation_bytes_per_sequence"]
                                  / by[("none", rr[0])]["activation_bytes_per_sequence"],
                   "best_step_s": sum(best[policy]) / len(best[policy]),
                   "time_ratio": sum(best[policy]) / sum(best["none"]),
                   "median_step_s": [by[(policy, i)]["steady_step_time_s"] for i in rr],
                   "same_batches": all(t == tokens[0] for t in tokens) and
                                   all(by[(p, i)]["step_real_tokens"][:n] == tokens[0] for p in pols for i in rr),
                   "precision": by[(policy, rr[0])]["precision"]}
            if policy in POLICY_TARGETS:
                tb, tt = POLICY_TARGETS[policy]
                row.update(target_bytes=tb, target_time=tt, bytes_ok=row["bytes_ratio"] <= tb,
                           time_ok=row["time_ratio"] <= tt)
            out.append(row)
    return out


def render_policies(doc: dict) -> str:
    from hpcbert.report import MISSING, markdown_grid  # imported after use_hpcbert()
    s = doc["settings"]
    summary = policies_summary(doc)
    lines = [f"hpcbert, synthetic task (random lengths up to 128, computed unpadded), {s['threads']} threads, "
             + (f"{s['passes']} passes over {s['epoch_batches']} batches ({s['steps']} steps) per run, the last "
                f"pass compared" if "passes" in s else f"{s['steps']} steps per run")
             + f", {s['repeats']} interleaved repeat(s); batch: "
             + ", ".join(f"{m} {b}" for m, b in s["models"].items()) + "; compared steps: "
             + ", ".join(f"{r['model']} {r['steps_compared'][0]}..{r['steps_compared'][1]}"
                         for r in summary if r["policy"] == "none")
             + f" (the same batches in every run: {'checked' if all(r['same_batches'] for r in summary) else 'NO'}).",
             ""]
    rows = []
    for r in summary:
        if "target_bytes" in r:
            tgt = f"≤ {r['target_bytes']:.2f}x bytes, ≤ {r['target_time']:.2f}x time"
            miss = [w for w, ok in (("bytes", r["bytes_ok"]), ("time", r["time_ok"])) if not ok]
            verdict = "**PASS**" if not miss else f"**MISS ({', '.join(miss)})**"
        else:
            tgt = verdict = MISSING
        rows.append([r["model"], r["policy"], f"{r['activation_bytes_per_sequence'] / 2**20:.2f}",
                     f"**{r['bytes_ratio']:.2f}x**", f"{r['best_step_s']:.3f}", f"**{r['time_ratio']:.2f}x**",
                     _fmt_list(r["median_step_s"], "{:.3f}"), tgt, verdict])
    lines.append(markdown_grid(
        ["model", "policy", "activation MiB/seq", "bytes vs none", "best-of-repeats step s", "time vs none",
         "median step s (per repeat)", "target", "verdict"], rows).rstrip("\n"))
    lines += ["", load_line(doc["runs"], s["threads"], doc["machine"]["cores"]), "", *doc.get("notes", [])]
    lines += ["", "Every run, in the order it ran:", "", markdown_grid(
        ["repeat", "model", "policy", "median step s", "mean step s", "other-work cores during the run"],
        [[str(r["repeat"]), r["model"], r["policy"], f"{r['steady_step_time_s']:.3f}", f"{r['mean_step_time_s']:.3f}",
          f"{r['noise']['other_cores_during']:.2f}"] for r in doc["runs"]]).rstrip("\n")]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# render
# ----------------------------------------------------------------------------------------------

def _machine_line(doc: dict, trainer_packages: bool = True) -> str:
    """The machine and software a result was measured with; without `trainer_packages`, accelerate and
    datasets are left out (runs that differ only in them group together)."""
    m = doc["machine"]
    dev = f", GPU {m['cuda']}" if m.get("cuda") else ""
    extra = f", accelerate {m['accelerate']}" if trainer_packages else ""
    if trainer_packages and m.get("datasets"):  # recorded where installed; the worker does not need it
        extra += f", datasets {m['datasets']}"
    return (f"{m['cpu']}, {m['cores']} cores, {m['threads']} threads per run{dev}; native bf16: "
            f"{'yes' if m['native_bf16'] else 'no'}; Python {m['python']}, torch {m['torch']}, transformers "
            f"{m['transformers']}{extra}; hpcbert: "
            f"{m.get('hpcbert_source', {}).get('note') or m.get('git_commit') or 'unknown'}")


def render_readme(results: Path) -> str:
    """results/compare_hf/README.md from the JSON files in `results`; nothing measured here, so
    rendering again gives the same text (tests/test_report.py::test_benchmark_readme_is_fresh)."""
    results = Path(results)
    sections = [(throughput_title(p), p.name, render_throughput)
                for p in sorted(results.glob("throughput-*.json"))] or [("Throughput", "throughput-mrpc.json",
                                                                          render_throughput)]
    sections += [("Accuracy" + ("" if p.stem == "accuracy" else f" ({p.stem.split('-', 1)[1]})"), p.name,
                  render_accuracy) for p in sorted(results.glob("accuracy*.json"))]
    for path in sorted(results.glob("policies-*.json")) or [results / "policies-bf16.json"]:
        prec = path.stem.split("-", 1)[1]
        sections.append((f"Gradient-checkpointing policies (hpcbert only), {prec}", path.name, render_policies))
    sections += [(throughput_title(p).replace("Throughput", "torch.compile"), p.name, render_compile)
                 for p in sorted(results.glob("compile-*.json"))]
    sections.append(("Where a step's time goes (why recomputation costs what it does)", "breakdown.json",
                     render_breakdown))
    out = ["# hpcbert vs the Hugging Face Trainer",
           "",
           "Generated by `python benchmarks/compare_hf.py render` from the JSON files in this folder; every "
           "figure comes from the runs the commands below started. Per-run hpcbert directories and logs are "
           "under `runs/compare_hf/` (not committed).",
           ""]
    return "\n".join(out + render_sections(results, sections))


def render_sections(results: Path, sections) -> list[str]:
    """README sections of this script and the two beside it: per (title, JSON file name, render function)
    the heading, where the file was measured (a file of one command: that command and its date; a file
    of interleaved calls: its first and last call's dates) and what the function makes of the file;
    "Not measured yet" where the file is missing or holds no run yet."""
    out = []
    for title, fname, fn in sections:
        out += [f"## {title}", ""]
        path = results / fname
        doc = read_json(path) if path.is_file() else None
        if doc is None or ("command" not in doc and not doc.get("calls")):
            out += [f"Not measured yet (`{fname}` {'is missing' if doc is None else 'holds no run'}).", ""]
            continue
        if "command" in doc:
            out += ["```", doc["command"], "```", "", f"Measured {doc['date']} on {_machine_line(doc)}.", ""]
        else:
            out += [f"Measured {doc['calls'][0]['date']} to {doc['calls'][-1]['date']} on "
                    f"{_machine_line(doc['calls'][0])}.", ""]
        out += [fn(doc), ""]
    return out


def accuracy_section(results: Path, render) -> list[str]:
    """The accuracy section's body in the two scripts beside this one: the machines of the runs in
    accuracy/*.json and `render`'s table of them, or "Not measured yet"."""
    runs = [read_json(p) for p in sorted((results / "accuracy").glob("*.json"))]
    if not runs:
        return ["Not measured yet (`accuracy/*.json` is missing).", ""]
    return accuracy_machines(runs) + [render(runs), ""]


def script_main(argv: list[str] | None, *, description: str, hf_worker, add_commands, results: Path, render,
                check=None) -> int:
    """The command line of this script and the two beside it: the hidden `_hf-worker` (one Trainer run
    in its own process), the commands `add_commands(subparsers)` adds, and `render` (README.md in
    `results` from its JSON files); the hpcbert the runs use is chosen (use_hpcbert) before `check(args)`
    and the command run. The worker imports the hpcbert its parent chose, from child_env's PYTHONPATH
    (use_hpcbert(None) there would put this checkout's BERT/ before a --hpcbert-rev tree)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_hf-worker":
        return hf_worker(argv[1:])
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    add_commands(sub)
    r = sub.add_parser("render", help=f"write {Path(results).relative_to(ROOT)}/README.md from the JSON files")
    r.add_argument("--results-dir", default=str(results))
    r.set_defaults(fn=lambda a: write_readme(a.results_dir, render))
    a = p.parse_args(argv)
    use_hpcbert(getattr(a, "hpcbert_rev", None))
    if check is not None:
        check(p, a)
    return a.fn(a)


def write_readme(results_dir: str, render) -> int:
    """`render` command of this script and the two beside it: README.md in the results folder, from its JSON."""
    text = render(Path(results_dir))
    (Path(results_dir) / "README.md").write_text(text)
    print(text)
    return 0


# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------

def add_noise_options(sp) -> None:
    """The noise control of the interleaved comparisons (throughput, policies, compile): wait_quiet before
    a run, `measured` around it."""
    sp.add_argument("--wait-quiet", type=float, default=120,
                    help="before each run, wait up to this many seconds for other work to use < 0.3 cores "
                         "(0: do not wait; default: %(default)s)")
    sp.add_argument("--noisy", type=float, default=0.5,
                    help="a run during which other work kept more cores than this busy on average is run "
                         "again (default: %(default)s)")
    sp.add_argument("--retries", type=int, default=1, help="at most this many re-runs of a noisy run (default: %(default)s)")


def add_commands(sub) -> None:
    def common(sp, data=True):
        if data:
            sp.add_argument("--data-dir", default=DEFAULT_DATA,
                            help="MRPC folder (train.tsv, dev.tsv) or a GLUE directory holding MRPC/ "
                                 "(default: %(default)s, relative to the project root)")
        sp.add_argument("--results-dir", default=str(DEFAULT_RESULTS), help="where the JSON files go (default: %(default)s)")
        sp.add_argument("--work-dir", default=str(DEFAULT_WORK),
                        help="run directories, logs and Trainer scratch (default: %(default)s)")
        sp.add_argument("--threads", type=int, default=THREADS, help="torch threads per run, both sides (default: %(default)s)")
        sp.add_argument("--hpcbert-rev", default=None,
                        help="run the hpcbert of this git commit (extracted with git archive) instead of the "
                             "working tree's BERT/, so concurrent edits cannot change the code mid-benchmark")

    t = sub.add_parser("throughput", help="steady seq/s, hpcbert vs Trainer, interleaved repeats")
    common(t)
    t.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default: %(default)s)")
    t.add_argument("--warmup-excluded", type=int, default=5, help="first steps left out, both sides (default: %(default)s)")
    t.add_argument("--repeats", type=int, default=2, help="interleaved repeats (default: %(default)s)")
    t.add_argument("--matched-precision", choices=("fp32", "bf16"), default=None,
                   help="precision of the 'matched' comparison (default: bf16 where the device has native bf16, else fp32)")
    t.add_argument("--hf-optim", default=None, help="TrainingArguments.optim (default: the Trainer's default)")
    t.add_argument("--task", default=TASK, choices=tuple(TASK_FOLDERS),
                   help="GLUE task (default: %(default)s); results go to throughput-TASK.json (fp32) or "
                        "throughput-TASK-bf16.json, and a rerun with "
                        "more --repeats keeps the runs already there (same settings and hpcbert commit)")
    add_noise_options(t)
    t.set_defaults(fn=cmd_throughput)

    c = sub.add_parser("accuracy", help="MRPC dev F1/accuracy after N epochs, per seed, both sides (resumable)")
    common(c)
    c.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (default: %(default)s)")
    c.add_argument("--epochs", type=float, default=3.0, help="training epochs (default: %(default)s)")
    c.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="both sides (default: bf16 where the device has native bf16, else fp32)")
    c.add_argument("--hpcbert-sampler", default="length-grouped", choices=("length-grouped", "random"),
                   help="hpcbert's sampler (default: %(default)s, its default)")
    c.add_argument("--hf-optim", default=None, help="TrainingArguments.optim (default: the Trainer's default)")
    c.add_argument("--sides", default="hpcbert,hf", help="which sides run (default: %(default)s)")
    c.add_argument("--name", default="accuracy",
                   help="result set: NAME.json and NAME/ per run (default: %(default)s); another name keeps "
                        "another set beside it (e.g. one --hpcbert-rev against another)")
    c.set_defaults(fn=cmd_accuracy)

    q = sub.add_parser("policies", help="hpcbert checkpointing policies: activation bytes and step time vs none")
    common(q, data=False)
    q.add_argument("--models", default=",".join(POLICY_MODELS), help="comma-separated (default: %(default)s)")
    q.add_argument("--epoch-batches", type=int, default=10,
                   help="batches in the training set each run passes over (default: %(default)s)")
    q.add_argument("--passes", type=int, default=3,
                   help="passes over it per run; only the last is compared (default: %(default)s)")
    q.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default: %(default)s)")
    add_noise_options(q)
    q.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="hpcbert --precision (default: its own auto, bf16 where the CPU has native bf16); "
                        "the results go to policies-<precision>.json")
    q.set_defaults(fn=cmd_policies)

    b = sub.add_parser("breakdown", help="forward / backward / optimizer time per step, dropout on and off")
    common(b, data=False)
    b.add_argument("--models", default=",".join(POLICY_MODELS), help="comma-separated (default: %(default)s)")
    b.add_argument("--precisions", default="fp32,bf16", help="comma-separated (default: %(default)s)")
    b.add_argument("--repeats", type=int, default=5, help="timed steps per configuration (default: %(default)s)")
    b.add_argument("--wait-quiet", type=float, default=120,
                   help="wait up to this many seconds for a quiet machine first (default: %(default)s)")
    b.set_defaults(fn=cmd_breakdown)

    k = sub.add_parser("compile", help="hpcbert --compile on vs off: steady seq/s, compile time, loss drift")
    common(k)
    k.add_argument("--task", default=TASK, choices=tuple(TASK_FOLDERS))
    k.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default: %(default)s)")
    k.add_argument("--warmup-excluded", type=int, default=5, help="first steps left out (default: %(default)s)")
    k.add_argument("--repeats", type=int, default=2, help="interleaved repeats (default: %(default)s)")
    k.add_argument("--precision", choices=("fp32", "bf16"), default=None)
    add_noise_options(k)
    k.set_defaults(fn=cmd_compile)


def check_models(p, a) -> None:
    if getattr(a, "models", None):
        unknown = [m for m in a.models.split(",") if m.strip() and m not in POLICY_MODELS]
        if unknown:
            p.error(f"--models: unknown {unknown}; accepted: {', '.join(POLICY_MODELS)}")


def main(argv: list[str] | None = None) -> int:
    return script_main(argv, description=__doc__, hf_worker=hf_worker, add_commands=add_commands,
                       results=DEFAULT_RESULTS, render=render_readme, check=check_models)


if __name__ == "__main__":
    sys.exit(main())
