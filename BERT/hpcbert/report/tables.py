"""The report's table: one row per seed group, its columns, how each cell reads, and its caption.

    build_table(runs, baseline)  -> pandas.DataFrame, caption lines in .attrs["caption"]
    display_columns(table)       -> the columns a human-facing table shows (Markdown, HTML)
    column_texts(table, col)     -> how the cells of a column read there

Runs that differ only in their seed are one row (mean and sample std). Columns whose value is the
same in every row are settings of the whole table: the caption states them and the Markdown and
HTML tables leave them out (CSV and JSON, for machines, keep every column).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import statistics
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from .loading import hardware_label, is_number

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
    "precision": "precision actually used (bf16/fp16: autocast; \", fp32 LayerNorms\": the LayerNorms and residual stream in fp32, --norm-precision fp32 or a run from before it)",
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
    "mfu_pct": "model FLOPs utilisation (FLOPs of the real tokens' computation), % of the device's peak at the precision used",
    "final_loss": "mean training loss over the last logged window",
    "speedup": "seq_per_s / the baseline's seq_per_s",
    "scaling_eff": "speedup / (world_size / the baseline's world_size), where world sizes differ",
    "act_vs_none": "act_MiB_per_seq / that of grad_ckpt none with otherwise equal settings",
    "step_time_vs_none": "step time / that of grad_ckpt none with otherwise equal settings (same batch "
                         "and world size): median of per-step ratios over the steady steps both logged "
                         "(same seed, so the same batches), else the ratio of median step times",
}

@functools.lru_cache(maxsize=1)
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
    launch["precision"] = precision_label(s)  # as run: norm_precision of the config says what was asked
    cfg.pop("norm_precision", None)
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
            str(s["per_device_batch_size"]), precision_label(s), bool(s["compile"]), s["optimizer"], label)


def grouped(runs: Sequence[dict]) -> list[list[dict]]:
    """Seed groups in table order; the runs inside a group ordered by seed."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(_group_key(r), []).append(r)
    def by_seed(r: dict) -> tuple:
        seed = r["summary"]["seed"]
        return (0, seed, r["label"]) if is_number(seed) else (1, str(seed), r["label"])

    out = [sorted(g, key=by_seed) for g in groups.values()]
    return sorted(out, key=lambda g: _sort_key(g[0]["summary"], group_label(g)))


def group_label(group: Sequence[dict]) -> str:
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


def scaled(v: Any, scale: float = 1.0) -> float:
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


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample std (ddof=1) over the values that are not NaN."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan")
    try:
        return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else float("nan"))
    except OverflowError:  # values near the float limit: the sum overflows; numpy says inf
        with np.errstate(all="ignore"):
            return float(np.mean(vals)), (float(np.std(vals, ddof=1)) if len(vals) > 1 else float("nan"))


def _run_values(run: dict, metric_names: dict[tuple[str, str], str]) -> dict[str, float]:
    s = run["summary"]
    vals = {col: scaled(s[key], scale) for col, key, scale, _ in MEASURED}
    for (sp, m), col in metric_names.items():
        vals[col] = scaled(s["eval"].get(sp, {}).get(m))
    vals["final_loss"] = scaled(s["final_loss"])
    return vals


def _as_list(baseline: dict | Sequence[dict] | None) -> list[dict]:
    if baseline is None:
        return []
    return [baseline] if isinstance(baseline, dict) else list(baseline)


def precision_label(s: dict) -> str:
    """A run's precision as the tables show it: bf16/fp16 with ", fp32 LayerNorms" where autocast ran
    the LayerNorms and the residual stream in fp32 (--norm-precision fp32, and every run from
    before that option, whose summary has no norm_precision)."""
    p = s["precision"]
    return p if p == "fp32" or s.get("norm_precision") == "low" else f"{p}, fp32 LayerNorms"


