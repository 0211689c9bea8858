"""Evaluation metrics: normalized entropy, ROC AUC and calibration for binary ads tasks; full-ranking
HR@K and NDCG@K for next-item recommendation (at the end of the file).

Host-side numpy, float64 inside. These are the numbers a run is judged by, so each function is the plain
definition written to be exact and O(n log n); the tests compare them with brute-force loops.

  NE (normalized entropy)  mean weighted binary cross-entropy of the predictions divided by the entropy
                           of the background click rate p: H(p) = -p log p - (1 - p) log(1 - p). NE < 1
                           means the model beats always predicting p; lower is better.
  AUC                      probability that a random positive scores above a random negative, ties
                           counting 1/2 (weighted Mann-Whitney U).
  calibration              sum(predicted) / sum(observed); 1 is perfectly calibrated in aggregate.

Weights are per-example importance; a weight of 0 removes the example entirely (its label and prediction
are not even checked), so a 0/1 mask may be passed as the weights.

Undefined results are NaN, returned without a warning: NE when the base rate is 0 or 1 (zero entropy) or
there is no example, AUC when one class has zero weight, calibration when no label is positive.

This module never clips or rescales bad input to make it fit: probabilities outside [0, 1], labels
outside {0, 1}, negative weights, non-finite values or mismatched shapes raise a ValueError that names the
argument and the first bad index. The only clipping is `EPS` below, and only to keep log() finite.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# Probabilities are clipped to [EPS, 1 - EPS] before the log only so that a saturated prediction (a
# float32 sigmoid rounds to exactly 0 or 1 beyond |logit| ~ 17) costs a large finite loss (-log 1e-7 =
# 16.1 nats) instead of inf. Pass logits (`normalized_entropy_from_logits`) to avoid the clip altogether.
EPS = 1e-7


# ---- input checks ---------------------------------------------------------------------------------
def _check(x: np.ndarray, bad: np.ndarray, index: np.ndarray, message: str) -> None:
  """Raises `message` (formatted with the value and its index in the caller's array) at the first bad x."""
  if bad.any():
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(message.format(value=x[i], index=int(index[i])))


def _check_inputs(labels, preds, weights, *, preds_name: str, probs: bool, binary_labels: bool):
  """Float64 vectors (labels, preds, weights) of the examples with positive weight.

  Zero-weight examples are dropped before labels and predictions are checked, so that a 0/1 mask can be
  passed as `weights` over arrays whose masked slots hold anything (an undefined label, a NaN).
  """
  y = np.asarray(labels, dtype=np.float64).reshape(-1)
  p = np.asarray(preds, dtype=np.float64).reshape(-1)
  if y.shape != p.shape:
    raise ValueError(f"labels has {y.size} values but {preds_name} has {p.size}")
  index = np.arange(y.size)
  if weights is not None:
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.shape != y.shape:
      raise ValueError(f"weights has {w.size} values but labels has {y.size}")
    _check(w, ~np.isfinite(w), index, "weights has a non-finite value {value} at index {index}")
    _check(w, w < 0, index, "weights must be non-negative; got {value} at index {index}")
    keep = w > 0
    y, p, w, index = y[keep], p[keep], w[keep], index[keep]
  else:
    w = np.ones_like(y)
  _check(y, ~np.isfinite(y), index, "labels has a non-finite value {value} at index {index}")
  _check(p, ~np.isfinite(p), index, preds_name + " has a non-finite value {value} at index {index}")
  if binary_labels:
    _check(y, (y != 0) & (y != 1), index, "labels must be 0 or 1; got {value} at index {index}")
  else:
    _check(y, (y < 0) | (y > 1), index, "labels must be in [0, 1]; got {value} at index {index}")
  if probs:
    _check(p, (p < 0) | (p > 1), index, preds_name + " must be probabilities in [0, 1]; got {value} at index {index}")
  return y, p, w


def _entropy(rate: float) -> float:
  """Entropy in nats of a Bernoulli(rate); 0 at rate 0 or 1."""
  if rate <= 0.0 or rate >= 1.0:
    return 0.0
  return float(-rate * np.log(rate) - (1.0 - rate) * np.log1p(-rate))


def _normalize(mean_loss: float, y: np.ndarray, w: np.ndarray, base_rate: float | None) -> float:
  total = w.sum()
  if total <= 0:
    return float("nan")
  if base_rate is None:
    base_rate = float((w * y).sum() / total)
  elif not 0.0 <= base_rate <= 1.0:
    raise ValueError(f"base_rate must be in [0, 1], got {base_rate}")
  h = _entropy(base_rate)
  return float(mean_loss / h) if h > 0 else float("nan")


# ---- the metrics ----------------------------------------------------------------------------------
def normalized_entropy(labels, probs, weights=None, base_rate: float | None = None) -> float:
  """Mean (weighted) log loss of `probs` over the entropy of `base_rate`.

  `base_rate` defaults to the weighted mean label of the same examples. Labels may be soft (in [0, 1]).
  """
  y, p, w = _check_inputs(labels, probs, weights, preds_name="probs", probs=True, binary_labels=False)
  if w.sum() <= 0:
    return float("nan")
  p = np.clip(p, EPS, 1.0 - EPS)
  loss = -(y * np.log(p) + (1.0 - y) * np.log1p(-p))
  return _normalize(float((w * loss).sum() / w.sum()), y, w, base_rate)


def normalized_entropy_from_logits(labels, logits, weights=None, base_rate: float | None = None) -> float:
  """`normalized_entropy` of sigmoid(logits), computed from the logits without clipping or overflow."""
  y, z, w = _check_inputs(labels, logits, weights, preds_name="logits", probs=False, binary_labels=False)
  if w.sum() <= 0:
    return float("nan")
  # BCE(y, sigmoid(z)) = softplus(z) - y z, with softplus(z) = max(z, 0) + log1p(exp(-|z|)).
  loss = np.maximum(z, 0.0) - y * z + np.log1p(np.exp(-np.abs(z)))
  return _normalize(float((w * loss).sum() / w.sum()), y, w, base_rate)


def auc(labels, scores, weights=None) -> float:
  """ROC AUC of `scores` (probabilities, logits: any monotone score) for binary `labels`.

  Weighted Mann-Whitney: sum over (positive i, negative j) of w_i w_j ([s_i > s_j] + [s_i == s_j] / 2),
  divided by (total positive weight) * (total negative weight). Equal scores are grouped (np.unique sorts,
  O(n log n)), which is the average-rank treatment of ties. NaN when either class has zero weight.
  """
  y, s, w = _check_inputs(labels, scores, weights, preds_name="scores", probs=False, binary_labels=True)
  w_pos_total = (w * y).sum()
  w_neg_total = (w * (1.0 - y)).sum()
  if w_pos_total <= 0 or w_neg_total <= 0:
    return float("nan")
  _, group = np.unique(s, return_inverse=True)  # group ids ascend with the score
  group = group.reshape(-1)
  w_pos_G = np.bincount(group, weights=w * y)
  w_neg_G = np.bincount(group, weights=w * (1.0 - y))
  neg_below_G = np.cumsum(w_neg_G) - w_neg_G  # negative weight strictly below each score group
  u = (w_pos_G * (neg_below_G + 0.5 * w_neg_G)).sum()
  return float(u / (w_pos_total * w_neg_total))


def calibration(labels, probs, weights=None) -> float:
  """sum(w * probs) / sum(w * labels); NaN when no label is positive."""
  y, p, w = _check_inputs(labels, probs, weights, preds_name="probs", probs=True, binary_labels=False)
  observed = (w * y).sum()
  return float((w * p).sum() / observed) if observed > 0 else float("nan")


# ---- accumulation over eval batches ---------------------------------------------------------------
class TaskMetrics:
  """Collects per-task predictions over eval batches, then computes every metric on all of them at once.

  NE and AUC do not decompose over batches (AUC needs the global ranking, NE the global base rate), so
  the unmasked (label, prediction) pairs are kept; an eval set of N examples costs ~16 N K bytes.

  Letters: B examples in a batch, K tasks.

  `from_logits=True`: `add` takes logits; NE is then computed without clipping and calibration on
  sigmoid(logits).
  """

  def __init__(self, *, from_logits: bool = False):
    self.from_logits = from_logits
    self._labels: list[list[np.ndarray]] | None = None
    self._preds: list[list[np.ndarray]] | None = None

  @property
  def num_tasks(self) -> int | None:
    return None if self._labels is None else len(self._labels)

  def reset(self) -> None:
    self._labels = self._preds = None

  def add(self, labels_BxK, preds_BxK, mask_BxK=None) -> None:
    """Adds one batch. `mask_BxK` (bool, or 0/1) is False where a label is undefined (conversion on a
    non-click) or the example is padding; labels and predictions there are ignored, whatever they hold."""
    labels_BxK = np.asarray(labels_BxK, dtype=np.float64)
    preds_BxK = np.asarray(preds_BxK, dtype=np.float64)
    if labels_BxK.ndim != 2 or labels_BxK.shape != preds_BxK.shape:
      raise ValueError(f"labels and predictions must both be B x K; got {labels_BxK.shape} and {preds_BxK.shape}")
    if mask_BxK is None:
      mask_BxK = np.ones(labels_BxK.shape, dtype=bool)
    else:
      mask_BxK = np.asarray(mask_BxK)
      if mask_BxK.shape != labels_BxK.shape:
        raise ValueError(f"mask must be B x K like the labels {labels_BxK.shape}; got {mask_BxK.shape}")
      if mask_BxK.dtype != bool:
        if ((mask_BxK != 0) & (mask_BxK != 1)).any():
          raise ValueError("mask must be boolean or 0/1")
        mask_BxK = mask_BxK.astype(bool)
    num_tasks = labels_BxK.shape[1]
    if self._labels is None:
      self._labels = [[] for _ in range(num_tasks)]
      self._preds = [[] for _ in range(num_tasks)]
    elif num_tasks != len(self._labels):
      raise ValueError(f"batch has {num_tasks} tasks, earlier batches had {len(self._labels)}")
    for k in range(num_tasks):
      keep = mask_BxK[:, k]
      self._labels[k].append(labels_BxK[keep, k])
      self._preds[k].append(preds_BxK[keep, k])

  def result(self, task_names: Sequence[str]) -> dict[str, dict[str, float]]:
    """{task: {ne, auc, calibration, base_rate, count}}; `task_names` names the K columns in order."""
    if self._labels is None:
      raise ValueError("TaskMetrics.result called before any add()")
    if len(task_names) != len(self._labels):
      raise ValueError(f"got {len(task_names)} task names for {len(self._labels)} tasks")
    out = {}
    for k, name in enumerate(task_names):
      y = np.concatenate(self._labels[k])
      pred = np.concatenate(self._preds[k])
      try:
        out[name] = self._task_result(y, pred)
      except ValueError as e:
        raise ValueError(f"task {name!r}: {e}") from None
    return out

  def _task_result(self, y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    if self.from_logits:
      ne = normalized_entropy_from_logits(y, pred)
      prob = 0.5 * (1.0 + np.tanh(0.5 * pred))  # sigmoid without exp overflow
    else:
      ne = normalized_entropy(y, pred)
      prob = pred
    return {
        "ne": ne,
        "auc": auc(y, pred),
        "calibration": calibration(y, prob),
        "base_rate": float(y.mean()) if y.size else float("nan"),
        "count": int(y.size),
    }


# ---- full-ranking retrieval metrics (next-item recommendation) -------------------------------------------
# One held-out target per user; every item is a candidate except those the protocol excludes (the user's
# history). rank = 1 + the number of allowed candidates scoring above the target + the number of allowed
# candidates tied with it: ties count against the target, so a model that scores everything alike gets
# HR@K ~ 0, not 1, and no result depends on a sort's tie order. The target itself is always ranked, even
# when it also appears in the excluded history (a repeated item).
#   HR@K   = mean over users of [rank <= K]                       (Recall@K with one target)
#   NDCG@K = mean over users of [rank <= K] / log2(rank + 1)      (the ideal DCG of one target is 1)


def full_ranking_ranks(scores_BxI, targets_B, exclude_BxI):
  """Rank (1 = best) of each row's target among the candidate columns of scores; jit-safe jnp.

  scores_BxI: float scores of every item (column i = item i; a padding column can be excluded);
  targets_B: int column of each row's target; exclude_BxI: bool, True for items that are not candidates.
  A row whose target score is NaN gets rank I + 1 (a miss at every K); a candidate whose score is NaN counts
  against the target, like a tie (items whose table rows went NaN must not drop out of the competition).
  """
  import jax.numpy as jnp  # metrics above are host numpy; only this function runs on device

  scores_BxI = jnp.asarray(scores_BxI, jnp.float32)
  targets_B = jnp.asarray(targets_B, jnp.int32)
  cols_I = jnp.arange(scores_BxI.shape[1], dtype=jnp.int32)
  is_target_BxI = cols_I[None, :] == targets_B[:, None]
  target_B1 = jnp.take_along_axis(scores_BxI, targets_B[:, None], axis=1)
  rivals_BxI = ~exclude_BxI & ~is_target_BxI & ~(scores_BxI < target_B1)   # >=, or NaN
  rank_B = 1 + jnp.sum(rivals_BxI, axis=1, dtype=jnp.int32)
  return jnp.where(jnp.isnan(target_B1[:, 0]), scores_BxI.shape[1] + 1, rank_B)


def hit_rate_ndcg(ranks, ks: Sequence[int]) -> dict[str, float]:
  """{"HR@K": ..., "NDCG@K": ...} for each K, averaged over all ranks (float64 on the host)."""
  r = np.asarray(ranks, dtype=np.int64).reshape(-1)
  if r.size == 0:
    raise ValueError("hit_rate_ndcg: no ranks")
  _check(r, r < 1, np.arange(r.size), "ranks must be >= 1; got {value} at index {index}")
  out = {}
  for k in ks:
    if k < 1:
      raise ValueError(f"hit_rate_ndcg: K must be >= 1, got {k}")
    hit = r <= k
    out[f"HR@{k}"] = float(hit.mean())
    out[f"NDCG@{k}"] = float(np.where(hit, 1.0 / np.log2(r + 1.0), 0.0).mean())
  return out
