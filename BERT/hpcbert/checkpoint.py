"""Checkpoints that survive being killed: atomic directories, a manifest written last, retention.

Layout (one directory per checkpoint, named by optimizer step):

    RUN_DIR/checkpoints/step-00000120/
        shared.pt          state every rank shares (model, optimizer, scheduler, scaler, position)
        rank-00000.pt      state of one rank (its RNG streams), one file per rank
        MANIFEST.json      written last: every file's size and sha256, step, world size

A checkpoint is built under a hidden temporary name, every file is fsync'ed, the manifest is
written, and only then is the directory renamed into place (rename is atomic on POSIX). A
directory without a complete, matching manifest is never loaded: `latest()` falls back to the
previous checkpoint with a warning naming the file at fault. What the state *means* is the
trainer's business; this module only stores and verifies it.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .runfiles import sha256_file

MANIFEST = "MANIFEST.json"
_NAME = re.compile(r"^step-(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint that is incomplete or damaged; the message names the file."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    world_size: int


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, obj: Any) -> tuple[int, str]:
    """torch.save to `path` with fsync; returns (bytes, sha256)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), hashlib.sha256(data).hexdigest()


def _attempt(path: Path, action: Callable[[], Any]) -> tuple[Any, str | None]:
    """(action's result, None), or (None, '<path>: <reason>') when it raises OSError: disk full
    (ENOSPC), quota (EDQUOT), I/O error. Other exceptions are bugs and propagate."""
    try:
        return action(), None
    except OSError as e:
        code = errno.errorcode.get(e.errno, "") if e.errno else ""
        return None, f"{path}: {e.strerror or e}" + (f" ({code})" if code else "")


def _fresh_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)  # left by a save that was killed
    path.mkdir(parents=True)


