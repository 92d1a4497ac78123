"""Classification/regression readers for a user's own CSV, TSV and JSON Lines files, and the Chinese
BERT tokenizer on ChnSentiCorp against transformers' own tokenizer."""

from __future__ import annotations

import csv
import shutil
from collections import Counter

import pytest

from conftest import ROOT
from hpcbert.data.own import label_set, read_classification

CHINESE = ROOT.parent / "shared" / "data" / "chinese"


def _write(tmp_path, name, text, encoding="utf-8"):
    p = tmp_path / name
    p.write_bytes(text.encode(encoding))
    return p


def test_csv_quoting_pairs_and_line_numbers(tmp_path):
    p = _write(tmp_path, "train.csv",
               'id,premise,hypothesis,label\n'
               '1,"A man, a plan","He said ""hi""",yes\n'
               '2,"two\nlines",short,no\n'
               '3,plain,text,10\n'
               '4,more,text,2\n')
    d = read_classification(p, ["premise", "hypothesis"], "label")
    assert d.labels == ("10", "2", "no", "yes")  # not all integers: sorted as text
    assert [(e.text_a, e.text_b, e.line) for e in d.examples] == [
        ("A man, a plan", 'He said "hi"', 2), ("two\nlines", "short", 3), ("plain", "text", 5), ("more", "text", 6)]
    assert [e.label for e in d.examples] == [3, 2, 0, 1]
    single = read_classification(p, "premise", "label")
    assert single.examples[0].text_b is None


def test_tsv_has_no_quoting_and_integer_labels_sort_by_value(tmp_path):
    p = _write(tmp_path, "t.tsv", 'label\ttext\n10\t"unbalanced quote\n2\tnext row\n')
    d = read_classification(p, "text", "label")
    assert [e.text_a for e in d.examples] == ['"unbalanced quote', "next row"]  # rows not merged
    assert d.labels == ("2", "10") and label_set(p, "label") == ("2", "10")
    assert [e.label for e in d.examples] == [1, 0]


def test_jsonl_and_regression(tmp_path):
    p = _write(tmp_path, "d.jsonl", '{"s": "good", "y": 4.5, "c": 1}\n{"s": "bad", "y": "0.25", "c": 0}\n')
    d = read_classification(p, "s", "y", regression=True)
    assert d.labels is None and [e.label for e in d.examples] == [4.5, 0.25]
    assert [e.line for e in d.examples] == [1, 2]
    c = read_classification(p, ["s"], "c")
    assert c.labels == ("0", "1") and [e.label for e in c.examples] == [1, 0]
    same = read_classification(_write(tmp_path, "d.txt", p.read_text()), "s", "c", fmt="jsonl")
    assert same.examples == c.examples


def test_dev_uses_the_training_label_set(tmp_path):
    train = _write(tmp_path, "train.tsv", "label\ttext\npos\tgood\nneg\tbad\n")
    dev = _write(tmp_path, "dev.tsv", "qid\ttext\tlabel\n7\tfine\tpos\n8\thm\tmeh\n")
    labels = label_set(train, "label")
    assert labels == ("neg", "pos")
    with pytest.raises(ValueError) as e:
        read_classification(dev, "text", "label", labels=labels)
    assert str(e.value) == f"{dev}:3: label: label 'meh' is not in the training label set (neg, pos)"


@pytest.mark.parametrize("name, content, args, kwargs, expected", [
    ("a.csv", "text,label\nhi,1\n", ("sentence", "label"), {}, ":2: sentence: no such column; the columns are text, label"),
    ("a.csv", "text,label\nhi,1\n  ,0\n", ("text", "label"), {}, ":3: text: empty text"),
    ("a.csv", "text,label\nhi,\n", ("text", "label"), {}, ":2: label: empty label"),
    ("a.csv", "text,label\nhi,1\nhi,1,extra\n", ("text", "label"), {}, ":3: 3 fields, the header has 2"),
    ("a.csv", "text,label\nhi,1\n\nho,0\n", ("text", "label"), {}, ":3: 0 fields, the header has 2"),
    ("a.csv", "text,text\nhi,1\n", ("text", "text"), {}, ":1: header repeats column 'text'"),
    ("a.tsv", "text\tscore\nhi\t3.5\nho\tabout 2\n", ("text", "score"), {"regression": True},
     ":3: score: 'about 2' is not a number"),
    ("a.tsv", "text\tscore\nhi\tnan\n", ("text", "score"), {"regression": True}, ":2: score: 'nan' is not a number"),
    ("a.jsonl", '{"t": "x", "l": 1}\n{"t": "y", "l": 2,}\n', ("t", "l"), {}, ":2: malformed JSON at column"),
    ("a.jsonl", '{"t": "x", "l": 1}\n\n{"t": "y", "l": 2}\n', ("t", "l"), {}, ":2: empty line"),
    ("a.jsonl", '["x", 1]\n', ("t", "l"), {}, ":1: expected a JSON object"),
    ("a.jsonl", '{"t": 5, "l": 1}\n', ("t", "l"), {}, ":1: t: not a string"),
    ("a.jsonl", '{"t": "x", "l": true}\n', ("t", "l"), {}, ":1: l: expected a class label, got true"),
    ("a.xlsx", "text,label\n", ("text", "label"), {}, ": cannot tell the format from the extension '.xlsx'"),
    ("a.csv", "text,label\n", ("text", "label"), {"fmt": "parquet"}, ": format 'parquet'; accepted: csv, jsonl, tsv"),
    ("a.csv", "text,label\n", ("text", "label"), {}, ": no rows after the header"),
    ("a.csv", "", ("text", "label"), {}, ":1: empty file"),
    ("a.csv", "text,label\nhi,1\n", (["a", "b", "c"], "label"), {}, "expected one column name"),
])
def test_errors_are_one_line_naming_file_line_and_field(tmp_path, name, content, args, kwargs, expected):
    p = _write(tmp_path, name, content)
    with pytest.raises(ValueError) as e:
        read_classification(p, *args, **kwargs)
    msg = str(e.value)
    assert expected in msg and "\n" not in msg
    if "expected one column name" not in expected:
        assert msg.startswith(str(p))


