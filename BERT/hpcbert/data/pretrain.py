"""Pre-training data: raw text -> sharded token arrays for masked-LM (`hpcbert prepare-pretraining`).

    hpcbert prepare-pretraining INPUT... --tokenizer DIR --max-seq-length 128 --out DATA_DIR
        [--workers N] [--eval-docs N|FRACTION] [--seed S] [--errors strict|replace] [--shard-tokens T]

Inputs are files, directories (every file below, sorted by path) or globs, in two formats, chosen
per file by its first non-blank line:
  plain            BERT's format: one sentence or paragraph per line, a blank line between documents.
                   WikiText heading lines (`= = Title = =`) are dropped and counted.
  wikiextractor    `<doc id=.. url=.. title=..>` / title line / text lines / `</doc>`: the title line
                   is dropped, title-only stubs too; blank lines inside a document separate nothing.

Output DATA_DIR:
  {split}_{k:05d}.tokens.npy   (tokens,) uint16 (vocabulary <= 65536 ids) else int32: the token ids of
                               whole documents, concatenated, no special tokens, not truncated
  {split}_{k:05d}.offsets.npy  (documents + 1,) int64: document j is tokens[offsets[j]:offsets[j+1]]
  {split}_{k:05d}.lines.npy    (lines + 1,) int64: line j is tokens[lines[j]:lines[j+1]]; every document
                               offset is a line offset. A line is BERT's sentence (its input format: one
                               sentence per line); WikiExtractor writes a paragraph per line. The
                               pre-training reader packs whole lines and cuts next-sentence pairs there
  metadata.json                written last: tokenizer, counts per split, sources with sha256, the
                               held-out document ids, dropped counts, every array file with its sha256
A split is `train` or `eval`; the eval documents are a seeded random choice of document indices.
Everything is deterministic: the same inputs, options and seed give byte-identical files.

The corpus is read twice, one document at a time: a first pass validates it (UTF-8, format),
hashes the sources and counts documents (so `--eval-docs N` can choose N of them); the second
tokenises, line by line as BERT's create_pretraining_data does (a line break is whitespace to the
WordPiece pre-tokenizer, so the ids are those of the whole document). At most one shard's worth of
tokens (`--shard-tokens`) per split is held in memory, so memory does not grow with the corpus.

Restartable: every time a training shard is written the evaluation split is flushed too and
progress.json records where both stand (documents done, shards with their sha256). A run that was
interrupted (killed, disk full, Ctrl-C) and is started again with the same inputs and options keeps
those shards, reads the documents before that point without tokenising them again, and continues;
the result is byte-identical to an uninterrupted run. A complete output (metadata.json) is kept as
it is; anything else is removed before a fresh start.
"""

from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import json
import math
import multiprocessing
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..runfiles import sha256_file

FORMAT_VERSION = 2  # bump when the layout of the files or the cleaning rules change (2: line offsets)
METADATA = "metadata.json"
SPLITS = ("train", "eval")
PROGRESS = "progress.json"  # an unfinished run's resumption point, written after each training shard
_SHARD_RE = re.compile(r"^((train|eval)_\d{5}\.(tokens|offsets|lines)\.npy|(metadata|progress)\.json\.tmp"
                       r"|progress\.json)(\.tmp)?$")
_HEADING_RE = re.compile(r"(=+)\s.*\s\1")  # WikiText: "= Title =", "= = Section = ="
_DOC_OPEN_RE = re.compile(r"<doc(\s[^>]*)?>")
_BATCH_BYTES = 1 << 20  # text per tokenisation task: large enough to amortise IPC, small to stream


class PrepareError(ValueError):
    """Bad input or options: one line that names the file (and byte offset) and what is accepted."""


# --- reading -------------------------------------------------------------------------------------

@dataclass
class Source:
    path: str
    bytes: int = 0
    sha256: str = ""
    format: str = ""
    documents: int = 0


