"""`hpcbert prepare-pretraining`: raw text -> sharded token arrays (hpcbert.data.pretrain).

Expected values come from outside the code under test: dropped counts are counted by hand in the
texts below, token ids come from transformers' pure-Python BertTokenizer on the same vocabulary.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import minilm_dir_or_skip
from hpcbert.cli import main as hpcbert_main
from hpcbert.data import pretrain

PRETRAIN_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "pretrain"

PLAIN = """\
The quick brown fox jumps over the lazy dog.
It was not amused.

 = Heading Only =

Second document, first line.
  Second line with café and naïve words.
 = = A section = =
Third line after a heading.



Tiny.
"""
# hand count: documents kept: 3 ("The quick..", "Second document..", "Tiny."); heading lines 2;
# empty documents 1 (the paragraph holding only "= Heading Only =").
PLAIN_DOCS = [
    ["The quick brown fox jumps over the lazy dog.", "It was not amused."],
    ["Second document, first line.", "Second line with café and naïve words.", "Third line after a heading."],
    ["Tiny."],
]

WIKI = """\
<doc id="1" url="?curid=1" title="Stub One">
Stub One


</doc>
<doc id="2" url="?curid=2" title="Fox">
Fox

A fox is a small omnivorous mammal.
Behaviour.

Foxes are mostly nocturnal.
</doc>
<doc id="3" url="?curid=3" title="Empty">
</doc>
<doc id="4" url="?curid=4" title="Dog">
Dog

Dogs bark.
</doc>
<doc id="5" url="?curid=5" title="Stub Two">
Stub Two
</doc>
"""
# hand count: title lines 4 (docs 1, 2, 4, 5), stubs 2 (docs 1, 5), empty documents 1 (doc 3).
WIKI_DOCS = [
    ["A fox is a small omnivorous mammal.", "Behaviour.", "Foxes are mostly nocturnal."],
    ["Dogs bark."],
]


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return minilm_dir_or_skip()


@pytest.fixture(scope="module")
def reference(tok_dir):
    """Independent tokenisation: transformers' pure-Python WordPiece on the same vocab.txt."""
    transformers = pytest.importorskip("transformers")
    bt = transformers.BertTokenizer(str(tok_dir / "vocab.txt"), do_lower_case=True)
    return lambda lines: [i for line in lines for i in bt.convert_tokens_to_ids(bt.tokenize(line))]


def run(tmp_path, inputs, out="out", *extra, tok=None, capsys=None):
    argv = ["prepare-pretraining", *map(str, inputs), "--tokenizer", str(tok), "--max-seq-length", "128",
            "--out", str(tmp_path / out), *map(str, extra)]
    return hpcbert_main(argv)


def _lines(s: pretrain.Shard, j: int) -> list[list[int]]:
    """Document j of a shard as its lines' token lists (line offsets inside the document)."""
    a, b = s.offsets[j], s.offsets[j + 1]
    cuts = [c for c in s.lines.tolist() if a <= c < b] + [b]
    return [s.tokens[x:y].tolist() for x, y in zip(cuts, cuts[1:])]


def documents_in_order(prep: pretrain.Prepared, lines: bool = False) -> list[list[int]]:
    """All documents of both splits, back in corpus order (eval ids say where eval documents were);
    with lines=True each document is a list of its lines."""
    doc = _lines if lines else (lambda s, j: s.document(j).tolist())
    train = [doc(s, j) for s in prep.splits["train"] for j in range(len(s.offsets) - 1)]
    ev = [doc(s, j) for s in prep.splits["eval"] for j in range(len(s.offsets) - 1)]
    ids = set(prep.metadata["eval_document_ids"])
    out, ti, ei = [], iter(train), iter(ev)
    for i in range(len(train) + len(ev)):
        out.append(next(ei) if i in ids else next(ti))
    return out


