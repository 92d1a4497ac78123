"""GLUE readers: all nine tasks from generated fixtures, the real MRPC/SST-2/STS-B files, and errors."""

from __future__ import annotations

import math
import pickle
from collections import Counter
from pathlib import Path

import glue_fixtures as fx
import pytest

from hpcbert.data.glue import TASKS, Example, GlueFormatError, TaskSpec, get_task, read_split, task_path

REAL_GLUE = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"


@pytest.fixture
def glue_dir(tmp_path: Path) -> Path:
    return fx.write_glue_dir(tmp_path / "glue")


def _triples(examples: list[Example]) -> list[tuple]:
    return [(e.text_a, e.text_b, e.label) for e in examples]


# --- task table and names ---------------------------------------------------------------------

def test_task_table_matches_glue():
    assert list(TASKS) == ["cola", "sst-2", "mrpc", "sts-b", "qqp", "mnli", "qnli", "rte", "wnli"]
    assert {n: t.folder for n, t in TASKS.items()} == {
        "cola": "CoLA", "sst-2": "SST-2", "mrpc": "MRPC", "sts-b": "STS-B", "qqp": "QQP",
        "mnli": "MNLI", "qnli": "QNLI", "rte": "RTE", "wnli": "WNLI"}
    assert {n: t.main_metric for n, t in TASKS.items()} == {
        "cola": "mcc", "sst-2": "accuracy", "mrpc": "f1", "sts-b": "pearson", "qqp": "f1",
        "mnli": "accuracy", "qnli": "accuracy", "rte": "accuracy", "wnli": "accuracy"}
    assert {n: t.num_labels for n, t in TASKS.items()} == {
        "cola": 2, "sst-2": 2, "mrpc": 2, "sts-b": 1, "qqp": 2, "mnli": 3, "qnli": 2, "rte": 2, "wnli": 2}
    assert [n for n, t in TASKS.items() if t.is_regression] == ["sts-b"]
    assert TASKS["mnli"].labels == ("contradiction", "entailment", "neutral")
    assert TASKS["mnli"].dev_files == {"dev_matched": "dev_matched.tsv", "dev_mismatched": "dev_mismatched.tsv"}
    assert all(t.train_file == "train.tsv" for t in TASKS.values())
    assert all(t.dev_files == {"dev": "dev.tsv"} for n, t in TASKS.items() if n != "mnli")
    assert len({t: n for n, t in TASKS.items()}) == 9  # specs are hashable despite the dict field


@pytest.mark.parametrize("alias, name", [
    ("CoLA", "cola"), ("sst2", "sst-2"), ("SST-2", "sst-2"), ("sst_2", "sst-2"), ("sst", "sst-2"),
    ("stsb", "sts-b"), ("STS-B", "sts-b"), ("sts", "sts-b"), ("MRPC", "mrpc"), ("qqp", "qqp"),
    ("mnli", "mnli"), ("mnli-m", "mnli"), ("MNLI-MM", "mnli"), ("mnli_mismatched", "mnli"),
    ("QNLI", "qnli"), (" rte ", "rte"), ("wnli", "wnli"),
])
def test_get_task_aliases(alias, name):
    assert get_task(alias) is TASKS[name]


def test_get_task_passes_spec_through():
    assert get_task(TASKS["rte"]) is TASKS["rte"]


def test_unknown_task_lists_accepted_names():
    with pytest.raises(ValueError, match="unknown GLUE task 'squad'") as err:
        get_task("squad")
    for name in TASKS:
        assert name in str(err.value)


# --- every task from the generated fixtures ----------------------------------------------------

SPLITS = [(name, split) for name, spec in TASKS.items() for split in ["train", *spec.dev_files]]


@pytest.mark.parametrize("name, split", SPLITS)
def test_reads_fixture(glue_dir, name, split):
    examples = read_split(glue_dir, name, split)
    assert _triples(examples) == fx.EXPECTED[name][split]
    first_data_line = 1 if name == "cola" else 2  # CoLA has no header row
    assert [e.line for e in examples] == list(range(first_data_line, first_data_line + len(examples)))
    label_type = float if name == "sts-b" else int
    assert all(type(e.label) is label_type for e in examples)


def test_fixtures_have_the_real_quirks(glue_dir):
    """Guard the fixtures themselves: without the quirks the tests above prove little."""
    assert (glue_dir / "MRPC" / "train.tsv").read_bytes().startswith(b"\xef\xbb\xbfQuality\t#1 ID")
    assert fx.read_line(glue_dir / "MRPC" / "train.tsv", 4).count('"') % 2 == 1  # unbalanced quotes
    assert fx.read_line(glue_dir / "SST-2" / "train.tsv", 2).endswith(" \t0")
    assert "\t" in fx.read_line(glue_dir / "CoLA" / "train.tsv", 1) and "sentence" not in fx.read_line(
        glue_dir / "CoLA" / "train.tsv", 1)
    assert fx.read_line(glue_dir / "MNLI" / "train.tsv", 2).count("\t") == 11
    assert fx.read_line(glue_dir / "MNLI" / "dev_matched.tsv", 2).count("\t") == 15


