#!/usr/bin/env python
"""Every checkpointing policy's memory against its time: bytes per sequence and step time, both
relative to `none`, per model and sequence length. A measurement, not a test; the README is
generated from the JSON it writes (`--render`).

    python benchmarks/pareto.py --models minilm-l6,bert-base --lengths 128   # measure, add to the JSON
    python benchmarks/pareto.py --render                                     # results/pareto/README.md

Bytes: what the run's summary reports (meters.activation_bytes_per_sequence), counted by
hpcbert.plan on the whole model in FakeTensorMode at the full length. Time: in this process, one
fresh copy of the model per policy and round (random weights, dropout 0.1), full-length batches
(every step the same work), a whole training step (forward, backward, AdamW); policies
interleaved, `--rounds` rounds; a policy's step time is its fastest timed step over all rounds
(contention on a shared machine only ever adds time), relative to `none`'s. The host allocator is set
as in every hpcbert run. Beside it, the bound a policy that reruns whole modules cannot beat: one
more forward of those modules, timed inside `none`'s steps (`alternate`, and on CPU `all`, rerun less).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "BERT"))
RESULTS = ROOT / "results" / "pareto"
POLICIES = ("none", "selective", "alternate", "every:2", "all", "offload")  # every:2: the 2020 kit's alternate
# per-device batch per (model, length): what a step of this CPU does in a few seconds
BATCH = {("minilm-l6", 128): 32, ("minilm-l6", 512): 4, ("bert-base", 128): 8, ("bert-base", 512): 2,
         ("bert-large", 128): 2, ("bert-large", 512): 1}
# on a GPU: batches a training run would use, whose activations under none (bf16: 3 to 12 GB at the
# CPU-measured bytes per sequence) leave an 80 GB card room for every policy
BATCH_CUDA = {("minilm-l6", 128): 256, ("minilm-l6", 512): 64, ("bert-base", 128): 128, ("bert-base", 512): 32,
              ("bert-large", 128): 64, ("bert-large", 512): 16}
TARGETS = {"selective": (0.75, 1.05), "alternate": (0.55, 1.15), "all": (0.10, 1.35)}  # (bytes, time) vs none


def say(msg: str) -> None:
    print(f"[pareto {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure(model_name: str, length: int, rounds: int, steps: int, threads: int, device) -> dict:
    import torch

    from hpcbert import objectives, plan, policies
    from hpcbert.config import RunConfig
    from hpcbert.optim import make_optimizer

    torch.set_num_threads(threads)
    cfg = RunConfig(task="synthetic", model=model_name, max_seq_length=length, precision="auto")
    precision = policies.resolve_precision(cfg.precision, device)
    runnable = [p for p in POLICIES if p != "offload" or device.type == "cuda"]
    bytes_ = {p: plan.measure_activations(cfg, p, device, precision)[0] for p in runnable}
    obj = objectives.get(cfg)
    B = (BATCH_CUDA if device.type == "cuda" else BATCH)[(model_name, length)]
    torch.manual_seed(0)
    base = obj.build_model(plan._model_config(cfg)).to(device)
    batch, norm = obj.example_batch(B, length, base.config.vocab_size)
    batch = batch.to(device)
    times: dict[str, list[float]] = {p: [] for p in runnable}
    forward_s: list[dict[str, float]] = []  # none's steps: each wrappable module's forward time
    for r in range(rounds):
        for p in runnable[r % len(runnable):] + runnable[:r % len(runnable)]:
            model = copy.deepcopy(base).train()
            policies.wrap_layers(model, p)
            opt = make_optimizer(cfg, model, 1e-5, device)
            timer = ForwardTimer(model, device) if p == "none" else None
            for i in range(1 + steps):  # the first step of a fresh model is not timed
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if timer is not None:
                    timer.clear()
                t0 = time.perf_counter()
                with policies.autocast(precision, device):
                    loss = obj.loss(model, obj.forward(model, batch), batch, norm)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i:
                    times[p].append(time.perf_counter() - t0)
                    if timer is not None:
                        forward_s.append(timer.read())
            del model, opt
            say(f"{model_name} {length} round {r + 1}: {p} fastest {min(times[p]):.3f} s")
    return {"model": model_name, "length": length, "batch": B, "precision": precision, "rounds": rounds,
            "steps_per_round": steps, "bytes_per_sequence": bytes_, "step_times_s": times,
            "none_forward_s": forward_s}


class ForwardTimer:
    """Hooks timing the forward of every module a policy can wrap (the embeddings and each encoder
    layer, by the names recompute_bound reads), for the step since `clear()`. On CUDA with events
    recorded on the stream, not synchronisations, so the timed step runs as without them; `read()`
    after the step's closing synchronisation."""

    def __init__(self, model, device) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.marks: dict[str, list] = {}
        mods = {"embeddings": model.bert.embeddings, **{f"layer.{i}": l for i, l in enumerate(model.bert.encoder.layer)}}
        for name, mod in mods.items():
            def mark(*_, name=name):
                if self.cuda:
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record()
                    self.marks.setdefault(name, []).append(ev)
                else:
                    self.marks.setdefault(name, []).append(time.perf_counter())
            mod.register_forward_pre_hook(mark)
            mod.register_forward_hook(mark)

    def clear(self) -> None:
        self.marks.clear()

    def read(self) -> dict[str, float]:
        """Seconds per module: its forward's end minus its start (its last forward of the step)."""
        if self.cuda:
            return {n: m[-2].elapsed_time(m[-1]) / 1e3 for n, m in self.marks.items()}
        return {n: m[-1] - m[-2] for n, m in self.marks.items()}


