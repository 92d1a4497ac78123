"""Property-based fuzzing of the readers of files a user hands the kit: GLUE TSVs and checkpoints.

Each reader gets 10,000 generated mutations of real inputs (byte flips, truncation, missing and extra
columns, empty fields, other encodings, huge lines, stray quotes, blank lines, CRLF). The property:
the reader either returns exactly what an independent oracle in this file says the mutated input
holds (every still-valid row, in order, with its text), or raises the kit's one-line error naming
the file (and, for TSV, the line the oracle says is the first bad one). Never another exception
type, a traceback-worthy crash, or a hang.

The oracles are written from the file formats' definitions, not from the readers' code.
Derandomized, so a CI failure reproduces locally; no example database is written.
"""

from __future__ import annotations

import codecs
import json
import os
import random
import re
import tempfile
import warnings
from pathlib import Path

import glue_fixtures as fx
import pytest

from fuzz_bytes import BYTE_KINDS, LINE_OPS, apply_bytes, apply_line_op
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcbert.data.glue import GlueFormatError, read_split

REAL_GLUE = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"

FUZZ = settings(max_examples=10_000, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# --- the GLUE oracle ------------------------------------------------------------------------------

# task -> (fixed column names for a file without a header, text_a, text_b, label column, label
# strings or None for a 0..5 score). From the GLUE tasks' file formats (CoLA has no header).
GLUE_FORMAT = {
    "cola": (("source", "label", "annotation", "sentence"), "sentence", None, "label", ("0", "1")),
    "sst-2": (None, "sentence", None, "label", ("0", "1")),
    "mrpc": (None, "#1 String", "#2 String", "Quality", ("0", "1")),
    "sts-b": (None, "sentence1", "sentence2", "score", None),
    "qqp": (None, "question1", "question2", "is_duplicate", ("0", "1")),
    "mnli": (None, "sentence1", "sentence2", "gold_label", ("contradiction", "entailment", "neutral")),
    "qnli": (None, "question", "sentence", "label", ("entailment", "not_entailment")),
    "rte": (None, "sentence1", "sentence2", "label", ("entailment", "not_entailment")),
    "wnli": (None, "sentence1", "sentence2", "label", ("0", "1")),
}
FOLDER_TASK = {"CoLA": "cola", "SST-2": "sst-2", "MRPC": "mrpc", "STS-B": "sts-b", "QQP": "qqp", "MNLI": "mnli",
               "QNLI": "qnli", "RTE": "rte", "WNLI": "wnli"}
SCORE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\Z")  # STS-B scores: '5.000', '0', '3.8'


class Bad(Exception):
    """The oracle's verdict: the first bad line."""

    def __init__(self, line: int):
        self.line = line


def glue_oracle(data: bytes, task: str) -> list[tuple]:
    """[(text_a, text_b, label, line)] a correct reader returns for `data`, or Bad(first bad line).

    Format: UTF-8 (a byte-order mark allowed before line 1), lines end in '\\n' (or '\\r\\n'), no
    NUL bytes; a header row naming the columns (each needed column once), except CoLA; every data
    row has the header's number of tab-separated fields; texts are non-empty after trimming
    whitespace; labels are one of the task's strings, STS-B scores decimals in [0, 5]; blank lines
    only after the last row; at least one row.
    """
    fixed, col_a, col_b, col_label, labels = GLUE_FORMAT[task]
    pieces = data.split(b"\n")
    if pieces[-1] == b"":
        pieces.pop()  # the file's final newline ends the last line, it does not start one
    if pieces:
        pieces[0] = pieces[0].removeprefix(codecs.BOM_UTF8)

    def text_of(i: int) -> str:
        raw = pieces[i].removesuffix(b"\r")
        if b"\x00" in raw:
            raise Bad(i + 1)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise Bad(i + 1) from None

    if fixed is None:
        if not pieces:
            raise Bad(1)
        header = [name.strip() for name in text_of(0).split("\t")]
        for needed in (col_a, col_b, col_label):
            if needed is not None and header.count(needed) != 1:
                raise Bad(1)
        start = 1
    else:
        header, start = list(fixed), 0
    rows, first_blank = [], None
    for i in range(start, len(pieces)):
        line = text_of(i)
        if line.strip() == "":
            first_blank = first_blank or i + 1
            continue
        if first_blank is not None:
            raise Bad(first_blank)
        fields = line.split("\t")
        if len(fields) != len(header):
            raise Bad(i + 1)
        row = dict(zip(header, fields))
        a = row[col_a].strip()
        b = row[col_b].strip() if col_b else None
        label = row[col_label].strip()
        if not a or b == "":
            raise Bad(i + 1)
        if labels is None:
            if not SCORE.match(label) or not 0.0 <= float(label) <= 5.0:
                raise Bad(i + 1)
            value = float(label)
        elif label in labels:
            value = labels.index(label)
        else:
            raise Bad(i + 1)
        rows.append((a, b, value, i + 1))
    if not rows:
        raise Bad(1)
    return rows


def glue_bases() -> list[tuple[str, str, str, bytes]]:
    """(task, folder, file name, bytes): every fixture file, and the first lines of the real files."""
    out = [(FOLDER_TASK[folder], folder, name, fx.tsv_text(*spec).encode("utf-8"))
           for folder, files in fx.FILES.items() for name, spec in files.items()]
    for folder in ("MRPC", "SST-2", "STS-B"):
        for name in ("train.tsv", "dev.tsv"):
            path = REAL_GLUE / folder / name
            if path.is_file():
                with open(path, "rb") as f:
                    out.append((FOLDER_TASK[folder], folder, name, b"".join(f.readline() for _ in range(7))))
    return out


BASES = glue_bases()

# --- mutations (positions are taken modulo the data's length when applied) -----------------------

SPECIAL = [b"\t", b"\n", b"\r\n", b"\r", b'"', b'""', b" ", b"", codecs.BOM_UTF8, codecs.BOM_UTF16_LE, b"\x00",
           "é".encode("latin-1"), "é".encode("utf-8"), "\u2028".encode("utf-8"), b"\x85", b"\xc3", b"\xed\xa0\x80",
           b"\n\n", b"  \t ", b"5.000", b"-1", b"nan", b"1_0", b"0_5", "٣".encode("utf-8"), b"entailment", b"1", b"0"]
FIELD_VALUES = [b"", b" ", b"0", b"1", b"2", b"entailment", b"neutral", b"-", b"5.000", b"5.", b".5", b"05", b" 4 ",
                b"0_5", b"1_0", "٣".encode("utf-8"), "５".encode("utf-8"), b"1e0", b"+3", b"-0", b"inf",
                b"nan", b"5.0001", b"0x1", b'"', b'"1"', b"label", b"sentence", b"score"]
ENCODINGS = ["latin-1", "utf-16", "utf-16-le", "utf-16-be", "utf-8-sig", "cp1252", "utf-32"]

def random_mutation(rng: random.Random) -> tuple:
    """One mutation descriptor; positions and indices are reduced modulo the data when applied.

    Drawn from a seeded generator rather than composed Hypothesis strategies: 10,000 examples then
    cost seconds, not minutes, and a failure still reproduces from the seed Hypothesis reports."""
    pos, idx = rng.randrange(1 << 20), rng.randrange(100)
    kind = rng.choice(["flip", "truncate", "delete", "insert", "drop_column", "add_column", "copy_field",
                       "empty_field", "set_field", "line", "huge", "encode", "crlf", "trailing"])
    special = rng.choice(SPECIAL) if rng.random() < 0.8 else rng.randbytes(rng.randrange(1, 7))
    return {
        "flip": ("flip", pos, rng.randrange(1, 256)),
        "truncate": ("truncate", pos),
        "delete": ("delete", pos, rng.randrange(1, 41)),
        "insert": ("insert", pos, special),
        "drop_column": ("drop_column", idx, rng.randrange(100)),
        "add_column": ("add_column", idx, rng.randrange(100), special),
        "copy_field": ("copy_field", idx, rng.randrange(100), rng.randrange(100)),
        "empty_field": ("empty_field", idx, rng.randrange(100)),
        "set_field": ("set_field", idx, rng.randrange(100),
                      rng.choice(FIELD_VALUES) if rng.random() < 0.7 else special),
        "line": ("line", idx, rng.choice(LINE_OPS)),
        "huge": ("huge", idx, rng.randrange(100), rng.choice([10_000, 300_000])),
        "encode": ("encode", rng.choice(ENCODINGS)),
        "crlf": ("crlf",),
        "trailing": ("trailing", rng.choice([b"\n", b"\n\n", b"\r\n \n", b"\n\t\n"])),
    }[kind]


def mutate(data: bytes, m: tuple) -> bytes:
    kind, *args = m
    if kind in BYTE_KINDS:
        return apply_bytes(data, m)
    lines = data.split(b"\n")
    i = args[0] % len(lines)
    fields = lines[i].split(b"\t")
    if kind == "line":
        assert apply_line_op(lines, args[1], i), m
        return b"\n".join(lines)
    j = args[1] % len(fields)
    if kind == "drop_column":
        del fields[j]
    elif kind == "add_column":
        fields.insert(j, args[2])
    elif kind == "copy_field":  # on a header: the same column name twice
        fields.insert(j, fields[args[2] % len(fields)])
    elif kind == "empty_field":
        fields[j] = b""
    elif kind == "set_field":
        fields[j] = args[2]
    elif kind == "huge":
        fields[j] = fields[j] + b"x" * args[2]
    lines[i] = b"\t".join(fields)
    return b"\n".join(lines)


def test_glue_oracle_agrees_with_the_hand_written_expectations(tmp_path):
    # The oracle itself is checked against fx.EXPECTED (written out by hand) before it judges the reader.
    for task, folder, name, data in BASES[: sum(len(f) for f in fx.FILES.values())]:
        split = name.removesuffix(".tsv")
        assert [r[:3] for r in glue_oracle(data, task)] == fx.EXPECTED[task][split], (folder, name)
    for data, line in [(b"sentence\tlabel\nok\t1\n\nok\t0\n", 3), (b"sentence\tlabel\nok\t1\x00\n", 2),
                       (b"sentence\tlabel\tlabel\nok\t1\t0\n", 1), (b"sentence\tlabel\n", 1),
                       (b"sentence\tlabel\nok\t1\nok\t2\n", 3), (b"sentence\tlabel\n \t1\n", 2)]:
        with pytest.raises(Bad) as e:
            glue_oracle(data, "sst-2")
        assert e.value.line == line, data


@pytest.fixture
def scratch(tmp_path):
    """A directory in memory when the machine has one (/dev/shm): 10,000 file writes stay cheap."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="hpcbert-fuzz-") as d:
            yield Path(d)
    else:
        yield tmp_path


def test_fuzzed_glue_files_are_read_exactly_or_rejected_with_file_and_line(scratch):
    outcomes = {"read": 0, "rejected": 0}

    @FUZZ
    @given(base=st.sampled_from(BASES), seed=st.integers(0, 2**64 - 1), count=st.integers(1, 3))
    def check(base, seed, count):
        task, folder, name, data = base
        rng = random.Random(seed)
        mutations = [random_mutation(rng) for _ in range(count)]
        for m in mutations:
            data = mutate(data, m)
        path = scratch / folder / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        try:
            expected = glue_oracle(data, task)
        except Bad as bad:
            with pytest.raises(GlueFormatError) as e:
                read_split(scratch, task, name.removesuffix(".tsv"))
            message = str(e.value)
            assert e.value.line == bad.line, (message, mutations)
            assert message.startswith(f"{path}:{bad.line}: ") and "\n" not in message and "\r" not in message
            if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                assert bad.line == 1 and "UTF-16" in message, (message, mutations)
            outcomes["rejected"] += 1
        else:
            got = read_split(scratch, task, name.removesuffix(".tsv"))
            assert [(e.text_a, e.text_b, e.label, e.line) for e in got] == expected, mutations
            outcomes["read"] += 1

    check()
    # Both sides of the property were exercised, not only the rejections.
    total = sum(outcomes.values())
    assert outcomes["read"] > total // 10 and outcomes["rejected"] > total // 10, outcomes


# --- the checkpoint manifest reader ---------------------------------------------------------------

ODD_VALUES = [None, True, False, 0, 1, 2, 3, -1, 1.5, 2.0, "2", "", "x" * 300, [], {}, [1], {"bytes": 1},
              10**12, 2**70, float("inf"), float("nan"), "0" * 64, "f" * 64, "F" * 64, "rank-00000.pt"]


def random_checkpoint_mutation(rng: random.Random, manifest: dict) -> tuple:
    """What to do to the newest checkpoint: to its manifest's bytes, to its parsed JSON, or to a
    data file. Descriptors are plain tuples so a failure message shows exactly what was done."""
    target = rng.choice(["manifest_bytes", "manifest_json", "manifest_json", "data", "none"])
    if target == "manifest_bytes":
        return ("manifest_bytes", random_mutation(rng))
    if target == "data":
        name = rng.choice(sorted(manifest["files"]))
        op = rng.choice(["flip", "truncate", "append", "delete", "directory"])
        return ("data", name, op, rng.randrange(1 << 20), rng.randrange(1, 256))
    if target == "none":
        return ("none",)
    keys = ["step", "world_size", "files", "extra"]
    op = rng.choice(["set", "delete", "set_entry", "delete_entry", "add_entry", "rename_entry", "replace_root",
                     "nest", "reformat"])
    return ("manifest_json", op, rng.choice(keys), rng.choice(sorted(manifest["files"])),
            rng.choice(["bytes", "sha256", "other"]), rng.choice(ODD_VALUES), rng.randrange(1 << 20))


def apply_checkpoint_mutation(ckdir: Path, manifest_bytes: bytes, original: bytes, m: tuple) -> None:
    """Apply `m` to ckdir; `manifest_bytes` is the manifest as it is now (JSON edits of a manifest
    that an earlier mutation left unparsable start from the `original` one)."""
    kind = m[0]
    if kind == "manifest_bytes":
        (ckdir / "MANIFEST.json").write_bytes(mutate(manifest_bytes, m[1]))
    elif kind == "data":
        _, name, op, pos, xor = m
        f = ckdir / name
        if not f.is_file():  # already deleted or replaced by an earlier mutation
            return
        data = f.read_bytes()
        if op == "flip":
            i = pos % len(data)
            f.write_bytes(data[:i] + bytes([data[i] ^ xor]) + data[i + 1:])
        elif op == "truncate":
            f.write_bytes(data[: pos % len(data)])
        elif op == "append":
            f.write_bytes(data + bytes([xor]))
        elif op == "delete":
            f.unlink()
        else:  # a directory where the file should be
            f.unlink()
            f.mkdir()
    elif kind == "manifest_json":
        _, op, key, entry, field, value, pos = m
        try:
            obj = json.loads(manifest_bytes)
        except (ValueError, RecursionError):
            obj = None
        if not (isinstance(obj, dict) and isinstance(obj.get("files"), dict)
                and all(isinstance(v, dict) for v in obj["files"].values()) and entry in obj["files"]):
            obj = json.loads(original)
        files = obj["files"]
        if op == "set":
            obj[key] = value
        elif op == "delete":
            obj.pop(key, None)
        elif op == "set_entry":
            if field == "other":
                files[entry] = value
            else:
                files[entry][field] = value
        elif op == "delete_entry":
            files[entry].pop(field, None) if field != "other" else files.pop(entry)
        elif op == "add_entry":
            files[f"rank-{pos % 3:05d}.pt" if pos % 2 else f"../{entry}"] = dict(files[entry])
        elif op == "rename_entry":
            files[entry.upper()] = files.pop(entry)
        elif op == "replace_root":
            obj = value
        if op == "nest":  # deeper than any JSON parser recursion limit
            text = "[" * (pos % 50_000 + 2_000) + "]" * (pos % 50_000 + 2_000)
        elif op == "reformat":  # the same manifest, other whitespace and key order: still valid
            text = json.dumps(dict(reversed(list(obj.items()))), indent=pos % 5, separators=(",", ": "))
        else:
            text = json.dumps(obj)
        (ckdir / "MANIFEST.json").write_text(text)


def manifest_oracle(ckdir: Path, original: dict, data_ok: bool) -> bool:
    """True iff the checkpoint in `ckdir` is intact: its manifest parses (UTF-8 JSON) to an object
    whose step, world_size and files are the saved ones, with the same JSON types (extra keys and
    formatting are allowed), and every data file holds the saved bytes."""
    if not data_ok:
        return False
    try:
        obj = json.loads((ckdir / "MANIFEST.json").read_bytes().decode("utf-8"))
    except (ValueError, RecursionError):
        return False
    canon = lambda x: json.dumps(x, sort_keys=True)  # noqa: E731  (1 vs true vs 1.0 differ here)
    return (isinstance(obj, dict) and all(k in obj for k in ("step", "world_size", "files"))
            and all(canon(obj[k]) == canon(original[k]) for k in ("step", "world_size", "files")))


def test_fuzzed_checkpoints_verify_exactly_when_intact_and_latest_falls_back(scratch):
    import torch

    from hpcbert.checkpoint import CheckpointError, CheckpointManager
    from hpcbert.model import BertConfig, BertForSequenceClassification

    # A real checkpoint of a tiny model with its optimizer state, saved by the kit (torch only here).
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32,
                                                     max_position_embeddings=32))
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 64, (2, 8))
    model.loss_sum(model(ids, None, torch.zeros_like(ids)), torch.tensor([0, 1])).backward()
    opt.step()
    mgr = CheckpointManager(scratch / "checkpoints", keep_last=3)
    mgr.save(1, {"model": model.state_dict(), "optimizer": opt.state_dict()}, {"rng": torch.get_rng_state()})
    ckdir = mgr.save(2, {"model": model.state_dict(), "optimizer": opt.state_dict()}, {"rng": torch.get_rng_state()})
    originals = {p.name: p.read_bytes() for p in ckdir.iterdir()}
    manifest_bytes = originals["MANIFEST.json"]
    manifest = json.loads(manifest_bytes)
    outcomes = {"intact": 0, "rejected": 0}

    touched = set(originals)  # files a mutation may have changed since they were last restored

    def restore():
        for name in touched:
            if (ckdir / name).is_dir():
                (ckdir / name).rmdir()
            (ckdir / name).write_bytes(originals[name])
        touched.clear()

    @FUZZ
    @given(seed=st.integers(0, 2**64 - 1), count=st.integers(1, 2))
    def check(seed, count):
        rng = random.Random(seed)
        mutations = [random_checkpoint_mutation(rng, manifest) for _ in range(count)]
        restore()
        for m in mutations:
            touched.add(m[1] if m[0] == "data" else "MANIFEST.json")
            apply_checkpoint_mutation(ckdir, (ckdir / "MANIFEST.json").read_bytes(), manifest_bytes, m)
        data_ok = all((ckdir / n).is_file() and (ckdir / n).read_bytes() == originals[n]
                      for n in touched if n != "MANIFEST.json")
        intact = manifest_oracle(ckdir, manifest, data_ok)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = mgr.latest()
        if intact:
            ck = mgr.verify(ckdir)
            assert (ck.path, ck.step, ck.world_size) == (ckdir, 2, 1), mutations
            assert found.step == 2 and not caught, mutations
            outcomes["intact"] += 1
        else:
            with pytest.raises(CheckpointError) as e:
                mgr.verify(ckdir)
            message = str(e.value)
            assert message.startswith(f"{ckdir}/") and "\n" not in message and len(message) < 1000, (message, mutations)
            assert found is not None and found.step == 1, mutations  # the previous checkpoint, verified
            assert len(caught) == 1 and str(ckdir) in str(caught[0].message), mutations
            outcomes["rejected"] += 1

    check()
    touched.update(originals)
    restore()
    assert sorted(p.name for p in ckdir.iterdir()) == sorted(originals)  # no mutation escaped restore()
    assert mgr.load(mgr.verify(ckdir))[0]["model"]["classifier.weight"].equal(model.state_dict()["classifier.weight"])
    total = sum(outcomes.values())
    assert outcomes["intact"] > total // 10 and outcomes["rejected"] > total // 10, outcomes