def file_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_plain_text_tokens_dropped_counts_and_split(tmp_path, tok_dir, reference, capsys):
    src = tmp_path / "corpus.txt"
    src.write_text(PLAIN)
    assert run(tmp_path, [src], "out", "--eval-docs", "1", "--seed", "3", tok=tok_dir) == 0
    final = capsys.readouterr().out
    assert "1 empty documents, 2 heading lines" in final
    prep = pretrain.load_prepared(tmp_path / "out", verify_sha256=True)
    meta = prep.metadata
    assert meta["dropped"] == {"title_lines": 0, "stub_documents": 0, "empty_documents": 1, "heading_lines": 2,
                               "replaced_bytes": 0, "empty_after_tokenisation": 0,
                               "empty_lines_after_tokenisation": 0}
    assert meta["dtype"] == "uint16" and meta["tokenizer"]["vocab_size"] == 30522
    assert prep.splits["train"][0].tokens.dtype == np.uint16
    assert isinstance(prep.splits["train"][0].tokens, np.memmap)
    expected = [reference(d) for d in PLAIN_DOCS]
    assert documents_in_order(prep) == expected  # every token once, in document order
    assert documents_in_order(prep, lines=True) == [[reference([ln]) for ln in d] for d in PLAIN_DOCS]
    assert meta["splits"]["train"]["lines"] + meta["splits"]["eval"]["lines"] == 6
    assert len(meta["eval_document_ids"]) == 1 and meta["splits"]["eval"]["documents"] == 1
    assert meta["splits"]["train"]["documents"] == 2
    total = sum(map(len, expected))
    assert meta["splits"]["train"]["tokens"] + meta["splits"]["eval"]["tokens"] == total
    ev = meta["splits"]["eval"]["tokens"]
    assert meta["splits"]["eval"]["expected_sequences"] == -(-ev // 126)
    src_meta = meta["sources"][0]
    assert src_meta["bytes"] == len(PLAIN.encode()) and src_meta["format"] == "plain"
    import hashlib
    assert src_meta["sha256"] == hashlib.sha256(PLAIN.encode()).hexdigest()
    from hpcbert.data.features import load_tokenizer
    fp = pretrain.tokenizer_sha256(load_tokenizer(tok_dir, 64))[:16]  # any truncation length: the same
    assert meta["tokenizer"]["sha256"].startswith(fp)
    pretrain.load_prepared(tmp_path / "out", tokenizer_sha256=fp)


def test_wikiextractor_titles_stubs_and_directory_input(tmp_path, tok_dir, reference):
    d = tmp_path / "wiki" / "AA"
    d.mkdir(parents=True)
    (d / "wiki_01").write_text(WIKI.replace('id="', 'id="9'))  # sorted after wiki_00
    (d / "wiki_00").write_text(WIKI)
    assert run(tmp_path, [tmp_path / "wiki"], "out", "--eval-docs", "0", tok=tok_dir) == 0
    prep = pretrain.load_prepared(tmp_path / "out")
    meta = prep.metadata
    assert [s["path"] for s in meta["sources"]] == [str(d / "wiki_00"), str(d / "wiki_01")]
    assert all(s["format"] == "wikiextractor" and s["documents"] == 2 for s in meta["sources"])
    assert meta["dropped"] == {"title_lines": 8, "stub_documents": 4, "empty_documents": 2, "heading_lines": 0,
                               "replaced_bytes": 0, "empty_after_tokenisation": 0,
                               "empty_lines_after_tokenisation": 0}
    assert documents_in_order(prep) == [reference(x) for x in WIKI_DOCS * 2]
    assert documents_in_order(prep, lines=True) == [[reference([ln]) for ln in d] for d in WIKI_DOCS * 2]
    assert meta["splits"]["eval"] == {"documents": 0, "lines": 0, "tokens": 0, "expected_sequences": 0,
                                      "shards": []}


def test_same_input_same_bytes_any_workers_and_split_by_seed(tmp_path, tok_dir, monkeypatch):
    monkeypatch.setattr(pretrain, "_BATCH_BYTES", 200)  # many batches in flight: their order must hold
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(f"Document number {i} says {'hello ' * (i % 7 + 1)}there." for i in range(60)))
    common = ["--eval-docs", "0.1", "--shard-tokens", "100"]
    assert run(tmp_path, [src], "a", *common, tok=tok_dir) == 0
    assert run(tmp_path, [src], "b", *common, tok=tok_dir) == 0
    assert run(tmp_path, [src], "w2", *common, "--workers", "2", tok=tok_dir) == 0
    a = file_bytes(tmp_path / "a")
    assert len([n for n in a if n.startswith("train_")]) >= 4  # several shards were written
    assert a == file_bytes(tmp_path / "b") == file_bytes(tmp_path / "w2")
    meta = json.loads(a["metadata.json"])
    ids = meta["eval_document_ids"]
    assert len(ids) == 6 and len(set(ids)) == 6 and meta["splits"]["eval"]["documents"] == 6
    assert meta["splits"]["train"]["documents"] == 54  # disjoint: 54 + 6 = all 60
    assert run(tmp_path, [src], "s1", *common, "--seed", "1", tok=tok_dir) == 0
    assert json.loads((tmp_path / "s1" / "metadata.json").read_text())["eval_document_ids"] != ids
    # documents stay whole in one shard: a shard holds >= 100 tokens except the last one
    lengths = [s["tokens"]["length"] for s in meta["splits"]["train"]["shards"]]
    assert all(n >= 100 for n in lengths[:-1]) and sum(lengths) == meta["splits"]["train"]["tokens"]