def recompute_bound(e: dict, policy: str) -> float | None:
    """The step time relative to none's if recomputation cost exactly one more forward of the modules
    `policy` wraps, taken from none's fastest step (its own forward times): 1 + their forward time / that
    step's time. None for the policies that do not rerun whole modules (none, selective, offload) and for
    entries measured before the forward times were recorded."""
    from hpcbert import policies

    if policy not in ("alternate", "all") and not policy.startswith("every:") or not e.get("none_forward_s"):
        return None
    steps = e["step_times_s"]["none"]
    k = min(range(len(steps)), key=steps.__getitem__)
    spans = e["none_forward_s"][k]
    layers = sum(1 for n in spans if n.startswith("layer."))
    wrapped = [f"layer.{i}" for i in policies.ckpt_layer_indices(policy, layers)]
    wrapped += ["embeddings"] if policy == "all" else []  # policies.wrap_layers wraps them under all
    return 1 + sum(spans[n] for n in wrapped) / steps[k]


def machine(threads: int) -> dict:
    import torch

    from hpcbert.meters import cpu_name
    from hpcbert.policies import device_has_native_bf16

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "BERT"], capture_output=True,
                                text=True).stdout.strip())
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__,
            "hpcbert_commit": commit, "hpcbert_source_modified": dirty,
            "python": platform.python_version(), "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None,
            "native_bf16": device_has_native_bf16(dev)}


