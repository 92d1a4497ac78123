"""Fuzz the run-directory reader: broken run files are skipped with one line naming the file, never a
traceback; valid runs are always reported.

Starting from a finished run as report_fixtures.make_run writes it (config.json from a real
RunConfig, every runfiles.SUMMARY_KEYS key, metrics.jsonl from MetricsWriter), Hypothesis mutates
summary.json, metrics.jsonl or config.json: byte flips, truncation, empty and missing files, other
encodings, huge lines, deep nesting, missing / extra keys, values of the wrong type, NaN, infinity
and over-long numbers. Each example writes MUTATIONS_PER_EXAMPLE mutated copies beside one untouched
run (another seed of the same configuration, so that both can land in one table row) and loads
them all at once, as `hpcbert report FOLDER` does. Then:

  * every mutated run is either reported or skipped with a reason that is one line and names the
    mutated file (metrics.jsonl: file and line);
  * the untouched run, and a mutated run whose mutation keeps it valid (an extra key, blank lines,
    a dropped or repeated metrics line, other whitespace), is reported;
  * the reported runs make a table that renders as Markdown, CSV and JSON (strict JSON: no NaN).

EXAMPLES x MUTATIONS_PER_EXAMPLE mutations in all (10,400), derandomized: the same ones every run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="pip install 'hypothesis>=6' (the test extra)")
from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # noqa: E402

from hpcbert import report  # noqa: E402
from hpcbert.runfiles import SUMMARY_KEYS  # noqa: E402
from report_fixtures import make_run  # noqa: E402

EXAMPLES = int(os.environ.get("HPCBERT_FUZZ_EXAMPLES", "800"))
MUTATIONS_PER_EXAMPLE = 13
FILES = ("summary.json", "metrics.jsonl", "config.json")
RAW = "\x00raw\x00"  # placeholder for a token json.dumps cannot write (NaN is written by json.dumps itself)
RAW_TOKENS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" * 5000, "[" * 20000, "{" * 3000,
              '"\\ud800"', "01", "+1", "'x'", "", "tru", "[1,]", "{\"a\" 1}"]


class RunFiles(dict):
    """{run: {file: bytes}}, shown briefly in Hypothesis' report of a failing example."""

    def __repr__(self) -> str:
        return f"RunFiles({', '.join(self)})"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> RunFiles:
    """The files of a finished run to mutate, and of an untouched one (another seed).
    HPCBERT_FUZZ_RUN_DIR=RUN_DIR starts from that run instead (e.g. one `hpcbert train` wrote; the
    untouched run is then a copy of it)."""
    given_dir = os.environ.get("HPCBERT_FUZZ_RUN_DIR")
    if given_dir:
        files = {f: (Path(given_dir) / f).read_bytes() for f in FILES}
        return RunFiles(base=files, control=files)
    root = tmp_path_factory.mktemp("fuzz-base")
    out = RunFiles()
    for name, seed in (("base", 1), ("control", 2)):
        d = make_run(root, name, config={"seed": seed}, metrics_steps=6)
        out[name] = {f: (d / f).read_bytes() for f in FILES}
    return out


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


def _dump(obj, pretty: bool) -> str:
    return json.dumps(obj, indent=2 if pretty else None)


def _key_path(obj: dict, draw) -> list:
    """A path to a value inside obj: a top-level key, or one level into a dict / list value."""
    key = draw(st.sampled_from(sorted(obj)))
    path = [key]
    v = obj[key]
    if isinstance(v, dict) and v and draw(st.booleans()):
        path.append(draw(st.sampled_from(sorted(v))))
    elif isinstance(v, list) and v and draw(st.booleans()):
        path.append(draw(st.integers(0, len(v) - 1)))
    return path


def _get_parent(obj, path):
    for k in path[:-1]:
        obj = obj[k]
    return obj


@st.composite
def object_mutation(draw, obj: dict) -> tuple[str, bool]:
    """(new text, stays valid) for one JSON object (summary.json, config.json, a metrics line)."""
    obj = json.loads(json.dumps(obj))
    kind = draw(st.sampled_from(["delete", "extra", "retype", "raw", "not-object", "reformat"]))
    token = None
    valid = False
    if kind == "delete" and obj:
        path = _key_path(obj, draw)
        parent = _get_parent(obj, path)
        del parent[path[-1]]
    elif kind == "extra":
        obj["x_" + draw(st.text(max_size=8))] = draw(json_values)  # not a key any reader knows
        valid = True
    elif kind == "retype" and obj:
        path = _key_path(obj, draw)
        _get_parent(obj, path)[path[-1]] = draw(json_values)
    elif kind == "raw" and obj:
        path = _key_path(obj, draw)
        _get_parent(obj, path)[path[-1]] = RAW
        token = draw(st.sampled_from(RAW_TOKENS))
    elif kind == "not-object":
        obj = draw(st.one_of(st.lists(json_values, max_size=2), st.integers(), st.text(max_size=5), st.none()))
    else:  # reformat: other whitespace, same content
        valid = True
    text = _dump(obj, draw(st.booleans()))
    if token is not None:
        text = text.replace(json.dumps(RAW), token)
    return text, valid


