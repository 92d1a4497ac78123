"""hpcbert report: tables from constructed run directories with known values.

Every expected number below is computed by hand from the values make_run writes.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import minilm_dir_or_skip
from hpcbert import report
from hpcbert.runfiles import RunDirError
from report_fixtures import CPU, THROUGHPUT_METHOD, V100, make_run, make_study, write_json

ROOT = Path(__file__).resolve().parents[1]
README_CMD = "hpcbert report results/ --format md --out results/README.md"


def table_of(*paths, baseline_label=None, **kw):
    runs, skipped = report.load_runs(paths)
    assert not skipped, skipped
    baseline = next(r for r in runs if r["label"] == baseline_label) if baseline_label else None
    return report.build_table(runs, baseline, **kw)


# --- the numbers --------------------------------------------------------------------------------

def test_speedup_scaling_efficiency_and_time_box(tmp_path):
    # The HPC-AI 2020 table: 1 GPU bs 24 at 115.2 seq/s vs 2x4 GPUs bs 48 at 971.52 seq/s.
    make_run(tmp_path, "baseline", config={"batch_size": 24}, seq_per_s=115.2, steps_in_budget=2938)
    make_run(tmp_path, "optimized", config={"batch_size": 48, "grad_ckpt": "alternate"}, world_size=8,
             nodes=2, seq_per_s=971.52, steps_in_budget=1225)
    make_run(tmp_path, "ckpt-1gpu", config={"batch_size": 24, "grad_ckpt": "all"}, seq_per_s=92.16)
    t = table_of(tmp_path, baseline_label="baseline").set_index("run")

    assert t.loc["optimized", "speedup"] == pytest.approx(971.52 / 115.2)          # 8.4333
    assert t.loc["optimized", "scaling_eff"] == pytest.approx(971.52 / 115.2 / 8)  # 1.0542
    assert t.loc["ckpt-1gpu", "speedup"] == pytest.approx(0.8)
    assert math.isnan(t.loc["ckpt-1gpu", "scaling_eff"])  # same world size: no scaling figure
    assert t.loc["baseline", "speedup"] == pytest.approx(1.0)
    # Work inside the 20-minute box: steps x global batch (global = per-device x accum x world).
    assert t.loc["optimized", "global_batch"] == 384
    assert t.loc["optimized", "nodes_x_gpus"] == "2x4" and t.loc["optimized", "world_size"] == 8
    assert t.loc["optimized", "steps_in_budget"] == 1225
    assert t.loc["optimized", "seq_in_budget"] == 470400
    assert t.loc["baseline", "seq_in_budget"] == 70512
    assert t.loc["optimized", "steps_per_s"] == pytest.approx(971.52 / 384)
    assert t.loc["baseline", "act_MiB_per_seq"] == pytest.approx(50.0)
    assert t.loc["baseline", "peak_mem_GiB"] == pytest.approx(3.0)
    assert t.loc["baseline", "mfu_pct"] == pytest.approx(100 * 115.2 * 2e10 / 1.25e14)
    caption = report.caption_text(t)
    assert "speedup = seq_per_s / 115.2 seq/s of baseline baseline (world size 1)" in caption


def test_mean_and_sample_std_over_three_seeds(tmp_path):
    for seed, sps, acc, steps in ((1, 100.0, 0.80, 1000), (2, 110.0, 0.84, 1100), (3, 120.0, 0.86, 1200)):
        make_run(tmp_path, f"mrpc-seed{seed}", config={"seed": seed}, seq_per_s=sps, accuracy=acc,
                 steps_in_budget=steps)
    t = table_of(tmp_path)
    assert len(t) == 1
    row = t.iloc[0]
    assert row["run"] == "mrpc" and row["seeds"] == 3 and row["seed"] == "1,2,3"
    assert row["seq_per_s"] == pytest.approx(110.0)
    assert row["seq_per_s_std"] == pytest.approx(10.0)  # sqrt((100 + 0 + 100) / 2)
    # accuracy: mean 2.5/3; deviations -1/30, 1/150, 2/75 -> sqrt(0.0018667 / 2) = 0.0305505
    assert row["accuracy"] == pytest.approx(0.8333333, abs=1e-6)
    assert row["accuracy_std"] == pytest.approx(0.0305505, abs=1e-6)
    assert row["steps_in_budget"] == pytest.approx(1100) and row["steps_in_budget_std"] == pytest.approx(100)
    assert row["seq_in_budget"] == pytest.approx(35200) and row["seq_in_budget_std"] == pytest.approx(3200)
    md = report.render_markdown(t)
    assert "| 110.0 ± 10.0 |" in md and "| 0.8333 ± 0.0306 |" in md
    assert "mean ± sample std (ddof=1)" in md


def test_grouping_merges_only_runs_that_differ_in_seed(tmp_path):
    make_run(tmp_path, "a-s1", config={"seed": 1}, seq_per_s=100.0)
    make_run(tmp_path, "a-s2", config={"seed": 2}, seq_per_s=102.0)
    make_run(tmp_path / "elsewhere", "a-s3", config={"seed": 3}, seq_per_s=104.0,  # other folder and
             hardware=dict(V100, hostname="dgx02"))                              # node: same group
    make_run(tmp_path, "lr-s1", config={"seed": 1, "lr": 3e-5}, seq_per_s=100.0)  # other lr
    make_run(tmp_path, "lr-s2", config={"seed": 2, "lr": 3e-5}, seq_per_s=100.0)
    make_run(tmp_path, "ws2-s1", config={"seed": 1}, world_size=2, seq_per_s=190.0)  # same config, 2 procs
    make_run(tmp_path, "cpu-s1", config={"seed": 1}, seq_per_s=10.0, hardware=CPU)  # other hardware
    old = make_run(tmp_path / "older-hpcbert", "a-s4", config={"seed": 4}, seq_per_s=102.0)
    cfg = json.loads((old / "config.json").read_text())
    del cfg["dropout"]  # a field added later; its default (None) is what the old run did
    write_json(old / "config.json", cfg)
    t = table_of(tmp_path).set_index("run")
    assert sorted(t.index) == ["a", "cpu-s1", "lr", "ws2-s1"]
    assert t.loc["a", "seeds"] == 4 and t.loc["a", "seq_per_s"] == pytest.approx(102.0)
    assert t.loc["lr", "seeds"] == 2 and t.loc["ws2-s1", "seeds"] == 1
    assert t.loc["cpu-s1", "hardware"] == "CPU (AMD EPYC 7B13), 2 cores"


def test_the_layer_norms_precision_is_part_of_a_runs_precision(tmp_path):
    """bf16 runs with fp32 LayerNorms (--norm-precision fp32, or a run from before the option: no
    norm_precision in its summary or config) are one group apart from those with bf16 LayerNorms;
    in fp32 runs the option changes nothing, and they group."""
    make_run(tmp_path, "low-s1", config={"precision": "bf16"})
    make_run(tmp_path, "n32-s1", config={"precision": "bf16", "norm_precision": "fp32"})
    old = make_run(tmp_path / "older-hpcbert", "n32-s2", config={"precision": "bf16", "seed": 2})
    s, cfg = (json.loads((old / f).read_text()) for f in ("summary.json", "config.json"))
    del s["norm_precision"], cfg["norm_precision"]
    write_json(old / "summary.json", {**s, "schema_version": 4})
    write_json(old / "config.json", cfg)
    make_run(tmp_path, "f-s1", config={"precision": "fp32"})
    make_run(tmp_path, "f-s2", config={"precision": "fp32", "norm_precision": "fp32", "seed": 2})
    t = table_of(tmp_path).set_index("run")
    assert sorted(t.index) == ["f", "low-s1", "n32"]
    assert t.loc["low-s1", "precision"] == "bf16" and t.loc["n32", "precision"] == "bf16, fp32 LayerNorms"
    assert t.loc["n32", "seeds"] == 2 and t.loc["f", "seeds"] == 2 and t.loc["f", "precision"] == "fp32"


def test_dev_metric_columns_bare_for_dev_and_split_prefixed_otherwise(tmp_path):
    make_run(tmp_path / "a", "mrpc", accuracy=0.8, f1=0.9)
    assert {"accuracy", "f1"} <= set(table_of(tmp_path / "a").columns)
    make_run(tmp_path / "c", "sst2", eval={"dev": {"accuracy": 0.9, "loss": 0.3}})
    t = table_of(tmp_path / "c")  # an eval loss must not read like the training loss
    assert t["accuracy"].iloc[0] == pytest.approx(0.9) and t["dev/loss"].iloc[0] == pytest.approx(0.3)
    assert "loss" not in t.columns and t["final_loss"].iloc[0] == pytest.approx(0.5)
    make_run(tmp_path / "b", "mnli", config={"task": "mnli"}, accuracy=None, f1=None,
             eval={"dev_matched": {"accuracy": 0.84}, "dev_mismatched": {"accuracy": 0.85}})
    t = table_of(tmp_path / "b")
    assert t["dev_matched/accuracy"].iloc[0] == pytest.approx(0.84)
    assert t["dev_mismatched/accuracy"].iloc[0] == pytest.approx(0.85)


def test_rows_are_sorted_and_uneven_per_rank_batches_are_shown(tmp_path):
    make_run(tmp_path, "zz-1gpu", seq_per_s=10.0)
    make_run(tmp_path, "aa-3gpu", world_size=3, seq_per_s=30.0, per_device_batch_size=[16, 16, 8],
             global_batch_size=40)
    t = table_of(tmp_path)
    assert list(t["run"]) == ["zz-1gpu", "aa-3gpu"]  # by world size before name
    assert list(t["per_device_batch"]) == ["32", "16/16/8"]


def test_caption_states_what_is_fixed_and_how_throughput_was_measured(tmp_path):
    make_study(tmp_path)
    scaling = table_of(tmp_path / "scaling")
    cap = report.caption_text(scaling)
    for fixed in ("task mrpc", "model minilm-l6 (pretrained)", "max_seq_length 128", "precision bf16",
                  "hardware Tesla V100-SXM2-32GB", "time budget 1200 s"):
        assert fixed in cap
    assert "nodes x GPUs" not in cap and "grad_ckpt" not in cap.split("Throughput")[0]  # they vary
    # How a step is timed, once; which steps, per row and named (THROUGHPUT_METHOD: the first 10
    # steps are untimed, the last is the run's step count).
    assert "Throughput: summed step times of the timed steps; a step runs from its first batch" in cap
    assert ("Timed steps per row: 1gpu 11..2938; 1gpu-ckpt 11..2800; 4gpu 11..1600; 8gpu 11..1225 "
            "(the steps before them are untimed first steps") in cap
    assert "N..N" not in cap and "differs between runs" not in cap
    cap = report.caption_text(table_of(tmp_path / "policies"))
    assert "model bert-base (random init)" in cap and "nodes x GPUs 1x1" in cap
    assert "Timed steps: 11..500 in every run" in cap


def test_timed_steps_name_the_runs_of_a_row_where_they_differ(tmp_path):
    # Two seeds of one configuration that stopped at different steps (a time box), one with 5
    # untimed first steps: the row names each run with its own timed steps.
    make_run(tmp_path, "mrpc-s1", config={"seed": 1}, steps_in_budget=900)
    make_run(tmp_path, "mrpc-s2", config={"seed": 2}, steps_in_budget=950, warmup_steps_excluded=5,
             throughput_method=THROUGHPUT_METHOD.format(steps=950).replace("11..", "6..").replace("first 10", "first 5"))
    make_run(tmp_path, "other", config={"lr": 1e-4}, steps_in_budget=700)
    cap = report.caption_text(table_of(tmp_path))
    assert ("Timed steps per row: mrpc (mrpc-s1 11..900, mrpc-s2 6..950); other 11..700 (the steps before "
            "them are untimed first steps") in cap


def test_a_compile_inside_the_timed_steps_is_named_in_the_caption(tmp_path):
    # Compiled runs: one compiled at step 1 only (an untimed first step), one again at step 16 (timed;
    # make_run's runs time steps 11..N): only the second row is named, with its step and time.
    make_run(tmp_path, "once", config={"compile": "on", "seed": 1}, steps_in_budget=900)
    make_run(tmp_path, "again", config={"compile": "on", "lr": 1e-4}, steps_in_budget=900,
             compile_steps=[{"step": 1, "graphs": 3, "step_s": 50.0}, {"step": 16, "graphs": 1, "step_s": 41.25}])
    cap = report.caption_text(table_of(tmp_path))
    assert "torch.compile compiled inside the timed steps of again: step 16 (41.2 s): that compile" in cap
    assert "once:" not in cap and "step 1 (" not in cap
    make_run(tmp_path / "eager", "plain")
    assert "torch.compile compiled" not in report.caption_text(table_of(tmp_path / "eager"))
    # a run that left its compile step out of the steady figures says so in throughput_method
    make_run(tmp_path / "left", "left", config={"compile": "on"}, steps_in_budget=900,
             compile_steps=[{"step": 1, "graphs": 1, "step_s": 50.0}, {"step": 31, "graphs": 1, "step_s": 55.5}],
             throughput_method="summed step times of steps 11..900 (the first 10 excluded from timing, and step 31, in "
                               "which torch.compile compiled); a step runs from its first batch to the end of the "
                               "optimizer step")
    cap = report.caption_text(table_of(tmp_path / "left"))
    assert ("torch.compile compiled again after the untimed first steps of left: step 31 (55.5 s): those steps are "
            "left out of the row's steady figures") in cap
    assert "that compile time is in the row's throughput" not in cap and "Timed steps: 11..900 in every run" in cap


def test_markdown_leaves_columns_that_are_the_same_in_every_row_to_the_caption(tmp_path):
    make_study(tmp_path)
    table = table_of(tmp_path / "scaling")
    md = _parse_md_table(report.render_markdown(table))
    # Same in every row: task, model, seq_len, precision, compile, hardware, per_device_batch,
    # grad_accum, optimizer (make_study); they vary: world size, nodes, global batch, grad_ckpt, seeds.
    fixed = ["task", "model", "seq_len", "precision", "compile", "hardware", "per_device_batch", "grad_accum",
             "optimizer"]
    assert not set(fixed) & set(md.columns), md.columns
    assert {"run", "seeds", "seed", "nodes_x_gpus", "world_size", "global_batch", "grad_ckpt", "seq_per_s",
            "accuracy"} <= set(md.columns)
    cap = report.caption_text(table)
    for stated in ("task mrpc", "model minilm-l6", "max_seq_length 128", "precision bf16", "compile off",
                   "hardware Tesla V100-SXM2-32GB", "per_device_batch 32", "grad_accum 1", "optimizer lamb"):
        assert stated in cap, stated
    # Machines get every column.
    assert set(fixed) <= set(pd.read_csv(io.StringIO(report.render_csv(table)), comment="#").columns)
    assert set(fixed) <= set(json.loads(report.render_json(table))["rows"][0])
    # Figures: kept in a one-row table; with several rows a figure equal everywhere joins the caption,
    # and one that no row has is named as not measured.
    policies = table_of(tmp_path / "policies")
    md = _parse_md_table(report.render_markdown(policies))
    assert "startup_s" not in md.columns and "steps_in_budget" not in md.columns and "seq_per_s" in md.columns
    cap = report.caption_text(policies)
    assert "Same in every row: startup_s 30.0;" in cap
    assert "Not measured in any row: steps_in_budget, seq_in_budget." in cap
    make_run(tmp_path / "one", "solo", steps_in_budget=None)
    solo = table_of(tmp_path / "one")
    md = _parse_md_table(report.render_markdown(solo))
    assert list(md.columns)[:3] == ["run", "steps_per_s", "seq_per_s"] and "startup_s" in md.columns
    assert "steps_in_budget" not in md.columns
    page = tmp_path / "r.html"
    assert report.cli([str(tmp_path / "scaling"), "--format", "html", "--out", str(page)]) == 0
    head = re.search(r"<thead>(.*?)</thead>", page.read_text()).group(1)
    assert "<th>optimizer</th>" not in head and "<th>grad_<wbr>ckpt</th>" in head


def test_report_text_says_untimed_first_steps_never_warm_up(tmp_path):
    # The training log's 'warm-up' is the learning-rate schedule's; the report's excluded steps are
    # 'untimed first steps' in every format (the summary key warmup_steps_excluded stays).
    make_study(tmp_path)
    for fmt in ("md", "csv", "json", "html"):
        out = tmp_path / f"r.{fmt}"
        assert report.cli([str(tmp_path), "--format", fmt, "--out", str(out)]) == 0
        text = out.read_text()
        assert not re.search(r"(?i)warm-?up", text), (fmt, re.search(r"(?i).{60}warm-?up.{20}", text))
        assert "untimed first steps" in text, fmt
    readme = report.render_results_readme(tmp_path)
    assert not re.search(r"(?i)warm-?up", readme) and "untimed first steps" in readme


def test_find_run_dirs_does_not_descend_into_runs(tmp_path):
    run = make_run(tmp_path / "study", "r1")
    write_json(run / "checkpoints" / "step-000010" / "config.json", {})
    make_run(tmp_path / "study" / "sub", "r2")
    (tmp_path / "study" / "plots").mkdir()
    assert report.find_run_dirs(tmp_path / "study") == [run, tmp_path / "study" / "sub" / "r2"]


def test_a_benchs_interleaved_measurement_is_not_taken_for_an_unfinished_run(tmp_path):
    # `hpcbert bench` leaves runs/bench-*/interleaved/ with config.json (the Trainer it builds) and
    # interleaved.json, never summary.json: the report must not list it as a crashed run.
    bench = tmp_path / "bench"
    run = make_run(bench, "none")
    write_json(bench / "interleaved" / "config.json", {})
    write_json(bench / "interleaved" / "interleaved.json", {"blocks": []})
    write_json(bench / "crashed" / "config.json", {})
    assert report.find_run_dirs(bench) == [bench / "crashed", run]
    runs, skipped = report.load_runs([bench])
    assert [r["rel"] for r in runs] == ["none"]
    assert [p for p, _ in skipped] == [f"{bench}/crashed"]
    _, skipped = report.load_runs([bench / "interleaved"])
    assert len(skipped) == 1 and "interleaved measurement of `hpcbert bench`" in skipped[0][1]
    # while it is still measuring (no interleaved.json yet) it is an unfinished run like any other
    (bench / "interleaved" / "interleaved.json").unlink()
    assert bench / "interleaved" in report.find_run_dirs(bench)


# --- formats parse back to the same numbers ------------------------------------------------------

def _parse_md_table(md: str) -> pd.DataFrame:
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    split = lambda ln: [c.strip() for c in re.split(r"(?<!\\)\|", ln.strip())[1:-1]]
    header = split(lines[0])
    return pd.DataFrame([split(ln) for ln in lines[2:]], columns=header)


def _md_number(text: str) -> tuple[float, float]:
    if text == report.MISSING:
        return math.nan, math.nan
    mean, _, std = text.partition(" ± ")
    return float(mean), float(std) if std else math.nan


def _same(a, b, tol=0.0) -> bool:
    a, b = float(a), float(b)
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol


def test_markdown_csv_and_json_parse_back_to_the_same_numbers(tmp_path):
    make_study(tmp_path)
    runs, _ = report.load_runs([tmp_path])
    base = [r for r in runs if r["label"].startswith("1gpu-s")]
    table = report.build_table(runs, base, policy_columns=True)
    numeric = [c for c in table.columns if pd.api.types.is_numeric_dtype(table[c])
               and not pd.api.types.is_bool_dtype(table[c])]
    assert {"seq_per_s", "seq_per_s_std", "speedup", "accuracy_std", "act_vs_none"} <= set(numeric)
    assert table["steps_in_budget"].isna().any()  # nulls travel too

    csv_text = report.render_csv(table)
    comments = [ln[2:] for ln in csv_text.splitlines() if ln.startswith("# ")]
    assert comments == table.attrs["caption"]
    back = pd.read_csv(io.StringIO(csv_text), comment=None, skiprows=len(comments))
    assert list(back.columns) == list(table.columns)
    doc = json.loads(report.render_json(table))
    assert doc["caption"] == report.caption_text(table) and doc["skipped"] == []
    from_json = pd.DataFrame(doc["rows"])
    assert list(from_json.columns) == list(table.columns)
    for col in numeric:
        for i in range(len(table)):
            want = table[col].iloc[i]
            assert _same(back[col].iloc[i], want), (col, i)
            got = from_json[col].iloc[i]
            assert _same(math.nan if got is None else got, want), (col, i)
    assert list(back["run"]) == list(table["run"]) == list(from_json["run"])

    md = _parse_md_table(report.render_markdown(table))
    assert list(md["run"]) == list(table["run"])
    for col in report.display_columns(table):
        if col not in numeric:
            continue
        tol = 0.5 * 10 ** -report.decimals(col) + 1e-9 if f"{col}_std" in table.columns or \
            pd.api.types.is_float_dtype(table[col]) else 0
        for i in range(len(table)):
            mean, std = _md_number(md[col].iloc[i])
            assert _same(mean, table[col].iloc[i], tol), (col, i, md[col].iloc[i])
            if table["seeds"].iloc[i] > 1 and f"{col}_std" in table.columns:
                assert _same(std, table[f"{col}_std"].iloc[i], tol), (col, i, md[col].iloc[i])


# --- bad input ------------------------------------------------------------------------------------

def _bad_runs(root: Path) -> dict[str, list[str]]:
    """Broken run dirs under root; name -> what the skip reason must say."""
    (root / "notarun").mkdir(parents=True)
    (root / "notarun" / "notes.txt").write_text("hello")
    make_run(root, "oldschema", schema_version=9)
    bad = make_run(root, "badjson")
    (bad / "summary.json").write_text('{"schema_version": 1, "run": ')
    missing = make_run(root, "nokey")
    s = json.loads((missing / "summary.json").read_text())
    del s["steady_sequences_per_sec"]
    write_json(missing / "summary.json", s)
    make_run(root, "nometric", eval={"dev": {"f1": 0.9}})
    badm = make_run(root, "badmetrics")
    with open(badm / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 510, "lr": 1e-5}) + "\n")
    unfinished = make_run(root, "unfinished")
    (unfinished / "summary.json").unlink()
    noconfig = make_run(root, "noconfig")
    (noconfig / "config.json").unlink()
    make_run(root, "strnum", mfu="high")
    return {
        "notarun": ["not an hpcbert run"],
        "oldschema": ["schema_version 9", "not supported"],
        "badjson": ["summary.json", "not valid JSON"],
        "nokey": ["missing key(s) steady_sequences_per_sec"],
        "nometric": ["missing metric 'accuracy'", "dev: f1"],
        "badmetrics": ["metrics.jsonl", "missing key(s) loss"],
        "unfinished": ["no summary.json", "not finished"],
        "noconfig": ["no config.json"],
        "strnum": ["mfu is 'high'"],
    }


def test_bad_runs_are_skipped_with_a_reason_and_the_others_reported(tmp_path, capsys):
    expected = _bad_runs(tmp_path / "bad")
    make_run(tmp_path, "good-1", seq_per_s=123.0)
    make_run(tmp_path, "good-2", config={"lr": 1e-4}, seq_per_s=77.0)
    args = [str(tmp_path / "good-1"), str(tmp_path / "good-2")] + \
        [str(tmp_path / "bad" / name) for name in sorted(expected)] + [str(tmp_path / "missing-dir")]

    assert report.cli(args + ["--format", "json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert sorted(r["seq_per_s"] for r in doc["rows"]) == [77.0, 123.0]
    reasons = {Path(s["run"]).name: s["reason"] for s in doc["skipped"]}
    assert set(reasons) == set(expected) | {"missing-dir"}
    assert "does not exist" in reasons["missing-dir"]
    warnings = [ln for ln in err.splitlines() if "warning: skipped" in ln]
    assert len(warnings) == len(expected) + 1
    for name, needles in expected.items():
        assert name in reasons[name], reasons[name]  # the reason names the run
        for needle in needles:
            assert needle in reasons[name], (name, reasons[name])
        assert any(name in w and needles[0] in w for w in warnings), name

    assert report.cli(args) == 0
    md = capsys.readouterr().out
    assert "**Skipped runs** (10):" in md and "| good-1 |" in md
    for name, needles in expected.items():
        assert needles[0] in md


@pytest.mark.parametrize("compile_steps", [3.5, [7], [{"step": 0, "step_s": 1.0}], [{"step": 12}],
                                           [{"step": 12, "step_s": "slow"}], {"step": 12, "step_s": 1.0}])
def test_a_run_whose_compile_steps_the_caption_cannot_read_is_skipped_naming_them(tmp_path, capsys, compile_steps):
    # the caption's compile line reads each entry's step and step_s (found by test_report_fuzz)
    make_run(tmp_path, "good", compile_steps=[{"step": 12, "graphs": 1, "step_s": 9.5}],
             throughput_method="summed step times of steps 11..900")
    make_run(tmp_path, "bad", config={"seed": 2}, compile_steps=compile_steps)
    assert report.cli([str(tmp_path / "good"), str(tmp_path / "bad"), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert [r["run"] for r in doc["rows"]] == ["good"]
    assert "step 12 (9.5 s)" in doc["caption"]
    [skipped] = doc["skipped"]
    assert "bad" in skipped["run"] and "compile_steps is " in skipped["reason"], skipped
    assert "expected null or a list of {step: a positive integer, step_s: seconds}" in skipped["reason"]


def test_a_folder_with_bad_runs_still_reports_the_good_ones(tmp_path, capsys):
    _bad_runs(tmp_path)
    make_run(tmp_path / "deeper", "good")
    assert report.cli([str(tmp_path), "--format", "csv"]) == 0
    out, err = capsys.readouterr()
    assert "\ngood," in out and out.count("# skipped: ") == 8  # notarun is just a folder here
    assert err.count("warning: skipped") == 8


def test_exit_status_2_when_no_run_is_reported(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert report.cli([str(tmp_path / "empty")]) == 2
    assert "no runs to report" in capsys.readouterr().err
    make_run(tmp_path, "old", schema_version=0)
    assert report.cli([str(tmp_path / "old"), "--format", "json"]) == 2
    err = capsys.readouterr().err
    assert "old" in err and "schema_version 0" in err


def test_cli_baseline_and_html_needs_out(tmp_path, capsys):
    base = make_run(tmp_path, "base", seq_per_s=100.0)
    big = make_run(tmp_path, "big", world_size=4, seq_per_s=360.0)
    assert report.cli([str(big), "--baseline", str(base), "--format", "json"]) == 0
    rows = {r["run"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["base"]["speedup"] == 1.0 and rows["big"]["speedup"] == pytest.approx(3.6)
    assert rows["big"]["scaling_eff"] == pytest.approx(0.9) and rows["base"]["scaling_eff"] is None
    assert report.cli([str(big), "--baseline", str(tmp_path / "nope")]) == 2
    assert "--baseline" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        report.cli([str(big), "--format", "html"])
    assert e.value.code == 2
    out = tmp_path / "sub" / "r.csv"
    assert report.cli([str(tmp_path), "--format", "csv", "--out", str(out)]) == 0
    assert out.read_text().startswith("# Fixed across rows")


def test_bench_report_compares_policies_with_none(tmp_path):
    dirs = [make_run(tmp_path, f"ckpt-{p}", config={"grad_ckpt": p}, act_mib=act, step_time_s=st,
                     seq_per_s=32 / st)
            for p, act, st in (("all", 8.0, 0.30), ("none", 48.0, 0.20), ("alternate", 24.0, 0.25))]
    # Checkpointing buys a bigger batch: its step time has no 'none' to compare with at that batch.
    dirs.append(make_run(tmp_path, "ckpt-all-bs64", config={"grad_ckpt": "all", "batch_size": 64},
                         act_mib=8.0, step_time_s=0.6, seq_per_s=64 / 0.6))
    html_path = tmp_path / "out" / "bench.html"
    md = report.bench_report(dirs, html_path)
    t = _parse_md_table(md).set_index("run")
    assert list(t.index) == ["ckpt-none", "ckpt-alternate", "ckpt-all", "ckpt-all-bs64"]
    assert t.loc["ckpt-alternate", "act_vs_none"] == "0.50"
    assert t.loc["ckpt-all", "act_vs_none"] == "0.17"       # 8 / 48
    assert t.loc["ckpt-all-bs64", "act_vs_none"] == "0.17"  # per sequence: batch does not matter
    assert t.loc["ckpt-alternate", "step_time_vs_none"] == "1.25"
    assert t.loc["ckpt-all", "step_time_vs_none"] == "1.50"
    assert t.loc["ckpt-all-bs64", "step_time_vs_none"] == report.MISSING
    assert t.loc["ckpt-all", "speedup"] == "0.67"  # (32 / 0.3) / (32 / 0.2)
    assert "baseline ckpt-none" in md
    assert "scaling_eff" not in md  # one world size: speed-up only
    page = html_path.read_text()
    assert page.count("<img ") == 3 and "Skipped: a scaling plot needs" in page


# --- results/README.md ----------------------------------------------------------------------------

def test_results_readme_is_deterministic_and_what_the_cli_writes(tmp_path, monkeypatch):
    results = tmp_path / "results"
    make_study(results)
    bad = make_run(results / "scaling", "broken", schema_version=99)
    text = report.render_results_readme(results)
    assert text == report.render_results_readme(results)
    assert text.startswith("# Results\n") and README_CMD in text
    assert str(tmp_path) not in text  # paths relative to results/, whoever runs it
    assert not re.search(r"\d{4}-\d{2}-\d{2}|\d\d:\d\d:\d\d", text)  # no timestamps
    assert "## results/policies/" in text and "## results/scaling/" in text
    assert text.index("| 1gpu | 3 | 1,2,3 |") < text.index("| 4gpu |") < text.index("| 8gpu | 3 |")
    assert "results/scaling/broken/summary.json: schema_version 99" in text
    # The scaling table gets speed-up against its smallest world size, named in the caption.
    assert "baseline 1gpu-s1, 1gpu-s2, 1gpu-s3 (world size 1)" in text
    assert text.count("**Table ") == 2

    monkeypatch.chdir(tmp_path)
    assert report.cli(["results/", "--format", "md", "--out", "results/README.md"]) == 0
    assert (results / "README.md").read_text() == text
    # A README already there is not a run; regenerating is a fixed point.
    assert report.cli(["results", "--format", "md", "--out", "results/README.md"]) == 0
    assert (results / "README.md").read_text() == text
    bad.joinpath("summary.json").unlink()
    assert report.render_results_readme(results) != text


def test_results_readme_of_no_runs_says_so(tmp_path):
    (tmp_path / "results" / "empty").mkdir(parents=True)
    with pytest.raises(RunDirError, match=r"results/: no hpcbert runs to report.*" + re.escape(README_CMD)):
        report.render_results_readme(tmp_path / "results")


def test_results_readme_is_fresh():
    results = ROOT / "results"
    if report.find_run_dirs(results):
        readme = results / "README.md"
        actual = readme.read_text() if readme.is_file() else "(missing)"
        assert actual == report.render_results_readme(results), (
            f"results/README.md is stale: regenerate it from the project root with `{README_CMD}`")
    else:
        with pytest.raises(RunDirError, match="no hpcbert runs to report"):
            report.render_results_readme(results)


def _benchmark_script(name: str):
    """benchmarks/NAME.py as a module (its generator functions; nothing runs at import)."""
    import importlib.util

    env = dict(os.environ)  # compare_hf switches the Hugging Face hubs off at import
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(env)
    return module


@pytest.mark.parametrize("script, folder, command", [
    ("compare_hf", "compare_hf", "python benchmarks/compare_hf.py render"),
    ("bench_ddp", "ddp", "python benchmarks/bench_ddp.py --render"),
    ("compare_hf_squad", "squad", "python benchmarks/compare_hf_squad.py render"),
    ("compare_hf_chinese", "chinese", "python benchmarks/compare_hf_chinese.py render"),
    ("pareto", "pareto", "python benchmarks/pareto.py --render"),
    ("bench_pretrain", "pretrain", "python benchmarks/bench_pretrain.py render"),
    ("bench_head_rows", "head_rows", "python benchmarks/bench_head_rows.py --render"),
    ("bench_model_ab", "model_ab", "python benchmarks/bench_model_ab.py --render"),
    ("bench_norm_precision", "norm_precision", "python benchmarks/bench_norm_precision.py --render"),
    ("bench_step_overhead", "step_overhead", "python benchmarks/bench_step_overhead.py --render"),
    ("bench_token_multiple", "token_multiple", "python benchmarks/bench_token_multiple.py --render"),
    ("bench_ddp_memory", "ddp_memory", "python benchmarks/bench_ddp_memory.py --render"),
    ("bench_mlm_loss", "mlm_loss", "python benchmarks/bench_mlm_loss.py --render"),
    ("gpu", "gpu", "python benchmarks/gpu.py render"),
])
def test_benchmark_readme_is_fresh(script, folder, command):
    """The benchmark scripts' READMEs are what their generators write from the committed JSON."""
    results = ROOT / "results" / folder
    readme = results / "README.md"
    actual = readme.read_text() if readme.is_file() else "(missing)"
    assert actual == _benchmark_script(script).render_readme(results), (
        f"results/{folder}/README.md is stale: regenerate it from the project root with `{command}`")


