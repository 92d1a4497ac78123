"""Task metrics against the scikit-learn / scipy references, on random inputs and edge cases."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy import stats
from sklearn import metrics as sk

from hpcbert.data.glue import TASKS
from hpcbert.data.metrics import (
    accuracy,
    compute_metrics,
    f1_binary,
    matthews_corrcoef,
    pearson,
    spearman,
)

TOL = 1e-9
SEEDS = range(6)


def _quiet(fn, *args, **kwargs):
    """Call a reference, silencing its warnings about undefined values (the values are the point)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def ref_f1(p, y):
    return _quiet(sk.f1_score, y, p)


def ref_mcc(p, y):
    return _quiet(sk.matthews_corrcoef, y, p)


def ref_pearson(p, y):
    return float(_quiet(stats.pearsonr, p, y).statistic)


def ref_spearman(p, y):
    return float(_quiet(stats.spearmanr, p, y).statistic)


def assert_close(value: float, reference: float) -> None:
    assert isinstance(value, float)
    if math.isnan(reference):
        assert math.isnan(value)
    else:
        assert abs(value - reference) <= TOL, (value, reference)


def _classification(seed: int, n: int, k: int = 2, agreement: float = 0.7):
    """Labels and predictions that agree on about `agreement` of the rows."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, n)
    preds = np.where(rng.random(n) < agreement, labels, rng.integers(0, k, n))
    return preds, labels


# --- random inputs -----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [2, 17, 500, 20000])
def test_binary_metrics_match_sklearn(seed, n):
    preds, labels = _classification(seed, n)
    assert_close(accuracy(preds, labels), sk.accuracy_score(labels, preds))
    assert_close(f1_binary(preds, labels), ref_f1(preds, labels))
    assert_close(matthews_corrcoef(preds, labels), ref_mcc(preds, labels))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [3, 5])
def test_multiclass_metrics_match_sklearn(seed, k):
    preds, labels = _classification(seed, 300, k=k, agreement=0.5)
    assert_close(accuracy(preds, labels), sk.accuracy_score(labels, preds))
    assert_close(matthews_corrcoef(preds, labels), ref_mcc(preds, labels))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [3, 50, 1500])
def test_correlations_match_scipy(seed, n):
    rng = np.random.default_rng(seed)
    labels = rng.uniform(0, 5, n)
    preds = labels + rng.normal(0, 1.5, n)
    assert_close(pearson(preds, labels), ref_pearson(preds, labels))
    assert_close(spearman(preds, labels), ref_spearman(preds, labels))


@pytest.mark.parametrize("seed", SEEDS)
def test_spearman_with_ties_matches_scipy(seed):
    """STS-B gold scores are mostly multiples of 0.2, so ties are the normal case."""
    rng = np.random.default_rng(seed)
    labels = np.round(rng.uniform(0, 5, 400) * 5) / 5
    preds = np.round(labels + rng.normal(0, 1, 400))  # integers: heavy ties on both sides
    assert len(np.unique(labels)) < 400 and len(np.unique(preds)) < 20
    assert_close(spearman(preds, labels), ref_spearman(preds, labels))
    assert_close(pearson(preds, labels), ref_pearson(preds, labels))


def test_mcc_no_overflow_on_large_inputs():
    preds, labels = _classification(0, 3_000_000)
    assert_close(matthews_corrcoef(preds, labels), ref_mcc(preds, labels))


# --- edge cases --------------------------------------------------------------------------------

CLASS_EDGES = {
    "perfect": ([0, 1, 1, 0, 1], [0, 1, 1, 0, 1]),
    "all wrong": ([1, 0, 0, 1], [0, 1, 1, 0]),
    "labels all 1": ([1, 0, 1, 1], [1, 1, 1, 1]),
    "labels all 0": ([1, 0, 1, 0], [0, 0, 0, 0]),
    "preds all 0": ([0, 0, 0, 0], [1, 0, 1, 1]),
    "preds all 1": ([1, 1, 1, 1], [1, 0, 1, 0]),
    "both all 0": ([0, 0, 0], [0, 0, 0]),
    "both all 1": ([1, 1, 1], [1, 1, 1]),
    "single row right": ([1], [1]),
    "single row wrong": ([0], [1]),
    "one positive found": ([0, 0, 1, 0], [0, 0, 1, 0]),
}


@pytest.mark.parametrize("preds, labels", CLASS_EDGES.values(), ids=CLASS_EDGES.keys())
def test_classification_edge_cases_match_sklearn(preds, labels):
    assert_close(accuracy(preds, labels), sk.accuracy_score(labels, preds))
    assert_close(f1_binary(preds, labels), ref_f1(preds, labels))
    assert_close(matthews_corrcoef(preds, labels), ref_mcc(preds, labels))


def test_known_values():
    assert matthews_corrcoef([0, 1, 1, 0], [0, 1, 1, 0]) == 1.0
    assert matthews_corrcoef([1, 0, 0, 1], [0, 1, 1, 0]) == -1.0
    assert matthews_corrcoef([1, 1, 1, 1], [0, 1, 1, 0]) == 0.0  # a class is absent from preds
    assert f1_binary([0, 0], [0, 0]) == 0.0  # no positives anywhere: sklearn's zero_division value
    assert accuracy([2, 1, 0], [2, 1, 1]) == pytest.approx(2 / 3)


def test_mcc_with_a_class_only_in_preds_matches_sklearn():
    preds, labels = [0, 2, 1, 1, 0], [0, 1, 1, 1, 0]
    assert_close(matthews_corrcoef(preds, labels), ref_mcc(preds, labels))


REGRESSION_EDGES = {
    "perfect": ([0.0, 1.5, 3.0, 5.0], [0.0, 1.5, 3.0, 5.0]),
    "inverse": ([5.0, 3.0, 1.0], [0.0, 2.0, 4.0]),
    "two points": ([0.3, 0.1], [1.0, 4.0]),
    "constant preds": ([2.5, 2.5, 2.5, 2.5], [0.0, 1.0, 4.0, 5.0]),
    "constant labels": ([0.2, 1.3, 4.1], [3.0, 3.0, 3.0]),
    "all ties but one": ([1.0, 1.0, 1.0, 2.0], [0.0, 5.0, 5.0, 5.0]),
    "integer input": ([1, 2, 3, 4, 4], [0, 2, 2, 5, 5]),
    "nan in preds": ([0.1, math.nan, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]),
}


@pytest.mark.parametrize("preds, labels", REGRESSION_EDGES.values(), ids=REGRESSION_EDGES.keys())
def test_correlation_edge_cases_match_scipy(preds, labels):
    assert_close(pearson(preds, labels), ref_pearson(preds, labels))
    assert_close(spearman(preds, labels), ref_spearman(preds, labels))


def test_correlations_do_not_need_scipy(monkeypatch):
    """scipy is test-only; pandas' own method="spearman" would import it."""
    import sys

    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.stats", None)
    assert spearman([1.0, 2.0, 2.0, 5.0], [0.0, 1.0, 3.0, 2.0]) == pytest.approx(0.6324555320336759)
    assert pearson([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == pytest.approx(1.0)


def test_nan_is_not_dropped_pairwise():
    """pandas alone would ignore the NaN row and report a perfect score."""
    assert math.isnan(pearson([1.0, 2.0, math.nan, 4.0], [1.0, 2.0, 3.0, 4.0]))


# --- input handling ----------------------------------------------------------------------------

def test_accepts_lists_arrays_and_column_vectors():
    preds, labels = [0.1, 0.4, 0.35, 0.8], [0.0, 1.0, 2.0, 3.0]
    column = np.array(preds).reshape(-1, 1)
    assert pearson(column, labels) == pearson(np.array(preds), np.array(labels)) == pearson(preds, labels)
    assert accuracy(np.array([[1], [0]]), [1, 1]) == 0.5


@pytest.mark.parametrize("fn", [accuracy, f1_binary, matthews_corrcoef, pearson, spearman])
def test_bad_shapes_are_refused(fn):
    with pytest.raises(ValueError, match="differ in length: 3 vs 2"):
        fn([0, 1, 1], [0, 1])
    with pytest.raises(ValueError, match="zero examples"):
        fn([], [])
    with pytest.raises(ValueError, match="not logits"):
        fn(np.zeros((4, 2)), [0, 1, 1, 0])


def test_f1_refuses_non_binary_values():
    with pytest.raises(ValueError, match=r"preds must be 0 or 1, found \[0, 1, 2\]"):
        f1_binary([0, 1, 2], [0, 1, 1])
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        f1_binary([0, 1, 1], [0.5, 1, 1])


# --- compute_metrics ---------------------------------------------------------------------------

EXPECTED_KEYS = {
    "cola": {"mcc"}, "sst-2": {"accuracy"}, "mrpc": {"f1", "accuracy"}, "sts-b": {"pearson", "spearman"},
    "qqp": {"f1", "accuracy"}, "mnli": {"accuracy"}, "qnli": {"accuracy"}, "rte": {"accuracy"},
    "wnli": {"accuracy"},
}


@pytest.mark.parametrize("name", list(TASKS))
def test_compute_metrics_keys_and_values(name):
    spec = TASKS[name]
    if spec.is_regression:
        rng = np.random.default_rng(1)
        labels = rng.uniform(0, 5, 60)
        preds = labels + rng.normal(0, 1, 60)
    else:
        preds, labels = _classification(1, 60, k=spec.num_labels)
    result = compute_metrics(name, preds, labels)
    assert set(result) == EXPECTED_KEYS[name]
    assert spec.main_metric in result
    assert all(type(v) is float for v in result.values())
    reference = {"mcc": ref_mcc, "f1": ref_f1, "pearson": ref_pearson, "spearman": ref_spearman,
                 "accuracy": lambda p, y: sk.accuracy_score(y, p)}
    for key, value in result.items():
        assert_close(value, float(reference[key](preds, labels)))
    assert compute_metrics(spec, list(preds), list(labels)) == result


def test_compute_metrics_accepts_aliases():
    assert compute_metrics("SST2", [1, 0], [1, 1]) == {"accuracy": 0.5}
    assert compute_metrics("stsb", np.array([[1.0], [2.0], [3.0]]), [0.0, 2.5, 5.0]) == {
        "pearson": pytest.approx(1.0), "spearman": pytest.approx(1.0)}
    with pytest.raises(ValueError, match="unknown GLUE task"):
        compute_metrics("squad", [1], [1])
