"""Run directories -> result tables (Markdown, CSV, JSON) and a self-contained HTML report.

    hpcbert report RUN_DIR|FOLDER... [--baseline RUN_DIR] [--format md|csv|html|json] [--out FILE]

Reads only the files of the run directory contract (`runfiles.py`): summary.json, config.json and
metrics.jsonl. One table row per run, or per group of runs that differ only in their seed (mean ±
sample standard deviation). Every table carries a caption that states what is fixed across its rows
and how throughput was measured. A run that cannot be read is skipped with a reason naming it; the
others are still reported.

    load_runs(paths)              -> (runs, skipped)
    build_table(runs, baseline)   -> pandas.DataFrame (caption in .attrs["caption"])
    render_markdown / render_csv / render_json / render_html
    render_results_readme(dir)    -> the text of results/README.md
    bench_report(run_dirs, html)  -> Markdown table of a grad_ckpt policy comparison (+ HTML file)
    cli(argv)                     -> exit code of `hpcbert report`
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import html
import io
import json
import math
import os
import re
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from .runfiles import RunDirError, read_json_object, read_metrics, read_summary

README_COMMAND = "hpcbert report {d}/ --format md --out {d}/README.md"
MISSING = "—"  # how a null / unmeasured figure is shown in Markdown and HTML

# config.json fields that may differ inside a seed group.
SEED_GROUP_IGNORES = ("out", "seed")

# Measured columns: (column, summary key, scale, decimals shown in md/html). Mean and sample std are
# kept over a seed group; `x_std` columns appear when any row groups several seeds.
MEASURED: list[tuple[str, str, float, int]] = [
    ("steps_per_s", "steady_steps_per_sec", 1.0, 3),
    ("seq_per_s", "steady_sequences_per_sec", 1.0, 1),
    ("tokens_per_s", "tokens_per_sec", 1.0, 0),
    ("step_time_ms", "steady_step_time_s", 1e3, 1),
    ("startup_s", "startup_s", 1.0, 1),
    ("steps_in_budget", "steps_in_budget", 1.0, 0),
    ("seq_in_budget", "sequences_in_budget", 1.0, 0),
    ("act_MiB_per_seq", "activation_bytes_per_sequence", 1.0 / 2**20, 2),
    ("peak_mem_GiB", "peak_memory_bytes", 1.0 / 2**30, 2),
    ("mfu_pct", "mfu", 100.0, 2),
]
DERIVED_DECIMALS = {"final_loss": 4, "speedup": 2, "scaling_eff": 2, "act_vs_none": 2,
                    "step_time_vs_none": 2}
METRIC_DECIMALS = 4

DESCRIPTIVE = ["run", "seeds", "seed", "task", "model", "seq_len", "precision", "compile", "hardware",
               "nodes_x_gpus", "world_size", "per_device_batch", "grad_accum", "global_batch",
               "grad_ckpt", "optimizer"]

COLUMN_DOCS = {
    "run": "run directory name (a seed group: the name with its seed removed)",
    "seeds": "runs in the row (runs that differ only in seed are one row)",
    "seed": "their seeds",
    "seq_len": "max_seq_length (truncation length)",
    "precision": "precision actually used",
    "compile": "torch.compile used",
    "hardware": "device name (on CPU: CPU model and cores)",
    "nodes_x_gpus": "nodes x devices (processes) per node",
    "world_size": "processes",
    "per_device_batch": "micro-batch per device (a/b/... when ranks differ)",
    "grad_accum": "micro-batches per optimizer step",
    "global_batch": "sequences per optimizer step over all ranks",
    "grad_ckpt": "gradient checkpointing policy",
    "steps_per_s": "steady-state optimizer steps per second",
    "seq_per_s": "steady-state training sequences per second (all ranks)",
    "tokens_per_s": "steady-state real (non-pad) tokens per second",
    "step_time_ms": "median steady-state step time",
    "startup_s": "seconds from process start to the first training step",
    "steps_in_budget": "optimizer steps finished inside the time budget",
    "seq_in_budget": "sequences of those steps",
    "act_MiB_per_seq": "activation memory saved for backward per sequence at max_seq_length (MiB)",
    "peak_mem_GiB": "peak memory (GiB; kind in the caption)",
    "mfu_pct": "model FLOPs utilisation, % of the device's peak at the precision used",
    "final_loss": "mean training loss over the last logged window",
    "speedup": "seq_per_s / the baseline's seq_per_s",
    "scaling_eff": "speedup / (world_size / the baseline's world_size), where world sizes differ",
    "act_vs_none": "act_MiB_per_seq / that of grad_ckpt none with otherwise equal settings",
    "step_time_vs_none": "step time / that of grad_ckpt none with otherwise equal settings (same batch "
                         "and world size): median of per-step ratios over the steady steps both logged "
                         "(same seed, so the same batches), else the ratio of median step times",
}

# Keys read as numbers: a string or a boolean there is a broken summary (null is allowed: unmeasured).
_NUMERIC_KEYS = [key for _, key, _, _ in MEASURED] + [
    "final_loss", "max_seq_length", "grad_accum", "global_batch_size", "time_budget_s",
    "warmup_steps_excluded", "world_size", "nodes", "gpus_per_node"]
_REQUIRED_INT_KEYS = ("world_size", "nodes", "gpus_per_node", "max_seq_length", "grad_accum",
                      "global_batch_size")


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def is_run_dir(path: str | os.PathLike) -> bool:
    """A run directory holds summary.json (finished) or at least config.json (started)."""
    p = Path(path)
    return (p / "summary.json").is_file() or (p / "config.json").is_file()


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

    Returns (runs, skipped). Each run is a dict: label (unique display name), path (as given),
    dir (resolved), rel (path below the folder it was found in, '.' for a run given directly),
    summary, config, metrics. Each skipped entry is (path, reason); the reason names the run and
    what is wrong with it.
    """
    return _load_runs([(str(Path(p)), Path(p)) for p in paths])


def _load_runs(args: Sequence[tuple[str, Path]]) -> tuple[list[dict], list[tuple[str, str]]]:
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
        if not dirs:
            skipped.append((shown, f"{shown}: not an hpcbert run (no summary.json or config.json) "
                                   f"and no run directories below it"))
        for d in dirs:
            if d.resolve() in seen:
                continue
            seen.add(d.resolve())
            rel = d.relative_to(path).as_posix()
            display = shown if rel == "." else f"{shown.rstrip('/')}/{rel}"
            try:
                run = _read_run(d)
            except RunDirError as e:
                skipped.append((display, str(e).replace(str(d), display)))
                continue
            run.update(path=display, rel=rel)
            runs.append(run)
    _assign_labels(runs)
    return runs, skipped