class _SetUp(Exception):
    """Raised by a stand-in for the benchmarks' process set-up: it was called."""


@pytest.mark.parametrize("script, argv", [
    ("bench_head_rows", []), ("bench_model_ab", ["--rev", "HEAD"]), ("bench_norm_precision", []),
    ("bench_token_multiple", ["--device", "cpu"]), ("bench_mlm_loss", []), ("bench_lamb", None),
])
def test_small_benchmarks_set_the_host_allocator_before_they_measure(script, argv, tmp_path, monkeypatch):
    """Each one-process benchmark sets the process up as `hpcbert train` does, the host allocator
    keeping freed memory, before its first measurement: without it every large buffer a step frees is
    unmapped and faulted in again next step, which train never pays (bench_mlm_loss's loss ratios
    were 3.9-4.2x without it, 1.1-1.2x with it)."""
    module = _benchmark_script(script)

    def set_up(*args):
        raise _SetUp

    def measured(*args, **kwargs):
        raise AssertionError(f"benchmarks/{script}.py measured before it set the host allocator")

    monkeypatch.setattr(module._small_bench, "setup", set_up)
    if argv is None:  # bench_lamb: its own options; measure() sets the process up, then times
        monkeypatch.setattr(module, "timed_step", measured)
        with pytest.raises(_SetUp):
            module.measure(argparse.Namespace(device="cpu", threads=torch.get_num_threads()))
        return
    monkeypatch.setattr(module, "measure", measured)
    with pytest.raises(_SetUp):
        module.main([*argv, "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_the_small_benchmarks_set_up_is_the_trainers(monkeypatch):
    """_small_bench.setup: torch's threads as asked, and dist.tune_host_allocator's setting returned."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _small_bench
    from hpcbert import dist

    calls = []
    monkeypatch.setattr(dist, "tune_host_allocator", lambda: calls.append(1) or "glibc-retain")
    threads = torch.get_num_threads()
    try:
        assert _small_bench.setup(1) == "glibc-retain" and torch.get_num_threads() == 1 and calls == [1]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_report_of_real_training_runs(tmp_path):
    """The real `hpcbert train` writes what the report reads: two seeds of bert-tiny, one row."""
    from conftest import run_env

    def hpcbert(*args):
        return subprocess.run([sys.executable, "-m", "hpcbert.cli", *map(str, args)], env=run_env(),
                              capture_output=True, text=True, timeout=240)

    for seed in (1, 2):
        r = hpcbert("train", "--model", "bert-tiny", "--task", "synthetic", "--max-steps", 6, "--batch-size", 8,
                    "--log-every", 2, "--synthetic-train-size", 64, "--synthetic-dev-size", 16,
                    "--seed", seed, "--out", tmp_path / "runs" / f"tiny-s{seed}")
        assert r.returncode == 0, r.stderr
    r = hpcbert("report", tmp_path / "runs", "--format", "json")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    doc = json.loads(r.stdout)
    assert doc["skipped"] == []
    assert len(doc["rows"]) == 1, [{k: v for k, v in row.items() if v != doc["rows"][0][k]}
                                   for row in doc["rows"]]
    row = doc["rows"][0]
    assert (row["run"], row["seeds"], row["seed"], row["world_size"]) == ("tiny", 2, "1,2", 1)
    assert row["seq_per_s"] > 0 and row["act_MiB_per_seq"] > 0 and 0 <= row["accuracy"] <= 1
    assert "excluded" in doc["caption"] and "model bert-tiny (random init)" in doc["caption"]
    out = tmp_path / "report.html"
    assert hpcbert("report", tmp_path / "runs", "--format", "html", "--out", out).returncode == 0
    assert out.read_text().count("<img ") == 2  # loss curves and dev metric; the other two are notes


def test_policy_step_time_is_compared_on_the_same_batches(tmp_path):
    # A time-boxed bench: the slower policy does fewer steps. Batches early in the order are longer
    # (length-grouped: a mega-batch's longest first), so the two runs' steady windows hold different
    # batches; comparing their median step times would mix the cost of the policy with that of the
    # batches. Same seed -> same batches at the same step: the ratio is taken step by step.
    def none_time(step):
        return 2.0 - 0.05 * step  # 1.95 s at step 1 down to 1.0 s at step 20

    runs = {"none": [(k, none_time(k)) for k in range(1, 21)],
            "alternate": [(k, 1.2 * none_time(k)) for k in range(1, 9)]}
    dirs = []
    for policy, steps in runs.items():
        times = [t for k, t in steps if k > 2]
        d = make_run(tmp_path, f"b-{policy}", config={"grad_ckpt": policy}, act_mib=10.0,
                     step_time_s=float(np.median(times)), seq_per_s=32 / float(np.median(times)),
                     warmup_steps_excluded=2)
        with open(d / "metrics.jsonl", "w") as f:
            for k, t in steps:
                f.write(json.dumps({"step": k, "loss": 0.5, "step_time_s": t}) + "\n")
        dirs.append(d)
    t = _parse_md_table(report.bench_report(dirs, tmp_path / "b.html")).set_index("run")
    assert t.loc["b-alternate", "step_time_vs_none"] == "1.20"
    # The medians alone would say 1.2 x 1.725 / 1.425 = 1.45 (steps 3-8 against steps 3-20).
    # Another seed is not the same batches: back to the ratio of median step times.
    other = make_run(tmp_path, "c-alternate", config={"grad_ckpt": "alternate", "seed": 2}, act_mib=10.0,
                     step_time_s=3.0, seq_per_s=32 / 3.0)
    none_only = [dirs[0], other]
    t2 = _parse_md_table(report.bench_report(none_only, tmp_path / "c.html")).set_index("run")
    assert t2.loc["c-alternate", "step_time_vs_none"] == f"{3.0 / float(np.median([none_time(k) for k in range(3, 21)])):.2f}"


def test_a_version_1_summary_reads_with_the_keys_added_since_as_null(tmp_path):
    from hpcbert.runfiles import ADDED_IN, read_summary
    run = make_run(tmp_path, "v1")
    s = json.loads((run / "summary.json").read_text())
    for k in ADDED_IN[2]:
        del s[k]
    write_json(run / "summary.json", {**s, "schema_version": 1})
    back = read_summary(run)
    assert all(back[k] is None for k in ADDED_IN[2]) and back["steps"] == s["steps"]
    del s["steps"]
    write_json(run / "summary.json", {**s, "schema_version": 1})
    with pytest.raises(ValueError, match="missing key.s. steps"):
        read_summary(run)


def test_model_ab_loads_an_earlier_model_file_without_taking_over_the_current_operators(tmp_path, monkeypatch):
    """bench_model_ab imports an earlier model.py beside the current one. A custom operator
    registered twice under one name silently runs the second registration everywhere, so the
    earlier file's must live under their own name: the current operator still runs the current
    file's code (its module globals are what this counts), and the earlier one runs too."""
    if subprocess.run(["git", "cat-file", "-e", "HEAD:BERT/hpcbert/model.py"], cwd=ROOT).returncode:
        pytest.skip("not a git checkout with a committed model.py")
    import torch

    from hpcbert import model
    ab = _benchmark_script("bench_model_ab")
    earlier = ab.load_model_file("HEAD", tmp_path)
    seen = []
    monkeypatch.setattr(model, "cpu_value", lambda t: seen.append(t) or t.item())
    torch.ops.hpcbert.keep_mask([64], 6554, torch.device("cpu"))
    assert len(seen) == 1
    keep, _ = earlier.keep_mask((64,), 0.1, torch.device("cpu"))
    assert keep.shape == (64,) and len(seen) == 1


def test_pareto_bound_is_one_more_forward_of_the_wrapped_modules():
    """pareto.py's one-forward bound: 1 + the forward time of the modules a policy wraps (alternate:
    layers 0 and 2 of 4; all: every layer and the embeddings) / none's step time, from none's fastest
    step; hand-computed on a made-up entry. The hooks that time the forwards see every module once
    per forward, each inside the forward's wall time."""
    import time

    import torch

    pareto = _benchmark_script("pareto")
    spans = [{"embeddings": 0.5, "layer.0": 0.5, "layer.1": 0.5, "layer.2": 0.5, "layer.3": 0.5},
             {"embeddings": 0.01, "layer.0": 0.1, "layer.1": 0.2, "layer.2": 0.3, "layer.3": 0.4}]
    e = {"step_times_s": {"none": [1.5, 1.0]}, "none_forward_s": spans}
    assert pareto.recompute_bound(e, "alternate") == pytest.approx(1 + (0.1 + 0.3) / 1.0)
    assert pareto.recompute_bound(e, "all") == pytest.approx(1 + (0.01 + 0.1 + 0.2 + 0.3 + 0.4) / 1.0)
    assert pareto.recompute_bound(e, "every:3") == pytest.approx(1 + (0.1 + 0.4) / 1.0)
    assert pareto.recompute_bound(e, "selective") is None and pareto.recompute_bound(e, "none") is None
    assert pareto.recompute_bound({"step_times_s": {"none": [1.0]}}, "all") is None  # measured before

    from hpcbert.model import BertConfig, BertForSequenceClassification
    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=3,
                                                     num_attention_heads=2, intermediate_size=32)).train()
    timer = pareto.ForwardTimer(model, torch.device("cpu"))
    t0 = time.perf_counter()
    model(torch.randint(0, 50, (2, 8)))
    wall = time.perf_counter() - t0
    got = timer.read()
    assert sorted(got) == ["embeddings", "layer.0", "layer.1", "layer.2"]
    assert all(v > 0 for v in got.values()) and sum(got.values()) < wall