@dataclass
class Dropped:
    """What cleaning removed, in the units named (recorded in metadata.json)."""
    title_lines: int = 0               # wikiextractor: the title line repeated after <doc ...>
    stub_documents: int = 0            # wikiextractor: documents with nothing but their title
    empty_documents: int = 0           # documents with no line left (all headings, or <doc></doc>)
    heading_lines: int = 0             # plain: WikiText heading lines "= ... =" (any level)
    replaced_bytes: int = 0            # --errors replace: invalid UTF-8 sequences replaced by U+FFFD
    empty_after_tokenisation: int = 0  # documents whose text gives no token (index kept, not written)
    empty_lines_after_tokenisation: int = 0  # lines of kept documents that give no token (no line offset)


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files, directories (every regular file below, sorted) and globs -> files, in argument order.
    A file reached twice (named twice, or by a file and a directory or glob that holds it) is
    refused: its documents would be trained on twice as often as the others'."""
    out: list[Path] = []
    seen: dict[Path, str] = {}
    for arg in inputs:
        p = Path(arg)
        if p.is_file():
            files = [p]
        elif p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file())
            if not files:
                raise PrepareError(f"input {arg}: directory holds no file")
        elif glob.has_magic(arg):
            files = sorted(Path(f) for f in glob.glob(arg, recursive=True) if Path(f).is_file())
            if not files:
                raise PrepareError(f"input {arg}: glob matches no file")
        else:
            raise PrepareError(f"input {arg}: no such file or directory")
        for f in files:
            key = f.resolve()
            if key in seen:
                raise PrepareError(f"input {arg}: {f} is also reached by input {seen[key]}; each file once (its "
                                   f"documents would be read twice)")
            seen[key] = arg
        out.extend(files)
    return out


def _decode(raw: bytes, path: Path, offset: int, errors: str, dropped: Dropped) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if errors == "strict":
            raise PrepareError(
                f"{path}: byte {offset + e.start}: not UTF-8 ({raw[e.start:e.end]!r}); "
                "fix the file or pass --errors replace to replace and count such bytes") from None
    text, pos = [], 0
    while True:  # same result as errors="replace", counting each replaced sequence
        try:
            text.append(raw[pos:].decode("utf-8"))
            return "".join(text)
        except UnicodeDecodeError as e:
            text.append(raw[pos:pos + e.start].decode("utf-8") + "\ufffd")
            dropped.replaced_bytes += 1
            pos += e.end


def _lines(path: Path, errors: str, dropped: Dropped, h):
    """(byte offset, stripped text) per line; feeds every byte to the hash `h`."""
    offset = 0
    with open(path, "rb") as f:
        for raw in f:
            h.update(raw)
            text = _decode(raw, path, offset, errors, dropped)
            yield offset, (text.removeprefix("\ufeff") if offset == 0 else text).strip()  # a BOM is no text
            offset += len(raw)


def _sniff(path: Path) -> str:
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            s = raw.decode("utf-8", "replace")
            s = (s.removeprefix("\ufeff") if i == 0 else s).strip()  # blank as _lines sees it
            if s:
                return "wikiextractor" if _DOC_OPEN_RE.match(s) else "plain"
    return "plain"


def _plain_documents(lines, dropped: Dropped):
    doc: list[str] = []
    had_lines = False
    for _, s in lines:
        if not s:
            if doc:
                yield "\n".join(doc)
            elif had_lines:
                dropped.empty_documents += 1
            doc, had_lines = [], False
        elif _HEADING_RE.fullmatch(s):
            dropped.heading_lines += 1
            had_lines = True
        else:
            doc.append(s)
    if doc:
        yield "\n".join(doc)
    elif had_lines:
        dropped.empty_documents += 1


