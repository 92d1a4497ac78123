"""Classification and regression examples from a user's own CSV, TSV or JSON Lines files.

Columns are chosen by name (header row, or the keys of each JSON object), so a train file and a
dev file may order or add columns differently (ChnSentiCorp's dev.tsv has a leading qid column).
CSV is read with the csv module's quoting (a quoted field may hold commas, quotes and newlines);
TSV is split on tabs with no quoting, as GLUE and ChnSentiCorp are written (a stray `"` in a TSV
text would otherwise swallow the rows after it). Every fault raises one ValueError line
'<file>:<line>: <field>: <what is wrong>; <what is accepted>'; no row is ever skipped.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .glue import Example

__all__ = ["FORMATS", "OwnData", "read_classification", "label_set"]

FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
_DECIMAL = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


@dataclass(frozen=True)
class OwnData:
    examples: list[Example]          # label: index into `labels`, or the float score (regression)
    labels: tuple[str, ...] | None   # class names in index order; None for regression


def _fmt(path: Path, fmt: str | None) -> str:
    accepted = sorted(set(FORMATS.values()))
    if fmt is not None:
        if fmt.lower() not in accepted:
            raise ValueError(f"{path}: format {fmt!r}; accepted: {', '.join(accepted)}")
        return fmt.lower()
    f = FORMATS.get(path.suffix.lower())
    if f is None:
        raise ValueError(f"{path}: cannot tell the format from the extension {path.suffix!r}; use one of "
                         f"{', '.join(FORMATS)} or name the format ({', '.join(accepted)})")
    return f


def _text(path: Path) -> str:
    # A BOM from spreadsheet exports is not part of the header. Removed before decoding, so that
    # e.start below indexes `data` (utf-8-sig counts it from after the BOM).
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: byte {data[e.start]:#04x} is not UTF-8; save the file as UTF-8") from None
    if "\0" in text:
        line = text[:text.index("\0")].count("\n") + 1
        raise ValueError(f"{path}:{line}: NUL character (is the file UTF-16 or binary?); expected UTF-8 text")
    return text


def _show(v, limit: int = 40) -> str:
    """A user's value in a one-line message: quoted (no raw newline), cut to `limit` characters."""
    v = str(v)
    return repr(v[:limit]) + ("..." if len(v) > limit else "")


def _names(names) -> str:
    """Column or label names for a one-line message: as written, odd ones (newlines, long) quoted and cut."""
    names = [str(n) for n in names]
    shown = [n if n.isprintable() and len(n) <= 40 else _show(n) for n in names[:20]]
    return ", ".join(shown) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")