def test_int32_for_a_vocabulary_over_65536(tmp_path):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"] + [f"w{i}" for i in range(70000)]
    tdir = tmp_path / "tok"
    tdir.mkdir()
    (tdir / "vocab.txt").write_text("\n".join(vocab) + "\n")
    src = tmp_path / "c.txt"
    src.write_text("hello world w69999\n")
    assert run(tmp_path, [src], "out", "--eval-docs", "0", tok=tdir) == 0
    prep = pretrain.load_prepared(tmp_path / "out")
    assert prep.metadata["dtype"] == "int32"
    assert prep.splits["train"][0].tokens.tolist() == [5, 6, 70006]


def error_of(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_inputs_one_line_exit_2(tmp_path, tok_dir, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\nok \xff\xfe here\n\nmore \xc3 text\n")
    assert run(tmp_path, [bad], "o1", tok=tok_dir) == 2
    assert error_of(capsys).endswith(f"{bad}: byte 13: not UTF-8 (b'\\xff'); fix the file or pass --errors "
                                     "replace to replace and count such bytes")
    assert not (tmp_path / "o1").exists()
    assert run(tmp_path, [bad], "o2", "--errors", "replace", "--eval-docs", "0", tok=tok_dir) == 0
    meta = json.loads((tmp_path / "o2" / "metadata.json").read_text())
    assert meta["dropped"]["replaced_bytes"] == 3  # \xff, \xfe, and the truncated sequence \xc3
    capsys.readouterr()

    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n = Only a heading =\n\n")
    assert run(tmp_path, [empty], "o3", tok=tok_dir) == 2
    assert "empty corpus, no document left after cleaning" in error_of(capsys)

    assert run(tmp_path, [tmp_path / "nope.txt"], "o4", tok=tok_dir) == 2
    assert error_of(capsys).endswith(f"input {tmp_path / 'nope.txt'}: no such file or directory")
    assert run(tmp_path, [str(tmp_path / "*.none")], "o4", tok=tok_dir) == 2
    assert "glob matches no file" in error_of(capsys)
    # a file reached twice: named twice, or named and inside a folder given too
    assert run(tmp_path, [empty, empty], "o4", tok=tok_dir) == 2
    assert error_of(capsys).endswith(f"input {empty}: {empty} is also reached by input {empty}; each file once "
                                     "(its documents would be read twice)")
    assert run(tmp_path, [tmp_path, bad], "o4", tok=tok_dir) == 2
    assert error_of(capsys).endswith(f"input {bad}: {bad} is also reached by input {tmp_path}; each file once "
                                     "(its documents would be read twice)")
    for length in (7, 513):
        assert hpcbert_main(["prepare-pretraining", str(bad), "--tokenizer", str(tok_dir), "--max-seq-length",
                             str(length), "--out", str(tmp_path / "o4")]) == 2
        assert error_of(capsys).endswith(f"--max-seq-length {length}: from 8 (what hpcbert train --task mlm takes) "
                                         "to 512 (BERT's positions)")
    assert not (tmp_path / "o4").exists()

    nomask = tmp_path / "nomask"
    nomask.mkdir()
    (nomask / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n")
    assert run(tmp_path, [bad], "o5", tok=nomask) == 2
    assert error_of(capsys).endswith(f"--tokenizer {nomask}: vocabulary lacks [MASK]; masked-LM pre-training "
                                     "needs [MASK], [CLS] and [SEP]")

    wiki = tmp_path / "w.txt"
    wiki.write_text('<doc id="1">\nT\n\nText.\n</doc>\nstray text\n')
    assert run(tmp_path, [wiki], "o6", tok=tok_dir) == 2
    msg = error_of(capsys)  # byte 29 = 13 + 2 + 1 + 6 + 7, the lines before "stray text"
    assert msg.startswith(f"hpcbert prepare-pretraining: error: {wiki}: byte 29: text outside <doc")
    wiki.write_text('<doc id="1">\nT\n\nText.\n')
    assert run(tmp_path, [wiki], "o6", tok=tok_dir) == 2
    assert error_of(capsys).endswith(f"{wiki}: <doc> opened at byte 0 is not closed by </doc>")

    src = tmp_path / "c.txt"
    src.write_text("one\n\ntwo\n")
    assert run(tmp_path, [src], "o7", "--eval-docs", "2", tok=tok_dir) == 2
    assert "2 of 2 documents would leave none to train on" in error_of(capsys)
    assert run(tmp_path, [src], "o7", "--eval-docs", "1.5", tok=tok_dir) == 2
    assert "give a document count (100) or a fraction in [0, 1)" in error_of(capsys)


def test_load_prepared_detects_damage_and_rerun_is_up_to_date(tmp_path, tok_dir, capsys):
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(f"Document {i} has some words in it." for i in range(20)))
    assert run(tmp_path, [src], "out", "--eval-docs", "0", tok=tok_dir) == 0
    capsys.readouterr()
    assert run(tmp_path, [src], "out", "--eval-docs", "0", tok=tok_dir) == 0
    assert "already prepared, nothing to do" in capsys.readouterr().out
    assert run(tmp_path, [src], "out", "--eval-docs", "0", tok=f"{tok_dir}/") == 0  # same tokenizer, other spelling
    assert "already prepared, nothing to do" in capsys.readouterr().out
    assert run(tmp_path, [src], "out", "--eval-docs", "0", "--seed", "5", tok=tok_dir) == 2
    assert "holds data prepared from other inputs or options (seed differ)" in error_of(capsys)

    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"prepared with another tokenizer \(sha256 [0-9a-f]{16}\.\.\., given 0000"):
        pretrain.load_prepared(out, tokenizer_sha256="0" * 64)
    shard = out / "train_00000.tokens.npy"
    data = shard.read_bytes()
    shard.write_bytes(data[:-6])  # truncated: 3 tokens short
    with pytest.raises(ValueError, match=rf"^{re.escape(str(shard))}: not a readable \.npy file, truncated"):
        pretrain.load_prepared(out)
    assert run(tmp_path, [src], "out", "--eval-docs", "0", tok=tok_dir) == 2  # the rerun sees it too
    assert f"{shard}: not a readable .npy file" in error_of(capsys)
    # same size, one token changed: only the sha256 check sees it
    shard.write_bytes(data[:-2] + bytes([data[-2] ^ 1, data[-1]]))
    pretrain.load_prepared(out)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(shard))}: sha256 [0-9a-f]{{16}}\.\.\. differs"):
        pretrain.load_prepared(out, verify_sha256=True)
    # a valid .npy of another length
    np.save(shard, np.zeros(5, np.uint16))
    with pytest.raises(ValueError, match=r"wrong length 5, metadata.json says \d+$"):
        pretrain.load_prepared(out)