def _policy_keys(s: dict) -> tuple[str, str]:
    """Keys of the 'none' run a policy is compared with: activation bytes per sequence do not depend
    on batch or world size; step time does."""
    coarse = json.dumps([s["task"], s["model"], s["max_seq_length"], precision_label(s), bool(s["compile"]),
                         hardware_label(s["hardware"]), s["num_layers"], s["hidden_size"]], default=str)
    fine = json.dumps([coarse, s["world_size"], s["nodes"], s["per_device_batch_size"], s["grad_accum"]],
                      default=str)
    return coarse, fine


def _logged_step_times(r: dict) -> dict[int, float]:
    """step -> that step's time, for the logged timed steps of a run (after its untimed first steps)."""
    w = r["summary"].get("warmup_steps_excluded") or 0
    return {m["step"]: m["step_time_s"] for m in r["metrics"]
            if m["step"] > w and is_number(m.get("step_time_s")) and 0 < m["step_time_s"] < math.inf}


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
        base_seq, _ = mean_std(scaled(b["summary"]["steady_sequences_per_sec"]) for b in base)
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
            ref_act = mean_std(none_act.get(coarse, []))[0]
            ref_step = mean_std(values[n["dir"]]["step_time_ms"] for n in none_runs.get(fine, []))[0]
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

    groups = grouped(runs)
    rows = []
    for g in groups:
        s = g[0]["summary"]
        row: dict[str, Any] = {
            "run": group_label(g), "seeds": len(g), "seed": ",".join(str(r["summary"]["seed"]) for r in g),
            "task": s["task"], "model": s["model"], "seq_len": s["max_seq_length"],
            "precision": precision_label(s), "compile": bool(s["compile"]),
            "hardware": hardware_label(s["hardware"]), "nodes_x_gpus": f"{s['nodes']}x{s['gpus_per_node']}",
            "world_size": s["world_size"], "per_device_batch": _batch_text(s["per_device_batch_size"]),
            "grad_accum": s["grad_accum"], "global_batch": s["global_batch_size"],
            "grad_ckpt": s["grad_ckpt"], "optimizer": s["optimizer"],
        }
        for col in measured:
            row[col], row[f"{col}_std"] = mean_std(values[r["dir"]][col] for r in g)
        rows.append(row)
    with_std = any(len(g) > 1 for g in groups)
    columns = list(DESCRIPTIVE)
    for col in measured:
        columns += [col, f"{col}_std"] if with_std else [col]
    table = pd.DataFrame(rows, columns=columns)
    if table["per_device_batch"].map(type).nunique() > 1:  # mixed ints and 'a/b' texts
        table["per_device_batch"] = table["per_device_batch"].astype(str)
    table.attrs["fixed"] = fixed_columns(table)
    table.attrs["caption"] = _caption(runs, groups, table, _Reference(base, base_seq, base_ws, scaling),
                                      policy_columns)
    return table



def _constant(values: Iterable[Any]) -> Any | None:
    vals = {json.dumps(v, sort_keys=True, default=str) for v in values}
    return json.loads(next(iter(vals))) if len(vals) == 1 else None


# How a fixed descriptive column is named in the caption (the others by their column name).
_FIXED_NAMES = {"seeds": "runs per row", "seq_len": "max_seq_length", "nodes_x_gpus": "nodes x GPUs",
                "global_batch": "global batch"}


def fixed_columns(table: pd.DataFrame) -> list[str]:
    """Columns that read the same in every row, which the caption states instead of the table:
    settings (DESCRIPTIVE) always, figures only where there are several rows (a one-row table still
    shows its figures) or where no row has one. `run` names the rows and is never fixed."""
    table = bare(table)
    out = []
    for col in table.columns:
        if col == "run" or (col.endswith("_std") and col[:-4] in table.columns):
            continue
        texts = set(column_texts(table, col))
        if len(texts) == 1 and (col in DESCRIPTIVE or len(table) > 1 or texts == {MISSING}):
            out.append(col)
    return out


def _timed_steps(s: dict) -> tuple[int, int] | None:
    """First and last timed step of a run (the steady figures' steps), or None when none were
    timed. train.py states the range in throughput_method; else it follows from the counts."""
    m = re.search(r"steps (\d+)\.\.(\d+)", str(s["throughput_method"]))
    first, last = (int(m.group(1)), int(m.group(2))) if m else ((s["warmup_steps_excluded"] or 0) + 1, s["steps"])
    return (first, last) if first <= last else None