class CheckpointManager:
    """Save, find and load checkpoints under `root`. Every rank calls `save` and `load`;
    `barrier` is the process group's barrier (a no-op for one process)."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 2, rank: int = 0, world_size: int = 1,
                 barrier: Callable[[], None] = lambda: None, gather: Callable[[Any], list] | None = None):
        if keep_last < 2:
            raise ValueError(f"keep_last: must be >= 2 (a newest checkpoint may be damaged), got {keep_last}")
        self.root, self.keep_last = Path(root), keep_last
        self.rank, self.world_size, self.barrier = rank, world_size, barrier
        if gather is None and world_size > 1:
            raise ValueError("CheckpointManager: several ranks need `gather` (every rank's item, in rank order), "
                             "e.g. lambda x: hpcbert.dist.all_gather_objects(d, x)")
        self.gather = gather or (lambda item: [item])  # the collectives are dist.py's, passed in

    def _tmp(self, step: int) -> Path:
        return self.root / f".step-{step:08d}.tmp"

    def save(self, step: int, shared: dict, per_rank: dict) -> Path:
        """Write one checkpoint; returns its final path. Collective: all ranks must call it.

        A write that fails (disk full, quota, I/O error) on any rank raises CheckpointError on
        every rank, naming the file and the system's reason; the partial temporary directory is
        removed and the previous checkpoints are untouched. No rank is left waiting: each rank's
        outcome travels in the all_gather of file sizes, and rank 0's (shared state, manifest,
        rename) in a second all_gather that replaces the closing barrier.
        """
        tmp, final = self._tmp(step), self.root / f"step-{step:08d}"
        name = f"rank-{self.rank:05d}.pt"
        error = _attempt(tmp, lambda: _fresh_dir(tmp))[1] if self.rank == 0 else None
        self.barrier()
        written = None
        if error is None:  # the other ranks learn of a failed mkdir from their own write failing
            written, error = _attempt(tmp / name, lambda: _write(tmp / name, per_rank))
        size, digest = written or (None, None)
        sizes = self.gather((name, size, digest, error))
        errors = [e for *_, e in sizes if e is not None]
        if self.rank == 0:
            if not errors:
                error = self._commit(step, tmp, final, {n: {"bytes": b, "sha256": h} for n, b, h, _ in sizes}, shared)
                errors = [error] if error else []
            if errors:
                shutil.rmtree(tmp, ignore_errors=True)
        errors = self.gather(errors)[0]  # rank 0's verdict, on every rank
        if errors:
            raise CheckpointError(f"checkpoint of step {step} not saved: {errors[0]}; the partial "
                                  f"{tmp.name} was removed, earlier checkpoints are kept")
        return final

    def _commit(self, step: int, tmp: Path, final: Path, files: dict, shared: dict) -> str | None:
        """Rank 0: shared state, manifest (last), atomic rename, retention. None, or what failed."""
        def write_shared():
            b, h = _write(tmp / "shared.pt", shared)
            files["shared.pt"] = {"bytes": b, "sha256": h}

        def write_manifest():
            with open(tmp / MANIFEST, "w") as f:
                json.dump({"step": step, "world_size": self.world_size, "files": files}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)

        def rename():
            if final.exists():  # same step saved again (e.g. signal right after a periodic save)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)

        for path, action in ((tmp / "shared.pt", write_shared), (tmp / MANIFEST, write_manifest), (final, rename),
                             (self.root, self._prune)):
            error = _attempt(path, action)[1]
            if error is not None:
                return error
        return None

    def _prune(self) -> None:
        complete = self.list()
        for ck in complete[: -self.keep_last]:
            shutil.rmtree(ck.path, ignore_errors=True)

    def list(self) -> list[Checkpoint]:
        """Checkpoint directories by step (oldest first), without verifying them."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir():
                out.append(Checkpoint(p, int(m.group(1)), -1))
        return sorted(out, key=lambda c: c.step)

    def verify(self, path: Path) -> Checkpoint:
        """Check the manifest and every file's size and checksum; CheckpointError names the file."""
        path = Path(path)
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise CheckpointError(f"{mpath}: missing (the save did not complete)")
        try:
            manifest = json.loads(mpath.read_bytes().decode("utf-8"))
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; RecursionError: deep nesting
            raise CheckpointError(f"{mpath}: unreadable manifest ({type(e).__name__}: {e})") from None
        problem = _manifest_problem(manifest, path.name)
        if problem:
            raise CheckpointError(f"{mpath}: {problem}")
        files, step, world = manifest["files"], manifest["step"], manifest["world_size"]
        for name, meta in files.items():
            f = path / name
            if not f.is_file():
                raise CheckpointError(f"{f}: missing")
            if f.stat().st_size != meta["bytes"]:
                raise CheckpointError(f"{f}: {f.stat().st_size} bytes, manifest says {meta['bytes']} (truncated?)")
            if sha256_file(f) != meta["sha256"]:
                raise CheckpointError(f"{f}: checksum does not match the manifest (damaged)")
        return Checkpoint(path, step, world)

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies; damaged newer ones are skipped with a warning."""
        for ck in reversed(self.list()):
            try:
                return self.verify(ck.path)
            except CheckpointError as e:
                warnings.warn(f"skipping damaged checkpoint: {e}", stacklevel=2)
        return None

    def load(self, ck: Checkpoint, map_location: Any = "cpu") -> tuple[dict, dict]:
        """(shared state, this rank's state). Refuses a checkpoint written by another world size."""
        if ck.world_size != self.world_size:
            raise CheckpointError(f"{ck.path}: written by {ck.world_size} ranks, this run has {self.world_size}")
        shared = torch.load(ck.path / "shared.pt", map_location=map_location, weights_only=False)
        mine = torch.load(ck.path / f"rank-{self.rank:05d}.pt", map_location=map_location, weights_only=False)
        return shared, mine


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is not a count


_SHA256 = re.compile(r"[0-9a-f]{64}\Z")


def _manifest_problem(manifest: Any, dirname: str) -> str | None:
    """What is wrong with a parsed manifest (one line, values repr'd), or None.

    Checked before any value is used: a damaged manifest must not crash the reader (a string
    where a number belongs), make it build a billion file names (world_size 10**9), or let a
    directory claim another step than its name."""
    if not isinstance(manifest, dict):
        return f"expected a JSON object, found {type(manifest).__name__}"
    missing = [k for k in ("step", "world_size", "files") if k not in manifest]
    if missing:
        return f"unreadable manifest (missing key(s) {', '.join(missing)})"
    step, world, files = manifest["step"], manifest["world_size"], manifest["files"]
    if not _is_int(step) or step < 0:
        return f"step {step!r} is not a step number"
    named = _NAME.match(dirname)
    if named and int(named.group(1)) != step:
        return f"step {step} does not match the directory name {dirname!r}"
    if not _is_int(world) or world < 1:
        return f"world_size {world!r} is not a number of ranks"
    if not isinstance(files, dict):
        return f"'files' is a JSON {type(files).__name__}, expected an object of file entries"
    if len(files) != world + 1:  # checked before building world_size names
        return f"lists {sorted(files)[:8]!r}, expected shared.pt and {world} rank file(s)"
    expected = {"shared.pt", *(f"rank-{r:05d}.pt" for r in range(world))}
    if set(files) != expected:
        return f"lists {sorted(files)!r}, expected {sorted(expected)!r}"
    for name, meta in sorted(files.items()):
        if not (isinstance(meta, dict) and _is_int(meta.get("bytes")) and meta["bytes"] >= 0
                and isinstance(meta.get("sha256"), str) and _SHA256.match(meta["sha256"])):
            return f"entry for {name} is {meta!r:.200}, expected {{'bytes': <int>, 'sha256': <64 hex digits>}}"
    return None