@st.composite
def mutation(draw, files: dict[str, bytes]) -> tuple[str, bytes | None, bool]:
    """(file, new bytes or None for 'removed', stays valid)."""
    name = draw(st.sampled_from(FILES))
    data = files[name]
    kind = draw(st.sampled_from(["bytes", "truncate", "empty", "missing", "encoding", "huge", "json"]))
    if kind == "bytes":
        flips = draw(st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(1, 255)), min_size=1, max_size=4))
        b = bytearray(data)
        for pos, xor in flips:
            b[pos] ^= xor
        return name, bytes(b), False
    if kind == "truncate":
        return name, data[:draw(st.integers(0, len(data) - 1))], False
    if kind == "empty":
        return name, b"", name == "metrics.jsonl"  # no metrics lines: a run that logged nothing
    if kind == "missing":
        return name, None, name == "metrics.jsonl"
    if kind == "encoding":
        text = data.decode().replace('"', '"é', 1) if draw(st.booleans()) else data.decode()
        codec = draw(st.sampled_from(["utf-16", "utf-16-le", "utf-32", "latin-1", "cp1252", "utf-8-sig"]))
        return name, text.encode(codec), False
    if kind == "huge":
        size = draw(st.sampled_from([2**12, 2**16, 2**20]))
        if name == "metrics.jsonl":
            line = json.dumps({"step": 1, "loss": 0.5, "x_pad": "x" * size}) if draw(st.booleans()) else "x" * size
            return name, data + line.encode() + b"\n", line.startswith("{")
        obj = json.loads(data)
        obj["x_pad"] = "y" * size
        return name, json.dumps(obj).encode(), True
    # json: a structural change of the object (or of one metrics line)
    if name != "metrics.jsonl":
        text, valid = draw(object_mutation(json.loads(data)))
        return name, text.encode(), valid
    lines = data.decode().splitlines()
    i = draw(st.integers(0, len(lines) - 1))
    how = draw(st.sampled_from(["line", "drop", "repeat", "blank", "insert"]))
    if how == "line":
        text, valid = draw(object_mutation(json.loads(lines[i])))
        lines[i] = text.replace("\n", " ")
    elif how == "drop":
        del lines[i]
        valid = True
    elif how == "repeat":
        lines.insert(i, lines[i])
        valid = True
    elif how == "blank":
        lines.insert(i, draw(st.sampled_from(["", "   ", "\t"])))
        valid = True
    else:
        lines.insert(i, draw(st.sampled_from(RAW_TOKENS + ["{}", "[]", "null", '{"step": 1}'])))
        valid = False
    return name, ("\n".join(lines) + "\n").encode(), valid


def _write(d: Path, files: dict[str, bytes], change: tuple[str, bytes | None, bool] | None = None) -> None:
    """The run's files in d (created once, then overwritten: examples reuse their directories)."""
    d.mkdir(parents=True, exist_ok=True)
    for f, data in files.items():
        if change and change[0] == f:
            if change[1] is None:
                (d / f).unlink(missing_ok=True)
                continue
            data = change[1]
        (d / f).write_bytes(data)


def _check(base: dict, root: Path, changes: list) -> None:
    dirs = []
    for j, change in enumerate(changes):
        _write(root / f"m{j}", base["base"], change)
        dirs.append(root / f"m{j}")
    if not (root / "control").is_dir():
        _write(root / "control", base["control"])
    runs, skipped = report.load_runs([*dirs, root / "control"])
    loaded = {Path(r["path"]) for r in runs}
    reasons = {Path(p): reason for p, reason in skipped}
    assert root / "control" in loaded, reasons
    assert len(runs) + len(skipped) == len(changes) + 1
    for d, (name, data, valid) in zip(dirs, changes):
        if d in loaded:
            continue
        reason = reasons[d]
        assert not valid, f"valid run dropped ({name} mutated): {reason}"
        assert len(reason.splitlines()) == 1 and len(reason) < 2000, reason[:3000]
        if name == "metrics.jsonl":
            assert re.search(r"metrics\.jsonl:\d+: ", reason), reason
        else:
            assert name in reason, (name, reason)
    table = report.build_table(runs, policy_columns=True)
    md = report.render_markdown(table, skipped)
    assert md.count("\n| ") == len(table) + 1  # header + one line per row: no cell broke a row
    report.render_csv(table, skipped)
    doc = json.loads(report.render_json(table, skipped))  # allow_nan=False inside: strict JSON
    assert len(doc["rows"]) == len(table)


# No shrinking: an example holds MUTATIONS_PER_EXAMPLE runs, and the failing run's mutation is in the
# assertion message already; shrinking would re-run the heavy examples for minutes.
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_run_files_are_skipped_with_a_one_line_reason(base, workdir, data):
    _check(base, workdir, [data.draw(mutation(base["base"])) for _ in range(MUTATIONS_PER_EXAMPLE)])


@pytest.fixture(scope="module")
def workdir():
    """Where the examples write their runs: memory-backed where the machine has /dev/shm (an
    example writes 30 files), else the temporary folder."""
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="hpcbert-fuzz-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_the_fuzz_oracle_sees_a_traceback_and_a_dropped_valid_run(base, tmp_path):
    """The property can fail: a reader that raised would surface here, and a valid run that was
    skipped would be reported as dropped."""
    summary = json.loads(base["base"]["summary.json"])
    summary["steps"] = "many"  # a broken run: skipped, naming summary.json and the key
    root = tmp_path / "a"
    _check(base, root, [("summary.json", json.dumps(summary).encode(), False)])
    with pytest.raises(AssertionError, match="valid run dropped"):
        _check(base, tmp_path / "b", [("summary.json", json.dumps(summary).encode(), True)])
    assert "steps" in SUMMARY_KEYS