def test_interrupted_run_starts_over_cleanly(tmp_path, tok_dir, capsys):
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(f"Document {i} has some words in it." for i in range(30)))
    args = ["--eval-docs", "3", "--shard-tokens", "50"]
    assert run(tmp_path, [src], "ref", *args, tok=tok_dir) == 0
    out = tmp_path / "out"
    shutil.copytree(tmp_path / "ref", out)
    (out / "metadata.json").unlink()  # interrupted before the metadata was written ...
    (out / "train_00001.tokens.npy").unlink()
    (out / "train_00001.tokens.npy.tmp").write_bytes(b"\x93NUMPY partial")  # ... while writing a shard
    (out / "train_00009.tokens.npy").write_bytes(b"left from a run with other options")
    (out / "metadata.json.tmp").write_text("{")
    with pytest.raises(ValueError, match="metadata.json: missing"):
        pretrain.load_prepared(out)
    capsys.readouterr()
    assert run(tmp_path, [src], "out", *args, tok=tok_dir) == 0
    assert "removed" in capsys.readouterr().err
    assert file_bytes(out) == file_bytes(tmp_path / "ref")


@pytest.mark.parametrize("workers", [1, 2])
def test_an_interrupted_run_resumes_after_its_last_shard_and_gives_the_same_bytes(tmp_path, tok_dir, capsys,
                                                                                   monkeypatch, workers):
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(f"Document {i} has some words in it.\nAnd a second line {i}." for i in range(40)))
    args = ["--eval-docs", "4", "--shard-tokens", "60", "--workers", workers]
    assert run(tmp_path, [src], "ref", *args, tok=tok_dir) == 0
    real_add, calls = pretrain._SplitWriter.add, []

    def crashing_add(self, *a):
        calls.append(1)
        if len(calls) == 25:  # mid-way, between two resumption points
            raise KeyboardInterrupt
        return real_add(self, *a)

    monkeypatch.setattr(pretrain._SplitWriter, "add", crashing_add)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, [src], "out", *args, tok=tok_dir)
    monkeypatch.setattr(pretrain._SplitWriter, "add", real_add)
    left = file_bytes(tmp_path / "out")
    prog = json.loads(left["progress.json"])
    assert 0 < prog["index"] < 25 and "metadata.json" not in left
    assert all(n in file_bytes(tmp_path / "ref") for n in left if n != "progress.json")  # complete shards only
    capsys.readouterr()
    assert run(tmp_path, [src], "out", *args, tok=tok_dir) == 0
    assert f"resuming after {prog['index']} of 40 documents" in capsys.readouterr().err
    assert file_bytes(tmp_path / "out") == file_bytes(tmp_path / "ref")  # byte-identical, no progress.json left


