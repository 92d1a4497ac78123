"""The report's plots: matplotlib Figure objects on the Agg canvas (no pyplot global state), returned
as base64 PNG for the self-contained HTML page. Each returns (png or None, note): a plot the data
cannot support is None with a note saying why.
"""

from __future__ import annotations

import base64
import io
import json
import math
import statistics
from typing import Any, Sequence

import pandas as pd

from .loading import is_number
from .renderers import jsonable
from .tables import MISSING, group_label, grouped, mean_std, policy_rank, scaled


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
        key = {c: jsonable(table[c].iloc[i]) for c in series_cols}
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
                    if any(is_number(m["loss"]) for m in r["metrics"])]
    if not with_metrics:
        return None, "Skipped: no run has metrics.jsonl lines with a loss."
    tasks = sorted({r["summary"]["task"] for r in with_metrics})
    fig = _figure(8.0, 3.6 * len(tasks))
    axes = fig.subplots(len(tasks), 1, squeeze=False)[:, 0]
    colors = _colors()
    for ax, task in zip(axes, tasks):
        for n, r in enumerate(x for x in with_metrics if x["summary"]["task"] == task):
            pts = [(m["step"], m["loss"]) for m in r["metrics"]
                   if is_number(m["loss"]) and is_number(m["step"])]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[n % len(colors)],
                    label=r["label"], linewidth=1.2)
        ax.set_title(f"task {task}", fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2 if len(with_metrics) > 6 else 1)
    return _png_base64(fig), ""


def plot_eval_curves(runs: Sequence[dict]) -> tuple[str | None, str]:
    """The main metric of evaluations during training (--eval-every lines of metrics.jsonl) against
    training tokens seen, one line per run, one panel per task: masked-LM accuracy vs tokens for
    pre-training, as MLPerf plots time to train."""
    def points(r: dict) -> list[tuple[float, float]]:
        main = r["summary"]["main_metric"]
        pts = []
        for m in r["metrics"]:
            ev = m.get("eval")
            if isinstance(ev, dict) and is_number(m.get("tokens_seen")):
                vals = [v[main] for _, v in sorted(ev.items()) if isinstance(v, dict) and is_number(v.get(main))]
                if vals:
                    pts.append((float(m["tokens_seen"]), float(vals[0])))
        return pts

    with_evals = [(r, points(r)) for r in sorted(runs, key=lambda r: r["label"])]
    with_evals = [(r, p) for r, p in with_evals if p]
    if not with_evals:
        return None, "Skipped: no run evaluated during training (--eval-every lines in metrics.jsonl)."
    tasks = sorted({r["summary"]["task"] for r, _ in with_evals})
    fig = _figure(8.0, 3.6 * len(tasks))
    axes = fig.subplots(len(tasks), 1, squeeze=False)[:, 0]
    colors = _colors()
    for ax, task in zip(axes, tasks):
        rows = [(r, p) for r, p in with_evals if r["summary"]["task"] == task]
        main = rows[0][0]["summary"]["main_metric"]
        for n, (r, pts) in enumerate(rows):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                    color=colors[n % len(colors)], label=r["label"], linewidth=1.2)
            target = r["config"].get("target_mlm_accuracy")
            if is_number(target):
                ax.axhline(target, color=colors[n % len(colors)], linestyle=":", linewidth=1)
        ax.set_title(f"task {task}: {main} during training", fontsize=10)
        ax.set_xlabel("training tokens seen")
        ax.set_ylabel(main)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _png_base64(fig), ""


def plot_policies(table: pd.DataFrame) -> tuple[str | None, str]:
    """Activation bytes per sequence and step time per grad_ckpt policy, relative to 'none' where
    the table has it (table from build_table(..., policy_columns=True))."""
    coarse_cols = ["task", "model", "seq_len", "precision", "compile", "hardware"]
    series: dict[str, list[int]] = {}
    for i in range(len(table)):
        key = json.dumps([jsonable(table[c].iloc[i]) for c in coarse_cols], default=str)
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
            heights.append(mean_std(vals)[0])
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
    return scaled(ev[splits[0]][main]) if splits else float("nan")


def plot_dev_metric(runs: Sequence[dict]) -> tuple[str | None, str]:
    """The headline dev metric per table row: square = mean, whiskers = sample std over seeds,
    dots = the individual seeds. One panel per task; the axis is scaled to the data (not from 0) so
    that seed spread stays visible."""
    groups = [g for g in grouped(runs) if g[0]["summary"]["eval"]]
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
            m, s = mean_std(vals)
            labels.append(f"{group_label(g)}\n(n={len(g)})")
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
