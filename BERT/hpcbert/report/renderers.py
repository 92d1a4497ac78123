"""Tables as text: Markdown (for people), CSV and JSON (for machines), and the Markdown grid the
benchmark scripts' READMEs use too.

    markdown_grid(header, rows, right)  -> a Markdown table from cell texts (any table)
    format_value(v, fmt)                -> a number as a cell reads, MISSING for null / NaN
    render_markdown / render_csv / render_json (table, skipped)
    glossary(tables)                    -> (column, meaning) for the columns shown
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import pandas as pd

from .tables import (COLUMN_DOCS, DESCRIPTIVE, MISSING, bare, caption_text, column_texts, display_columns,
                     numeric_column)


def format_value(v: Any, fmt: str = "{:.3f}") -> str:
    """`fmt.format(v)`, or MISSING where there is no figure (None or NaN)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return MISSING
    return fmt.format(v)


def markdown_grid(header: Sequence[str], rows: Sequence[Sequence[str]],
                  right: Sequence[bool] | None = None) -> str:
    """A Markdown table from cell texts: `|` in a cell is escaped and line breaks become spaces, so
    every row stays one table row; `right` marks right-aligned (numeric) columns."""
    right = list(right) if right is not None else [False] * len(header)
    assert len(right) == len(header) and all(len(r) == len(header) for r in rows), "ragged table"

    def cell(text: Any) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |",
             "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def markdown_table(table: pd.DataFrame) -> str:
    """The human-facing columns of a report table (display_columns) as a Markdown table."""
    cols = display_columns(table)
    table = bare(table)
    right = [numeric_column(table, c) or pd.api.types.is_integer_dtype(table[c]) for c in cols]
    texts = [column_texts(table, c) for c in cols]
    return markdown_grid(cols, [list(row) for row in zip(*texts)], right)


def _skipped_md(skipped: Sequence[tuple[str, str]]) -> str:
    if not skipped:
        return ""
    return (f"**Skipped runs** ({len(skipped)}):\n\n"
            + "".join(f"- {reason}\n" for _, reason in skipped) + "\n")


def captioned(caption: str, body: str, number: int | None = None) -> str:
    """'**Table N.** caption', a blank line, then the table (Markdown)."""
    head = f"**Table {number}.** " if number is not None else "**Table.** "
    return head + caption + "\n\n" + body


def render_markdown(table: pd.DataFrame, skipped: Sequence[tuple[str, str]] = (), *,
                    number: int | None = None) -> str:
    """Caption paragraph, the table, and the skipped runs with their reasons."""
    return captioned(caption_text(table), markdown_table(table), number) + "\n" + _skipped_md(skipped)


def render_csv(table: pd.DataFrame, skipped: Sequence[tuple[str, str]] = ()) -> str:
    """Every column, with a header row; caption and skipped runs as '# ' comment lines above it."""
    comments = [f"# {line}" for line in table.attrs.get("caption", [])]
    comments += [f"# skipped: {reason}" for _, reason in skipped]
    body = table.to_csv(index=False, lineterminator="\n")
    return "\n".join(comments) + ("\n" if comments else "") + body


def jsonable(v: Any) -> Any:
    """A cell as JSON: numpy scalars as Python values; NaN and infinity (no figure) as null."""
    if hasattr(v, "item"):  # numpy scalar
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def render_json(table: pd.DataFrame, skipped: Sequence[tuple[str, str]] = ()) -> str:
    """{"caption": str, "rows": [{column: value}] with every column, "skipped": [{"run", "reason"}]};
    NaN is null."""
    plain = bare(table)
    columns = {c: plain[c].tolist() for c in plain.columns}
    rows = [{c: jsonable(v[i]) for c, v in columns.items()} for i in range(len(table))]
    doc = {"caption": caption_text(table), "rows": rows,
           "skipped": [{"run": run, "reason": reason} for run, reason in skipped]}
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


def glossary(tables: Sequence[pd.DataFrame]) -> list[tuple[str, str]]:
    """(column, meaning) for the columns of the tables (shown, or stated in the caption as the same
    in every row); dev metrics as one entry."""
    present = {c for t in tables for c in t.columns if not (c.endswith("_std") and c[:-4] in t.columns)}
    out = [(c, doc) for c, doc in COLUMN_DOCS.items() if c in present]
    metric_cols = sorted(present - set(COLUMN_DOCS) - set(DESCRIPTIVE))
    if metric_cols:
        out.append((", ".join(metric_cols), "dev metric(s) from summary.json eval (split/metric where "
                                            "there is a split other than dev)"))
    return out


def glossary_md(tables: Sequence[pd.DataFrame]) -> str:
    return "".join(f"- `{c}`: {doc}\n" for c, doc in glossary(tables))