def test_wrong_encoding_names_the_line(tmp_path):
    p = _write(tmp_path, "l1.tsv", "text\tlabel\nok\t1\ncaf\u00e9\t0\n", encoding="latin-1")
    with pytest.raises(ValueError, match=r"l1\.tsv:3: byte 0xe9 is not UTF-8"):
        read_classification(p, "text", "label")
    p = _write(tmp_path, "u16.csv", "text,label\nhi,1\n", encoding="utf-16-le")
    with pytest.raises(ValueError, match=r"u16\.csv:1: NUL character"):
        read_classification(p, "text", "label")
    bom = _write(tmp_path, "bom.csv", "\ufefftext,label\nhi,1\n")  # Excel's UTF-8 BOM is not a column name
    assert read_classification(bom, "text", "label").examples[0].text_a == "hi"


# --- ChnSentiCorp and the Chinese BERT vocabulary ------------------------------------------------

@pytest.fixture(scope="module")
def chnsenticorp():
    d = CHINESE / "chnsenticorp"
    if not (d / "train.tsv").is_file():
        pytest.skip(f"ChnSentiCorp not found at {d} (it lives in ../shared beside the project)")
    train = read_classification(d / "train.tsv", "text_a", "label")
    dev = read_classification(d / "dev.tsv", "text_a", "label", labels=train.labels)  # extra qid column
    return train, dev


def test_chnsenticorp_reads_whole(chnsenticorp):
    train, dev = chnsenticorp
    assert train.labels == ("0", "1")
    # README: train 9,600 rows (4,799 positive = label 1, 4,801 negative); dev 1,200 (593 / 607)
    assert Counter(e.label for e in train.examples) == {1: 4799, 0: 4801}
    assert sorted(Counter(e.label for e in dev.examples).values()) == [593, 607]
    # Independent count of data rows: physical lines minus the header (no row spans lines in a TSV)
    for split, data in (("train", train), ("dev", dev)):
        with open(CHINESE / "chnsenticorp" / f"{split}.tsv", encoding="utf-8", newline="") as f:
            n = sum(1 for _ in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)) - 1
        assert len(data.examples) == n
        assert data.examples[-1].line == n + 1


@pytest.mark.parametrize("files", [("tokenizer.json",), ("vocab.txt",)])
def test_chinese_tokenizer_matches_transformers(chnsenticorp, tmp_path, files):
    """features.load_tokenizer gives the ids of transformers' BertTokenizerFast on every
    ChnSentiCorp text, from tokenizer.json and from vocab.txt alone (each with tokenizer_config.json:
    without it transformers lower-cases by default, so "XP" becomes "xp" and 2,069 texts differ)."""
    transformers = pytest.importorskip("transformers")
    src = CHINESE / "bert-base-chinese"
    if not (src / "vocab.txt").is_file():
        pytest.skip(f"bert-base-chinese vocabulary not found at {src}")
    from hpcbert.data.features import load_tokenizer

    for name in files + ("tokenizer_config.json", "config.json"):
        shutil.copyfile(src / name, tmp_path / name)
    train, dev = chnsenticorp
    texts = [e.text_a for e in train.examples + dev.examples]
    ours = [e.ids for e in load_tokenizer(tmp_path, 512).encode_batch(texts)]
    hf = transformers.BertTokenizerFast.from_pretrained(str(tmp_path), local_files_only=True)
    theirs = hf(texts, truncation=True, max_length=512)["input_ids"]
    diff = [i for i in range(len(texts)) if ours[i] != theirs[i]]
    assert not diff, f"{len(diff)} texts differ, first: {texts[diff[0]][:60]!r}"
    assert max(map(len, ours)) == 512  # some reviews are longer than BERT's 512 tokens: truncation ran