def test_mnli_label_is_gold_label_not_label1(glue_dir):
    """dev_matched row 2 has label1 'entailment' but gold_label 'contradiction'."""
    assert fx.read_line(glue_dir / "MNLI" / "dev_matched.tsv", 3).split("\t")[10] == "entailment"
    assert read_split(glue_dir, "mnli", "dev_matched")[1].label == TASKS["mnli"].labels.index("contradiction")


def test_unbalanced_quotes_do_not_merge_rows(glue_dir):
    """A csv reader with quoting would swallow the rows after MRPC dev's leading '"'."""
    examples = read_split(glue_dir, "mrpc", "dev")
    assert len(examples) == 2
    assert examples[0].text_b.startswith('" The foodservice')


def test_mrpc_without_bom_and_with_crlf(glue_dir):
    path = glue_dir / "MRPC" / "train.tsv"
    text = path.read_text(encoding="utf-8-sig")
    path.write_bytes(text.replace("\n", "\r\n").encode("utf-8"))
    assert _triples(read_split(glue_dir, "mrpc", "train")) == fx.EXPECTED["mrpc"]["train"]


def test_accepts_task_spec_and_path_string(glue_dir):
    assert read_split(str(glue_dir), TASKS["wnli"], "dev") == read_split(glue_dir, "WNLI", "dev")


# --- malformed files ---------------------------------------------------------------------------

def _drop_last_column(line: str) -> str:
    return line.rsplit("\t", 1)[0]


def _set_column(index: int, value: str):
    def edit(line: str) -> str:
        fields = line.split("\t")
        fields[index] = value
        return "\t".join(fields)
    return edit


MALFORMED = [
    # (task, split, file, line, edit of that line, expected reason)
    ("mrpc", "train", "MRPC/train.tsv", 3, _drop_last_column, "expected 5 tab-separated columns, found 4"),
    ("cola", "train", "CoLA/train.tsv", 2, _drop_last_column, "expected 4 tab-separated columns, found 3"),
    ("sst-2", "dev", "SST-2/dev.tsv", 3, lambda line: line + "\textra", "expected 2 tab-separated columns, found 3"),
    ("mnli", "dev_matched", "MNLI/dev_matched.tsv", 2,
     lambda line: "\t".join(line.split("\t")[:11] + ["neutral"]), "expected 16 tab-separated columns, found 12"),
    ("sst-2", "train", "SST-2/train.tsv", 3, _set_column(1, "2"), "label '2' not in ('0', '1')"),
    ("cola", "dev", "CoLA/dev.tsv", 2, _set_column(1, "x"), "label 'x' not in ('0', '1')"),
    ("mnli", "train", "MNLI/train.tsv", 4, _set_column(11, "-"),
     "label '-' not in ('contradiction', 'entailment', 'neutral')"),
    ("rte", "dev", "RTE/dev.tsv", 2, _set_column(3, "entailed"), "label 'entailed' not in ('entailment', 'not_entailment')"),
    ("sts-b", "train", "STS-B/train.tsv", 3, _set_column(9, "abc"), "score 'abc' is not a number"),
    ("sts-b", "train", "STS-B/train.tsv", 2, _set_column(9, "5.5"), "score '5.5' outside [0, 5]"),
    ("sts-b", "dev", "STS-B/dev.tsv", 3, _set_column(9, "-0.25"), "score '-0.25' outside [0, 5]"),
    ("sts-b", "dev", "STS-B/dev.tsv", 2, _set_column(9, "nan"), "score 'nan' is not a number"),
    ("sts-b", "dev", "STS-B/dev.tsv", 2, _set_column(9, ""), "score '' is not a number"),
    # float() takes these, but none is an STS-B score (found by tests/test_fuzz_readers.py)
    ("sts-b", "dev", "STS-B/dev.tsv", 2, _set_column(9, "0_5"), "score '0_5' is not a number"),
    ("sts-b", "dev", "STS-B/dev.tsv", 3, _set_column(9, "\u0663"), "score '\u0663' is not a number"),
    ("sts-b", "train", "STS-B/train.tsv", 2, _set_column(9, "1e0"), "score '1e0' is not a number"),
    ("sts-b", "train", "STS-B/train.tsv", 4, _set_column(9, "infinity"), "score 'infinity' is not a number"),
    ("sst-2", "train", "SST-2/train.tsv", 3, lambda line: line.replace(" ", "\x00", 1),  # "contains\x00no wit"
     "NUL byte at byte 8; GLUE files are UTF-8 text (is this file UTF-16 or binary?)"),
    ("sst-2", "train", "SST-2/train.tsv", 1, lambda line: "label\tsentence\tlabel",
     "header names column(s) 'label' more than once"),
    ("sst-2", "train", "SST-2/train.tsv", 4, _set_column(0, "   "), "empty text in column 'sentence'"),
    ("rte", "train", "RTE/train.tsv", 3, _set_column(2, ""), "empty text in column 'sentence2'"),
    ("mrpc", "dev", "MRPC/dev.tsv", 2, _set_column(3, " "), "empty text in column '#1 String'"),
    ("cola", "train", "CoLA/train.tsv", 3, _set_column(3, ""), "empty text in column 'sentence'"),
    ("sst-2", "train", "SST-2/train.tsv", 2, lambda line: "", "blank line between data rows"),
    ("mrpc", "train", "MRPC/train.tsv", 1, lambda line: line.replace("#2 String", "#2 Sentence"),
     "header lacks column(s) '#2 String'"),
    ("mnli", "dev_mismatched", "MNLI/dev_mismatched.tsv", 1,
     lambda line: line.replace("gold_label", "label6").replace("sentence1\t", "premise\t"),
     "header lacks column(s) 'sentence1', 'gold_label'"),
    ("qnli", "dev", "QNLI/dev.tsv", 1, lambda line: line.replace("question", "sentence1"),
     "header lacks column(s) 'question'"),
]