def _steps_text(rng: tuple[int, int] | None) -> str:
    return "none" if rng is None else f"{rng[0]}..{rng[1]}"


def _timed_steps_line(groups: Sequence[Sequence[dict]]) -> str:
    """Which steps each row's figures come from, naming the row (and its runs where they differ)."""
    ranges = [[_timed_steps(r["summary"]) for r in g] for g in groups]
    untimed = "the steps before them are untimed first steps, left out of the steady figures"
    if len({rng for rr in ranges for rng in rr}) == 1:
        return f"Timed steps: {_steps_text(ranges[0][0])} in every run ({untimed})."
    parts = []
    for g, rr in zip(groups, ranges):
        if len(set(rr)) == 1:
            parts.append(f"{group_label(g)} {_steps_text(rr[0])}")
        else:
            parts.append(f"{group_label(g)} (" + ", ".join(f"{r['label']} {_steps_text(x)}"
                                                         for r, x in zip(g, rr)) + ")")
    return f"Timed steps per row: {'; '.join(parts)} ({untimed})."


def _compiles_line(groups: Sequence[Sequence[dict]]) -> str | None:
    """The rows with a torch.compile compile among their timed steps (summary compile_steps). A run
    that leaves such a step out of its steady figures says so in its throughput_method; in a run
    from before it did, the compile's time is in the figures. None where no row has one."""
    held, left = [], []
    for g in groups:
        for r in g:
            rng = _timed_steps(r["summary"])
            inside = [c for c in r["summary"].get("compile_steps") or []
                      if rng and rng[0] <= c["step"] <= rng[1]]
            if inside:
                run = f" ({r['label']})" if len(g) > 1 else ""
                text = f"{group_label(g)}{run}: " + ", ".join(f"step {c['step']} ({c['step_s']:.1f} s)" for c in inside)
                (left if "torch.compile compiled" in str(r["summary"]["throughput_method"]) else held).append(text)
    out = []
    if held:
        out.append("torch.compile compiled inside the timed steps of " + "; ".join(held)
                   + ": that compile time is in the row's throughput.")
    if left:
        out.append("torch.compile compiled again after the untimed first steps of " + "; ".join(left)
                   + ": those steps are left out of the row's steady figures, their time is given here.")
    return " ".join(out) or None


def _method_text(sums: Sequence[dict]) -> str:
    """How throughput was measured, without the per-run step range (the timed-steps line names
    those) and in the report's words: 'untimed first steps', never 'warm-up', which the training
    log uses for the learning-rate schedule."""
    texts = [re.sub(r" of steps \d+\.\.\d+( \((the )?first \d+ excluded[^)]*\))?", " of the timed steps",
                    str(s["throughput_method"])) for s in sums]
    method = re.sub(r"(?i)\bwarm-?up\b", "untimed first steps", merge_texts(texts))
    return method if method.endswith(".") else method + "."


@dataclasses.dataclass(frozen=True)
class _Reference:
    """The baseline the speed-up columns divide by."""
    runs: list[dict]
    seq_per_s: float
    world_size: float
    scaling: bool   # world sizes differ: a scaling-efficiency column too


