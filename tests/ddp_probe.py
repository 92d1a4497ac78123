"""Run `hpcbert train` in this process (under torchrun or alone) and record, for the tests, what
each rank did: a hash of all parameters after every optimizer step, the gradient each step used,
the shard of every global batch this rank drew, and every file or directory it opened for writing.

    PROBE_OUT=DIR python tests/ddp_probe.py train --model bert-tiny ...   ->  DIR/rank{R}.pt

The recording is done from outside through global optimizer hooks and wrappers; hpcbert's code
is unchanged. The probe's own file is written after the run, with the wrappers removed.
"""

from __future__ import annotations

import builtins
import hashlib
import os
import tempfile
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "BERT"))

import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook  # noqa: E402

import hpcbert.train as T  # noqa: E402
from hpcbert.cli import main  # noqa: E402

record: dict[str, list] = {"param_sha256": [], "grads": [], "shards": [], "writes": []}


def _params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def _pre(opt, args, kwargs):  # after DDP's all-reduce and clipping, before the update
    record["grads"].append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten()
                                      for p in _params(opt)]).clone())


def _post(opt, args, kwargs):
    h = hashlib.sha256()
    for p in _params(opt):
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    record["param_sha256"].append(h.hexdigest())


_shard = T.shard


def _recording_shard(batch, per_rank, rank, grad_accum):
    out = _shard(batch, per_rank, rank, grad_accum)
    record["shards"].append([m.tolist() for m in out])
    return out


_open, _os_open, _mkdir = builtins.open, os.open, os.mkdir


def _rec_open(file, mode="r", *a, **k):
    if any(c in mode for c in "wax+"):
        record["writes"].append(str(file))
    return _open(file, mode, *a, **k)


def _rec_os_open(path, flags, *a, **k):
    if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
        record["writes"].append(str(path))
    return _os_open(path, flags, *a, **k)


def _rec_mkdir(path, *a, **k):
    record["writes"].append(str(path))
    return _mkdir(path, *a, **k)


if __name__ == "__main__":
    out = Path(os.environ["PROBE_OUT"])
    rank = int(os.environ.get("RANK", "0"))
    h1, h2 = register_optimizer_step_pre_hook(_pre), register_optimizer_step_post_hook(_post)
    T.shard = _recording_shard
    # Python's tempfile checks that $TMPDIR is writable with a throw-away file the first time it
    # is asked (torch's import of dynamo asks); that is the interpreter's write, not hpcbert's.
    tempfile.gettempdir()
    builtins.open, os.open, os.mkdir = _rec_open, _rec_os_open, _rec_mkdir
    try:
        rc = main(sys.argv[1:])
    finally:
        builtins.open, os.open, os.mkdir = _open, _os_open, _mkdir
        h1.remove()
        h2.remove()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(record, out / f"rank{rank}.pt")
    sys.exit(rc)