def _wiki_documents(path: Path, lines, dropped: Dropped):
    doc: list[str] | None = None  # None: outside <doc>
    opened_at, title_seen = 0, False
    for offset, s in lines:
        if doc is None:
            if _DOC_OPEN_RE.fullmatch(s):
                doc, opened_at, title_seen = [], offset, False
            elif s:
                raise PrepareError(f"{path}: byte {offset}: text outside <doc ...> ... </doc> "
                                   f"(WikiExtractor format, chosen by the file's first line): {s[:40]!r}")
        elif s == "</doc>":
            if doc:
                yield "\n".join(doc)
            elif title_seen:
                dropped.stub_documents += 1
            else:
                dropped.empty_documents += 1
            doc = None
        elif _DOC_OPEN_RE.fullmatch(s):
            raise PrepareError(f"{path}: byte {offset}: <doc> inside the <doc> opened at byte {opened_at}")
        elif s:
            if title_seen:
                doc.append(s)
            else:
                title_seen = True
                dropped.title_lines += 1
    if doc is not None:
        raise PrepareError(f"{path}: <doc> opened at byte {opened_at} is not closed by </doc>")


def iter_documents(files: list[Path], errors: str, dropped: Dropped, sources: list[Source]):
    """Cleaned document texts (lines joined by newlines), one at a time, in file order.
    Appends one Source per file (size, sha256, format, documents) as each file is finished."""
    for path in files:
        h = hashlib.sha256()
        fmt = _sniff(path)
        lines = _lines(path, errors, dropped, h)
        docs = _wiki_documents(path, lines, dropped) if fmt == "wikiextractor" else _plain_documents(lines, dropped)
        n = 0
        for text in docs:
            n += 1
            yield text
        sources.append(Source(str(path), path.stat().st_size, h.hexdigest(), fmt, n))


# --- tokenisation ----------------------------------------------------------------------------------

def tokenizer_sha256(tok) -> str:
    """sha256 of the tokenizer's serialised form without its truncation and padding settings: the
    same vocabulary and rules give the same hash whatever length a run loads it for."""
    spec = json.loads(tok.to_str())
    spec["truncation"] = spec["padding"] = None
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


