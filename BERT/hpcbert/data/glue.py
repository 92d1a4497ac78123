"""Readers for the nine GLUE tasks in the standard GLUE_DIR layout (one sub-folder per task).

The files are read as plain tab-separated text, never with csv quoting: MRPC, QQP and MNLI contain
unbalanced `"` characters that a quoting reader would treat as the start of a multi-line field and
silently merge rows. Columns are found by header name wherever a file has a header (CoLA has none),
so the 12-column MNLI train file and its 16-column dev files are read by the same code.

Every malformed row raises `GlueFormatError` naming the file, the line and what was expected: a
dataset that silently loses rows gives wrong dev scores that nobody notices.
"""

from __future__ import annotations

import codecs
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "TASKS",
    "Example",
    "GlueFormatError",
    "TaskSpec",
    "get_task",
    "read_split",
    "task_path",
]


class GlueFormatError(ValueError):
    """A GLUE file that does not have the expected format; str() is '<path>:<line>: <reason>'.

    That form is what editors and terminals turn into a clickable location. The parts are kept as
    attributes (`path`, `line`, `reason`) for callers that want them, and as `args` so the error
    survives pickling (e.g. when raised in a DataLoader worker).
    """

    def __init__(self, path: str | os.PathLike, line: int, reason: str):
        super().__init__(str(path), int(line), reason)
        self.path = str(path)
        self.line = int(line)
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass(frozen=True)
class TaskSpec:
    """What the rest of the kit needs to know about one GLUE task."""

    name: str
    """Canonical lower-case name: cola, sst-2, mrpc, sts-b, qqp, mnli, qnli, rte, wnli."""
    folder: str
    """Sub-folder of the GLUE directory, spelled as the GLUE download script writes it."""
    train_file: str
    """File name of the training split inside `folder`."""
    dev_files: dict[str, str] = field(hash=False)
    """Dev split name -> file name; MNLI has two (matched and mismatched). Excluded from the hash
    (a dict is unhashable) so that a TaskSpec can still be a dict key."""
    labels: tuple[str, ...] | None
    """Label strings as they appear in the files, in index order; None for regression (STS-B)."""
    main_metric: str
    """The metric GLUE reports for this task, a key of `metrics.compute_metrics`' result."""

    @property
    def num_labels(self) -> int:
        """Size of the classifier output: the number of classes, or 1 for regression."""
        return 1 if self.labels is None else len(self.labels)

    @property
    def is_regression(self) -> bool:
        """True for STS-B, whose label is a similarity score rather than a class."""
        return self.labels is None


@dataclass(frozen=True)
class Example:
    """One labelled sentence or sentence pair."""

    text_a: str
    text_b: str | None
    """None for single-sentence tasks (CoLA, SST-2)."""
    label: int | float
    """Index into `TaskSpec.labels`, or the float score for STS-B."""
    line: int
    """1-based line number in the source file, so later errors can point back at the row."""


_DEV = {"dev": "dev.tsv"}
_BINARY = ("0", "1")
_ENTAILMENT = ("entailment", "not_entailment")

TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("cola", "CoLA", "train.tsv", dict(_DEV), _BINARY, "mcc"),
        TaskSpec("sst-2", "SST-2", "train.tsv", dict(_DEV), _BINARY, "accuracy"),
        TaskSpec("mrpc", "MRPC", "train.tsv", dict(_DEV), _BINARY, "f1"),
        TaskSpec("sts-b", "STS-B", "train.tsv", dict(_DEV), None, "pearson"),
        TaskSpec("qqp", "QQP", "train.tsv", dict(_DEV), _BINARY, "f1"),
        TaskSpec(
            "mnli",
            "MNLI",
            "train.tsv",
            {"dev_matched": "dev_matched.tsv", "dev_mismatched": "dev_mismatched.tsv"},
            ("contradiction", "entailment", "neutral"),
            "accuracy",
        ),
        TaskSpec("qnli", "QNLI", "train.tsv", dict(_DEV), _ENTAILMENT, "accuracy"),
        TaskSpec("rte", "RTE", "train.tsv", dict(_DEV), _ENTAILMENT, "accuracy"),
        TaskSpec("wnli", "WNLI", "train.tsv", dict(_DEV), _BINARY, "accuracy"),
    )
}