def _caption(runs: Sequence[dict], groups: Sequence[Sequence[dict]], table: pd.DataFrame, ref: "_Reference",
             policy_columns: bool) -> list[str]:
    """Sentences: what is fixed across the rows (every column the Markdown table leaves out), which
    steps were timed per row and how, what ± means."""
    sums = [r["summary"] for r in runs]
    fixed = table.attrs["fixed"]
    plain = bare(table)
    settings, same, absent = [], [], []
    for col in fixed:
        text = column_texts(plain, col)[0]
        if col not in DESCRIPTIVE:
            (absent if text == MISSING else same).append(col if text == MISSING else f"{col} {text}")
            continue
        if col == "compile":
            text = "on" if text == "yes" else "off"
        if col == "model":
            rnd = _constant(s["model_is_random"] for s in sums)
            text = f"{text} ({'random init' if rnd else 'pretrained'})" if rnd is not None else text
        settings.append(f"{_FIXED_NAMES.get(col, col)} {text}")
    budget = _constant(s["time_budget_s"] for s in sums)
    if is_number(budget):
        settings.append(f"time budget {budget:g} s from process start")
    lines = [("Fixed across rows: " + "; ".join(settings) + ".") if settings else "Nothing is fixed across rows."]
    if same:
        lines.append("Same in every row: " + "; ".join(same) + ".")
    if absent:
        lines.append("Not measured in any row: " + ", ".join(absent) + ".")
    lines.append(f"Throughput: {_method_text(sums)}")
    lines.append(_timed_steps_line(groups))
    if (compiles := _compiles_line(groups)) is not None:
        lines.append(compiles)
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
    if ref.runs:
        names = ", ".join(sorted(b["label"] for b in ref.runs))
        lines.append(f"speedup = seq_per_s / {ref.seq_per_s:.1f} seq/s of baseline {names} (world size "
                     f"{ref.world_size})" + (f"; scaling_eff = speedup / (world_size / {ref.world_size}), where "
                                      f"world sizes differ." if ref.scaling else "."))
    if policy_columns:
        lines.append("act_vs_none, step_time_vs_none: ratio to grad_ckpt none with otherwise equal "
                     "settings (step time: same batch and world size; where both runs logged the same timed "
                     "steps with the same seed, the median of per-step ratios over those steps, so both sides "
                     "time the same batches).")
    return [" ".join(line.split()) for line in lines]


def merge_texts(texts: Sequence[str]) -> str:
    """One text for texts that differ only in their numbers: the numbers that differ become N.
    Texts that differ otherwise are joined with ' | '."""
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
# How cells read in Markdown and HTML
# ---------------------------------------------------------------------------------------------

def decimals(col: str) -> int:
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
    """Columns shown in Markdown and HTML: the std columns are folded into 'mean ± std', and the
    columns that read the same in every row are left to the caption (fixed_columns)."""
    # build_table records them (working them out reads every column, which pandas makes slow).
    fixed = set(table.attrs["fixed"]) if "fixed" in table.attrs else set(fixed_columns(table))
    return [c for c in table.columns
            if not (c.endswith("_std") and c[:-4] in table.columns) and c not in fixed]


def numeric_column(table: pd.DataFrame, col: str) -> bool:
    return f"{col}_std" in table.columns or col in DERIVED_DECIMALS or (
        pd.api.types.is_float_dtype(table[col]) and col not in DESCRIPTIVE)


def bare(table: pd.DataFrame) -> pd.DataFrame:
    """The table without its attrs (a shallow copy): pandas deep-copies attrs into every column it
    hands out, which makes reading a table column by column slow."""
    out = table.copy(deep=False)
    out.attrs = {}
    return out


def column_texts(table: pd.DataFrame, col: str) -> list[str]:
    """How the cells of one column read in Markdown and HTML (fixed decimals per column, 'mean ±
    std' where a row has several seeds; no locale), top to bottom."""
    values = table[col].tolist()
    if numeric_column(table, col):
        d = decimals(col)
        std_col = f"{col}_std"
        stds = table[std_col].tolist() if std_col in table.columns else [math.nan] * len(values)
        return [_fmt(v, d) + (f" ± {_fmt(s, d)}" if n > 1 and not math.isnan(s) else "")
                for v, s, n in zip(values, stds, table["seeds"].tolist())]
    out = []
    for v in values:
        if isinstance(v, bool):
            out.append("yes" if v else "no")
        elif v is None or (isinstance(v, float) and math.isnan(v)):
            out.append(MISSING)
        else:
            out.append(" ".join(str(v).split()))  # one line: a table row is one line
    return out


def format_cell(table: pd.DataFrame, i: int, col: str) -> str:
    """How one cell reads in Markdown and HTML (column_texts of its column)."""
    return column_texts(table, col)[i]
