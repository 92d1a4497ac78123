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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


class CheckpointManager:
    """Save, find and load checkpoints under `root`. Every rank calls `save` and `load`;
    `barrier` is the process group's barrier (a no-op for one process)."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 2, rank: int = 0, world_size: int = 1,
                 barrier: Callable[[], None] = lambda: None):
        if keep_last < 2:
            raise ValueError(f"keep_last: must be >= 2 (a newest checkpoint may be damaged), got {keep_last}")
        self.root, self.keep_last = Path(root), keep_last
        self.rank, self.world_size, self.barrier = rank, world_size, barrier

    def _tmp(self, step: int) -> Path:
        return self.root / f".step-{step:08d}.tmp"

    def save(self, step: int, shared: dict, per_rank: dict) -> Path:
        """Write one checkpoint; returns its final path. Collective: all ranks must call it."""
        tmp, final = self._tmp(step), self.root / f"step-{step:08d}"
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a save that was killed
            tmp.mkdir(parents=True)
        self.barrier()
        size, digest = _write(tmp / f"rank-{self.rank:05d}.pt", per_rank)
        sizes = _gather(self, (f"rank-{self.rank:05d}.pt", size, digest))
        if self.rank == 0:
            files = dict((name, {"bytes": b, "sha256": h}) for name, b, h in sizes)
            b, h = _write(tmp / "shared.pt", shared)
            files["shared.pt"] = {"bytes": b, "sha256": h}
            manifest = {"step": step, "world_size": self.world_size, "files": files}
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():  # same step saved again (e.g. signal right after a periodic save)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        self.barrier()
        return final

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
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise CheckpointError(f"{mpath}: missing (the save did not complete)")
        try:
            manifest = json.loads(mpath.read_text())
            files, step, world = manifest["files"], int(manifest["step"]), int(manifest["world_size"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from e
        expected = {"shared.pt", *(f"rank-{r:05d}.pt" for r in range(world))}
        if set(files) != expected:
            raise CheckpointError(f"{mpath}: lists {sorted(files)}, expected {sorted(expected)}")
        for name, meta in files.items():
            f = path / name
            if not f.is_file():
                raise CheckpointError(f"{f}: missing")
            if f.stat().st_size != meta["bytes"]:
                raise CheckpointError(f"{f}: {f.stat().st_size} bytes, manifest says {meta['bytes']} (truncated?)")
            if _sha256(f) != meta["sha256"]:
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


def _gather(mgr: CheckpointManager, item: tuple) -> list[tuple]:
    if mgr.world_size == 1:
        return [item]
    import torch.distributed as dist

    out: list = [None] * mgr.world_size
    dist.all_gather_object(out, item)
    return out