@pytest.mark.parametrize("task, split, file, line, edit, reason", MALFORMED,
                         ids=[f"{m[0]}-{m[2].split('/')[1]}-{m[5][:24]}" for m in MALFORMED])
def test_malformed_row_names_file_line_and_reason(glue_dir, task, split, file, line, edit, reason):
    path = glue_dir / file
    fx.replace_line(path, line, edit(fx.read_line(path, line)))
    with pytest.raises(GlueFormatError) as err:
        read_split(glue_dir, task, split)
    assert str(err.value).startswith(f"{path}:{line}: ")
    assert reason in str(err.value)
    assert (err.value.path, err.value.line) == (str(path), line)
    assert isinstance(err.value, ValueError)


def test_invalid_utf8_names_the_line(glue_dir):
    path = glue_dir / "RTE" / "train.tsv"
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b"sorrow", b"sorr\xff")
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(GlueFormatError, match=r":3: not valid UTF-8"):
        read_split(glue_dir, "rte", "train")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be"])
def test_utf16_file_is_named_as_such(glue_dir, encoding):
    path = glue_dir / "SST-2" / "dev.tsv"
    text = path.read_text(encoding="utf-8")
    path.write_bytes(("\ufeff" if encoding != "utf-16" else "").encode(encoding) + text.encode(encoding))
    with pytest.raises(GlueFormatError, match=r":1: starts with a UTF-16 byte-order mark"):
        read_split(glue_dir, "sst-2", "dev")
    path.write_bytes(text.encode("utf-16-le"))  # no byte-order mark: NUL bytes between the letters
    with pytest.raises(GlueFormatError, match=r":1: NUL byte at byte 1; .* UTF-16"):
        read_split(glue_dir, "sst-2", "dev")


@pytest.mark.parametrize("content, reason", [
    ("", "empty file; expected a header with columns sentence, label"),
    ("sentence\tlabel\n", "the file has no examples"),
    ("sentence\tlabel\n\n\n", "the file has no examples"),
])
def test_empty_files_are_errors(glue_dir, content, reason):
    path = glue_dir / "SST-2" / "dev.tsv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(GlueFormatError) as err:
        read_split(glue_dir, "sst-2", "dev")
    assert str(err.value) == f"{path}:1: {reason}"


def test_format_error_pickles():
    err = pickle.loads(pickle.dumps(GlueFormatError("/d/RTE/dev.tsv", 7, "bad")))
    assert str(err) == "/d/RTE/dev.tsv:7: bad"
    assert (err.path, err.line, err.reason) == ("/d/RTE/dev.tsv", 7, "bad")


# --- paths -------------------------------------------------------------------------------------

def test_task_path(glue_dir):
    assert task_path(glue_dir, TASKS["mnli"], "dev_mismatched") == glue_dir / "MNLI" / "dev_mismatched.tsv"
    assert task_path(glue_dir, "sst2", "train") == glue_dir / "SST-2" / "train.tsv"


