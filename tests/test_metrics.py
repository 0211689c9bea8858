"""Metrics vs their brute-force definitions (explicit loops), fixed cases and hypothesis-randomized ones."""

import math
import warnings

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from gem_jax import metrics


# ---- brute force ------------------------------------------------------------------------------------
def brute_ne(labels, probs, weights=None, base_rate=None):
  weights = [1.0] * len(labels) if weights is None else list(weights)
  total = loss = pos = 0.0
  for y, p, w in zip(labels, probs, weights):
    p = min(max(p, metrics.EPS), 1 - metrics.EPS)
    loss += w * -(y * math.log(p) + (1 - y) * math.log(1 - p))
    pos += w * y
    total += w
  rate = pos / total if base_rate is None else base_rate
  return (loss / total) / -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def brute_auc(labels, scores, weights=None):
  weights = [1.0] * len(labels) if weights is None else list(weights)
  num = wp = wn = 0.0
  for yi, si, wi in zip(labels, scores, weights):
    wp += wi * yi
    wn += wi * (1 - yi)
    if yi != 1:
      continue
    for yj, sj, wj in zip(labels, scores, weights):
      if yj == 0:
        num += wi * wj * (1.0 if si > sj else 0.5 if si == sj else 0.0)
  return num / (wp * wn)


# ---- fixed cases ------------------------------------------------------------------------------------
def test_ne_matches_loop_with_weights_and_base_rate():
  rng = np.random.default_rng(0)
  y = rng.integers(0, 2, 50).astype(float)
  p = rng.uniform(0.01, 0.99, 50)
  w = rng.uniform(0.1, 3.0, 50)
  assert metrics.normalized_entropy(y, p) == pytest.approx(brute_ne(y, p), rel=1e-12)
  assert metrics.normalized_entropy(y, p, w) == pytest.approx(brute_ne(y, p, w), rel=1e-12)
  assert metrics.normalized_entropy(y, p, w, base_rate=0.3) == pytest.approx(brute_ne(y, p, w, 0.3), rel=1e-12)


def test_predicting_the_base_rate_gives_ne_one():
  y = np.array([1, 0, 0, 0, 1, 0, 0, 0, 0, 0], float)
  assert metrics.normalized_entropy(y, np.full(10, 0.2)) == pytest.approx(1.0, rel=1e-12)
  w = np.array([3, 1, 1, 1, 1, 1, 1, 1, 1, 1], float)  # weighted rate = 4 / 12
  assert metrics.normalized_entropy(y, np.full(10, 4 / 12), w) == pytest.approx(1.0, rel=1e-12)
  assert metrics.normalized_entropy_from_logits(y, np.full(10, math.log(0.2 / 0.8))) == pytest.approx(1.0, rel=1e-12)


def test_better_predictions_give_lower_ne():
  y = np.array([1, 0, 1, 0], float)
  assert metrics.normalized_entropy(y, [0.9, 0.1, 0.8, 0.2]) < 0.5
  assert metrics.normalized_entropy(y, [0.1, 0.9, 0.2, 0.8]) > 1.5


def test_ne_from_logits_matches_probs_and_stays_finite_when_saturated():
  rng = np.random.default_rng(1)
  y = rng.integers(0, 2, 40).astype(float)
  z = rng.normal(0, 3, 40)
  p = 1 / (1 + np.exp(-z))
  assert metrics.normalized_entropy_from_logits(y, z) == pytest.approx(metrics.normalized_entropy(y, p), rel=1e-10)
  # A confidently wrong logit of -200 costs 200 nats exactly; no clip, no overflow.
  ne = metrics.normalized_entropy_from_logits([1.0, 0.0], [-200.0, 0.0])
  assert ne == pytest.approx(((200.0 + math.log(2)) / 2) / math.log(2), rel=1e-12)