def _rows(path: Path, fmt: str):
    """Yield (line, {field: value}) for every record, checking widths against the header."""
    text = _text(path)
    if fmt == "jsonl":
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # the newline that ends the last line
        for n, raw in enumerate(lines, 1):
            if not raw.strip():
                raise ValueError(f"{path}:{n}: empty line; JSON Lines needs one JSON object per line")
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: malformed JSON at column {e.colno}: {e.msg}") from None
            except (ValueError, RecursionError) as e:  # an integer of over 4300 digits; nesting deeper than the stack
                raise ValueError(f"{path}:{n}: unreadable JSON ({str(e).split(':')[0]}); "
                                 "expected one JSON object per line") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object ({{\"field\": value, ...}}), "
                                 f"got {type(obj).__name__}")
            yield n, obj
        return
    if fmt == "csv":
        reader = csv.reader(io.StringIO(text, newline=""))
    else:
        reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE)
    header, start = None, 1
    try:
        for row in reader:
            line, start = start, reader.line_num + 1  # a quoted CSV field can span lines
            if header is None:
                header = row
                dup = sorted({h for h in header if header.count(h) > 1})
                if dup:
                    raise ValueError(f"{path}:{line}: header repeats column {_show(dup[0])}; names must be unique")
                continue
            if len(row) != len(header):
                raise ValueError(f"{path}:{line}: {len(row)} fields, the header has {len(header)} "
                                 f"({_names(header)})")
            yield line, dict(zip(header, row))
    except csv.Error as e:
        raise ValueError(f"{path}:{reader.line_num}: {e}") from None
    if header is None:
        raise ValueError(f"{path}:1: empty file; expected a header row naming the columns")


def _field(path: Path, line: int, row: dict, name: str, what: str):
    if name not in row:
        raise ValueError(f"{path}:{line}: {name}: no such column; the columns are {_names(row)}")
    v = row[name]
    if isinstance(v, bool) or not isinstance(v, (str, int, float)) or v is None:
        raise ValueError(f"{path}:{line}: {name}: expected {what}, got {json.dumps(v)[:40]}")
    return v


def _label_key(v) -> str:
    return str(v).strip() if not isinstance(v, float) else repr(v)


def _sorted_labels(keys) -> tuple[str, ...]:
    # Integer labels sort by value ("2" before "10"); anything else sorts as text. Equal values
    # ("1", "01") sort as text: by set order the class indices would change with PYTHONHASHSEED.
    keys = set(keys)
    if all(re.fullmatch(r"[+-]?\d+", k) for k in keys):
        return tuple(sorted(keys, key=lambda k: (int(k), k)))
    return tuple(sorted(keys))


def _text_fields(text_fields: str | Sequence[str]) -> list[str]:
    tf = [t.strip() for t in text_fields.split(",")] if isinstance(text_fields, str) else list(text_fields)
    if len(tf) not in (1, 2) or not all(tf):
        raise ValueError(f"text fields: {text_fields!r}; expected one column name (single sentences) or two (pairs)")
    return tf


def label_set(path: str | os.PathLike, label_field: str, fmt: str | None = None) -> tuple[str, ...]:
    """The sorted class names found in a (training) file's label column."""
    p = Path(path)
    keys = []
    for line, row in _rows(p, _fmt(p, fmt)):
        v = _field(p, line, row, label_field, "a class label")
        if not _label_key(v):
            raise ValueError(f"{p}:{line}: {label_field}: empty label; every row needs a class")
        keys.append(_label_key(v))
    if not keys:
        raise ValueError(f"{p}: no rows after the header")
    return _sorted_labels(keys)


def read_classification(path: str | os.PathLike, text_fields: str | Sequence[str], label_field: str,
                        fmt: str | None = None, labels: Sequence[str] | None = None,
                        regression: bool = False, labelled: bool = True) -> OwnData:
    """Examples (text_a, text_b, label, line) from a CSV/TSV/JSONL file.

    text_fields: one column (single sentences) or two (pairs), a list or "a,b". fmt: csv, tsv or
    jsonl (default: from the extension). labels: the training file's class names (label_set);
    given for a dev file, a label outside it is an error; None takes them from this file.
    regression: labels are decimal numbers, kept as floats. labelled=False: a file to predict; its
    label column is not read (it may be absent) and every example's label is 0 (0.0 for
    regression), a placeholder; its texts are checked as strictly as any other file's."""
    p = Path(path)
    tf = _text_fields(text_fields)
    rows = []
    for line, row in _rows(p, _fmt(p, fmt)):
        texts = []
        for name in tf:
            t = _field(p, line, row, name, "text (a string)")
            if not isinstance(t, str) or not t.strip():
                raise ValueError(f"{p}:{line}: {name}: {'empty text' if isinstance(t, str) else 'not a string'}; "
                                 "every row needs its text")
            texts.append(t)
        if not labelled:
            rows.append((texts, 0.0 if regression else 0, line))
            continue
        v = _field(p, line, row, label_field, "a number" if regression else "a class label")
        if regression:
            if isinstance(v, str):
                if not _DECIMAL.fullmatch(v.strip()):
                    raise ValueError(f"{p}:{line}: {label_field}: {_show(v)} is not a number; regression labels "
                                     "are decimal numbers such as 3.5")
                v = float(v.strip())  # float() trims fewer characters than str.strip (not \x1c-\x1f)
            try:
                label = float(v)
            except OverflowError:  # a JSON integer beyond the float range
                label = math.inf
            if not math.isfinite(label):
                raise ValueError(f"{p}:{line}: {label_field}: {str(v)[:40]}; expected a finite number")
        else:
            label = _label_key(v)
            if not label:
                raise ValueError(f"{p}:{line}: {label_field}: empty label; every row needs a class")
        rows.append((texts, label, line))
    if not rows:
        raise ValueError(f"{p}: no rows after the header")
    names = None
    if not labelled:
        names = None if regression else tuple(labels or ())
    elif not regression:
        names = tuple(labels) if labels is not None else _sorted_labels(r[1] for r in rows)
        index = {n: i for i, n in enumerate(names)}
        for _, label, line in rows:
            if label not in index:
                raise ValueError(f"{p}:{line}: {label_field}: label {_show(label)} is not in the training "
                                 f"label set ({_names(names)})")
        rows = [(t, index[lab], line) for t, lab, line in rows]
    examples = [Example(t[0], t[1] if len(t) == 2 else None, lab, line) for t, lab, line in rows]
    return OwnData(examples, names)