def test_gpu_profile_groups_operators_and_its_child_profiles_the_loop(tmp_path, monkeypatch):
    """gpu.py profile: operators' own times grouped by name (hand-summed on made-up operators), and
    its child (hpcbert train with Trainer.step wrapped) run on the CPU: the profiled steps' operators
    include the matmuls and the fused AdamW, and their own times fit inside the steps' wall time."""
    gpu = _benchmark_script("gpu")
    ops = [{"name": "aten::addmm", "self_device_us": 3000.0}, {"name": "aten::mm", "self_device_us": 1000.0},
           {"name": "aten::_flash_attention_forward", "self_device_us": 500.0},
           {"name": "aten::_fused_adamw_", "self_device_us": 200.0}, {"name": "aten::_foreach_norm", "self_device_us": 100.0},
           {"name": "aten::native_layer_norm", "self_device_us": 400.0}, {"name": "aten::add", "self_device_us": 800.0}]
    assert gpu.profile_groups(ops, 2) == pytest.approx(
        {"attention": 0.25, "matmul": 2.0, "optimizer and clipping": 0.15, "other": 0.6})

    monkeypatch.setenv("HPCBERT_GPU_BENCH_ON_CPU", "1")
    assert gpu.main(["profile", "--model", "bert-tiny", "--batch", "4", "--after", "2", "--steps", "2",
                     "--threads", "1", "--results-dir", str(tmp_path / "r"), "--work-dir", str(tmp_path / "w")]) == 0
    rec = json.loads((tmp_path / "r" / "profile.json").read_text())["runs"][0]
    names = {o["name"] for o in json.loads((tmp_path / "w" / "profile" / "ops-synthetic-compile-off.json").read_text())["ops"]}
    assert {"aten::addmm", "aten::_fused_adamw_"} <= names
    assert rec["time_of"] == "self_cpu_us" and 0 < rec["device_busy_ms"] <= rec["step_ms"]
    assert rec["groups_ms"]["matmul"] > 0 and rec["groups_ms"]["optimizer and clipping"] > 0


