"""Run directories -> validated runs, and the runs that cannot be read with a one-line reason each.

A run is a dict: label (unique display name), name, path (as given), dir (resolved), rel (path below
the folder it was found in, '.' for a run given directly), summary, config, metrics. Beyond the
run-directory contract that `runfiles` checks (schema version, every key present, one JSON object
per metrics line), this module checks the types the tables rely on, so that a broken run is skipped
with a reason naming its file and key, never a traceback in the middle of a table.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..runfiles import (RunDirError, is_real, one_line, read_json_object, read_metrics, read_summary,
                        short_repr)

# Summary keys read as numbers: a string or a boolean there is a broken summary. null is allowed
# (not measured) and so is NaN (undefined, e.g. a correlation of constant predictions); both show
# as missing. Infinity is not a measurement.
NUMERIC_KEYS = ("steady_steps_per_sec", "steady_sequences_per_sec", "tokens_per_sec", "steady_step_time_s",
                "startup_s", "steps_in_budget", "sequences_in_budget", "activation_bytes_per_sequence",
                "peak_memory_bytes", "mfu", "final_loss", "time_budget_s")
POSITIVE_INT_KEYS = ("world_size", "nodes", "gpus_per_node", "max_seq_length", "grad_accum",
                     "global_batch_size")
# Keys whose values name things: compared and sorted across runs, so they must be text.
TEXT_KEYS = ("task", "model", "precision", "grad_ckpt", "optimizer", "main_metric")


def is_run_dir(path: str | os.PathLike) -> bool:
    """A run directory holds summary.json (finished) or at least config.json (started); a bench's
    finished interleaved measurement (config.json beside interleaved.json) is not a run: its
    figures are the bench's table (bench.md one folder up)."""
    p = Path(path)
    if is_interleaved_dir(p):
        return False
    return (p / "summary.json").is_file() or (p / "config.json").is_file()


def is_interleaved_dir(path: Path) -> bool:
    return (path / "interleaved.json").is_file() and not (path / "summary.json").is_file()


def find_run_dirs(path: str | os.PathLike) -> list[Path]:
    """`path` when it is a run directory, else the run directories below it (sorted; the search
    does not descend into runs, whose checkpoints/ are not runs, nor into hidden folders)."""
    path = Path(path)
    if is_run_dir(path):
        return [path]
    found: list[Path] = []
    for root, dirs, _files in os.walk(path):
        dirs.sort()
        keep = []
        for d in dirs:
            if d.startswith("."):
                continue
            if is_run_dir(Path(root) / d):
                found.append(Path(root) / d)
            else:
                keep.append(d)
        dirs[:] = keep
    return sorted(found)


def load_runs(paths: Iterable[str | os.PathLike]) -> tuple[list[dict], list[tuple[str, str]]]:
    """Read every run directory given or found below the given folders.

    Returns (runs, skipped); each skipped entry is (path, reason), the reason one line naming the
    run's file and what is wrong with it.
    """
    return load_runs_as([(str(Path(p)), Path(p)) for p in paths])


def load_runs_as(args: Sequence[tuple[str, Path]]) -> tuple[list[dict], list[tuple[str, str]]]:
    """load_runs with the name each path is shown under: [(shown, path)]."""
    runs: list[dict] = []
    skipped: list[tuple[str, str]] = []
    seen: set[Path] = set()
    for shown, path in args:
        if not path.exists():
            skipped.append((shown, f"{shown}: does not exist"))
            continue
        if not path.is_dir():
            skipped.append((shown, f"{shown}: not a directory (give a run directory or a folder of runs)"))
            continue
        dirs = find_run_dirs(path)
        if not dirs and is_interleaved_dir(path):
            skipped.append((shown, f"{shown}: the interleaved measurement of `hpcbert bench`, not a run: "
                                   f"its table is bench.md in the folder above"))
        elif not dirs:
            skipped.append((shown, f"{shown}: not an hpcbert run (no summary.json or config.json) "
                                   f"and no run directories below it"))
        for d in dirs:
            if d.resolve() in seen:
                continue
            seen.add(d.resolve())
            rel = d.relative_to(path).as_posix()
            display = shown if rel == "." else f"{shown.rstrip('/')}/{rel}"
            try:
                run = read_run(d)
            except RunDirError as e:
                skipped.append((display, str(e).replace(str(d), display)))
                continue
            run.update(path=display, rel=rel)
            runs.append(run)
    assign_labels(runs)
    return runs, skipped