def test_auc_matches_pair_count_with_ties_and_weights():
  y = np.array([1, 0, 1, 0, 1, 0, 0, 1], float)
  s = np.array([0.9, 0.9, 0.5, 0.5, 0.5, 0.1, 0.7, 0.7])  # ties within and across classes
  w = np.array([1, 2, 0.5, 1, 3, 1, 0.2, 1])
  assert metrics.auc(y, s) == pytest.approx(brute_auc(y, s), rel=1e-12)
  assert metrics.auc(y, s, w) == pytest.approx(brute_auc(y, s, w), rel=1e-12)


def test_auc_perfect_reversed_and_constant():
  y = np.array([0, 0, 1, 1, 0, 1], float)
  assert metrics.auc(y, y * 0.8 + 0.1) == 1.0
  assert metrics.auc(y, -y) == 0.0
  assert metrics.auc(y, np.zeros(6)) == 0.5


def test_undefined_results_are_nan_without_warning():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert math.isnan(metrics.auc([1, 1], [0.2, 0.3]))
    assert math.isnan(metrics.auc([0, 1], [0.2, 0.3], [1.0, 0.0]))
    assert math.isnan(metrics.normalized_entropy([0, 0], [0.2, 0.3]))
    assert math.isnan(metrics.normalized_entropy([], []))
    assert math.isnan(metrics.calibration([0, 0], [0.2, 0.3]))


def test_calibration():
  assert metrics.calibration([1, 0, 0, 1], [0.5, 0.25, 0.25, 0.5]) == pytest.approx(0.75)
  assert metrics.calibration([1, 0], [0.5, 0.5], [2.0, 2.0]) == pytest.approx(1.0)


def test_zero_weight_examples_are_dropped_unchecked():
  y = np.array([1.0, 0.0, -1.0, 1.0, 0.0])  # index 2 is an undefined label, masked out
  p = np.array([0.8, 0.3, np.nan, 0.6, 0.1])
  mask = np.array([1.0, 1.0, 0.0, 1.0, 1.0])
  keep = mask > 0
  assert metrics.normalized_entropy(y, p, mask) == pytest.approx(brute_ne(y[keep], p[keep]), rel=1e-12)
  assert metrics.auc(y, p, mask) == pytest.approx(brute_auc(y[keep], p[keep]), rel=1e-12)
  assert metrics.calibration(y, p, mask) == pytest.approx(p[keep].sum() / y[keep].sum(), rel=1e-12)
  with pytest.raises(ValueError, match="labels must be in .*got -1.0 at index 2"):
    metrics.normalized_entropy(y, np.nan_to_num(p), mask + (1 - mask) * 0.5)


@pytest.mark.parametrize("call, match", [
    (lambda: metrics.normalized_entropy([1, 0], [0.5, 1.5]), r"probs .*1\.5 at index 1"),
    (lambda: metrics.normalized_entropy([1, 0], [0.5, np.nan]), r"probs has a non-finite value nan at index 1"),
    (lambda: metrics.auc([1, 2], [0.5, 0.5]), r"labels must be 0 or 1; got 2.0 at index 1"),
    (lambda: metrics.auc([1, 0], [0.5, 0.5], [1.0, -1.0]), r"weights must be non-negative; got -1.0 at index 1"),
    (lambda: metrics.calibration([1, 0, 1], [0.5, 0.5]), r"labels has 3 values but probs has 2"),
    (lambda: metrics.normalized_entropy([1, 0], [0.5, 0.5], base_rate=1.2), r"base_rate"),
])
def test_bad_input_raises_a_clear_error(call, match):
  with pytest.raises(ValueError, match=match):
    call()