def test_real_wikiextractor_slice(tmp_path, tok_dir):
    wiki = PRETRAIN_DATA / "wiki-en" / "wiki_00"
    if not wiki.is_file():
        pytest.skip(f"{PRETRAIN_DATA} absent (real pre-training text, not part of the repository)")
    from tokenizers import Tokenizer
    text = wiki.read_text(encoding="utf-8")
    src = tmp_path / "wiki_00"
    src.write_text(text)
    assert run(tmp_path, [src], "out", "--eval-docs", "0.05", tok=tok_dir) == 0
    prep = pretrain.load_prepared(tmp_path / "out", verify_sha256=True)
    meta = prep.metadata
    # independent count with regular expressions over the whole text
    bodies = re.findall(r"<doc [^>]*>\n(.*?)\n</doc>", text, flags=re.S)
    assert len(bodies) == text.count("<doc ")
    kept = [[ln.strip() for ln in b.split("\n")[1:] if ln.strip()] for b in bodies]
    kept = [k for k in kept if k]
    assert meta["dropped"]["title_lines"] == len(bodies)
    assert meta["dropped"]["stub_documents"] == len(bodies) - len(kept)
    assert meta["sources"][0]["documents"] == len(kept)
    assert len(meta["eval_document_ids"]) == round(0.05 * len(kept))
    # tokens: the Rust tokenizer line by line (the preparation tokenises whole documents)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()  # its tokenizer.json pads to 128
    got = documents_in_order(prep)
    enc = iter(tok.encode_batch([ln for k in kept for ln in k], add_special_tokens=False))
    assert got == [[i for _ in k for i in next(enc).ids] for k in kept]