def test_missing_file_names_path_and_layout(tmp_path):
    fx.write_glue_dir(tmp_path, folders=["RTE"])
    with pytest.raises(FileNotFoundError) as err:
        read_split(tmp_path, "mrpc", "dev")
    message = str(err.value)
    assert str(tmp_path / "MRPC" / "dev.tsv") in message
    assert f"{tmp_path}/MRPC/{{train.tsv, dev.tsv}}" in message
    assert "sub-folders: RTE" in message


def test_missing_data_dir_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        task_path(tmp_path / "nope", "rte", "train")


def test_task_folder_instead_of_parent_gets_a_hint(glue_dir):
    with pytest.raises(FileNotFoundError, match="looks like the RTE folder itself; pass its parent"):
        task_path(glue_dir / "RTE", "rte", "train")


def test_unknown_split_lists_splits(glue_dir):
    with pytest.raises(ValueError, match="unknown split 'dev'; accepted: train, dev_matched, dev_mismatched"):
        task_path(glue_dir, "mnli", "dev")


# --- the real files ----------------------------------------------------------------------------

# MRPC train: the shared copy has 3667 data rows (3668 lines with the header; 2473 positive).
# The canonical GLUE MRPC train has 3668 rows (2474 positive), so one positive pair is absent
# from this copy; the counts below are those of the files actually on disk.
REAL = [
    ("mrpc", "train", 3667, {0: 1194, 1: 2473},
     ('Amrozi accused his brother , whom he called " the witness " , of deliberately distorting his evidence .',
      'Referring to him as only " the witness " , Amrozi accused his brother of deliberately distorting his evidence .', 1),
     ("The 30-year bond US30YT = RR rose 22 / 32 for a yield of 4.31 percent , versus 4.35 percent at Wednesday 's close .",
      "The 30-year bond US30YT = RR grew 1-3 / 32 for a yield of 4.30 percent , down from 4.35 percent late Wednesday .", 0)),
    ("mrpc", "dev", 408, {0: 129, 1: 279},
     ("He said the foodservice pie business doesn 't fit the company 's long-term growth strategy .",
      '" The foodservice pie business does not fit our long-term growth strategy .', 1),
     ("Ex-KGB agent Putin added that the Beatles were considered ' propaganda of an alien ideology ' .",
      'In Soviet times the Beatles \' music " was considered propaganda of an alien ideology .', 1)),
    ("sst-2", "train", 67349, {0: 29780, 1: 37569},
     ("hide new secretions from the parental units", None, 0),
     ("this new jangle of noise , mayhem and stupidity must be a serious contender for the title .", None, 0)),
    ("sst-2", "dev", 872, {0: 428, 1: 444},
     ("it 's a charming and often affecting journey .", None, 1),
     ("looking aristocratic , luminous yet careworn in jane hamilton 's exemplary costumes , rampling gives a "
      "performance that could not be improved upon . '", None, 1)),
    ("sts-b", "train", 5749, None,
     ("A plane is taking off.", "An air plane is taking off.", 5.0),
     ("Putin spokesman: Doping charges appear unfounded",
      "The Latest on Severe Weather: 1 Dead in Texas After Tornado", 0.0)),
    ("sts-b", "dev", 1500, None,
     ("A man with a hard hat is dancing.", "A man wearing a hard hat is dancing.", 5.0),
     ("New video shows US police officers beating mentally-ill man",
      "New York police officer critically wounded in hatchet attack", 0.0)),
]

# Sum of all STS-B scores, checked independently with awk over the score column.
STSB_SCORE_SUM = {"train": 15528.043396825, "dev": 3545.861333333}


@pytest.mark.parametrize("task, split, count, label_counts, first, last", REAL,
                         ids=[f"{r[0]}-{r[1]}" for r in REAL])
def test_real_files(task, split, count, label_counts, first, last):
    if not (REAL_GLUE / TASKS[task].folder).is_dir():
        pytest.skip(f"real GLUE files not found under {REAL_GLUE}")
    examples = read_split(REAL_GLUE, task, split)
    assert len(examples) == count
    assert _triples([examples[0], examples[-1]]) == [first, last]
    assert (examples[0].line, examples[-1].line) == (2, count + 1)
    if label_counts is not None:
        counts = Counter(e.label for e in examples)
        assert counts == label_counts and sum(counts.values()) == count
    else:
        assert all(0.0 <= e.label <= 5.0 for e in examples)
        assert math.fsum(e.label for e in examples) == pytest.approx(STSB_SCORE_SUM[split], abs=1e-6)
    assert all(e.text_a == e.text_a.strip() and e.text_a for e in examples)
    assert all(isinstance(e, Example) for e in examples)


def test_taskspec_is_a_frozen_dataclass():
    with pytest.raises(AttributeError):
        TASKS["rte"].name = "x"  # type: ignore[misc]
    assert isinstance(TASKS["rte"], TaskSpec)
