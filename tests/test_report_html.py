"""The HTML report: self-contained, every plot a real picture, and it renders in a browser offline.

The browser test needs Debian's chromium (`apt-get install -y chromium`); it is skipped without it.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hpcbert import report
from report_fixtures import make_run, make_study

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
IMG_SRC = re.compile(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


@pytest.fixture(scope="module")
def study_html(tmp_path_factory) -> Path:
    root = make_study(tmp_path_factory.mktemp("study") / "results")
    out = root.parent / "report.html"
    assert report.cli([str(root), "--format", "html", "--out", str(out)]) == 0
    return out


def _pngs(page: str) -> list[bytes]:
    return [base64.b64decode(b64, validate=True) for b64 in IMG_SRC.findall(page)]


def test_html_is_self_contained(study_html):
    page = study_html.read_text()
    text = IMG_SRC.sub("<img ", page)  # everything but the inline images
    assert not re.search(r"https?:|ftp:|file:|//[\w.-]+/", text), "external URL in the report"
    assert not re.search(r"<script|<link|<iframe|@import|url\(|href=", text)
    srcs = re.findall(r'src="([^"]{0,30})', page)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert page.count("<table>") == 1 and "<figcaption><b>Table 1.</b> Fixed across rows" in page


def test_every_plot_decodes_to_a_non_blank_png(study_html):
    from matplotlib.image import imread

    pngs = _pngs(study_html.read_text())
    assert len(pngs) == 4  # scaling, loss curves, checkpointing policies, dev metric
    for png in pngs:
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        img = imread(io.BytesIO(png), format="png")  # (H, W, 4) floats in [0, 1]
        assert img.shape[0] > 200 and img.shape[1] > 300
        assert img[..., :3].std() > 0.05, "plot is blank"
        assert (img[..., :3] < 0.5).mean() > 0.005, "no dark pixels: no axes, lines or text"


def test_plots_the_data_cannot_support_become_notes(tmp_path):
    make_run(tmp_path, "only", accuracy=None, f1=None, metrics_steps=0)
    out = tmp_path / "r.html"
    assert report.cli([str(tmp_path / "only"), "--format", "html", "--out", str(out)]) == 0
    page = out.read_text()
    assert "<img " not in page
    notes = re.findall(r'<p class="note">([^<]*)</p>', page)
    assert len(notes) == 5
    assert "world size(s) 1" in notes[0] and "no run has metrics.jsonl" in notes[1]
    assert "no run evaluated during training" in notes[2]
    assert "two or more grad_ckpt policies" in notes[3] and "no run was evaluated" in notes[4]


CHECK_JS = """<script>window.addEventListener("load", function () {
  var im = document.images, ok = 0;
  for (var i = 0; i < im.length; i++) if (im[i].complete && im[i].naturalWidth > 0) ok++;
  document.body.setAttribute("data-check", JSON.stringify({images: im.length, decoded: ok,
    tables: document.querySelectorAll("table").length, rows: document.querySelectorAll("tbody tr").length}));
});</script>"""


def _chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND",
           "--enable-logging=stderr", "--v=0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(study_html, tmp_path):
    # 1) The DOM after load: the table is there and every <img> decoded (naturalWidth > 0).
    checked = tmp_path / "check.html"
    checked.write_text(study_html.read_text().replace("</body>", CHECK_JS + "</body>"))
    res = _chromium(tmp_path, "--virtual-time-budget=10000", "--dump-dom", checked.as_uri())
    m = re.search(r'data-check="([^"]*)"', res.stdout)
    assert m, f"no check result in the DOM dump; stderr:\n{res.stderr[-2000:]}"
    check = json.loads(m.group(1).replace("&quot;", '"'))
    assert check == {"images": 4, "decoded": 4, "tables": 1, "rows": 7}
    console = [ln for ln in res.stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]
    assert not console, console

    # 2) The report as shipped: no console message (no failed load, no error), and a screenshot.
    shot = tmp_path / "report.png"
    res = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,2000", "--hide-scrollbars",
                    study_html.as_uri())
    console = [ln for ln in res.stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]
    assert not console, console
    assert shot.is_file(), f"no screenshot; stderr:\n{res.stderr[-2000:]}"
    assert shot.stat().st_size > 20_000
    from matplotlib.image import imread

    img = imread(str(shot))
    assert img.shape[:2] == (2000, 1280)
    assert img[..., :3].std() > 0.05
