"""The HTML report: one self-contained page (captioned tables, skipped runs, plots as inline base64
PNGs, a column glossary); no external URL, no script."""

from __future__ import annotations

import html
from typing import Sequence

import pandas as pd

from .plots import plot_dev_metric, plot_eval_curves, plot_loss_curves, plot_policies, plot_scaling
from .renderers import glossary
from .tables import bare, build_table, caption_text, column_texts, display_columns, numeric_column


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
    caption = html.escape(caption_text(table))
    table = bare(table)
    num = [numeric_column(table, c) or pd.api.types.is_integer_dtype(table[c]) for c in cols]
    # <wbr> after '_' lets long column names wrap in the header; cells never wrap.
    head = "".join(f"<th>{html.escape(c).replace('_', '_<wbr>')}</th>" for c in cols)
    body = []
    texts = [column_texts(table, c) for c in cols]
    for i in range(len(table)):
        cells = "".join(f"<td{NUM_CLASS if n else ''}>{html.escape(text[i])}</td>" for text, n in zip(texts, num))
        body.append(f"<tr>{cells}</tr>")
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
        ("Evaluation during training", "Headline metric of the evaluations during training (--eval-every; "
         "masked-LM accuracy for pre-training) against training tokens seen; dotted: the target.",
         lambda: plot_eval_curves(runs)),
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
        f"<dt>{html.escape(c)}</dt><dd>{html.escape(doc)}</dd>" for c, doc in glossary(tables))
        + "</dl>\n</body></html>\n")
    return "".join(parts)
