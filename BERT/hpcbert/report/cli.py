"""`hpcbert report` and the table `hpcbert bench` prints.

    hpcbert report RUN_DIR|FOLDER... [--baseline RUN_DIR] [--format md|csv|html|json] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from ..runfiles import RunDirError
from .html import render_html
from .loading import assign_labels, load_runs
from .readme import results_readme
from .renderers import render_csv, render_json, render_markdown
from .tables import build_table, grouped


def bench_report(run_dirs: Sequence[str | os.PathLike], html_path: str | os.PathLike) -> str:
    """The table `hpcbert bench` prints at the end: baseline = the grad_ckpt 'none' run (its seed
    group at the smallest world size), with act_vs_none and step_time_vs_none columns. Writes the
    HTML report to html_path and returns the Markdown (caption, table, skipped runs)."""
    runs, skipped = load_runs(run_dirs)
    if not runs:
        raise RunDirError("bench: no run could be read: " + "; ".join(r for _, r in skipped))
    none_groups = [g for g in grouped(runs) if g[0]["summary"]["grad_ckpt"] == "none"]
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
            text, skipped = results_readme(args.runs[0])
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
            assign_labels(runs)
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


def main() -> None:  # python -m hpcbert.report (report/__main__.py)
    sys.exit(cli(sys.argv[1:]))