def read_run(d: Path) -> dict:
    """One run directory, validated; RunDirError (one line, naming the file) otherwise."""
    if not (d / "summary.json").is_file():
        raise RunDirError(f"{d}: no summary.json: the run has not finished (still running, crashed "
                          f"or killed)")
    summary = read_summary(d)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise RunDirError(f"{d}: no config.json (the resolved config is needed to group seeds)")
    config = read_json_object(cfg_path)
    check_summary(d / "summary.json", summary)
    metrics = read_metrics(d, required=("step", "loss"))
    return {"label": d.resolve().name, "name": d.resolve().name, "dir": str(d.resolve()),
            "summary": summary, "config": config, "metrics": metrics}


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_measure(v: Any) -> bool:
    """A number the tables can hold: finite, or NaN (undefined; shown like null)."""
    return is_real(v) and not math.isinf(v)


def _is_count(v: Any, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and least <= v < 2**53


def check_summary(path: Path, s: dict) -> None:
    """Beyond read_summary's key check: the types the report relies on, and the headline metric."""
    def bad(key: str, expected: str) -> RunDirError:
        return RunDirError(f"{path}: {key} is {short_repr(s[key])}; expected {expected}")

    for key in NUMERIC_KEYS:
        if s[key] is not None and not _is_measure(s[key]):
            raise bad(key, "a finite number or null")
    for key in POSITIVE_INT_KEYS:
        if not _is_count(s[key], 1):
            raise bad(key, "a positive integer")
    if not _is_count(s["steps"], 0):
        raise bad("steps", "a non-negative integer")
    if s["warmup_steps_excluded"] is not None and not _is_count(s["warmup_steps_excluded"], 0):
        raise bad("warmup_steps_excluded", "a non-negative integer or null")
    for key in TEXT_KEYS:
        if not isinstance(s[key], str):
            raise bad(key, "a string")
    b = s["per_device_batch_size"]
    if not (_is_count(b, 1) or (isinstance(b, list) and b and all(_is_count(x, 1) for x in b))):
        raise bad("per_device_batch_size", "a positive integer or a non-empty list of them")
    ev = s["eval"]
    if not isinstance(ev, dict) or not all(isinstance(m, dict) for m in ev.values()):
        raise bad("eval", "{split: {metric: value}}")
    for split, metrics in ev.items():
        for name, value in metrics.items():
            if value is not None and not _is_measure(value):
                raise RunDirError(f"{path}: eval.{split}.{name} is {short_repr(value)}; expected a finite "
                                  f"number or null")
    compiles = s.get("compile_steps")  # the caption's compile line reads each {step, step_s}
    if compiles is not None and not (isinstance(compiles, list) and all(
            isinstance(c, dict) and _is_count(c.get("step"), 1) and _is_measure(c.get("step_s")) for c in compiles)):
        raise bad("compile_steps", "null or a list of {step: a positive integer, step_s: seconds}")
    main = s["main_metric"]
    if ev and not any(main in m for m in ev.values()):
        have = "; ".join(f"{sp}: {', '.join(sorted(m)) or 'nothing'}" for sp, m in sorted(ev.items()))
        raise RunDirError(f"{path}: missing metric {short_repr(main)} (the task's main_metric) in eval "
                          f"({one_line(have)})")


def assign_labels(runs: list[dict]) -> None:
    """Directory names, or the path where two runs share a name."""
    counts = Counter(r["name"] for r in runs)
    for r in runs:
        r["label"] = r["name"] if counts[r["name"]] == 1 else r["path"]


def hardware_label(hw: Any) -> str:
    """A short name for summary['hardware']: the device name, or the CPU model and cores on CPU."""
    if not isinstance(hw, dict):
        return one_line(str(hw)) if hw else "unknown"
    # meters.hardware(): {hostname, cpu, cores, threads, device_type, device, device_count}.
    # The host name is left out: seeds of one configuration may run on different nodes.
    name = hw.get("device") or hw.get("cpu") or "unknown"
    if hw.get("device_type", "cpu") == "cpu" and hw.get("cores"):
        return one_line(f"{name}, {hw['cores']} cores")
    return one_line(str(name))
