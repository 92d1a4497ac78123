"""Data-parallel scaling on this machine and across two simulated nodes (a benchmark, not a test).

    sudo python benchmarks/bench_ddp.py [--model minilm-l6] [--batch 8] [--steps 10] [--out results/ddp]

Runs the real `hpcbert train` CLI (synthetic task, padded to --max-seq-length so every step does the
same work) in five configurations and reads back each run's summary.json:

  1 process x 1 thread, batch B             the per-core reference
  1 process x 2 threads, batch 2B           both cores in one process
  2 processes x 1 thread, batch B each      torchrun --standalone, gloo over loopback
  2 nodes x 1 process x 1 thread, B each    two network namespaces joined by a veth pair, started
                                            by multinode_communication/bootstrap.sh, link limited
                                            by tc to 10 Gbit/s and to 1 Gbit/s

Beside each multi-process run: the measured time to all-reduce one step's gradients (the model's
fp32 gradient, in DDP's 25 MB buckets, gloo, median of 5 after a warm-up), and the ring model
2(n-1)/n x bytes / bandwidth. Scaling efficiency = sequences/s / (cores used x sequences/s of the
1 x 1 reference). Writes RESULTS/bench_ddp.json and RESULTS/README.md (table generated here, with
hpcbert.report's Markdown renderer). The namespace rows need root; without it they are left out,
with the reason in the README.

    python benchmarks/bench_ddp.py --render [--out results/ddp]   README.md again from bench_ddp.json

(`tests/test_report.py::test_benchmark_readme_is_fresh` fails when the committed README is not what
--render writes.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "BERT"))
sys.path.insert(0, str(ROOT / "tests"))  # the namespace fixture lives with the tests

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def env_for(tmp: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "BERT") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(OMP_NUM_THREADS="1", TMPDIR=str(tmp), HPCBERT_CACHE=str(tmp / "cache"))
    for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NODE_RANK"):
        env.pop(k, None)
    return env


def train_args(a, batch: int, threads: int, out: Path) -> list[str]:
    return ["--model", a.model, "--task", "synthetic", "--max-seq-length", str(a.seq), "--pad-to-max-length",
            "--batch-size", str(batch), "--threads", str(threads), "--max-steps", str(a.steps), "--log-every",
            str(a.steps), "--warmup-steps-excluded", "2", "--synthetic-train-size", "2048", "--no-do-eval",
            "--precision", "fp32", "--out", str(out)]


def check(procs: list[subprocess.Popen], what: str, timeout: float = 600) -> None:
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            raise SystemExit(f"{what} failed (exit {p.returncode}):\n{log[-4000:]}")


def summary_row(name: str, out: Path, ranks: int, threads: int, link: str | None) -> dict:
    from hpcbert.runfiles import read_summary
    s = read_summary(out)
    return {"config": name, "ranks": ranks, "threads_per_rank": threads, "cores": ranks * threads, "link": link,
            "global_batch": s["global_batch_size"], "steps": s["steps"],
            "warmup_steps_excluded": s["warmup_steps_excluded"], "step_time_s": s["steady_step_time_s"],
            "sequences_per_sec": s["steady_sequences_per_sec"], "per_rank_step_time_s": s["per_rank_step_time_s"],
            "startup_s": s["startup_s"]}


# --- the all-reduce probe: one step's gradient, in DDP-sized buckets -------------------------------

def gradient_bytes(model: str) -> int:
    from hpcbert import zoo
    from hpcbert.model import BertForSequenceClassification
    src = zoo.resolve(model)
    cfg = type(src.config)(**{**src.config.to_dict(), "num_labels": 2})
    return sum(p.numel() * 4 for p in BertForSequenceClassification(cfg).parameters())


def allreduce_worker(nbytes: int, reps: int) -> None:
    import torch
    import torch.distributed as tdist

    from hpcbert import dist
    d = dist.init(threads=1, timeout_s=120)
    n = nbytes // 4
    buckets = [torch.ones(min(BUCKET_BYTES // 4, n - i)) for i in range(0, n, BUCKET_BYTES // 4)]
    times = []
    for r in range(reps + 1):
        tdist.barrier()
        t0 = time.perf_counter()
        works = [tdist.all_reduce(b, async_op=True) for b in buckets]  # launched as DDP launches buckets
        for w in works:
            w.wait()
        if r:  # the first is warm-up (connections, buffers)
            times.append(time.perf_counter() - t0)
    if d.is_main:
        print("ALLREDUCE " + json.dumps({"bytes": nbytes, "buckets": len(buckets), "times_s": times,
                                         "median_s": statistics.median(times)}), flush=True)
    dist.shutdown(d)


def parse_allreduce(log: str) -> dict:
    for line in log.splitlines():
        if line.startswith("ALLREDUCE "):
            return json.loads(line[len("ALLREDUCE "):])
    raise SystemExit(f"all-reduce probe printed no result:\n{log[-3000:]}")


def ring_model_s(nbytes: int, n: int, bits_per_s: float) -> float:
    """Ring all-reduce: each rank sends and receives 2(n-1)/n of the data (Patarasuk & Yuan 2009)."""
    return 2 * (n - 1) / n * nbytes / (bits_per_s / 8)


# --- the benchmark ---------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm-l6")
    p.add_argument("--batch", type=int, default=8, help="micro-batch per rank (the 1 x 2 run uses twice this)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--reps", type=int, default=5, help="all-reduce repetitions after one warm-up")
    p.add_argument("--rates", default="10gbit,1gbit")
    p.add_argument("--out", default=str(ROOT / "results" / "ddp"))
    p.add_argument("--render", action="store_true",
                   help="only write OUT/README.md again from OUT/bench_ddp.json (runs nothing)")
    p.add_argument("--allreduce-worker", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.allreduce_worker is not None:
        return allreduce_worker(a.allreduce_worker, a.reps)
    if a.render:
        text = render_readme(Path(a.out))
        (Path(a.out) / "README.md").write_text(text)
        print(text, end="")
        return None

    from netns import limit_rate, rate_bits, two_nodes, unavailable_reason
    results, out_dir = Path(a.out), Path(tempfile.mkdtemp(prefix="bench_ddp-"))
    env = env_for(out_dir)
    py = sys.executable
    cli = [py, "-m", "hpcbert.cli", "train"]
    nbytes = gradient_bytes(a.model)
    rows, allreduce = [], {}
    started, load_before = time.time(), os.getloadavg()[0]

    def run_local(name, cmd, ranks, threads, batch):
        out = out_dir / name
        print(f"[bench_ddp] {name}", file=sys.stderr, flush=True)
        check([subprocess.Popen([*cmd, *train_args(a, batch, threads, out)], env=env, cwd=out_dir,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)], name)
        rows.append(summary_row(name, out, ranks, threads, None))

    run_local("1 process x 1 thread", cli, 1, 1, a.batch)
    run_local("1 process x 2 threads", cli, 1, 2, 2 * a.batch)
    run_local("2 processes x 1 thread", [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                         "-m", "hpcbert.cli", "train"], 2, 1, a.batch)
    probe = subprocess.run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
                            "--allreduce-worker", str(nbytes), "--reps", str(a.reps)], env=env, cwd=out_dir,
                           capture_output=True, text=True, timeout=600)
    allreduce["2 processes x 1 thread"] = parse_allreduce(probe.stdout + probe.stderr)

    reason = unavailable_reason()
    if reason is None:
        with two_nodes("hpcb-b", "10.211.1") as nodes:  # names apart from the tests' hpcb-n1/n2
            hosts = ",".join(n.ip for n in nodes)
            for rate in a.rates.split(","):
                limit_rate(nodes, rate)
                name = f"2 nodes x 1 process x 1 thread, {rate_bits(rate) / 1e9:g} Gbit/s"
                print(f"[bench_ddp] {name}", file=sys.stderr, flush=True)
                out = out_dir / f"netns-{rate}"
                job = f"bench-ddp-{os.getpid()}-{rate}"
                check([n.popen([str(ROOT / "multinode_communication" / "bootstrap.sh"), "--hosts", hosts,
                                "--job-id", job, "--ifname", n.ifname, "--nproc-per-node", "1", "--",
                                *train_args(a, a.batch, 1, out)], env={**env, "PYTHON": py}, cwd=out_dir,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in nodes], name)
                rows.append(summary_row(name, out, 2, 1, rate))
                rows[-1]["link_bits_per_s"] = rate_bits(rate)
                # The all-reduce probe, started by hand in each namespace (RANK/WORLD_SIZE/MASTER_*).
                port = 29900 + len(allreduce)
                procs = [n.popen([py, __file__, "--allreduce-worker", str(nbytes), "--reps", str(a.reps)],
                                 env={**env, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": nodes[0].ip,
                                      "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": n.ifname},
                                 cwd=out_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                         for r, n in enumerate(nodes)]
                logs = [q.communicate(timeout=600)[0] for q in procs]
                allreduce[name] = parse_allreduce(logs[0])
            limit_rate(nodes, None)

    # --- derived figures --------------------------------------------------------------------------
    ref = rows[0]
    for r in rows:
        r["scaling_efficiency"] = r["sequences_per_sec"] / (r["cores"] * ref["sequences_per_sec"])
        ar = allreduce.get(r["config"])
        r["allreduce_measured_s"] = ar["median_s"] if ar else None
        r["allreduce_ring_model_s"] = ring_model_s(nbytes, r["ranks"], r["link_bits_per_s"]) \
            if r.get("link_bits_per_s") else None
        r["exposed_comm_s"] = r["step_time_s"] - ref["step_time_s"] if r["ranks"] > 1 else None
    cmd = "python " + " ".join(shlex.quote(x) for x in [str(Path(__file__).relative_to(ROOT)), *sys.argv[1:]])
    from hpcbert import meters
    meta = {"command": cmd, "model": a.model, "gradient_bytes": nbytes, "bucket_bytes": BUCKET_BYTES,
            "max_seq_length": a.seq, "batch_per_rank": a.batch, "steps": a.steps, "precision": "fp32",
            "allreduce_reps": a.reps,
            "cpu": platform.processor() or platform.machine(), "cpu_name": meters.cpu_name(), "cores": os.cpu_count(),
            "netns_skipped": reason, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "bench_wall_s": time.time() - started, "load_average_1min": [load_before, os.getloadavg()[0]]}
    results.mkdir(parents=True, exist_ok=True)
    (results / "bench_ddp.json").write_text(json.dumps({"meta": meta, "rows": rows, "allreduce": allreduce},
                                                       indent=2) + "\n")
    (results / "README.md").write_text(render(meta, rows))
    print(render(meta, rows))
    shutil.rmtree(out_dir, ignore_errors=True)  # the figures are in bench_ddp.json


def render_readme(results: Path) -> str:
    """README.md from RESULTS/bench_ddp.json (what the benchmark wrote), nothing measured here."""
    from hpcbert.runfiles import read_json_object
    doc = read_json_object(results / "bench_ddp.json")
    return render(doc["meta"], doc["rows"])


def render(meta: dict, rows: list[dict]) -> str:
    """The README: what was fixed, one row per configuration, what each column means. Every figure
    comes from `meta` and `rows` (bench_ddp.json), so rendering again gives the same text."""
    from hpcbert.report import format_value as f, markdown_grid
    lines = [
        "# Data-parallel scaling: 1 vs 2 processes, and two simulated nodes",
        "",
        "Generated by `benchmarks/bench_ddp.py` from the runs' summary.json files; do not edit by hand.",
        "",
        f"Command: `{meta['command']}` (as root, for the namespace rows)",
        "",
        f"Fixed: model {meta['model']} ({meta['gradient_bytes'] / 1e6:.1f} MB fp32 gradient, all-reduced in "
        f"{meta['bucket_bytes'] // 2**20} MB buckets), synthetic task padded to {meta['max_seq_length']} tokens, "
        f"{meta['batch_per_rank']} sequences per rank and step (the 1 x 2 run: {2 * meta['batch_per_rank']}), "
        f"{meta['precision']}, {meta['steps']} steps, the first 2 untimed; CPU {meta.get('cpu_name') or meta['cpu']}, "
        f"{meta['cores']} cores shared with other work (1-minute load average {meta['load_average_1min'][0]:.1f} "
        f"before, {meta['load_average_1min'][1]:.1f} after: timings vary run to run); gloo; {meta['date_utc']} UTC.",
        "",
        markdown_grid(
            ["configuration", "cores", "global batch", "step time (s, median)", "sequences/s",
             "all-reduce measured (s/step)", "ring model (s/step)", "step time − 1×1 step (s)", "scaling efficiency"],
            [[r["config"], str(r["cores"]), str(r["global_batch"]), f(r["step_time_s"]),
              f(r["sequences_per_sec"], "{:.2f}"), f(r["allreduce_measured_s"]), f(r["allreduce_ring_model_s"]),
              f(r["exposed_comm_s"]), f(r["scaling_efficiency"], "{:.0%}")] for r in rows],
            right=[False] + [True] * 8).rstrip("\n"),
        "",
        "- all-reduce measured: one step's gradient in DDP-sized buckets, launched together and waited for "
        f"(gloo), median of {meta['allreduce_reps']} after a warm-up, with no training running beside it.",
        "- ring model: 2(n−1)/n × bytes / bandwidth with n = 2 ranks and the tc rate (`tbf` on both veth ends); "
        "none for loopback, which has no set bandwidth.",
        "- step time − 1×1 step: what data parallelism adds to a step over one process doing the same per-rank "
        "work (DDP overlaps its bucket all-reduces with the backward pass, so this can be below the measured "
        "all-reduce time).",
        "- scaling efficiency: sequences/s ÷ (cores used × sequences/s of 1 process × 1 thread).",
    ]
    if meta["netns_skipped"]:
        lines.append(f"- namespace rows left out: {meta['netns_skipped']}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