@dataclass(frozen=True)
class _Layout:
    """Which columns hold a task's texts and label.

    `fixed_header` names the columns of a file without a header row (CoLA), so that it is read by
    the same by-name code as the others.
    """

    text_a: str
    text_b: str | None
    label: str
    fixed_header: tuple[str, ...] | None = None


_LAYOUTS = {
    "cola": _Layout("sentence", None, "label", ("source", "label", "annotation", "sentence")),
    "sst-2": _Layout("sentence", None, "label"),
    "mrpc": _Layout("#1 String", "#2 String", "Quality"),
    "sts-b": _Layout("sentence1", "sentence2", "score"),
    "qqp": _Layout("question1", "question2", "is_duplicate"),
    "mnli": _Layout("sentence1", "sentence2", "gold_label"),
    "qnli": _Layout("question", "sentence", "label"),
    "rte": _Layout("sentence1", "sentence2", "label"),
    "wnli": _Layout("sentence1", "sentence2", "label"),
}

_SCORE_RANGE = (0.0, 5.0)  # STS-B similarity scores

_ALIASES = {"sst": "sst-2", "sts": "sts-b", "mnli-m": "mnli", "mnli-mm": "mnli",
            "mnli-matched": "mnli", "mnli-mismatched": "mnli"}


def _key(name: str) -> str:
    """Spelling-insensitive lookup key: 'SST-2', 'sst_2' and 'sst2' are the same task."""
    return re.sub(r"[\s_-]", "", name.lower())


_LOOKUP = {_key(n): n for n in TASKS} | {_key(a): n for a, n in _ALIASES.items()}


def get_task(name: str | TaskSpec) -> TaskSpec:
    """The TaskSpec for a task name, ignoring case, '-' and '_' (so sst2, STS-B, mnli-mm all work).

    A TaskSpec is returned unchanged, so callers can accept either.
    """
    if isinstance(name, TaskSpec):
        return name
    canonical = _LOOKUP.get(_key(str(name)))
    if canonical is None:
        raise ValueError(
            f"unknown GLUE task {name!r}; accepted: {', '.join(TASKS)} "
            f"(also {', '.join(sorted(_ALIASES))}, and spellings without '-')"
        )
    return TASKS[canonical]


def task_path(data_dir: str | os.PathLike, task: TaskSpec | str, split: str) -> Path:
    """Path of one split's file; raises FileNotFoundError describing the expected layout.

    The message spells out the layout because the usual mistakes are pointing at the task folder
    instead of its parent, or at a folder with other names, and a bare path does not say that.
    """
    spec = get_task(task)
    files = {"train": spec.train_file, **spec.dev_files}
    if split not in files:
        raise ValueError(f"task {spec.name}: unknown split {split!r}; accepted: {', '.join(files)}")
    root = Path(data_dir).expanduser()
    path = root / spec.folder / files[split]
    if not path.is_file():
        raise FileNotFoundError(
            f"GLUE file not found: {path}. Expected the standard GLUE_DIR layout "
            f"{root}/{spec.folder}/{{{', '.join(files.values())}}}{_layout_hint(root, spec)}"
        )
    return path


def _layout_hint(root: Path, spec: TaskSpec) -> str:
    """A best guess at what is wrong with `root`, for the FileNotFoundError message."""
    if not root.is_dir():
        return f" (the data directory {root} does not exist)"
    if (root / spec.train_file).is_file():
        return f" ({root} looks like the {spec.folder} folder itself; pass its parent directory)"
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    return f" ({root} has sub-folders: {', '.join(folders[:12]) or 'none'})"


def read_split(data_dir: str | os.PathLike, task: TaskSpec | str, split: str) -> list[Example]:
    """All examples of one split ('train' or a key of `dev_files`), in file order."""
    spec = get_task(task)
    path = task_path(data_dir, spec, split)
    examples = list(_read_examples(path, spec))
    if not examples:
        raise GlueFormatError(path, 1, "the file has no examples")
    return examples


def _read_examples(path: Path, spec: TaskSpec) -> Iterator[Example]:
    """Parse every data row of `path` into an Example."""
    layout = _LAYOUTS[spec.name]
    lines = _numbered_lines(path)
    header = layout.fixed_header or _read_header(path, lines, layout)
    col = {name: i for i, name in enumerate(header)}
    for number, fields in _data_rows(path, lines, len(header)):
        yield Example(
            text_a=_text(path, number, fields[col[layout.text_a]], layout.text_a),
            text_b=None if layout.text_b is None
            else _text(path, number, fields[col[layout.text_b]], layout.text_b),
            label=_label(path, number, fields[col[layout.label]], spec),
            line=number,
        )