def test_gpu_mfu_compile_values_are_hpcbert_options():
    """gpu.py mfu/profile --compile: on, off and auto as they are; a torch.compile mode compiles in it."""
    from hpcbert.config import RunConfig
    gpu = _benchmark_script("gpu")
    assert gpu.compile_args("off") == ["--compile", "off"] and gpu.compile_args("on") == ["--compile", "on"]
    args = gpu.compile_args("max-autotune-no-cudagraphs")
    assert args == ["--compile", "on", "--compile-mode", "max-autotune-no-cudagraphs"]
    assert RunConfig(compile=args[1], compile_mode=args[3]).compile_mode == "max-autotune-no-cudagraphs"


def test_pretrain_throughput_rows_are_grouped_by_precision(tmp_path):
    """bench_pretrain's throughput table: a record from before --precision is fp32 and from before
    native_bf16 was recorded is from the CPU without it; each precision on each kind of machine has
    rows and a mean of its own (hand-computed here)."""
    def side(tps):
        return {"tokens_per_sec": tps, "steady_step_time_s": 1.0, "real_tokens_per_seq": 100.0,
                "padded_tokens_per_sec": 128.0, "steady_sequences_per_sec": 1.0, "other_cores_during": 0.0}

    def rec(repeat, h, t, precision=None, native=None):
        r = {"repeat": repeat, "hpcbert": side(h), "trainer": side(t), "ratio": h / t, "date": "d",
             "machine": {"git_commit": "abc"}, "command": f"cmd {repeat} {precision}"}
        if native is not None:
            r["machine"]["native_bf16"] = native
        return r if precision is None else {**r, "precision": precision}

    (tmp_path / "throughput.json").write_text(json.dumps({"bert-small": [
        rec(1, 300.0, 200.0), rec(2, 300.0, 100.0, "fp32", True), rec(3, 500.0, 100.0, "fp32", True),
        rec(1, 800.0, 400.0, "bf16", True), rec(2, 900.0, 300.0, "bf16", True)]}))
    text = _benchmark_script("bench_pretrain").render_readme(tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| bert-small |")]
    assert [r.split(" | ")[1:4] for r in rows] == [
        ["fp32", "no", "1"], ["fp32", "no", "mean"], ["fp32", "yes", "2"], ["fp32", "yes", "3"],
        ["fp32", "yes", "mean"], ["bf16", "yes", "1"], ["bf16", "yes", "2"], ["bf16", "yes", "mean"]]
    assert "**1.500x**" in rows[1]  # 300 / 200, one repeat: no spread
    assert "**4.000 ± 1.414x**" in rows[4]  # 300 / 100 = 3 and 500 / 100 = 5, not the first machine's 1.5
    assert "**2.500 ± 0.707x**" in rows[7]  # 800 / 400 = 2 and 900 / 300 = 3


def test_pretrain_loss_seeds_are_summarised_per_machine(tmp_path):
    """bench_pretrain's loss table: the seeds measured on one machine have a mean of their own (records
    without native_bf16 are the first machine's); hand-computed means."""
    def rec(seed, h, t, native=None):
        side = lambda loss: {"eval": {"mlm_loss": loss, "mlm_accuracy": 0.05}, "losses": [loss]}  # noqa: E731
        machine = {"git_commit": "abc"} | ({} if native is None else {"native_bf16": native})
        return {"seed": seed, "steps": 200, "hpcbert": side(h), "trainer": side(t), "date": "d", "machine": machine,
                "command": f"cmd {seed}"}

    (tmp_path / "loss.json").write_text(json.dumps({"bert-mini": [
        rec(1, 7.0, 7.1), rec(2, 7.2, 7.1), rec(1, 6.0, 6.1, True), rec(2, 6.2, 6.3, True)]}))
    text = _benchmark_script("bench_pretrain").render_readme(tmp_path)
    means = [line for line in text.splitlines() if line.startswith("| bert-mini | | mean")]
    assert [m.split(" | ")[2:4] for m in means] == [["7.100 ± 0.141", "7.100 ± 0.000"],
                                                     ["6.100 ± 0.141", "6.200 ± 0.141"]]


def test_gpu_mfu_on_pretraining_data_trains_mlm_and_renders_its_own_table(tmp_path, monkeypatch):
    """gpu.py mfu and profile --task mlm, run on the CPU: `hpcbert train --task mlm` on a prepared
    folder, records in mfu-mlm.json and profile-mlm.json (not the synthetic task's files), the
    folder's token count as a count of its arrays gives it, real tokens per sequence within the
    length, and sections of their own in the rendered README. --task mlm without --data-dir is a
    usage error."""
    from hpcbert.cli import main as hpcbert_main

    tok = minilm_dir_or_skip()
    gpu = _benchmark_script("gpu")
    words = "the river near a village where fishermen caught salmon and studied history".split()
    rng = np.random.default_rng(0)
    docs = ["\n".join(" ".join(rng.choice(words, rng.integers(5, 60))) + "." for _ in range(rng.integers(1, 6)))
            for _ in range(80)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    data = tmp_path / "prepared"
    assert hpcbert_main(["prepare-pretraining", str(tmp_path / "corpus.txt"), "--tokenizer", str(tok),
                         "--max-seq-length", "128", "--out", str(data), "--eval-docs", "2"]) == 0
    tokens = sum(len(np.load(f)) for f in data.glob("train_*.tokens.npy"))

    monkeypatch.setenv("HPCBERT_GPU_BENCH_ON_CPU", "1")
    results = tmp_path / "r"
    with pytest.raises(SystemExit) as e:
        gpu.main(["mfu", "--task", "mlm", "--results-dir", str(results)])
    assert e.value.code == 2
    assert gpu.main(["mfu", "--task", "mlm", "--data-dir", str(data), "--model", "bert-tiny", "--tokenizer", str(tok),
                     "--batches", "4", "--steps", "3", "--warmup-excluded", "1", "--compile", "off",
                     "--norm-precision", "low", "--threads", "1", "--results-dir", str(results),
                     "--work-dir", str(tmp_path / "w")]) == 0
    assert not (results / "mfu.json").exists()
    doc = json.loads((results / "mfu-mlm.json").read_text())
    assert doc["settings"]["task"] == "mlm" and doc["settings"]["data"]["tokens"] == tokens
    (run,) = doc["runs"]
    argv = run["argv"]
    assert argv[argv.index("--task") + 1] == "mlm" and argv[argv.index("--data-dir") + 1] == str(data.resolve())
    assert 0 < run["tokens_per_sec"] / run["steady_sequences_per_sec"] <= 128
    assert gpu.main(["profile", "--task", "mlm", "--data-dir", str(data), "--model", "bert-tiny", "--tokenizer",
                     str(tok), "--batch", "4", "--after", "1", "--steps", "1", "--threads", "1",
                     "--results-dir", str(results), "--work-dir", str(tmp_path / "w")]) == 0
    assert not (results / "profile.json").exists()
    prof = json.loads((results / "profile-mlm.json").read_text())["runs"][0]
    assert prof["argv"][prof["argv"].index("--task") + 1] == "mlm" and prof["groups_ms"]["matmul"] > 0
    text = gpu.render(results)
    assert "## MFU: bert-tiny, masked-LM pre-training, length 128, bf16" in text and "synthetic task" not in text
    assert "## Where a step goes: bert-tiny, masked-LM pre-training, length 128, batch 4" in text


def test_gpu_large_records_the_count_beside_the_plan_and_renders_both(tmp_path, monkeypatch):
    """gpu.py large --name, run on the CPU (bert-tiny): NAME.json, not large.json; per policy the
    plan's workspace, the count alone (plan.measure_workspace, called here) and the largest batch
    the count alone plans, which on the CPU (where the plan's workspace is the count) is the
    plan's own; the README's section names the file's cap and adds the table of them, and marks a
    policy probed but timed at no batch."""
    import torch

    from hpcbert import plan
    from hpcbert.config import RunConfig

    gpu = _benchmark_script("gpu")
    monkeypatch.setenv("HPCBERT_GPU_BENCH_ON_CPU", "1")
    results = tmp_path / "r"
    assert gpu.main(["large", "--model", "bert-tiny", "--length", "128", "--memory", "72MiB", "--policies", "none,all",
                     "--steps", "1", "--threads", "1", "--results-dir", str(results), "--name", "large-tiny"]) == 0
    assert not (results / "large.json").exists()
    doc = json.loads((results / "large-tiny.json").read_text())
    cfg = RunConfig(task="synthetic", model="bert-tiny", max_seq_length=128, precision="bf16")
    for rec in doc["policies"]:
        counted = plan.measure_workspace(cfg, rec["policy"], torch.device("cpu"), "bf16")
        assert rec["counted_workspace_bytes_per_sequence"] == counted == rec["predicted_workspace_bytes_per_sequence"]
        assert rec["largest_batch_by_count"] == rec["predicted_largest_batch"] >= 1
        assert rec["probed_largest_batch"] >= 1 and rec["peak_reserved_bytes"] is None  # no CUDA here
        # the plan's memory at the batch timed, one process (the probe's): held without the gradients
        made = plan.make_plan(cfg, 72 * 2**20, torch.device("cpu"), (rec["policy"],), world_size=1)
        assert rec["predicted_peak_at_timed_bytes"] == made.memory(rec["policy"], rec["timed_batch"])
        assert rec["gradients_held"] is False and rec["plan_held_bytes"] == made.held_bytes
    text = gpu.render(results)
    assert "## bert-tiny at length 128, bf16, under a" in text and "No record in `large-tiny.json` for" in text
    table = text[text.index("| policy | activation MiB/seq | planned workspace"):].split("\n\n")[0].splitlines()
    assert [row.split(" | ")[0] for row in table[2:]] == ["| none", "| all"]
    assert table[0].endswith("| allocated / planned at batch timed |") and table[2].endswith("| — |")  # no CUDA
    assert "Not a clean measurement" not in text  # every policy timed
    doc["policies"][0]["step_times_s"] = []  # a policy probed and then timed at no batch (H200, 9a2a6c4)
    (results / "large-tiny.json").write_text(json.dumps(doc))
    assert "Not a clean measurement: timed at no batch (none):" in gpu.render(results)


def test_gpu_data_script_gathers_what_a_gpu_session_carries(tmp_path):
    """benchmarks/gpu_data.sh: MRPC and the minilm-l6 tokenizer files copied byte for byte, the wiki
    extract's first 16 files prepared for masked-LM (the token count in metadata.json as the arrays
    hold it, every source named); a DATA folder without them is exit 2 naming the missing path."""
    data = ROOT.parent / "shared" / "data"
    if not (data / "pretrain" / "wiki-en" / "wiki_15").is_file() or not (data / "glue" / "MRPC").is_dir():
        pytest.skip(f"the wiki extract and GLUE MRPC are not at {data} (they live in ../shared beside the project)")
    vocab = minilm_dir_or_skip()
    script = ROOT / "benchmarks" / "gpu_data.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(script), str(tmp_path / "out"), str(data)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "out"
    for name in ("train.tsv", "dev.tsv"):
        assert (out / "glue" / "MRPC" / name).read_bytes() == (data / "glue" / "MRPC" / name).read_bytes()
    assert (out / "vocab" / "vocab.txt").read_bytes() == (vocab / "vocab.txt").read_bytes()
    meta = json.loads((out / "pretrain" / "metadata.json").read_text())
    assert [Path(s["path"]).name for s in meta["sources"]] == [f"wiki_{i:02d}" for i in range(16)]
    tokens = sum(len(np.load(f)) for f in (out / "pretrain").glob("train_*.tokens.npy"))
    assert tokens == meta["splits"]["train"]["tokens"] > 1_000_000
    r = subprocess.run(["bash", str(script), str(tmp_path / "out2"), str(tmp_path / "nowhere")], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 2 and str(tmp_path / "nowhere" / "glue" / "MRPC") in r.stderr


@pytest.mark.slow
def test_gpu_queue_steps_are_commands_the_tools_accept(tmp_path):
    """benchmarks/gpu_queue.sh, run here through the real gpu_session.sh: every step's gpu.py options
    parse (on a CPU each run stops at "needs a CUDA device", never at argparse's usage), its pytest node
    IDs exist (collected and skipped, none "not found"), and each step comes back as one file,
    STEP.tar.gz, with no folder left beside it. An unknown step is exit 2 naming the steps, before
    anything runs."""
    import tarfile

    steps = ["planner-base", "planner-large", "mlm", "attention", "autotune"]
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HPCBERT_COMMIT": "test", "CUDA_VISIBLE_DEVICES": ""}
    script = ROOT / "benchmarks" / "gpu_queue.sh"
    r = subprocess.run(["bash", str(script), "planner-base", "warp-speed"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 2 and "unknown step 'warp-speed'" in r.stderr and all(s in r.stderr for s in steps)
    assert not out.exists()
    r = subprocess.run(["bash", str(script), *steps], capture_output=True, text=True, env=env, timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{s}.tar.gz" for s in steps)
    # gpu.py parts: large (twice), mfu-mlm, profile, mfu; each parsed its options and met the CPU
    assert log.count("benchmarks/gpu.py: needs a CUDA device") == 5 and "usage:" not in log, log[-3000:]
    assert log.count("benchmarks/bench_mlm_loss.py: needs a CUDA device") == 1, log[-3000:]  # mlm's loss bench
    for step in steps:
        with tarfile.open(out / f"{step}.tar.gz") as t:
            names = set(t.getnames())
            assert {f"{step}/info.txt", f"{step}/README.md"} <= names, names
            if step in ("planner-base", "attention"):
                text = t.extractfile(f"{step}/pytest-gpu.log").read().decode()
                assert "not found" not in text and "ERROR" not in text and re.search(r"\d+ skipped", text), text
                assert "== pytest -m gpu: exit 0" in text
            if step == "planner-base":
                for node in ("test_a_step_dropped_before_backward_leaves_nothing_allocated",
                             "test_predicted_largest_batch_against_probing_on_the_gpu"):
                    assert node in text
            if step == "attention":
                assert f"{step}/attention.json" in names


def _trainer_worker_or_skip() -> Path:
    """What compare_hf.py's Trainer worker needs here (transformers' Trainer with accelerate, both in
    the [test] extras; the minilm-l6 tokenizer): the tokenizer's folder, or the test skips."""
    for mod in ("transformers", "accelerate"):
        pytest.importorskip(mod, reason="the Trainer worker needs transformers and accelerate (the [test] extras)")
    return minilm_dir_or_skip()


def test_trainer_worker_pads_to_a_multiple_when_asked(tmp_path):
    """compare_hf.py's Trainer worker with --pad-to-multiple-of 8: every batch's padded length is a
    multiple of 8 and at least its longest sequence (the real tokens per step are those of the same
    batches as without it); without the option the padded length is the longest sequence's. The
    option needs dynamic padding and a positive number (exit 2 otherwise)."""
    from glue_fixtures import write_glue_dir

    tok = _trainer_worker_or_skip()
    glue = write_glue_dir(tmp_path / "glue", ["MRPC"])
    script = ROOT / "benchmarks" / "compare_hf.py"

    def worker(name, *extra):
        out = tmp_path / f"{name}.json"
        cmd = [sys.executable, str(script), "_hf-worker", "--data-dir", str(glue), "--task", "mrpc",
               "--model", "bert-tiny", "--tokenizer", str(tok), "--batch-size", "2", "--max-steps", "2",
               "--warmup-steps-excluded", "0", "--threads", "1", "--padding", "dynamic", "--precision", "fp32",
               "--order", "hpcbert-random", "--out", str(out), "--scratch", str(tmp_path / name), *extra]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return r, (json.loads(out.read_text()) if r.returncode == 0 else None)

    r, plain = worker("plain")
    assert r.returncode == 0, r.stderr[-2000:]
    r, pad8 = worker("pad8", "--pad-to-multiple-of", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert pad8["pad_to_multiple_of"] == 8 and plain["pad_to_multiple_of"] is None
    assert pad8["step_real_tokens"] == plain["step_real_tokens"]  # the same batches
    assert any((p // n) % 8 for p, n in zip(plain["step_padded_tokens"], plain["step_sequences"]))  # live
    for p, q, n in zip(plain["step_padded_tokens"], pad8["step_padded_tokens"], plain["step_sequences"]):
        longest, padded = p // n, q // n
        assert padded % 8 == 0 and longest <= padded < longest + 8, (longest, padded)
    r, _ = worker("bad", "--pad-to-multiple-of", "0")
    assert r.returncode == 2 and "--pad-to-multiple-of: a positive number" in r.stderr


def test_fastest_trainer_on_equal_batches_is_the_highest_median():
    """The comparison the throughput README names as the Trainer at its best on equal batches: the
    highest median Trainer seq/s among the equal-batch rows; other rows (length grouping) are not
    candidates."""
    C = _benchmark_script("compare_hf")
    rows = [{"comparison": "equal batches", "hf_seq_s": [50.0, 60.0, 55.0]},
            {"comparison": "own length grouping", "hf_seq_s": [90.0, 91.0, 92.0]},
            {"comparison": "equal batches, Trainer compiled", "hf_seq_s": [70.0, 40.0, 41.0]},
            {"comparison": "equal batches, Trainer padding to multiples of 8", "hf_seq_s": [56.0, 56.0, 1.0]}]
    assert C.fastest_trainer_on_equal_batches(rows) is rows[3]  # medians 55, 41, 56
    assert C.fastest_trainer_on_equal_batches(rows[1:2]) is None


def test_pair_call_alternates_the_first_side_and_replaces_a_repeated_run(tmp_path):
    """compare_hf.pair_call, the throughput step of compare_hf_squad.py and compare_hf_chinese.py:
    an odd repeat runs hpcbert first, an even one the Trainer first; each side's record is on disk
    before the other side starts; running a (pair, repeat) again replaces its two records."""
    C = _benchmark_script("compare_hf")
    path = tmp_path / "throughput.json"
    doc = {"settings": {"threads": 2}, "calls": [], "runs": []}
    seen = []

    def run_side(side, name):
        on_disk = json.loads(path.read_text())["runs"] if path.is_file() else []
        seen.append((name, [(r["side"], r["repeat"], r["steady_sequences_per_sec"]) for r in on_disk]))
        return {"steady_sequences_per_sec": float(len(seen)), "padded_tokens_per_seq": 10.0,
                "noise": {"other_cores_during": 0.0}}

    def call(repeat):
        a = argparse.Namespace(pair="dynamic", repeat=repeat)
        assert C.pair_call(a, path, doc, ("hp label", "hf label"), 2, run_side, lambda m: None) == 0

    call(1)
    call(2)
    assert [n for n, _ in seen] == ["tp-dynamic-hpcbert-r1", "tp-dynamic-hf-r1", "tp-dynamic-hf-r2",
                                    "tp-dynamic-hpcbert-r2"]
    assert seen[1][1] == [("hpcbert", 1, 1.0)] and seen[3][1][-1] == ("hf", 2, 3.0)
    call(1)  # again: runs 5 and 6 replace runs 1 and 2
    runs = json.loads(path.read_text())["runs"]
    assert [(r["side"], r["repeat"], r["steady_sequences_per_sec"], r["label"]) for r in runs] == [
        ("hf", 2, 3.0, "hf label"), ("hpcbert", 2, 4.0, "hp label"), ("hpcbert", 1, 5.0, "hp label"),
        ("hf", 1, 6.0, "hf label")]
    assert len(doc["calls"]) == 3 and all(r["command"] == doc["calls"][0]["command"] for r in runs)


def test_trainer_worker_flags_parse_back_to_what_they_say():
    """compare_hf.trainer_worker_flags builds the switches of a `_hf-worker` command line that
    add_trainer_worker_options parses: every combination reads back as given."""
    import itertools

    C = _benchmark_script("compare_hf")
    p = argparse.ArgumentParser()
    C.add_trainer_worker_options(p, epochs=2.0, warmup_excluded=3)
    base = ["--out", "o.json", "--scratch", "s", "--padding", "dynamic", "--seed", "1"]
    for group, steps, ev in itertools.product((False, True), (None, 7), (False, True)):
        a = p.parse_args(base + C.trainer_worker_flags(group_by_length=group, max_steps=steps, do_eval=ev))
        assert (a.group_by_length, a.max_steps, a.do_eval, a.epochs, a.warmup_steps_excluded) == (group, steps, ev, 2.0, 3)


def test_script_main_routes_the_worker_the_commands_and_render(tmp_path, monkeypatch):
    """compare_hf.script_main, the command line of compare_hf.py and the two scripts beside it: `_hf-worker`
    hands the rest of the line to the worker and parses nothing nor chooses an hpcbert (the parent's
    PYTHONPATH names the one of --hpcbert-rev); a command reaches its function after
    `check` saw its arguments (and a usage error there exits 2 before it runs); `render` writes what the
    render function returns to README.md of --results-dir."""
    C = _benchmark_script("compare_hf")
    monkeypatch.setattr(C, "use_hpcbert", lambda rev: calls.append(("use", rev)))
    calls = []

    def add_commands(sub):
        sp = sub.add_parser("go")
        sp.add_argument("--n", type=int, default=1)
        sp.add_argument("--hpcbert-rev", default=None)
        sp.set_defaults(fn=lambda a: calls.append(("go", a.n)) or 5)

    def check(p, a):
        calls.append(("check", a.command))
        if getattr(a, "n", 0) < 0:
            p.error("--n: not below 0")

    def main(argv):
        return C.script_main(argv, description="d", hf_worker=lambda rest: calls.append(("worker", rest)) or 7,
                             add_commands=add_commands, results=C.ROOT / "results" / "x",
                             render=lambda d: f"readme of {d.name}", check=check)

    assert main(["_hf-worker", "--out", "o.json", "render"]) == 7
    assert calls == [("worker", ["--out", "o.json", "render"])]  # its hpcbert: the parent's PYTHONPATH
    calls.clear()
    assert main(["go", "--n", "3", "--hpcbert-rev", "abc"]) == 5
    assert calls == [("use", "abc"), ("check", "go"), ("go", 3)]
    calls.clear()
    with pytest.raises(SystemExit) as e:
        main(["go", "--n", "-1"])
    assert e.value.code == 2 and ("go", -1) not in calls
    out = tmp_path / "res"
    out.mkdir()
    assert main(["render", "--results-dir", str(out)]) == 0
    assert (out / "README.md").read_text() == "readme of res"


def test_render_sections_says_where_each_file_was_measured(tmp_path):
    """compare_hf.render_sections: a file of one command shows that command and its date, a file of
    interleaved calls its first and last call's dates, and a missing file or one without calls says
    "Not measured yet" without calling the section's render function."""
    C = _benchmark_script("compare_hf")
    machine = {"cpu": "cpuX", "cores": 2, "threads": 2, "native_bf16": True, "python": "3.11", "torch": "2",
               "transformers": "4", "accelerate": "1", "git_commit": "c0ffee"}
    write_json(tmp_path / "one.json", {"command": "python one.py", "date": "D1", "machine": machine})
    write_json(tmp_path / "calls.json", {"calls": [{"date": "D2", "machine": machine}, {"date": "D3"}]})
    write_json(tmp_path / "empty.json", {"calls": []})
    rendered = []

    def fn(doc):
        rendered.append(doc)
        return "TABLE"

    out = C.render_sections(tmp_path, [(t, f, fn) for t, f in (("One", "one.json"), ("Calls", "calls.json"),
                                                                 ("Empty", "empty.json"), ("Gone", "gone.json"))])
    text = "\n".join(out)
    assert "## One\n\n```\npython one.py\n```\n\nMeasured D1 on cpuX, 2 cores" in text
    assert "## Calls\n\nMeasured D2 to D3 on cpuX, 2 cores" in text
    assert "## Empty\n\nNot measured yet (`empty.json` holds no run)." in text
    assert "## Gone\n\nNot measured yet (`gone.json` is missing)." in text
    assert text.count("TABLE") == 2 and len(rendered) == 2


def test_pair_throughput_headline_is_the_dynamic_pair_against_the_target(monkeypatch):
    """compare_hf.render_pair_throughput: the headline is the (dynamic, dynamic) comparison's median,
    judged MET only at or above the target, with no verdict where there is no target and no headline
    where that comparison is absent."""
    C = _benchmark_script("compare_hf")
    monkeypatch.setattr(C, "render_pair_table", lambda summary, fmt: "TABLE")
    monkeypatch.setattr(C, "render_pair_runs", lambda doc: ["", "RUNS"])
    doc = {"settings": {"batch_size": 16}}
    summary = [{"headline": False, "ratio_median": 9.0}, {"headline": True, "ratio_median": 1.196}]

    def headline(summary, target):
        text = C.render_pair_throughput(doc, "INTRO", summary, "{:.2f}", target)
        assert text.startswith("INTRO\n\nTABLE\n") and text.endswith("\n\nRUNS")
        return [line for line in text.splitlines() if line.startswith("Headline")]

    assert headline(summary, 1.2) == ["Headline (equal batches of 16, each side's dynamic padding with length "
                                      "grouping): **1.20x** the Trainer's training sequences/s (target ≥ 1.2x): "
                                      "**NOT MET**."]
    assert headline(summary, 1.19)[0].endswith("(target ≥ 1.19x): **MET**.")
    assert headline(summary, None)[0].endswith("**1.20x** the Trainer's training sequences/s.")
    assert headline(summary[:1], 1.2) == []


def test_gpu_throughput_runs_each_trainer_configuration(tmp_path, monkeypatch):
    """gpu.py throughput, run on the CPU: one hpcbert run and one Trainer run per --hf-configs entry
    on the same batches (the real-token counts per step agree), a summary row per configuration,
    and the rendered line naming hpcbert against the fastest; an unknown configuration is a usage
    error naming the ones there are."""
    from glue_fixtures import write_glue_dir

    tok = _trainer_worker_or_skip()
    gpu = _benchmark_script("gpu")
    monkeypatch.setenv("HPCBERT_GPU_BENCH_ON_CPU", "1")
    glue, results = write_glue_dir(tmp_path / "glue", ["MRPC"]), tmp_path / "r"
    common = ["throughput", "--model", "bert-tiny", "--data-dir", str(glue), "--tokenizer", str(tok), "--batches", "2", "--steps", "2",
              "--warmup-excluded", "1", "--repeats", "1", "--threads", "1", "--results-dir", str(results),
              "--work-dir", str(tmp_path / "w")]
    with pytest.raises(SystemExit) as e:
        gpu.main([*common, "--hf-configs", "plain,bogus"])
    assert e.value.code == 2
    assert gpu.main([*common, "--hf-configs", "plain,pad8"]) == 0
    doc = json.loads((results / "throughput.json").read_text())
    assert [(r["side"], r.get("hf_config")) for r in doc["runs"]] == [("hpcbert", None), ("hf", "plain"), ("hf", "pad8")]
    hp, plain, pad8 = doc["runs"]  # 3 examples: two steps of batch 2 are one epoch, the worker's order
    assert hp["step_real_tokens"] == plain["step_real_tokens"] == pad8["step_real_tokens"]
    assert pad8["pad_to_multiple_of"] == 8 and all((p // n) % 8 == 0 for p, n in zip(pad8["step_padded_tokens"], pad8["step_sequences"]))
    assert [(r["batch"], r["hf_config"]) for r in doc["summary"]] == [(2, "plain"), (2, "pad8")]
    # both sides ran the model asked for: the Trainer worker's command lines, as logged
    logs = sorted((tmp_path / "w" / "logs").glob("*.log"))
    assert doc["settings"]["model"] == "bert-tiny" and len(logs) == 3
    assert all("--model bert-tiny" in log.read_text().splitlines()[0] for log in logs), [log.name for log in logs]
    assert "hpcbert against the Trainer at its best on equal batches: batch 2:" in gpu.render(results)