def _encode(tok, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Document texts (lines joined by newlines) -> (all ids concatenated, (lines,) int64 tokens per
    line, (len(texts),) int64 lines per document); no special tokens. Each line is encoded alone."""
    lines = [line for text in texts for line in text.split("\n")]
    per_doc = np.fromiter((text.count("\n") + 1 for text in texts), dtype=np.int64, count=len(texts))
    enc = tok.encode_batch(lines, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) for e in enc), dtype=np.int64, count=len(enc))
    ids = np.fromiter((i for e in enc for i in e.ids), dtype=dtype, count=int(lengths.sum()))
    return ids, lengths, per_doc


_worker_tok = None
_worker_dtype = None


def _worker_init(tok_json: str, dtype: str) -> None:
    global _worker_tok, _worker_dtype
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # N processes, one thread each
    from tokenizers import Tokenizer
    _worker_tok, _worker_dtype = Tokenizer.from_str(tok_json), np.dtype(dtype)


def _worker_encode(texts: list[str]):
    return _encode(_worker_tok, texts, _worker_dtype)


def _batches(docs):
    batch, size, batch_bytes = [], 0, _BATCH_BYTES
    for text in docs:
        batch.append(text)
        size += len(text)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encoded_batches(tok, docs, dtype: np.dtype, workers: int):
    """(ids, lengths) per document batch, in input order. With workers > 1 a process pool
    tokenises at most 2 * workers batches ahead (Pool.imap would read the whole corpus ahead)."""
    if workers <= 1:
        for batch in _batches(docs):
            yield _encode(tok, batch, dtype)
        return
    # fork: spawn and forkserver re-import __main__ (the hpcbert script: torch) in every worker, seconds
    # each. Safe here: this process has not run the tokenizer (no Rust thread pool to inherit).
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with ctx.Pool(workers, initializer=_worker_init, initargs=(tok.to_str(), dtype.str)) as pool:
        pending: collections.deque = collections.deque()
        for batch in _batches(docs):
            pending.append(pool.apply_async(_worker_encode, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# --- writing ---------------------------------------------------------------------------------------


def _save_array(out: Path, name: str, arr: np.ndarray) -> dict:
    """Write arr as out/name via name.tmp + rename (a reader never sees a partial shard)."""
    tmp = out / f"{name}.tmp"
    with open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)
    os.replace(tmp, out / name)
    return {"file": name, "dtype": arr.dtype.name, "length": int(arr.shape[0]), "sha256": sha256_file(out / name)}


@dataclass
class _SplitWriter:
    out: Path
    split: str
    shard_tokens: int
    dtype: np.dtype
    shards: list = field(default_factory=list)
    documents: int = 0
    tokens: int = 0
    _ids: list = field(default_factory=list)
    _lengths: list = field(default_factory=list)
    _buffered: int = 0

    _line_lengths: list = field(default_factory=list)
    lines: int = 0

    def add(self, ids: np.ndarray, line_lengths: np.ndarray) -> None:
        """One document: its ids and the token count of each of its lines (none zero)."""
        self._ids.append(ids)
        self._lengths.append(len(ids))
        self._line_lengths.append(line_lengths)
        self._buffered += len(ids)
        if self._buffered >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._ids:
            return
        name = f"{self.split}_{len(self.shards):05d}"
        tokens = np.concatenate(self._ids).astype(self.dtype, copy=False)  # (tokens,)
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)        # (documents + 1,)
        np.cumsum(self._lengths, out=offsets[1:])
        line_lengths = np.concatenate(self._line_lengths)
        lines = np.zeros(len(line_lengths) + 1, dtype=np.int64)            # (lines + 1,)
        np.cumsum(line_lengths, out=lines[1:])
        self.shards.append({"documents": len(self._lengths), "line_count": len(line_lengths),
                            "tokens": _save_array(self.out, f"{name}.tokens.npy", tokens),
                            "offsets": _save_array(self.out, f"{name}.offsets.npy", offsets),
                            "lines": _save_array(self.out, f"{name}.lines.npy", lines)})
        self.documents += len(self._lengths)
        self.lines += len(line_lengths)
        self.tokens += len(tokens)
        self._ids, self._lengths, self._line_lengths, self._buffered = [], [], [], 0


class _Progress:
    """A progress bar on a terminal (redrawn twice a second), else a log line every 5 s."""

    def __init__(self, total_docs: int, log, tty: bool | None = None):
        self.total, self.log = total_docs, log
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.t0 = self.last = time.perf_counter()
        self.drawn = False

    def update(self, docs: int, tokens: int, bytes_done: int) -> None:
        now = time.perf_counter()
        if now - self.last < (0.5 if self.tty else 5.0):
            return
        self.last = now
        frac = docs / max(self.total, 1)
        text = (f"{docs:,}/{self.total:,} documents ({100 * frac:.0f}%), {tokens:,} tokens, "
                f"{bytes_done / 2**20 / (now - self.t0):.1f} MB/s")
        if self.tty:
            bar = "#" * int(30 * frac)
            print(f"\rprepare-pretraining [{bar:.<30}] {text}", end="", file=sys.stderr, flush=True)
            self.drawn = True
        else:
            self.log(f"prepare-pretraining: {text}")

    def close(self) -> None:
        if self.drawn:
            print(file=sys.stderr, flush=True)


def _remove_shards(out: Path, keep: frozenset = frozenset()) -> list[str]:
    removed = []
    for p in sorted(out.iterdir()):
        if _SHARD_RE.match(p.name) and p.name not in keep:
            p.unlink()
            removed.append(p.name)
    return removed


def _resumable(out: Path, header: dict, log) -> dict | None:
    """The progress.json of an interrupted run of the same inputs and options whose listed shards are
    intact (size and sha256), or None (then the run starts over)."""
    path = out / PROGRESS
    try:
        prog = json.loads(path.read_text())
        if prog["header"] != header:
            return None
        for w in prog["writers"].values():
            for sh in w["shards"]:
                for kind in ("tokens", "offsets", "lines"):
                    f = out / sh[kind]["file"]
                    if not f.is_file() or sha256_file(f) != sh[kind]["sha256"]:
                        log(f"prepare-pretraining: {f}: missing or changed since {PROGRESS}; starting over")
                        return None
        return prog
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _listed(prog: dict | None) -> frozenset:
    if not prog:
        return frozenset()
    return frozenset([PROGRESS] + [sh[k]["file"] for w in prog["writers"].values() for sh in w["shards"]
                                   for k in ("tokens", "offsets", "lines")])


def _save_progress(out: Path, header: dict, index: int, writers: dict, dropped: Dropped) -> None:
    """progress.json (atomic): documents done, each split's shards and counts, the tokenisation counts."""
    state = {s: {k: getattr(w, k) for k in ("shards", "documents", "lines", "tokens")} for s, w in writers.items()}
    tok_counts = {k: getattr(dropped, k) for k in ("empty_after_tokenisation", "empty_lines_after_tokenisation")}
    tmp = out / f"{PROGRESS}.tmp"
    tmp.write_text(json.dumps({"header": header, "index": index, "writers": state, "tokenised_dropped": tok_counts}))
    os.replace(tmp, out / PROGRESS)


def _eval_count(spec: str, n_docs: int) -> int:
    """--eval-docs: a document count (100), or a fraction in [0, 1) written with a point (0.01)."""
    bad = PrepareError(f"--eval-docs {spec!r}: give a document count (100) or a fraction in [0, 1) (0.01)")
    try:
        if spec.isdigit():
            n = int(spec)
        elif 0 <= float(spec) < 1:
            n = round(float(spec) * n_docs)
        else:
            raise bad
    except ValueError:
        raise bad from None
    if n >= n_docs:
        raise PrepareError(f"--eval-docs {spec}: {n} of {n_docs} documents would leave none to train on")
    return n


@dataclass
class Options:
    inputs: list[str]
    tokenizer: str
    max_seq_length: int
    out: str
    workers: int = 1
    eval_docs: str = "0.01"
    seed: int = 0
    errors: str = "strict"
    shard_tokens: int = 16 * 2**20

    def __post_init__(self) -> None:
        if not 8 <= self.max_seq_length <= 512:
            raise PrepareError(f"--max-seq-length {self.max_seq_length}: from 8 (what hpcbert train --task mlm "
                               f"takes) to 512 (BERT's positions)")
        if self.workers < 1:
            raise PrepareError(f"--workers {self.workers}: must be >= 1")
        if self.shard_tokens < 1:
            raise PrepareError(f"--shard-tokens {self.shard_tokens}: must be >= 1")
        if self.errors not in ("strict", "replace"):
            raise PrepareError(f"--errors {self.errors!r}: accepted: strict, replace")


def _load_checked_tokenizer(opts: Options):
    from .features import load_tokenizer

    if not Path(opts.tokenizer).exists():
        raise PrepareError(f"--tokenizer {opts.tokenizer}: no such file or directory")
    tok = load_tokenizer(opts.tokenizer, opts.max_seq_length)
    missing = [t for t in ("[MASK]", "[CLS]", "[SEP]") if tok.token_to_id(t) is None]
    if missing:
        raise PrepareError(f"--tokenizer {opts.tokenizer}: vocabulary lacks {', '.join(missing)}; "
                           "masked-LM pre-training needs [MASK], [CLS] and [SEP]")
    return tok


def prepare(opts: Options, log=None) -> dict:
    """Prepare opts.out from opts.inputs; returns the metadata (also written to metadata.json).
    An existing complete output for the same inputs and options is kept (metadata["up_to_date"])."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    files = expand_inputs(opts.inputs)
    tok = _load_checked_tokenizer(opts)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    header = {
        "format_version": FORMAT_VERSION,
        "tokenizer": {"path": str(opts.tokenizer), "sha256": tokenizer_sha256(tok), "vocab_size": vocab_size,
                      "mask_id": tok.token_to_id("[MASK]"), "cls_id": tok.token_to_id("[CLS]"),
                      "sep_id": tok.token_to_id("[SEP]"), "pad_id": tok.token_to_id("[PAD]")},
        "max_seq_length": opts.max_seq_length,
        "dtype": dtype.name,
        "seed": opts.seed,
        "eval_docs_option": opts.eval_docs,
        "errors": opts.errors,
        "shard_tokens": opts.shard_tokens,
    }

    # Pass 1: validate, hash, count documents.
    dropped, sources = Dropped(), []
    n_docs = sum(1 for _ in iter_documents(files, opts.errors, dropped, sources))
    if n_docs == 0:
        raise PrepareError(f"inputs {' '.join(opts.inputs)}: empty corpus, no document left after cleaning "
                           f"({json.dumps(vars(dropped))})")
    header["sources"] = [vars(s) for s in sources]

    out = Path(opts.out)
    meta_path = out / METADATA
    if meta_path.is_file():
        try:
            old = json.loads(meta_path.read_text())
        except (OSError, ValueError) as e:
            raise PrepareError(f"{meta_path}: unreadable ({e}); remove it to prepare again") from None
        same_tokenizer = {k: v for k, v in header["tokenizer"].items() if k != "path"}  # any spelling of it
        differ = [k for k in header if k != "tokenizer" and old.get(k) != header[k]]
        if {k: v for k, v in old.get("tokenizer", {}).items() if k != "path"} != same_tokenizer:
            differ.insert(0, "tokenizer")
        if differ:
            raise PrepareError(f"{out}: holds data prepared from other inputs or options ({', '.join(differ)} "
                               "differ); choose another --out or remove it")
        load_prepared(out, tokenizer_sha256=header["tokenizer"]["sha256"])  # its shards still match
        old["up_to_date"] = True
        return old
    out.mkdir(parents=True, exist_ok=True)
    # An interrupted run of the same inputs and options continues after its last complete training
    # shard (progress.json); anything else it left (no metadata: not trusted) is removed.
    resume = _resumable(out, header, log)
    removed = _remove_shards(out, keep=_listed(resume))
    if removed:
        log(f"prepare-pretraining: {out}: no {METADATA}, removed {len(removed)} files of an unfinished run")

    n_eval = _eval_count(opts.eval_docs, n_docs)
    rng = np.random.default_rng(opts.seed)
    eval_ids = sorted(rng.choice(n_docs, size=n_eval, replace=False).tolist()) if n_eval else []
    eval_set = set(eval_ids)

    # Pass 2: tokenise and write shards.
    tok.no_truncation()  # whole documents; packing into sequences is the reader's business
    writers = {s: _SplitWriter(out, s, opts.shard_tokens, dtype) for s in SPLITS}
    dropped2, sources2 = Dropped(), []
    docs = iter_documents(files, opts.errors, dropped2, sources2)
    index = 0
    if resume:  # documents before the resumption point are read again (cheap), not tokenised again
        index = resume["index"]
        for s, w in resume["writers"].items():
            vars(writers[s]).update(w)
        for k, v in resume["tokenised_dropped"].items():
            setattr(dropped2, k, v)
        docs = (d for i, d in enumerate(docs) if i >= index)
        log(f"prepare-pretraining: {out}: resuming after {index:,} of {n_docs:,} documents "
            f"({len(writers['train'].shards)} training shards kept)")
    progress = _Progress(n_docs, log)
    try:
        for ids, line_lengths, per_doc in _encoded_batches(tok, docs, dtype, opts.workers):
            line_starts = np.concatenate([[0], np.cumsum(line_lengths)])  # (lines + 1,) into ids
            doc_lines = np.concatenate([[0], np.cumsum(per_doc)])       # (documents + 1,) into lines
            for j in range(len(per_doc)):
                a, b = doc_lines[j], doc_lines[j + 1]
                if line_starts[b] == line_starts[a]:
                    dropped2.empty_after_tokenisation += 1
                else:
                    lens = line_lengths[a:b]
                    dropped2.empty_lines_after_tokenisation += int((lens == 0).sum())
                    split = "eval" if index in eval_set else "train"
                    shards = len(writers[split].shards)
                    writers[split].add(ids[line_starts[a]:line_starts[b]], lens[lens > 0])
                    if split == "train" and len(writers["train"].shards) > shards:
                        writers["eval"].flush()  # both splits complete up to here: a resumption point
                        _save_progress(out, header, index + 1, writers, dropped2)
                index += 1
            progress.update(index, sum(w.tokens + w._buffered for w in writers.values()),
                            sum(s.bytes for s in sources2))
        for w in writers.values():
            w.flush()
        progress.close()
        assert index == n_docs and [vars(s) for s in sources2] == header["sources"], "inputs changed while read"
        if writers["train"].tokens == 0:
            raise PrepareError(f"inputs {' '.join(opts.inputs)}: empty corpus, no token in the training "
                               "documents after cleaning and tokenisation")
    except BaseException:
        # Nothing partial stays behind; the shards up to the last resumption point stay for a re-run.
        _remove_shards(out, keep=_listed(_resumable(out, header, lambda m: None)))
        raise

    seq_len = opts.max_seq_length - 2
    meta = dict(header)
    meta["expected_sequences_definition"] = (
        f"ceil(tokens / (max_seq_length - 2)) per split: {seq_len}-token windows packed across documents, "
        "leaving room for [CLS] and [SEP]; a lower bound, the reader's packing (whole lines, a [SEP] between "
        "documents) decides the exact count")
    meta["splits"] = {s: {"documents": w.documents, "lines": w.lines, "tokens": w.tokens,
                          "expected_sequences": math.ceil(w.tokens / seq_len), "shards": w.shards}
                      for s, w in writers.items()}
    meta["eval_document_ids"] = eval_ids
    meta["eval_document_ids_definition"] = ("0-based index of the document among all documents left after "
                                            "cleaning, in input order (sources order, then file order)")
    meta["dropped"] = vars(dropped2)
    tmp = out / f"{METADATA}.tmp"
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, meta_path)  # last: its presence means the output is complete
    (out / PROGRESS).unlink(missing_ok=True)
    return meta


# --- reading prepared data -------------------------------------------------------------------------

@dataclass
class Shard:
    tokens: np.ndarray   # (tokens,) uint16/int32, memory-mapped
    offsets: np.ndarray  # (documents + 1,) int64
    lines: np.ndarray    # (lines + 1,) int64, a superset of offsets

    def document(self, j: int) -> np.ndarray:
        return self.tokens[self.offsets[j]:self.offsets[j + 1]]


@dataclass
class Prepared:
    metadata: dict
    splits: dict  # split -> list[Shard]


def _open_array(data_dir: Path, entry: dict, verify_sha256: bool) -> np.ndarray:
    name = entry["file"]
    path = data_dir / name
    if not path.is_file():
        raise ValueError(f"{path}: missing (listed in {METADATA})")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable .npy file, truncated or damaged ({e})") from None
    if arr.dtype.name != entry["dtype"] or arr.ndim != 1:
        raise ValueError(f"{path}: dtype {arr.dtype.name} shape {arr.shape}, {METADATA} says "
                         f"{entry['dtype']} ({entry['length']},)")
    if arr.shape[0] != entry["length"]:
        raise ValueError(f"{path}: wrong length {arr.shape[0]}, {METADATA} says {entry['length']}")
    if verify_sha256:
        got = sha256_file(path)
        if got != entry["sha256"]:
            raise ValueError(f"{path}: sha256 {got[:16]}... differs from {METADATA} ({entry['sha256'][:16]}...)")
    return arr


def load_prepared(data_dir, tokenizer_sha256: str | None = None, verify_sha256: bool = False) -> Prepared:
    """Memory-map a prepared directory, checking every shard against metadata.json (existence,
    dtype, length, offsets; file sha256 with verify_sha256). tokenizer_sha256 (`tokenizer_sha256(tok)`,
    or a prefix of >= 16 characters of it) must match the one it was prepared with.
    Raises ValueError with one line naming the file and what does not match."""
    d = Path(data_dir)
    meta_path = d / METADATA
    if not meta_path.is_file():
        raise ValueError(f"{meta_path}: missing; prepare the data with hpcbert prepare-pretraining "
                         "(an interrupted run leaves no metadata)")
    try:
        meta = json.loads(meta_path.read_text())
        version = meta["format_version"]
        recorded = meta["tokenizer"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{meta_path}: unreadable ({type(e).__name__}: {e})") from None
    if version != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format_version {version}, this hpcbert reads {FORMAT_VERSION}")
    if tokenizer_sha256 is not None:
        if len(tokenizer_sha256) < 16 or not recorded.startswith(tokenizer_sha256):
            raise ValueError(f"{meta_path}: prepared with another tokenizer (sha256 {recorded[:16]}..., "
                             f"given {tokenizer_sha256[:16]}...)")
    splits = {}
    for split, info in meta["splits"].items():
        shards = []
        for entry in info["shards"]:
            tokens = _open_array(d, entry["tokens"], verify_sha256)
            offsets = np.asarray(_open_array(d, entry["offsets"], verify_sha256))
            lines = np.asarray(_open_array(d, entry["lines"], verify_sha256))
            for arr, what, count in ((offsets, "offsets", entry["documents"]), (lines, "lines", entry["line_count"])):
                if (len(arr) != count + 1 or arr[0] != 0 or arr[-1] != len(tokens) or np.any(np.diff(arr) <= 0)):
                    raise ValueError(f"{d / entry[what]['file']}: {what[:-1] if what == 'lines' else 'document'} "
                                     f"offsets do not span {entry['tokens']['file']} ({len(tokens)} tokens) in "
                                     f"increasing order")
            if not np.isin(offsets, lines).all():
                raise ValueError(f"{d / entry['lines']['file']}: a document of {entry['offsets']['file']} does not "
                                 f"start at a line")
            shards.append(Shard(tokens, offsets, lines))
        splits[split] = shards
    return Prepared(meta, splits)


# --- command line ----------------------------------------------------------------------------------

def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="hpcbert prepare-pretraining", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, directories or globs")
    p.add_argument("--tokenizer", required=True, help="directory with tokenizer.json or vocab.txt")
    p.add_argument("--max-seq-length", type=int, required=True, help="sequence length the data is for")
    p.add_argument("--out", required=True, help="output directory (DATA_DIR)")
    p.add_argument("--workers", type=int, default=1, help="tokenising processes (default 1: this process)")
    p.add_argument("--eval-docs", default="0.01",
                   help="held-out documents: a count (1000) or a fraction (0.01, the default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out choice")
    p.add_argument("--errors", default="strict", choices=("strict", "replace"),
                   help="bytes that are not UTF-8: strict stops (default), replace replaces and counts them")
    p.add_argument("--shard-tokens", type=int, default=16 * 2**20,
                   help="tokens per shard (whole documents: a shard may exceed it by one document)")
    ns = p.parse_args(argv)
    try:
        opts = Options(ns.inputs, ns.tokenizer, ns.max_seq_length, ns.out, ns.workers, ns.eval_docs,
                       ns.seed, ns.errors, ns.shard_tokens)
        t0 = time.perf_counter()
        meta = prepare(opts)
    except (ValueError, OSError) as e:  # PrepareError, load_prepared's complaints, an unwritable --out
        if os.environ.get("HPCBERT_DEBUG"):
            raise
        print(f"hpcbert prepare-pretraining: error: {e}", file=sys.stderr)
        return 2
    sp, dr = meta["splits"], meta["dropped"]
    what = "already prepared, nothing to do" if meta.get("up_to_date") else \
        f"prepared in {time.perf_counter() - t0:.1f} s"
    print(f"{ns.out}: {what}: "
          + "; ".join(f"{s} {sp[s]['documents']:,} documents {sp[s]['lines']:,} lines {sp[s]['tokens']:,} tokens "
                      f"in {len(sp[s]['shards'])} shards" for s in SPLITS)
          + f"; dropped {dr['title_lines']:,} title lines, {dr['stub_documents']:,} stub documents, "
            f"{dr['empty_documents']:,} empty documents, {dr['heading_lines']:,} heading lines, "
            f"{dr['empty_after_tokenisation']:,} documents without tokens, "
            f"{dr['replaced_bytes']:,} invalid UTF-8 sequences replaced")
    return 0