# ---- randomized vs brute force ------------------------------------------------------------------------
@st.composite
def labelled_scores(draw):
  n = draw(st.integers(2, 25))
  y = draw(hnp.arrays(np.float64, n, elements=st.sampled_from([0.0, 1.0])))
  # Few distinct score values so that ties are common.
  s = draw(hnp.arrays(np.float64, n, elements=st.sampled_from([0.05, 0.2, 0.5, 0.51, 0.9])))
  # Zero or at least 1e-3: subnormal weights make w_pos * w_neg underflow to 0 in both computations.
  w = draw(hnp.arrays(np.float64, n, elements=st.one_of(st.just(0.0), st.floats(1e-3, 5.0))))
  return y, s, w


@settings(max_examples=60, deadline=None)
@given(labelled_scores())
def test_auc_random_vs_brute_force(case):
  y, s, w = case
  for weights in (None, w):
    got = metrics.auc(y, s, weights)
    ww = np.ones_like(y) if weights is None else weights
    if (ww * y).sum() == 0 or (ww * (1 - y)).sum() == 0:
      assert math.isnan(got)
    else:
      assert got == pytest.approx(brute_auc(y, s, weights), rel=1e-9, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(labelled_scores())
def test_ne_random_vs_brute_force(case):
  y, p, w = case
  w = w + 0.1
  rate = (w * y).sum() / w.sum()
  got = metrics.normalized_entropy(y, p, w)
  if rate in (0.0, 1.0):
    assert math.isnan(got)
  else:
    assert got == pytest.approx(brute_ne(y, p, w), rel=1e-9)


# ---- accumulator ------------------------------------------------------------------------------------
def test_task_metrics_over_batches_respects_masks():
  rng = np.random.default_rng(2)
  labels = rng.integers(0, 2, (30, 2)).astype(float)
  probs = rng.uniform(0.05, 0.95, (30, 2))
  mask = rng.uniform(size=(30, 2)) < 0.7
  mask[:, 0] = True
  labels[~mask] = -1.0  # undefined labels hold garbage that must be ignored
  acc = metrics.TaskMetrics()
  for lo in range(0, 30, 8):
    acc.add(labels[lo:lo + 8], probs[lo:lo + 8], mask[lo:lo + 8])
  got = acc.result(["click", "conversion"])
  for k, name in enumerate(["click", "conversion"]):
    y, p = labels[mask[:, k], k], probs[mask[:, k], k]
    assert got[name]["count"] == mask[:, k].sum()
    assert got[name]["ne"] == pytest.approx(brute_ne(y, p), rel=1e-12)
    assert got[name]["auc"] == pytest.approx(brute_auc(y, p), rel=1e-12)
    assert got[name]["calibration"] == pytest.approx(p.sum() / y.sum(), rel=1e-12)
    assert got[name]["base_rate"] == pytest.approx(y.mean(), rel=1e-12)


def test_task_metrics_from_logits():
  rng = np.random.default_rng(3)
  labels = rng.integers(0, 2, (20, 1)).astype(float)
  logits = rng.normal(0, 2, (20, 1))
  acc = metrics.TaskMetrics(from_logits=True)
  acc.add(labels, logits)
  got = acc.result(["click"])["click"]
  p = 1 / (1 + np.exp(-logits[:, 0]))
  assert got["ne"] == pytest.approx(brute_ne(labels[:, 0], p), rel=1e-10)
  assert got["calibration"] == pytest.approx(p.sum() / labels.sum(), rel=1e-10)


def test_task_metrics_errors():
  acc = metrics.TaskMetrics()
  with pytest.raises(ValueError, match="before any add"):
    acc.result(["click"])
  acc.add(np.zeros((2, 2)), np.full((2, 2), 0.5))
  with pytest.raises(ValueError, match="3 tasks, earlier batches had 2"):
    acc.add(np.zeros((2, 3)), np.full((2, 3), 0.5))
  with pytest.raises(ValueError, match="1 task names for 2 tasks"):
    acc.result(["click"])
  acc.add(np.array([[1.0, 3.0]]), np.full((1, 2), 0.5))
  with pytest.raises(ValueError, match="task 'b': labels must be in"):
    acc.result(["a", "b"])
