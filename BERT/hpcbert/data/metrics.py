"""GLUE task metrics, in numpy and pandas only.

scikit-learn and scipy are test-only references: the training kit should not pull them onto a
cluster node for five formulas. Each function returns what its reference returns, degenerate
cases included (MCC and F1 are 0 where sklearn returns 0; correlations are NaN where scipy returns
NaN, e.g. for constant input), so numbers agree with published GLUE evaluation code.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .glue import TaskSpec, get_task

__all__ = ["accuracy", "compute_metrics", "f1_binary", "f1_macro", "matthews_corrcoef", "pearson", "spearman"]


def _pair(preds, labels) -> tuple[np.ndarray, np.ndarray]:
    """Both inputs as 1-D arrays of equal, non-zero length.

    A trailing axis of size 1 (regression output of shape (n, 1)) is dropped; any other 2-D input
    is refused, because passing logits instead of class indices would otherwise compare garbage.
    """
    p, y = _flat(preds, "preds"), _flat(labels, "labels")
    if len(p) != len(y):
        raise ValueError(f"preds and labels differ in length: {len(p)} vs {len(y)}")
    if len(p) == 0:
        raise ValueError("cannot compute a metric on zero examples")
    return p, y


def _flat(values, what: str) -> np.ndarray:
    """`values` as a 1-D array; (n, 1) is accepted, other shapes raise ValueError."""
    a = np.asarray(values)
    if a.ndim == 2 and a.shape[1] == 1:
        a = a[:, 0]
    if a.ndim != 1:
        raise ValueError(
            f"{what}: expected a 1-D sequence, got shape {a.shape} (pass class indices, not logits)"
        )
    return a


def accuracy(preds, labels) -> float:
    """Fraction of predictions equal to the label."""
    p, y = _pair(preds, labels)
    return float(np.mean(p == y))


def f1_binary(preds, labels) -> float:
    """F1 of the positive class 1 (MRPC, QQP); 0.0 when there are no true or predicted positives.

    Inputs must be 0/1: anything else is almost certainly a bug (probabilities, logits, or labels
    of another task), and sklearn refuses it too.
    """
    p, y = _pair(preds, labels)
    for a, what in ((p, "preds"), (y, "labels")):
        if not np.isin(a, (0, 1)).all():
            raise ValueError(f"f1_binary: {what} must be 0 or 1, found {np.unique(a)[:10].tolist()}")
    tp = np.sum((p == 1) & (y == 1))
    fp = np.sum((p == 1) & (y != 1))
    fn = np.sum((p != 1) & (y == 1))
    denominator = 2 * tp + fp + fn
    return float(2 * tp / denominator) if denominator else 0.0


def f1_macro(preds, labels) -> float:
    """Unweighted mean of each class's F1 over the classes that occur among the labels or the
    predictions (sklearn's f1_score(average="macro"), as the `evaluate` library reports it):
    every class counts alike, whatever its size and whichever index it has."""
    p, y = _pair(preds, labels)
    classes, codes = np.unique(np.concatenate([y, p]), return_inverse=True)
    k = len(classes)
    confusion = np.bincount(codes[: len(y)] * k + codes[len(y):], minlength=k * k).reshape(k, k)
    tp = np.diag(confusion).astype(np.float64)
    denominator = confusion.sum(axis=0) + confusion.sum(axis=1)  # 2tp + fp + fn, > 0 for a present class
    return float(np.mean(2 * tp / denominator))


def matthews_corrcoef(preds, labels) -> float:
    """Matthews correlation (CoLA), multi-class form; 0.0 when either side has a single class.

    Computed from the confusion matrix like sklearn (Gorodkin's R_K), so it also works for more
    than two classes. Counts are floats so that the products cannot overflow on large sets.
    """
    p, y = _pair(preds, labels)
    classes, codes = np.unique(np.concatenate([y, p]), return_inverse=True)
    y_codes, p_codes = codes[: len(y)], codes[len(y):]
    k = len(classes)
    confusion = np.bincount(y_codes * k + p_codes, minlength=k * k).reshape(k, k).astype(np.float64)
    true_counts, pred_counts = confusion.sum(axis=1), confusion.sum(axis=0)
    n, correct = confusion.sum(), np.trace(confusion)
    cov_yp = correct * n - true_counts @ pred_counts
    cov_pp = n * n - pred_counts @ pred_counts
    cov_yy = n * n - true_counts @ true_counts
    if cov_pp * cov_yy == 0:
        return 0.0
    return float(cov_yp / math.sqrt(cov_yy * cov_pp))


def pearson(preds, labels) -> float:
    """Pearson correlation (STS-B); NaN for constant input or any NaN value, as scipy."""
    return _correlation(preds, labels, rank=False)


def spearman(preds, labels) -> float:
    """Spearman rank correlation with average ranks for ties (STS-B); NaN cases as `pearson`.

    Computed as the Pearson correlation of the ranks (the definition scipy uses) rather than with
    Series.corr(method="spearman"), which imports scipy, a test-only dependency here.
    """
    return _correlation(preds, labels, rank=True)


def _correlation(preds, labels, rank: bool) -> float:
    """Pearson correlation via pandas Series.corr, of the values or of their average ranks.

    NaN anywhere gives NaN, as in scipy: pandas alone would drop NaN pairs, and a model that emits
    NaN must not get a good score from the rows it did not break.
    """
    p, y = _pair(preds, labels)
    p, y = pd.Series(p.astype(np.float64)), pd.Series(y.astype(np.float64))
    if p.isna().any() or y.isna().any():
        return math.nan
    if rank:
        p, y = p.rank(method="average"), y.rank(method="average")
    return float(p.corr(y, method="pearson"))


def compute_metrics(task: TaskSpec | str, preds, labels) -> dict[str, float]:
    """The GLUE metrics of `task`; the key `task.main_metric` is always present.

    cola: mcc; mrpc, qqp: f1 and accuracy; sts-b: pearson and spearman; the others: accuracy.
    `preds` are class indices, or float scores for STS-B.
    """
    spec = get_task(task)
    if spec.is_regression:
        return {"pearson": pearson(preds, labels), "spearman": spearman(preds, labels)}
    if spec.main_metric == "mcc":
        return {"mcc": matthews_corrcoef(preds, labels)}
    if spec.main_metric == "f1":
        return {"f1": f1_binary(preds, labels), "accuracy": accuracy(preds, labels)}
    return {"accuracy": accuracy(preds, labels)}
