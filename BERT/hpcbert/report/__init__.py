"""Run directories -> result tables (Markdown, CSV, JSON) and a self-contained HTML report.

    hpcbert report RUN_DIR|FOLDER... [--baseline RUN_DIR] [--format md|csv|html|json] [--out FILE]

Reads only the files of the run directory contract (`runfiles.py`): summary.json, config.json and
metrics.jsonl. One table row per run, or per group of runs that differ only in their seed (mean ±
sample standard deviation). Every table carries a caption that states what is fixed across its rows
(those columns are left out of the Markdown and HTML tables), which steps of each row were timed and
how. A run that cannot be read is skipped with a one-line reason naming its file; the others are
still reported.

    loading     run directories -> validated runs, skipped runs with reasons
    tables      the table (grouping, seeds, ratios), how cells read, the caption
    renderers   Markdown / CSV / JSON, and the Markdown grid the benchmark READMEs use
    readme      results/README.md
    plots       matplotlib figures as base64 PNG
    html        the self-contained HTML page
    cli         `hpcbert report` argv, and the table `hpcbert bench` prints
"""

from .cli import BENCH_COLUMNS, bench_report, cli, main
from .html import render_html
from .loading import find_run_dirs, hardware_label, is_run_dir, load_runs
from .plots import plot_dev_metric, plot_loss_curves, plot_policies, plot_scaling
from .readme import README_COMMAND, render_results_readme
from .renderers import (format_value, glossary, markdown_grid, markdown_table, render_csv, render_json,
                        render_markdown)
from .tables import (COLUMN_DOCS, DESCRIPTIVE, MEASURED, MISSING, build_table, caption_text, column_texts,
                     decimals, display_columns, fixed_columns, format_cell, mean_std, policy_rank)

__all__ = [
    "BENCH_COLUMNS", "COLUMN_DOCS", "DESCRIPTIVE", "MEASURED", "MISSING", "README_COMMAND", "bench_report",
    "build_table", "caption_text", "cli", "column_texts", "decimals", "display_columns", "find_run_dirs", "fixed_columns",
    "format_cell", "format_value", "glossary", "hardware_label", "is_run_dir", "load_runs", "main",
    "markdown_grid", "markdown_table", "mean_std", "plot_dev_metric", "plot_loss_curves", "plot_policies",
    "plot_scaling", "policy_rank", "render_csv", "render_html", "render_json", "render_markdown",
    "render_results_readme",
]