def _read_run(d: Path) -> dict:
    if not (d / "summary.json").is_file():
        raise RunDirError(f"{d}: no summary.json: the run has not finished (still running, crashed "
                          f"or killed)")
    summary = read_summary(d)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise RunDirError(f"{d}: no config.json (the resolved config is needed to group seeds)")
    config = read_json_object(cfg_path)
    _check_summary(d / "summary.json", summary)
    metrics = read_metrics(d)
    for i, rec in enumerate(metrics, 1):
        missing = [k for k in ("step", "loss") if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise RunDirError(f"{d / 'metrics.jsonl'}: record {i}: missing key(s) {', '.join(missing)}")
    return {"label": d.resolve().name, "name": d.resolve().name, "dir": str(d.resolve()),
            "summary": summary, "config": config, "metrics": metrics}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_summary(path: Path, s: dict) -> None:
    """Beyond read_summary's key check: types the report relies on, and the headline metric."""
    for key in _NUMERIC_KEYS:
        if s[key] is not None and not _is_number(s[key]):
            raise RunDirError(f"{path}: {key} is {s[key]!r}; expected a number or null")
    for key in _REQUIRED_INT_KEYS:
        if not isinstance(s[key], int) or isinstance(s[key], bool) or s[key] < 1:
            raise RunDirError(f"{path}: {key} is {s[key]!r}; expected a positive integer")
    b = s["per_device_batch_size"]
    if not (_is_number(b) or (isinstance(b, list) and b and all(_is_number(x) for x in b))):
        raise RunDirError(f"{path}: per_device_batch_size is {b!r}; expected an integer or a list of them")
    ev = s["eval"]
    if not isinstance(ev, dict) or not all(isinstance(m, dict) for m in ev.values()):
        raise RunDirError(f"{path}: eval is {ev!r}; expected {{split: {{metric: value}}}}")
    for split, metrics in ev.items():
        for name, value in metrics.items():
            if value is not None and not _is_number(value):
                raise RunDirError(f"{path}: eval.{split}.{name} is {value!r}; expected a number or null")
    main = s["main_metric"]
    if ev and not any(main in m for m in ev.values()):
        have = "; ".join(f"{sp}: {', '.join(sorted(m)) or 'nothing'}" for sp, m in sorted(ev.items()))
        raise RunDirError(f"{path}: missing metric {main!r} (the task's main_metric) in eval ({have})")


def _assign_labels(runs: list[dict]) -> None:
    """Directory names, or the path where two runs share a name."""
    counts = Counter(r["name"] for r in runs)
    for r in runs:
        r["label"] = r["name"] if counts[r["name"]] == 1 else r["path"]


def hardware_label(hw: Any) -> str:
    """A short name for summary['hardware']: the device name, or the CPU model and cores on CPU."""
    if not isinstance(hw, dict):
        return str(hw) if hw else "unknown"
    # meters.hardware(): {hostname, cpu, cores, threads, device_type, device, device_count}.
    # The host name is left out: seeds of one configuration may run on different nodes.
    name = hw.get("device") or hw.get("cpu") or "unknown"
    if hw.get("device_type", "cpu") == "cpu" and hw.get("cores"):
        return f"{name}, {hw['cores']} cores"
    return str(name)


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

def _config_defaults() -> dict[str, Any]:
    from hpcbert.config import RunConfig

    return {f.name: f.default for f in dataclasses.fields(RunConfig)
            if f.default is not dataclasses.MISSING}


def _group_key(run: dict) -> str:
    """Everything that defines a run except its seed: the config without out/seed, plus how it
    was launched and on what (not in config.json: world size, nodes, resolved precision, device)."""
    s = run["summary"]
    # A field that a run's hpcbert did not have yet counts as its default (a new option's default
    # keeps the old behaviour), so runs from before and after its addition still group.
    cfg = {k: v for k, v in {**_config_defaults(), **run["config"]}.items() if k not in SEED_GROUP_IGNORES}
    launch = {k: s[k] for k in ("task", "model", "max_seq_length", "precision", "compile", "grad_ckpt",
                                "optimizer", "world_size", "nodes", "gpus_per_node",
                                "per_device_batch_size", "grad_accum", "global_batch_size")}
    launch["hardware"] = hardware_label(s["hardware"])
    return json.dumps([cfg, launch], sort_keys=True, default=str)


def policy_rank(policy: str) -> float:
    """Fraction of layers checkpointed, for ordering: none < every:4 < alternate = every:2 < all."""
    if policy == "none":
        return 0.0
    if policy == "all":
        return 1.0
    if policy == "alternate":
        return 0.5
    m = re.fullmatch(r"every:(\d+)", policy)
    return 1.0 / int(m.group(1)) if m else 2.0


def _sort_key(s: dict, label: str) -> tuple:
    return (s["task"], s["model"], s["max_seq_length"], hardware_label(s["hardware"]), s["world_size"],
            s["nodes"], policy_rank(s["grad_ckpt"]), s["grad_ckpt"], s["global_batch_size"],
            str(s["per_device_batch_size"]), s["precision"], bool(s["compile"]), s["optimizer"], label)


def _grouped(runs: Sequence[dict]) -> list[list[dict]]:
    """Seed groups in table order; the runs inside a group ordered by seed."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(_group_key(r), []).append(r)
    def by_seed(r: dict) -> tuple:
        seed = r["summary"]["seed"]
        return (0, seed, r["label"]) if _is_number(seed) else (1, str(seed), r["label"])

    out = [sorted(g, key=by_seed) for g in groups.values()]
    return sorted(out, key=lambda g: _sort_key(g[0]["summary"], _group_label(g)))


def _group_label(group: Sequence[dict]) -> str:
    """One run: its label. Several seeds: the shared name with the seed taken out."""
    labels = [r["label"] for r in group]
    if len(group) == 1:
        return labels[0]
    stripped = set()
    for r in group:
        seed = re.escape(str(r["summary"]["seed"]))
        label = r["label"]
        new = re.sub(rf"(^|[-_.])(seed|s)[-_=]?0*{seed}(?=$|[-_./])", r"\1", label)
        if new == label:
            new = re.sub(rf"[-_.]0*{seed}$", "", label)
        stripped.add(re.sub(r"[-_.]{2,}", "-", new).strip("-_."))
    if len(stripped) == 1 and "" not in stripped:
        return stripped.pop()
    prefix = os.path.commonprefix(labels).rstrip("-_.=")
    prefix = re.sub(r"[-_.](seed|s)$", "", prefix)
    return prefix if len(prefix) >= 3 else f"{labels[0]} (+{len(labels) - 1})"


def _scaled(v: Any, scale: float = 1.0) -> float:
    return float("nan") if v is None else float(v) * scale


def _batch_text(b: Any) -> Any:
    if isinstance(b, list):
        return int(b[0]) if len(set(b)) == 1 else "/".join(str(int(x)) for x in b)
    return int(b)


def _metric_columns(runs: Sequence[dict]) -> dict[tuple[str, str], str]:
    """(split, metric) -> column name: bare metric names when 'dev' is the only split."""
    pairs = sorted({(sp, m) for r in runs for sp, ms in r["summary"]["eval"].items() for m in ms})
    mains = {r["summary"]["main_metric"] for r in runs}
    bare = {sp for sp, _ in pairs} <= {"dev"}
    # 'loss' alone would read like the training loss: it stays 'dev/loss'.
    taken = set(DESCRIPTIVE) | {c for c, *_ in MEASURED} | set(DERIVED_DECIMALS) | {"loss"}
    names = {}
    for sp, m in sorted(pairs, key=lambda p: (p[1] not in mains, p[0] != "dev", p[0], p[1])):
        name = m if bare and m not in taken else f"{sp}/{m}"
        names[(sp, m)] = name
    return names


def _mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample std (ddof=1) over the values that are not NaN."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan")
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else float("nan"))


def _run_values(run: dict, metric_names: dict[tuple[str, str], str]) -> dict[str, float]:
    s = run["summary"]
    vals = {col: _scaled(s[key], scale) for col, key, scale, _ in MEASURED}
    for (sp, m), col in metric_names.items():
        vals[col] = _scaled(s["eval"].get(sp, {}).get(m))
    vals["final_loss"] = _scaled(s["final_loss"])
    return vals


def _as_list(baseline: dict | Sequence[dict] | None) -> list[dict]:
    if baseline is None:
        return []
    return [baseline] if isinstance(baseline, dict) else list(baseline)


def _policy_keys(s: dict) -> tuple[str, str]:
    """Keys of the 'none' run a policy is compared with: activation bytes per sequence do not depend
    on batch or world size; step time does."""
    coarse = json.dumps([s["task"], s["model"], s["max_seq_length"], s["precision"], bool(s["compile"]),
                         hardware_label(s["hardware"]), s["num_layers"], s["hidden_size"]], default=str)
    fine = json.dumps([coarse, s["world_size"], s["nodes"], s["per_device_batch_size"], s["grad_accum"]],
                      default=str)
    return coarse, fine


def _logged_step_times(r: dict) -> dict[int, float]:
    """step -> that step's time, for the logged steady steps of a run (after its warm-up)."""
    w = r["summary"].get("warmup_steps_excluded") or 0
    return {m["step"]: m["step_time_s"] for m in r["metrics"]
            if m.get("step", 0) > w and _is_number(m.get("step_time_s")) and m["step_time_s"] > 0}


def _same_step_ratio(r: dict, refs: Sequence[dict], min_steps: int = 3) -> float | None:
    """Step time of a checkpointed run over that of its 'none' runs, on the same batches: the median of
    per-step ratios over the steady steps both logged, with 'none' runs of the same seed (same seed,
    same batch order). A time-boxed run of a slower policy does fewer steps, and with variable lengths
    (length-grouped order puts a mega-batch's longest batches first) its steady window would hold
    other batches than the reference's; step-by-step ratios compare like with like. None when fewer
    than `min_steps` common steps exist (the caller falls back to the ratio of median step times)."""
    mine = _logged_step_times(r)
    ratios = []
    for ref in refs:
        if ref["summary"]["seed"] != r["summary"]["seed"]:
            continue
        theirs = _logged_step_times(ref)
        common = sorted(set(mine) & set(theirs))
        if len(common) >= min_steps:
            ratios.append(float(np.median([mine[k] / theirs[k] for k in common])))
    return float(np.mean(ratios)) if ratios else None


def build_table(runs: Sequence[dict], baseline: dict | Sequence[dict] | None = None, *,
                policy_columns: bool = False) -> pd.DataFrame:
    """One row per seed group (runs equal in everything but seed and out dir), sorted.

    Measured columns hold the mean over the group; `<col>_std` (sample std, ddof=1) follows each of
    them when some row has several seeds. With a baseline (one run, or a list whose values are
    averaged): speedup = seq_per_s / baseline seq_per_s, and scaling_eff = speedup / (world_size /
    baseline world_size) where world sizes differ. policy_columns adds act_vs_none and
    step_time_vs_none (ratios to grad_ckpt 'none' with otherwise equal settings). The caption lines
    are in table.attrs["caption"].
    """
    if not runs:
        raise ValueError("build_table: no runs to tabulate")
    metric_names = _metric_columns(runs)
    values = {r["dir"]: _run_values(r, metric_names) for r in runs}
    base = _as_list(baseline)
    base_seq = base_ws = float("nan")
    if base:
        base_seq, _ = _mean_std(_scaled(b["summary"]["steady_sequences_per_sec"]) for b in base)
        base_ws = base[0]["summary"]["world_size"]
        for r in runs:
            v, ws = values[r["dir"]], r["summary"]["world_size"]
            v["speedup"] = v["seq_per_s"] / base_seq if base_seq else float("nan")
            v["scaling_eff"] = v["speedup"] / (ws / base_ws) if ws != base_ws else float("nan")
    if policy_columns:
        none_act: dict[str, list[float]] = {}
        none_runs: dict[str, list[dict]] = {}
        for r in runs:
            if r["summary"]["grad_ckpt"] == "none":
                coarse, fine = _policy_keys(r["summary"])
                none_act.setdefault(coarse, []).append(values[r["dir"]]["act_MiB_per_seq"])
                none_runs.setdefault(fine, []).append(r)
        for r in runs:
            coarse, fine = _policy_keys(r["summary"])
            v = values[r["dir"]]
            ref_act = _mean_std(none_act.get(coarse, []))[0]
            ref_step = _mean_std(values[n["dir"]]["step_time_ms"] for n in none_runs.get(fine, []))[0]
            v["act_vs_none"] = v["act_MiB_per_seq"] / ref_act if ref_act else float("nan")
            same = _same_step_ratio(r, none_runs.get(fine, []))
            v["step_time_vs_none"] = same if same is not None else (
                v["step_time_ms"] / ref_step if ref_step else float("nan"))

    measured = [c for c, *_ in MEASURED] + list(metric_names.values()) + ["final_loss"]
    scaling = bool(base) and any(r["summary"]["world_size"] != base_ws for r in runs)
    if base:
        measured += ["speedup", "scaling_eff"] if scaling else ["speedup"]
    if policy_columns:
        measured += ["act_vs_none", "step_time_vs_none"]

    groups = _grouped(runs)
    rows = []
    for g in groups:
        s = g[0]["summary"]
        row: dict[str, Any] = {
            "run": _group_label(g), "seeds": len(g), "seed": ",".join(str(r["summary"]["seed"]) for r in g),
            "task": s["task"], "model": s["model"], "seq_len": s["max_seq_length"],
            "precision": s["precision"], "compile": bool(s["compile"]),
            "hardware": hardware_label(s["hardware"]), "nodes_x_gpus": f"{s['nodes']}x{s['gpus_per_node']}",
            "world_size": s["world_size"], "per_device_batch": _batch_text(s["per_device_batch_size"]),
            "grad_accum": s["grad_accum"], "global_batch": s["global_batch_size"],
            "grad_ckpt": s["grad_ckpt"], "optimizer": s["optimizer"],
        }
        for col in measured:
            row[col], row[f"{col}_std"] = _mean_std(values[r["dir"]][col] for r in g)
        rows.append(row)
    with_std = any(len(g) > 1 for g in groups)
    columns = list(DESCRIPTIVE)
    for col in measured:
        columns += [col, f"{col}_std"] if with_std else [col]
    table = pd.DataFrame(rows, columns=columns)
    if table["per_device_batch"].map(type).nunique() > 1:  # mixed ints and 'a/b' texts
        table["per_device_batch"] = table["per_device_batch"].astype(str)
    table.attrs["caption"] = _caption(runs, table, base, base_seq, base_ws, scaling, policy_columns)
    return table


def _constant(values: Iterable[Any]) -> Any | None:
    vals = {json.dumps(v, sort_keys=True, default=str) for v in values}
    return json.loads(next(iter(vals))) if len(vals) == 1 else None


def _caption(runs: Sequence[dict], table: pd.DataFrame, base: list[dict], base_seq: float,
             base_ws: float, scaling: bool, policy_columns: bool) -> list[str]:
    """Sentences: what is fixed across the rows, how throughput was measured, what ± means."""
    sums = [r["summary"] for r in runs]
    fixed = []
    for col, what in (("task", "task"), ("model", "model"), ("seq_len", "max_seq_length"),
                      ("precision", "precision"), ("compile", "compile"), ("hardware", "hardware"),
                      ("nodes_x_gpus", "nodes x GPUs"), ("optimizer", "optimizer"),
                      ("grad_ckpt", "grad_ckpt"), ("global_batch", "global batch")):
        v = _constant(table[col].tolist())
        if v is None:
            continue
        if col == "compile":
            v = "on" if v else "off"
        if col == "model":
            rnd = _constant(s["model_is_random"] for s in sums)
            v = f"{v} ({'random init' if rnd else 'pretrained'})" if rnd is not None else v
        fixed.append(f"{what} {v}")
    budget = _constant(s["time_budget_s"] for s in sums)
    if budget is not None:
        fixed.append(f"time budget {budget:g} s from process start")
    lines = [("Fixed across rows: " + "; ".join(fixed) + ".") if fixed else "Nothing is fixed across rows."]

    method = _merge_texts([str(s["throughput_method"]) for s in sums])
    warm = sorted({s["warmup_steps_excluded"] for s in sums}, key=str)
    lines.append(f"Throughput: {method}" + ("" if method.endswith(".") else "."))
    lines.append("Warm-up steps excluded from the steady figures: "
                 + ", ".join(str(w) for w in warm) + ".")
    kinds = sorted({str(s["peak_memory_kind"]) for s in sums})
    lines.append(f"Peak memory: {', '.join(kinds)}.")
    splits = sorted({sp for s in sums for sp in s["eval"]})
    mains = sorted({s["main_metric"] for s in sums if s["eval"]})
    if splits:
        lines.append(f"Dev metrics on split(s) {', '.join(splits)}; headline metric "
                     f"{', '.join(mains)}.")
    else:
        lines.append("No run was evaluated.")
    if int(table["seeds"].max()) > 1:
        lines.append("Runs that differ only in seed are one row: mean ± sample std (ddof=1) over "
                     "`seeds` runs.")
    if base:
        names = ", ".join(sorted(b["label"] for b in base))
        lines.append(f"speedup = seq_per_s / {base_seq:.1f} seq/s of baseline {names} (world size "
                     f"{base_ws})" + (f"; scaling_eff = speedup / (world_size / {base_ws}), where "
                                      f"world sizes differ." if scaling else "."))
    if policy_columns:
        lines.append("act_vs_none, step_time_vs_none: ratio to grad_ckpt none with otherwise equal "
                     "settings (step time: same batch and world size; where both runs logged the same steady "
                     "steps with the same seed, the median of per-step ratios over those steps, so both sides "
                     "time the same batches).")
    return lines


def _merge_texts(texts: Sequence[str]) -> str:
    """One text for texts that differ only in their numbers (a step range such as 'steps 11..N'):
    the numbers that differ become N. Texts that differ otherwise are joined with ' | '."""
    uniq = sorted(set(texts))
    if len(uniq) == 1:
        return uniq[0]
    parts = [re.split(r"(\d+(?:\.\d+)?)", t) for t in uniq]  # [text, number, text, ..., text]
    n = len(parts[0])
    if any(len(p) != n for p in parts) or any(len({p[i] for p in parts}) > 1 for i in range(0, n, 2)):
        return " | ".join(uniq)
    merged = "".join(parts[0][i] if len({p[i] for p in parts}) == 1 else "N" for i in range(n))
    return f"{merged} (N differs between runs)"


def caption_text(table: pd.DataFrame) -> str:
    return " ".join(table.attrs.get("caption", []))


# ---------------------------------------------------------------------------------------------
# Renderers
# ---------------------------------------------------------------------------------------------

def _decimals(col: str) -> int:
    for c, _, _, d in MEASURED:
        if c == col:
            return d
    return DERIVED_DECIMALS.get(col, METRIC_DECIMALS)


def _fmt(v: float, decimals: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return MISSING
    text = f"{v:.{decimals}f}"
    return text[1:] if re.fullmatch(r"-0(\.0*)?", text) else text  # no '-0.0'


def display_columns(table: pd.DataFrame) -> list[str]:
    """Columns shown in Markdown and HTML: the std columns are folded into 'mean ± std'."""
    return [c for c in table.columns if not (c.endswith("_std") and c[:-4] in table.columns)]


def _numeric_display(table: pd.DataFrame, col: str) -> bool:
    return f"{col}_std" in table.columns or col in DERIVED_DECIMALS or (
        pd.api.types.is_float_dtype(table[col]) and col not in DESCRIPTIVE)


def format_cell(table: pd.DataFrame, i: int, col: str) -> str:
    """How one cell reads in Markdown and HTML (fixed decimals per column; no locale)."""
    v = table[col].iloc[i]
    if _numeric_display(table, col):
        d = _decimals(col)
        text = _fmt(v, d)
        std_col = f"{col}_std"
        if std_col in table.columns and table["seeds"].iloc[i] > 1 and not math.isnan(table[std_col].iloc[i]):
            text += f" ± {_fmt(table[std_col].iloc[i], d)}"
        return text
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return MISSING
    return str(v)


def markdown_table(table: pd.DataFrame) -> str:
    cols = display_columns(table)
    right = [_numeric_display(table, c) or pd.api.types.is_integer_dtype(table[c]) for c in cols]
    lines = ["| " + " | ".join(cols) + " |",
             "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    for i in range(len(table)):
        cells = [format_cell(table, i, c).replace("|", "\\|") for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _skipped_md(skipped: Sequence[tuple[str, str]]) -> str:
    if not skipped:
        return ""
    return (f"**Skipped runs** ({len(skipped)}):\n\n"
            + "".join(f"- {reason}\n" for _, reason in skipped) + "\n")


def render_markdown(table: pd.DataFrame, skipped: Sequence[tuple[str, str]] = (), *,
                    number: int | None = None) -> str:
    """Caption paragraph, the table, and the skipped runs with their reasons."""
    head = f"**Table {number}.** " if number is not None else "**Table.** "
    return head + caption_text(table) + "\n\n" + markdown_table(table) + "\n" + _skipped_md(skipped)


def render_csv(table: pd.DataFrame, skipped: Sequence[tuple[str, str]] = ()) -> str:
    """The table with a header row; caption and skipped runs as '# ' comment lines above it."""
    comments = [f"# {line}" for line in table.attrs.get("caption", [])]
    comments += [f"# skipped: {reason}" for _, reason in skipped]
    body = table.to_csv(index=False, lineterminator="\n")
    return "\n".join(comments) + ("\n" if comments else "") + body


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):  # numpy scalar
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def render_json(table: pd.DataFrame, skipped: Sequence[tuple[str, str]] = ()) -> str:
    """{"caption": str, "rows": [{column: value}], "skipped": [{"run", "reason"}]}; NaN is null."""
    rows = [{c: _jsonable(table[c].iloc[i]) for c in table.columns} for i in range(len(table))]
    doc = {"caption": caption_text(table), "rows": rows,
           "skipped": [{"run": run, "reason": reason} for run, reason in skipped]}
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


def _glossary(tables: Sequence[pd.DataFrame]) -> list[tuple[str, str]]:
    """(column, meaning) for the columns shown in the tables; dev metrics as one entry."""
    present = {c for t in tables for c in display_columns(t)}
    out = [(c, doc) for c, doc in COLUMN_DOCS.items() if c in present]
    metric_cols = sorted(present - set(COLUMN_DOCS) - set(DESCRIPTIVE))
    if metric_cols:
        out.append((", ".join(metric_cols), "dev metric(s) from summary.json eval (split/metric where "
                                            "there is a split other than dev)"))
    return out


def _glossary_md(tables: Sequence[pd.DataFrame]) -> str:
    return "".join(f"- `{c}`: {doc}\n" for c, doc in _glossary(tables))


# ---------------------------------------------------------------------------------------------
# results/README.md
# ---------------------------------------------------------------------------------------------

def _auto_baseline(runs: Sequence[dict]) -> list[dict] | None:
    """Where world sizes differ within a table: the seed group of the smallest world size
    (grad_ckpt none first, then table order)."""
    if len({r["summary"]["world_size"] for r in runs}) < 2:
        return None
    groups = _grouped(runs)
    smallest = min(g[0]["summary"]["world_size"] for g in groups)
    candidates = [g for g in groups if g[0]["summary"]["world_size"] == smallest]
    return min(candidates, key=lambda g: (g[0]["summary"]["grad_ckpt"] != "none", candidates.index(g)))


def _table_sets(runs: Sequence[dict]) -> list[tuple[str, str, list[dict]]]:
    """(section, subtitle, runs): one section per sub-folder (runs at the top level first), one
    table per (task, model, hardware) inside it."""
    sections: dict[str, list[dict]] = {}
    for r in runs:
        parts = r["rel"].split("/")
        sections.setdefault(parts[0] if len(parts) > 1 else "", []).append(r)
    out = []
    for section in sorted(sections):
        sets: dict[tuple[str, str, str], list[dict]] = {}
        for r in sections[section]:
            s = r["summary"]
            sets.setdefault((s["task"], s["model"], hardware_label(s["hardware"])), []).append(r)
        for key in sorted(sets):
            out.append((section, " · ".join(key) if len(sets) > 1 else "", sets[key]))
    return out


def _results_readme(results_dir: str | os.PathLike) -> tuple[str, list[tuple[str, str]]]:
    results_dir = Path(results_dir)
    name = results_dir.resolve().name
    command = README_COMMAND.format(d=name)
    runs, skipped = _load_runs([(name, results_dir)])
    if not runs:
        why = "; ".join(reason for _, reason in skipped)
        raise RunDirError(f"{name}/: no hpcbert runs to report ({why}). Put run directories (with "
                          f"summary.json and config.json) under {name}/ and regenerate with `{command}`")
    parts = [
        f"# Results\n\nGenerated by `hpcbert report` from the run directories under `{name}/`; do not "
        f"edit by hand. Regenerate it from the project root with\n\n    {command}\n\n"
        f"(`tests/test_report.py::test_results_readme_is_fresh` fails when it is stale.)\n"]
    tables = []
    current = None
    for number, (section, subtitle, subset) in enumerate(_table_sets(runs), 1):
        if section != current:
            current = section
            parts.append(f"\n## {name}/{section + '/' if section else ''}\n")
        if subtitle:
            parts.append(f"\n### {subtitle}\n")
        several_policies = len({r["summary"]["grad_ckpt"] for r in subset}) > 1
        table = build_table(subset, _auto_baseline(subset), policy_columns=several_policies)
        tables.append(table)
        parts.append("\n" + render_markdown(table, number=number).rstrip("\n") + "\n")
    others = sorted(p for p in results_dir.glob("*/README.md") if not is_run_dir(p.parent))
    if others:  # measurements that benchmark scripts render themselves (not run directories)
        parts.append("\n## Other measurements\n\n" + "".join(
            f"- [`{name}/{p.parent.name}/`]({p.parent.name}/README.md): {_title(p)}\n" for p in others))
    parts.append("\n## Columns\n\n" + _glossary_md(tables))
    if skipped:
        parts.append("\n## Skipped runs\n\n" + "".join(f"- {reason}\n" for _, reason in skipped))
    return "".join(parts), skipped


def _title(readme: Path) -> str:
    for line in readme.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return readme.parent.name


def render_results_readme(results_dir: str | os.PathLike) -> str:
    """The whole results/README.md: title, the command that regenerates it, one captioned table per
    sub-folder and (task, model, hardware), a column glossary and the skipped runs. Deterministic:
    sorted rows, fixed decimals, paths relative to the folder, no timestamps. Raises RunDirError when
    the folder holds no readable run."""
    return _results_readme(results_dir)[0]


# ---------------------------------------------------------------------------------------------
# Plots (matplotlib Figure objects on the Agg canvas; no pyplot global state)
# ---------------------------------------------------------------------------------------------

def _png_base64(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(width: float = 8.0, height: float = 4.5) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _finite(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _series_label(key: dict, varying: set[str]) -> str:
    return ", ".join(f"{k} {key[k]}" for k in sorted(varying)) or "measured"


def plot_scaling(table: pd.DataFrame) -> tuple[str | None, str]:
    """Steady seq/s vs world size per configuration, against ideal linear scaling from the
    smallest world size. Returns (png_base64 or None, note)."""
    series_cols = ["task", "model", "seq_len", "precision", "compile", "hardware", "grad_ckpt",
                   "optimizer", "per_device_batch", "grad_accum"]
    series: dict[str, dict] = {}
    for i in range(len(table)):
        if not _finite(table["seq_per_s"].iloc[i]):
            continue
        key = {c: _jsonable(table[c].iloc[i]) for c in series_cols}
        entry = series.setdefault(json.dumps(key, default=str), {"key": key, "points": {}})
        std = table["seq_per_s_std"].iloc[i] if "seq_per_s_std" in table.columns else float("nan")
        entry["points"].setdefault(int(table["world_size"].iloc[i]), []).append(
            (float(table["seq_per_s"].iloc[i]), float(std)))
    usable = [e for e in series.values() if len(e["points"]) >= 2]
    if not usable:
        sizes = sorted({int(w) for w in table["world_size"]})
        return None, (f"Skipped: a scaling plot needs one configuration measured at two or more world "
                      f"sizes; these runs have world size(s) {', '.join(map(str, sizes))} and no "
                      f"configuration spans two of them.")
    # Name a line by what tells it apart from the other rows of the table (e.g. its grad_ckpt).
    varying = {c for c in series_cols if len({json.dumps(e["key"][c]) for e in series.values()}) > 1}
    fig = _figure()
    ax = fig.subplots()
    colors = _colors()
    for n, e in enumerate(usable[:8]):
        ws = sorted(e["points"])
        y = [statistics.fmean(p[0] for p in e["points"][w]) for w in ws]
        err = [statistics.fmean(0.0 if math.isnan(p[1]) else p[1] for p in e["points"][w]) for w in ws]
        c = colors[n % len(colors)]
        label = _series_label(e["key"], varying)
        ax.errorbar(ws, y, yerr=err, marker="o", color=c, capsize=3, label=f"{label}")
        ax.plot(ws, [y[0] * w / ws[0] for w in ws], linestyle="--", color=c, alpha=0.6,
                label=f"ideal linear from world size {ws[0]}" + (f" ({label})" if len(usable) > 1 else ""))
    ax.set_xlabel("world size (processes)")
    ax.set_ylabel("steady sequences / s")
    ax.set_xticks(sorted({w for e in usable for w in e["points"]}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    note = "" if len(usable) <= 8 else f"Showing 8 of {len(usable)} configurations."
    return _png_base64(fig), note


def plot_loss_curves(runs: Sequence[dict]) -> tuple[str | None, str]:
    """Training loss vs optimizer step from metrics.jsonl, one line per run, one panel per task."""
    with_metrics = [r for r in sorted(runs, key=lambda r: r["label"])
                    if any(_is_number(m["loss"]) for m in r["metrics"])]
    if not with_metrics:
        return None, "Skipped: no run has metrics.jsonl lines with a loss."
    tasks = sorted({r["summary"]["task"] for r in with_metrics})
    fig = _figure(8.0, 3.6 * len(tasks))
    axes = fig.subplots(len(tasks), 1, squeeze=False)[:, 0]
    colors = _colors()
    for ax, task in zip(axes, tasks):
        for n, r in enumerate(x for x in with_metrics if x["summary"]["task"] == task):
            pts = [(m["step"], m["loss"]) for m in r["metrics"]
                   if _is_number(m["loss"]) and _is_number(m["step"])]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[n % len(colors)],
                    label=r["label"], linewidth=1.2)
        ax.set_title(f"task {task}", fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2 if len(with_metrics) > 6 else 1)
    return _png_base64(fig), ""


def plot_policies(table: pd.DataFrame) -> tuple[str | None, str]:
    """Activation bytes per sequence and step time per grad_ckpt policy, relative to 'none' where
    the table has it (table from build_table(..., policy_columns=True))."""
    coarse_cols = ["task", "model", "seq_len", "precision", "compile", "hardware"]
    series: dict[str, list[int]] = {}
    for i in range(len(table)):
        key = json.dumps([_jsonable(table[c].iloc[i]) for c in coarse_cols], default=str)
        series.setdefault(key, []).append(i)
    usable = [(k, rows) for k, rows in series.items()
              if len({table["grad_ckpt"].iloc[i] for i in rows}) >= 2]
    if not usable:
        return None, ("Skipped: comparing gradient checkpointing policies needs two or more grad_ckpt "
                      "policies with otherwise equal task, model, max_seq_length, precision and "
                      "hardware.")
    shown = usable[:4]
    fig = _figure(10.0, 3.8 * len(shown))
    axes = fig.subplots(len(shown), 2, squeeze=False)
    for (key, rows), (ax_act, ax_step) in zip(shown, axes):
        rows = sorted(rows, key=lambda i: (policy_rank(table["grad_ckpt"].iloc[i]),
                                           table["grad_ckpt"].iloc[i], i))
        title = " · ".join(str(x) for x in json.loads(key)[:3])
        # Activation bytes per sequence: one bar per policy (mean over rows of that policy).
        policies = list(dict.fromkeys(table["grad_ckpt"].iloc[i] for i in rows))
        rel = "act_vs_none" in table.columns and "none" in policies
        col = "act_vs_none" if rel else "act_MiB_per_seq"
        heights = []
        for p in policies:
            vals = [float(table[col].iloc[i]) for i in rows if table["grad_ckpt"].iloc[i] == p]
            heights.append(_mean_std(vals)[0])
        _bars(ax_act, policies, heights, "{:.2f}×" if rel else "{:.2f} MiB")
        ax_act.set_ylabel("activation bytes / seq, relative to none" if rel else "activation MiB / sequence")
        ax_act.set_title(f"{title}: saved activations", fontsize=10)
        # Step time: one bar per row (policy, and batch where batches differ).
        batches = {str(table["per_device_batch"].iloc[i]) for i in rows}
        sizes = {int(table["world_size"].iloc[i]) for i in rows}
        labels = []
        for i in rows:
            lab = str(table["grad_ckpt"].iloc[i])
            if len(batches) > 1:
                lab += f"\nbs {table['per_device_batch'].iloc[i]}"
            if len(sizes) > 1:
                lab += f"\nws {table['world_size'].iloc[i]}"
            labels.append(lab)
        rel_step = "step_time_vs_none" in table.columns and all(
            _finite(table["step_time_vs_none"].iloc[i]) for i in rows)
        col = "step_time_vs_none" if rel_step else "step_time_ms"
        _bars(ax_step, labels, [float(table[col].iloc[i]) for i in rows],
              "{:.2f}×" if rel_step else "{:.1f} ms")
        ax_step.set_ylabel("step time, relative to none" if rel_step else "median step time (ms)")
        ax_step.set_title(f"{title}: step time", fontsize=10)
    note = "" if len(usable) <= 4 else f"Showing 4 of {len(usable)} configurations."
    return _png_base64(fig), note


def _main_metric_value(summary: dict, main: str) -> float:
    ev = summary["eval"]
    splits = [sp for sp in sorted(ev, key=lambda sp: (sp != "dev", sp)) if main in ev[sp]]
    return _scaled(ev[splits[0]][main]) if splits else float("nan")


def plot_dev_metric(runs: Sequence[dict]) -> tuple[str | None, str]:
    """The headline dev metric per table row: square = mean, whiskers = sample std over seeds,
    dots = the individual seeds. One panel per task; the axis is scaled to the data (not from 0) so
    that seed spread stays visible."""
    groups = [g for g in _grouped(runs) if g[0]["summary"]["eval"]]
    if not groups:
        return None, "Skipped: no run was evaluated (summary.json eval is empty)."
    tasks = sorted({g[0]["summary"]["task"] for g in groups})
    fig = _figure(max(6.0, min(14.0, 1.3 * max(len(groups), 4))), 3.6 * len(tasks))
    axes = fig.subplots(len(tasks), 1, squeeze=False)[:, 0]
    for ax, task in zip(axes, tasks):
        tg = [g for g in groups if g[0]["summary"]["task"] == task]
        main = tg[0][0]["summary"]["main_metric"]
        labels = []
        for x, g in enumerate(tg):
            vals = [_main_metric_value(r["summary"], main) for r in g]
            m, s = _mean_std(vals)
            labels.append(f"{_group_label(g)}\n(n={len(g)})")
            dots = [v for v in vals if not math.isnan(v)]
            offsets = [0.12 * (k - (len(dots) - 1) / 2) / max(1, len(dots) - 1) for k in range(len(dots))]
            ax.plot([x + 0.25 + o for o in offsets], dots, "o", color="#6baed6", markersize=4,
                    label="seeds" if x == 0 else None)
            if not math.isnan(m):
                ax.errorbar([x], [m], yerr=[0.0 if math.isnan(s) else s], fmt="s", color="#08519c",
                            capsize=5, markersize=7, label="mean ± std" if x == 0 else None)
                ax.annotate(f"{m:.4f}" + ("" if math.isnan(s) else f" ± {s:.4f}"), (x, m),
                            xytext=(-8, 0), textcoords="offset points", ha="right", va="center",
                            fontsize=7)
        ax.set_xticks(list(range(len(tg))), labels, fontsize=8,
                      rotation=20 if len(tg) > 4 else 0, ha="right" if len(tg) > 4 else "center")
        ax.set_xlim(-0.8, len(tg) - 0.4)
        ax.margins(y=0.25)
        ax.set_ylabel(f"dev {main}")
        ax.set_title(f"task {task}: dev {main}, mean ± sample std over seeds", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    return _png_base64(fig), ""


def _colors() -> list[str]:
    return ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _bars(ax: Any, labels: Sequence[str], heights: Sequence[float], fmt: str) -> None:
    x = list(range(len(labels)))
    h = [0.0 if math.isnan(v) else v for v in heights]
    ax.bar(x, h, color="#9ecae1", edgecolor="#3182bd")
    for xi, v in zip(x, heights):
        ax.annotate(MISSING if math.isnan(v) else fmt.format(v), (xi, 0.0 if math.isnan(v) else v),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, labels, fontsize=8)
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)


# ---------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       margin: 24px; color: #222; max-width: 1400px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ddd; }
figure { margin: 12px 0 20px 0; }
figcaption { font-size: 13px; color: #333; margin-bottom: 6px; line-height: 1.4; }
.scroll { overflow-x: auto; border: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 12px; }
th, td { padding: 3px 7px; border-bottom: 1px solid #eee; white-space: nowrap; }
th { background: #f4f6f8; text-align: left; vertical-align: bottom; white-space: normal; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr:nth-child(even) td { background: #fafafa; }
img.plot { max-width: 100%; height: auto; border: 1px solid #eee; }
p.note { background: #fff8e1; border-left: 4px solid #f0b400; padding: 6px 10px; font-size: 13px; }
ul.skipped li { font-family: monospace; font-size: 12px; color: #a00; }
dl { font-size: 12px; display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; }
dt { font-family: monospace; font-weight: bold; } dd { margin: 0; }
th:first-child, td:first-child { position: sticky; left: 0; background: #fff; border-right: 1px solid #ddd; }
th:first-child { background: #f4f6f8; z-index: 1; }
"""


NUM_CLASS = ' class="num"'


def _html_table(table: pd.DataFrame, number: int) -> str:
    cols = display_columns(table)
    num = [_numeric_display(table, c) or pd.api.types.is_integer_dtype(table[c]) for c in cols]
    # <wbr> after '_' lets long column names wrap in the header; cells never wrap.
    head = "".join(f"<th>{html.escape(c).replace('_', '_<wbr>')}</th>" for c in cols)
    body = []
    for i in range(len(table)):
        cells = "".join(f"<td{NUM_CLASS if n else ''}>{html.escape(format_cell(table, i, c))}</td>"
                        for c, n in zip(cols, num))
        body.append(f"<tr>{cells}</tr>")
    caption = html.escape(caption_text(table))
    return (f'<figure class="table"><figcaption><b>Table {number}.</b> {caption}</figcaption>'
            f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>'
            + "\n".join(body) + "</tbody></table></div></figure>\n")


def render_html(tables: Sequence[pd.DataFrame], runs: Sequence[dict],
                skipped: Sequence[tuple[str, str]] = (), *, title: str = "hpcbert report") -> str:
    """One self-contained page: the captioned tables, the skipped runs, and the plots as inline
    base64 PNGs (no external URL, no script). A plot the data cannot support is replaced by a
    visible note."""
    parts = [f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
             f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
             f"<h1>{html.escape(title)}</h1>\n"
             f"<p>{len(runs)} run(s) in {sum(len(t) for t in tables)} row(s)"
             f"{f', {len(skipped)} skipped' if skipped else ''}.</p>\n<h2>Results</h2>\n"]
    parts += [_html_table(t, n) for n, t in enumerate(tables, 1)]
    if skipped:
        parts.append('<h2>Skipped runs</h2>\n<ul class="skipped">'
                     + "".join(f"<li>{html.escape(reason)}</li>" for _, reason in skipped) + "</ul>\n")
    overall = build_table(runs, None, policy_columns=True) if runs else None
    plots = [
        ("Throughput vs world size", "Steady sequences/s (mean ± std over seeds) against ideal linear "
         "scaling from the smallest world size.", lambda: plot_scaling(overall)),
        ("Training loss", "Loss vs optimizer step from metrics.jsonl.", lambda: plot_loss_curves(runs)),
        ("Gradient checkpointing policies", "Activation bytes per sequence and step time per grad_ckpt "
         "policy, relative to none where a none run exists.", lambda: plot_policies(overall)),
        ("Dev metric", "Headline dev metric per row with the spread over seeds.",
         lambda: plot_dev_metric(runs)),
    ]
    for heading, what, make in plots:
        parts.append(f"<h2>{html.escape(heading)}</h2>\n")
        png, note = make() if runs else (None, "Skipped: no runs.")
        if png:
            parts.append(f'<figure><figcaption>{html.escape(what)}</figcaption>'
                         f'<img class="plot" alt="{html.escape(heading)}" '
                         f'src="data:image/png;base64,{png}"></figure>\n')
        if note:
            parts.append(f'<p class="note">{html.escape(note)}</p>\n')
    parts.append("<h2>Columns</h2>\n<dl>" + "".join(
        f"<dt>{html.escape(c)}</dt><dd>{html.escape(doc)}</dd>" for c, doc in _glossary(tables))
        + "</dl>\n</body></html>\n")
    return "".join(parts)


# ---------------------------------------------------------------------------------------------
# bench and CLI
# ---------------------------------------------------------------------------------------------

def bench_report(run_dirs: Sequence[str | os.PathLike], html_path: str | os.PathLike) -> str:
    """The table `hpcbert bench` prints at the end: baseline = the grad_ckpt 'none' run (its seed
    group at the smallest world size), with act_vs_none and step_time_vs_none columns. Writes the
    HTML report to html_path and returns the Markdown (caption, table, skipped runs)."""
    runs, skipped = load_runs(run_dirs)
    if not runs:
        raise RunDirError("bench: no run could be read: " + "; ".join(r for _, r in skipped))
    none_groups = [g for g in _grouped(runs) if g[0]["summary"]["grad_ckpt"] == "none"]
    baseline = min(none_groups, key=lambda g: g[0]["summary"]["world_size"]) if none_groups else None
    table = build_table(runs, baseline, policy_columns=True)
    Path(html_path).parent.mkdir(parents=True, exist_ok=True)
    Path(html_path).write_text(render_html([table], runs, skipped, title="hpcbert bench"))
    # The terminal gets the columns that answer "what does each policy cost and buy"; the HTML
    # report beside the runs has them all.
    keep = [c for c in table.columns if c.removesuffix("_std") in BENCH_COLUMNS]
    compact = table[keep]
    compact.attrs = table.attrs
    return render_markdown(compact, skipped)


BENCH_COLUMNS = ("run", "seeds", "grad_ckpt", "per_device_batch", "steps", "seq_per_s", "step_time_ms",
                 "step_time_vs_none", "act_MiB_per_seq", "act_vs_none", "peak_mem_GiB", "startup_s",
                 "steps_in_budget", "mfu_pct", "accuracy", "final_loss", "speedup")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpcbert report",
        description="Result tables and plots from run directories (summary.json, config.json, "
                    "metrics.jsonl). Runs that differ only in seed become one row (mean ± std).",
        epilog="With --format md, a single folder D and --out D/README.md, the whole results README "
               "is written (title, regeneration command, one table per sub-folder and task/model/"
               "hardware). Exit status: 0 when at least one run was reported, 2 when none.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="run directories, or folders searched recursively for run directories")
    p.add_argument("--baseline", metavar="RUN_DIR",
                   help="run to compare against: adds speedup and scaling_eff columns")
    p.add_argument("--format", choices=("md", "csv", "html", "json"), default="md",
                   help="output format (default md; html needs --out)")
    p.add_argument("--out", metavar="FILE", help="write here instead of stdout")
    return p


def _warn(skipped: Sequence[tuple[str, str]]) -> None:
    for _, reason in skipped:
        print(f"hpcbert report: warning: skipped {reason}", file=sys.stderr)


def _write(text: str, out: str | None) -> None:
    if out is None:
        sys.stdout.write(text)
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)


def cli(argv: Sequence[str]) -> int:
    """`hpcbert report ...`; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    if args.format == "html" and not args.out:
        parser.error("--format html needs --out FILE (the report is one self-contained HTML file)")

    readme_mode = (args.format == "md" and args.out and len(args.runs) == 1 and args.baseline is None
                   and Path(args.out).name == "README.md"
                   and Path(args.out).resolve().parent == Path(args.runs[0]).resolve())
    if readme_mode:
        try:
            text, skipped = _results_readme(args.runs[0])
        except RunDirError as e:
            print(f"hpcbert report: error: {e}", file=sys.stderr)
            return 2
        _warn(skipped)
        _write(text, args.out)
        return 0

    runs, skipped = load_runs(args.runs)
    baseline = None
    if args.baseline:
        base_runs, base_skipped = load_runs([args.baseline])
        if base_skipped or len(base_runs) != 1:
            why = "; ".join(r for _, r in base_skipped) or f"{len(base_runs)} runs found, expected one"
            print(f"hpcbert report: error: --baseline {args.baseline}: {why}", file=sys.stderr)
            return 2
        baseline = base_runs[0]
        if baseline["dir"] not in {r["dir"] for r in runs}:
            runs.append(baseline)
            _assign_labels(runs)
        else:
            baseline = next(r for r in runs if r["dir"] == baseline["dir"])
    _warn(skipped)
    if not runs:
        print("hpcbert report: error: no runs to report", file=sys.stderr)
        return 2
    table = build_table(runs, baseline)
    if args.format == "md":
        text = render_markdown(table, skipped)
    elif args.format == "csv":
        text = render_csv(table, skipped)
    elif args.format == "json":
        text = render_json(table, skipped)
    else:
        text = render_html([table], runs, skipped)
    _write(text, args.out)
    return 0


def main() -> None:  # python -m hpcbert.report
    sys.exit(cli(sys.argv[1:]))


if __name__ == "__main__":
    main()
