"""An option that only some tasks read is refused, naming it and the tasks it is for, when a run of
another task sets it, and so is a --poly-power without --lr-decay poly: nothing given on the command
line is silently ignored. Each case is written by hand from the options' documentation (`hpcbert
train --help`), not from the table in hpcbert.objectives."""

from __future__ import annotations

import pytest

from hpcbert import objectives
from hpcbert.cli import main
from hpcbert.config import RunConfig

# what each task needs to pass its own checks up to the point where options are compared
BASE = {"mrpc": {"data_dir": "glue"}, "synthetic": {}, "squad": {"train_file": "t.json", "do_eval": False},
        "classify": {"train_file": "t.csv", "text_fields": "a", "do_eval": False}, "mlm": {"data_dir": "prepared"}}

REFUSED = [  # (task, option set, the start of the message)
    ("mrpc", {"train_file": "x.csv"}, "train_file: an option of squad and classify, not used by --task mrpc"),
    ("mrpc", {"regression": True}, "regression: an option of classify, not used by --task mrpc"),
    ("mrpc", {"doc_stride": 64}, "doc_stride: an option of squad, not used by --task mrpc"),
    ("mrpc", {"mask_prob": 0.2}, "mask_prob: an option of mlm, not used by --task mrpc"),
    ("mrpc", {"synthetic_train_size": 8}, "synthetic_train_size: an option of synthetic, not used by --task mrpc"),
    ("synthetic", {"data_dir": "glue"}, "data_dir: an option of GLUE tasks and mlm, not used by --task synthetic"),
    ("synthetic", {"label_field": "y"}, "label_field: an option of classify, not used by --task synthetic"),
    ("synthetic", {"nsp": True}, "nsp: an option of mlm, not used by --task synthetic"),
    ("squad", {"test_file": "x.csv"}, "test_file: an option of classify, not used by --task squad"),
    ("squad", {"eval_data": "other"}, "eval_data: an option of mlm, not used by --task squad"),
    ("squad", {"synthetic_dev_size": 8}, "synthetic_dev_size: an option of synthetic, not used by --task squad"),
    ("classify", {"squad_version": "2.0"}, "squad_version: an option of squad, not used by --task classify"),
    ("classify", {"max_query_length": 32}, "max_query_length: an option of squad, not used by --task classify"),
    ("classify", {"data_dir": "glue"}, "data_dir: an option of GLUE tasks and mlm, not used by --task classify"),
    ("mlm", {"format": "csv"}, "format: an option of classify, not used by --task mlm"),
    ("mlm", {"n_best_size": 5}, "n_best_size: an option of squad, not used by --task mlm"),
    ("mlm", {"dev_file": "d.json"}, "dev_file: an option of squad and classify, not used by --task mlm"),
    ("mlm", {"cache_dir": "c"}, "cache_dir: an option of GLUE tasks, squad and classify, not used by --task mlm"),
    ("synthetic", {"cache_dir": "c"}, "cache_dir: an option of GLUE tasks, squad and classify, not used by "
                                      "--task synthetic"),
]


@pytest.mark.parametrize("task,option,message", REFUSED, ids=[f"{t}-{next(iter(o))}" for t, o, _ in REFUSED])
def test_an_option_of_another_task_is_refused_by_name(task, option, message):
    cfg = RunConfig(task=task, **BASE[task], **option)
    with pytest.raises(ValueError) as e:
        objectives.get(cfg).check(cfg)
    assert str(e.value).startswith(message) and str(e.value).endswith("; leave it out"), str(e.value)


@pytest.mark.parametrize("task,option", [
    ("synthetic", {"synthetic_train_size": 8, "synthetic_dev_size": 8}),
    ("mrpc", {"data_dir": "glue"}),
    ("mlm", {"mask_prob": 0.2, "whole_word_masking": True, "nsp": True}),
])
def test_an_option_of_the_task_itself_is_not_refused(task, option):
    cfg = RunConfig(task=task, **{**BASE[task], **option})
    try:
        objectives.get(cfg).check(cfg)
    except ValueError as e:  # a later check may refuse a path that does not exist: not an option's refusal
        assert "an option of" not in str(e), str(e)


def test_the_command_line_refuses_it_before_any_run_directory(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--task", "sst-2", "--data-dir", str(tmp_path), "--regression", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert ("hpcbert train: error: regression: an option of classify, not used by --task sst-2 (which reads the GLUE "
            "files in --data-dir); leave it out") in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("command", ["plan", "bench"])
def test_plan_and_bench_refuse_it_as_train_would_before_any_work(tmp_path, capsys, command):
    out = tmp_path / "bench"
    args = ["--memory", "8GiB"] if command == "plan" else ["--out", str(out)]
    assert main([command, "--task", "synthetic", "--doc-stride", "64", *args]) == 2
    err = capsys.readouterr().err
    assert (f"hpcbert {command}: error: doc_stride: an option of squad, not used by --task synthetic (which "
            "generates its data); leave it out") in err and "Traceback" not in err, err
    assert not out.exists()


def test_a_poly_power_without_poly_decay_is_refused():
    with pytest.raises(ValueError, match=r"^poly_power: 0\.5 is the power of --lr-decay poly, which this run does not "
                                         r"use \(--lr-decay linear\)"):
        RunConfig(poly_power=0.5)
    assert RunConfig(poly_power=0.5, lr_decay="poly").poly_power == 0.5