def _numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based number, text without line ending) for each line, UTF-8 with an optional BOM.

    Lines are split on '\\n' only (with a '\\r' before it removed): sentences may contain other
    Unicode line breaks that str.splitlines() would split on. Decoding line by line lets an
    encoding error name its line. A NUL byte is refused: it is valid UTF-8 but never GLUE text,
    and it is what a UTF-16 file read as UTF-8 looks like (ASCII letters with NULs between them).
    """
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1:
                if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                    raise GlueFormatError(path, 1, "starts with a UTF-16 byte-order mark; GLUE files are UTF-8 "
                                                   "(re-save the file as UTF-8)")
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if b"\x00" in raw:
                reason = f"NUL byte at byte {raw.index(0)}; GLUE files are UTF-8 text (is this file UTF-16 or binary?)"
                raise GlueFormatError(path, number, reason)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                reason = f"not valid UTF-8 ({e.reason} at byte {e.start})"
                raise GlueFormatError(path, number, reason) from None
            yield number, text.removesuffix("\n").removesuffix("\r")


def _read_header(path: Path, lines: Iterator[tuple[int, str]], layout: _Layout) -> list[str]:
    """Column names from line 1; every column the layout reads must be present."""
    needed = [c for c in (layout.text_a, layout.text_b, layout.label) if c is not None]
    first = next(lines, None)
    if first is None:
        raise GlueFormatError(path, 1, f"empty file; expected a header with columns {', '.join(needed)}")
    names = [name.strip() for name in first[1].split("\t")]
    missing = [c for c in needed if c not in names]
    if missing:
        raise GlueFormatError(
            path, 1, f"header lacks column(s) {', '.join(map(repr, missing))}; found {names}"
        )
    twice = [c for c in needed if names.count(c) > 1]
    if twice:  # which of the two holds the data is a guess; refuse rather than read the wrong one
        raise GlueFormatError(path, 1, f"header names column(s) {', '.join(map(repr, twice))} more than once: {names}")
    return names


def _data_rows(path: Path, lines: Iterator[tuple[int, str]], width: int) -> Iterator[tuple[int, list[str]]]:
    """Tab-split data rows of exactly `width` columns; blank lines are allowed only at the end."""
    first_blank = None
    for number, text in lines:
        if not text.strip():
            first_blank = first_blank or number
            continue
        if first_blank is not None:
            raise GlueFormatError(
                path, first_blank, "blank line between data rows (only trailing blank lines are allowed)"
            )
        fields = text.split("\t")
        if len(fields) != width:
            reason = f"expected {width} tab-separated columns, found {len(fields)}"
            raise GlueFormatError(path, number, reason)
        yield number, fields


def _text(path: Path, number: int, value: str, column: str) -> str:
    """A text field without surrounding whitespace (SST-2 has trailing spaces); must not be empty."""
    text = value.strip()
    if not text:
        raise GlueFormatError(path, number, f"empty text in column {column!r}")
    return text


def _label(path: Path, number: int, value: str, spec: TaskSpec) -> int | float:
    """The label's index in `spec.labels`, or the STS-B score as a float in [0, 5]."""
    raw = value.strip()
    if spec.labels is None:
        return _score(path, number, raw)
    try:
        return spec.labels.index(raw)
    except ValueError:
        raise GlueFormatError(path, number, f"label {raw!r} not in {spec.labels}") from None


_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\Z")


def _score(path: Path, number: int, raw: str) -> float:
    """An STS-B similarity score: a plain decimal ('5.000', '0', '3.8') in [0, 5].

    Checked against a signed decimal pattern before float(): float() also takes '0_5' (= 5.0), other
    scripts' digits (Arabic-Indic 3 = 3.0), exponents, 'nan' and 'inf', none of which is a score.
    """
    low, high = _SCORE_RANGE
    score = float(raw) if _DECIMAL.match(raw) else math.nan
    if not math.isfinite(score):
        reason = f"score {raw!r} is not a number; expected a decimal like 3.800 in [{low:g}, {high:g}]"
        raise GlueFormatError(path, number, reason)
    if not low <= score <= high:
        raise GlueFormatError(path, number, f"score {raw!r} outside [{low:g}, {high:g}]")
    return score