def render_readme(results: Path = RESULTS) -> str:
    from hpcbert.report import markdown_grid
    from hpcbert.runfiles import read_json_object

    path = results / "pareto.json"
    out = ["# Checkpointing policies: memory against time", "",
           "Generated by `python benchmarks/pareto.py --render` from `pareto.json`; every figure comes from the "
           "commands listed with it.", ""]
    if not path.is_file():
        return "\n".join(out + ["Not measured yet (`pareto.json` is missing).", ""])
    doc = read_json_object(path)
    commit = {m["date"]: str(m["machine"].get("hpcbert_commit") or "—")[:7] for m in doc["measurements"]}
    rows = []
    order = list(dict.fromkeys(BATCH))  # (model, length) as BATCH lists them
    for e in sorted(doc["entries"], key=lambda e: order.index((e["model"], e["length"]))
                    if (e["model"], e["length"]) in order else len(order)):
        none_b, none_t = e["bytes_per_sequence"]["none"], min(e["step_times_s"]["none"])
        for p, b in e["bytes_per_sequence"].items():
            t = min(e["step_times_s"][p])
            tb, tt = TARGETS.get(p, (None, None))
            verdict = "—" if tb is None else ("PASS" if b / none_b <= tb and t / none_t <= tt else
                                             "MISS (" + ", ".join(w for w, ok in (("bytes", b / none_b <= tb),
                                                                                  ("time", t / none_t <= tt)) if not ok) + ")")
            bound = recompute_bound(e, p)
            rows.append([commit.get(e["date"], "—"), e["model"], str(e["length"]), str(e["batch"]), e["precision"], p,
                         f"{b / 2**20:.1f}",
                         f"**{b / none_b:.2f}x**", f"{t:.3f}", f"**{t / none_t:.2f}x**",
                         "—" if bound is None else f"{bound:.2f}x",
                         "—" if tb is None else f"≤ {tb:.2f}x, ≤ {tt:.2f}x", verdict])
    out += [markdown_grid(["commit", "model", "length", "batch", "precision", "policy", "act MiB/seq", "bytes vs none",
                           "fastest step s", "time vs none", "one-forward bound", "target (bytes, time)", "verdict"],
                          rows).rstrip("\n"), ""]
    out += ["Bytes: activations kept for backward per sequence at the full length, as the run's summary counts them "
            "(storages created during forward and alive at its end, batch 2 minus batch 1), measured on the whole "
            "model in FakeTensorMode by `hpcbert.plan`. Time: a whole training step (forward, backward, AdamW) on "
            "full-length batches (no padding, so every step does the same work), in one process, a fresh copy of the "
            "model per policy and round, policies interleaved; the fastest timed step of a policy over all rounds "
            "(other work only ever adds time) divided by `none`'s. Random weights; dropout 0.1. `offload` needs CUDA "
            "and appears only where the run had a GPU. On CPU the batches are what a step of a 2-core CPU does in a few "
            "seconds (on a GPU, those of a training run: `BATCH_CUDA`); at batch 1 or 2 the optimizer's pass over every parameter (bert-large: 335 M) is a fixed part "
            "of each step that recomputation does not add to, so those rows' time ratios are lower than at the "
            "batch a GPU would run. Few rounds of few steps: a ratio within a few percent of 1 is within noise. "
            "The process sets the host allocator as every hpcbert run does (`hpcbert.dist.tune_host_allocator`; each "
            "measurement below names the setting it ran with): with glibc's default, `none`, which allocates the "
            "most each step, pays the most page faults, and the policies' ratios come out lower.", "",
            "One-forward bound: the time vs none a policy that reruns whole modules (`alternate`, `all`) would "
            "take if its recomputation cost exactly one more forward of the modules it wraps: 1 + their forward "
            "time / the step time, both from `none`'s fastest step (hooks time each module's forward there). A "
            "time target below the bound cannot be met by recomputing faster, only by recomputing less. "
            "`alternate` does: its wrapped layers keep their feed-forward's tensors and rerun only their "
            "attention, taking its dropout masks from the bits the forward kept and, from 9865084, its K and V "
            "(the Q projection alone is recomputed; its other layers keep what `selective` keeps). On CPU `all` does too, every wrapped layer but the last keeping its output "
            "for its last LayerNorm's backward, so that its recomputation stops before the feed-forward's "
            "second matmul; no policy draws a dropout mask again in backward (from 597be85: each recomputed "
            "or LayerNorm-kept mask is kept as bits). "
            "Recomputing one forward costs about a third of a step where backward takes twice the forward; "
            "on a CPU, where the forward also draws every dropout mask and backward only applies them, the "
            "forward's share and so the bound are higher.", ""]
    for m in doc["measurements"]:
        mc = m["machine"]
        where = mc["gpu"] or f"{mc['cpu']}, {mc['cores']} cores, {mc['threads']} threads"
        out += [f"- `{m['command']}`: {m['date']}, {where}; native bf16: {'yes' if mc['native_bf16'] else 'no'} "
                f"(precision auto: {', '.join(sorted({e['precision'] for e in doc['entries']}))}); torch {mc['torch']}; "
                f"{m['rounds']} rounds of {m['steps']} timed steps; host allocator: {mc.get('host_allocator', 'system (not set)')}"
                + (f"; hpcbert commit {mc['hpcbert_commit']}{' (BERT/ modified)' if mc.get('hpcbert_source_modified') else ''}"
                   if mc.get("hpcbert_commit") else "") + "."]
    return "\n".join(out) + "\n"


def in_use(doc: dict) -> list[dict]:
    """The measurements some entry still comes from (an entry measured again replaces the old one)."""
    dates = {e["date"] for e in doc["entries"]}
    return [m for m in doc["measurements"] if m["date"] in dates]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="minilm-l6,bert-base,bert-large")
    p.add_argument("--lengths", default="128,512")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed steps per policy and round (default: %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--results-dir", default=str(RESULTS))
    p.add_argument("--render", action="store_true", help="only write README.md from the JSON")
    a = p.parse_args(argv)
    results = Path(a.results_dir)
    if not a.render:
        from hpcbert import cuda_allocator_default
        cuda_allocator_default()  # CUDA's allocator as hpcbert train runs it
        import torch

        from hpcbert.runfiles import read_json_object, write_json_atomic

        path = results / "pareto.json"
        doc = read_json_object(path) if path.is_file() else {"entries": [], "measurements": []}
        from hpcbert.dist import tune_host_allocator

        allocator = tune_host_allocator()  # as every run sets it (dist.init)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        doc["measurements"].append({"command": "python benchmarks/pareto.py " + shlex.join(sys.argv[1:] if argv is None else argv),
                                    "date": date, "machine": {**machine(a.threads), "host_allocator": allocator},
                                    "rounds": a.rounds, "steps": a.steps})
        for model in a.models.split(","):
            for length in (int(x) for x in a.lengths.split(",")):
                e = measure(model, length, a.rounds, a.steps, a.threads, device)
                e["date"] = date
                doc["entries"] = [x for x in doc["entries"] if (x["model"], x["length"]) != (model, length)] + [e]
                doc["measurements"] = in_use(doc)
                results.mkdir(parents=True, exist_ok=True)
                write_json_atomic(path, doc)
    (results / "README.md").write_text(render_readme(results))
    print((results / "README.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
