"""The repository keeps its promises to users: the README's commands are what CI runs."""

from __future__ import annotations

import re
import subprocess

from conftest import ROOT


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [b.strip() for b in blocks]


def test_readme_has_the_two_setup_commands_and_ci_runs_the_test_one():
    cmds = readme_commands()
    bench = [c for c in cmds if c.endswith("hpcbert bench")]
    tests = [c for c in cmds if "pytest" in c]
    assert len(bench) == 1 and len(tests) == 1, "README must hold one bench and one test set-up command"
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests[0] in ci, ".ci/run must run the README's test command verbatim"


def test_no_glue_data_is_tracked():
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True).stdout.split()
    assert not [f for f in files if f.endswith(".tsv")], "GLUE files from ../shared must never be committed"
