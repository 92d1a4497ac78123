"""What the small one-process benchmark scripts (bench_head_rows.py, bench_model_ab.py,
bench_norm_precision.py, bench_token_multiple.py, bench_mlm_loss.py) share: their common options,
the process set up as `hpcbert train` sets it up (threads, the host allocator),
the JSON they write (the command that made it, date, machine, rows) and the README generated from
it."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from hpcbert import dist, meters


def parser(doc: str, results: str, steps: int) -> argparse.ArgumentParser:
    """The options every one of them takes: --steps, --threads (torch's; default the CPU's cores),
    --out (default results/RESULTS) and --render (the README again from the JSON, nothing measured)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / results))
    p.add_argument("--render", action="store_true")
    return p


def setup(threads: int) -> str:
    """The process as `hpcbert train` sets it up: torch's threads, and the host allocator keeping
    freed memory (dist.tune_host_allocator; without it every large buffer a step frees is unmapped
    and page-faulted again next step: bench_mlm_loss's loss ratios were 3.9-4.2x without it, 1.1-1.2x
    with it; bench_lamb's loop / foreach 1.27x without it, 1.01-1.06x with it, in the same hour).
    Returns the allocator setting, for the JSON (`write(..., host_allocator=...)`)."""
    torch.set_num_threads(threads)
    return dist.tune_host_allocator()


def allocator(doc: dict) -> str:
    """The README's words for a JSON's host allocator; JSON written before setup() recorded it
    measured under glibc's default."""
    setting = doc.get("host_allocator")
    if setting is None:
        return "glibc's default (not set: measured before these benchmarks set it as `hpcbert train` does)"
    return f"{setting}, as `hpcbert train` sets it" if setting == "glibc-retain" else setting


def commit() -> str:
    """The commit measured, 7 characters: HPCBERT_COMMIT where set (gpu_session.sh's: a GPU machine
    gets a copy of the tree, without git), else the checkout's."""
    return (os.environ.get("HPCBERT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short=7", "HEAD"], cwd=Path(__file__).resolve().parents[1],
        capture_output=True, text=True).stdout.strip())[:7]


def write(out: Path, name: str, argv: list[str] | None, threads: int, rows: list[dict], **extra) -> None:
    """out/NAME.json: the command as typed (argv, or sys.argv's), date, machine, `extra`, rows."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"command": (f"python benchmarks/{name}.py " + shlex.join(sys.argv[1:] if argv is None else argv)).strip(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{meters.cpu_name()}, {os.cpu_count()} cores, {threads} threads, torch {torch.__version__}",
           **extra, "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")


def write_readme(out: Path, render_readme: Callable[[Path], str]) -> None:
    (out / "README.md").write_text(render_readme(out))
    print((out / "README.md").read_text())
