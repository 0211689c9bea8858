"""Host-side validation of `Examples` and packed `Batch`es against a `FeatureSpec`.

Every batch is checked here before it reaches a device, because device code trusts its input: an
out-of-range id would be silently clamped by an XLA gather, a NaN would only show up as a diverged loss
steps later. Each check is vectorized numpy (cheap next to producing the data) and the first failure
raises `BatchValidationError` naming the feature, the row (example index) and the bad value.

This module never repairs data: nothing is clipped, cast to a narrower type or dropped. It only reads.
"""

from __future__ import annotations

import numpy as np

from gem_jax.data.batch import Batch, Examples
from gem_jax.data.spec import FeatureSpec
from gem_jax.jagged import validate_offsets


class BatchValidationError(ValueError):
  """Input data breaks the feature spec; the message names the feature and the row."""


def validate_examples(ex: Examples, spec: FeatureSpec) -> None:
  """Raises BatchValidationError unless `ex` holds well-formed examples of `spec`."""
  n = _check_vector("domain", ex.domain_n, None, "int").shape[0]
  _check_keys("sparse", ex.sparse, [f.name for f in spec.single_hot])
  for f in spec.single_hot:
    ids = _check_vector(f.name, ex.sparse[f.name], n, "int")
    _check_ids(f.name, ids, spec.table(f.table).vocab_size)
  _check_keys("multi_hot", ex.multi_hot, [f.name for f in spec.multi_hot])
  for f in spec.multi_hot:
    values, lengths = ex.multi_hot[f.name]
    offsets = _offsets_from_lengths(f.name, values, lengths, n, f.max_ids, "max_ids")
    values = _check_vector(f"{f.name} values", values, None, "int")
    _check_ids(f.name, values, spec.table(f.table).vocab_size, offsets)
  values, lengths = ex.history
  offsets = _offsets_from_lengths("history", values, lengths, n, spec.sequence.max_len, "sequence.max_len")
  _check_history_values(values, offsets, spec)
  _check_dense(ex.dense_nxG, spec, n)
  _check_domain(ex.domain_n, spec)
  _check_labels(ex.labels_nxK, ex.label_mask_nxK, ex.planted_logits_nxK, spec, n, exact_float32=False)


def validate_batch(batch: Batch, spec: FeatureSpec) -> None:
  """Raises BatchValidationError unless `batch` is a well-formed static-shape batch of `spec`.

  Tail padding tokens of jagged arrays are checked too: a lookup reads every slot of the static capacity.
  """
  B = _check_vector("example_mask_B", batch.example_mask_B, None, "float32").shape[0]
  _check_vector("domain_B", batch.domain_B, B, "int32")
  _check_keys("sparse", batch.sparse, [f.name for f in spec.single_hot])
  for f in spec.single_hot:
    ids = _check_vector(f.name, batch.sparse[f.name], B, "int32")
    _check_ids(f.name, ids, spec.table(f.table).vocab_size)
  _check_keys("multi_hot", batch.multi_hot, [f.name for f in spec.multi_hot])
  for f in spec.multi_hot:
    jag = batch.multi_hot[f.name]
    offsets = _check_batch_offsets(f.name, jag.offsets, np.shape(jag.values)[0], B, f.max_ids, "max_ids")
    values = _check_vector(f"{f.name} values", jag.values, None, "int32")
    _check_ids(f.name, values, spec.table(f.table).vocab_size, offsets)
  offsets = _check_batch_offsets("history", batch.history.offsets, np.shape(batch.history.values)[0], B,
                                 spec.sequence.max_len, "sequence.max_len")
  values = np.asarray(batch.history.values)
  if values.dtype != np.int32:
    raise BatchValidationError(f"history: values must be int32, got {values.dtype}")
  _check_history_values(values, offsets, spec)
  _check_dense(batch.dense_BxG, spec, B)
  _check_domain(batch.domain_B, spec)
  _check_labels(batch.labels_BxK, batch.label_mask_BxK, batch.planted_logits_BxK, spec, B, exact_float32=True)
  example_mask = np.asarray(batch.example_mask_B)
  _first_bad("example_mask_B", ~np.isin(example_mask, (0.0, 1.0)), example_mask, "is not 0 or 1")
  label_mask = np.asarray(batch.label_mask_BxK)
  # A padding row must not carry a defined label, or it would count in the loss and the metrics.
  _first_bad("label_mask_BxK", np.any(label_mask > example_mask[:, None], axis=1), example_mask,
             "is a padding row (example_mask 0) with a defined label")


# ---- shapes and dtypes ------------------------------------------------------------------------------


def _check_keys(what: str, got: dict, expected: list[str]) -> None:
  missing = [k for k in expected if k not in got]
  extra = [k for k in got if k not in expected]
  if missing or extra:
    raise BatchValidationError(f"{what}: features {sorted(got)} do not match the spec {expected}"
                               f" (missing {missing}, unexpected {extra})")


def _check_dtype(name: str, a: np.ndarray, kind: str) -> None:
  ok = {"int": np.issubdtype(a.dtype, np.integer), "float": np.issubdtype(a.dtype, np.floating),
        "int32": a.dtype == np.int32, "float32": a.dtype == np.float32}[kind]
  if not ok:
    want = {"int": "an integer dtype", "float": "a floating dtype"}.get(kind, kind)
    raise BatchValidationError(f"{name}: expected {want}, got {a.dtype}")


def _check_vector(name: str, a, n: int | None, kind: str) -> np.ndarray:
  """Checks a 1-D array of length n (any length if None) and dtype kind; returns it as numpy."""
  a = np.asarray(a)
  if a.ndim != 1 or (n is not None and a.shape[0] != n):
    want = "(n,)" if n is None else f"({n},)"
    raise BatchValidationError(f"{name}: expected shape {want}, got {a.shape}")
  _check_dtype(name, a, kind)
  return a


def _check_matrix(name: str, a, shape: tuple[int, int], kind: str) -> np.ndarray:
  a = np.asarray(a)
  if a.shape != shape:
    raise BatchValidationError(f"{name}: expected shape {shape}, got {a.shape}")
  _check_dtype(name, a, kind)
  return a


# ---- ids and jagged layout --------------------------------------------------------------------------


def _first_bad(name: str, bad_n: np.ndarray, values_n: np.ndarray, what: str) -> None:
  """Raises for the first True row of bad_n, quoting that row's value."""
  if bad_n.any():
    r = int(np.flatnonzero(bad_n)[0])
    raise BatchValidationError(f"{name}: row {r}: value {values_n[r]} {what}")


def _check_ids(name: str, ids: np.ndarray, vocab: int, offsets: np.ndarray | None = None) -> None:
  """Every id in [0, vocab). ids[i] belongs to row i, or to the jagged row whose offsets span i."""
  ids = np.asarray(ids)
  bad = np.flatnonzero((ids < 0) | (ids >= vocab))
  if bad.size:
    i = int(bad[0])
    if offsets is None:
      where = f"row {i}"
    elif i < offsets[-1]:
      where = f"row {int(np.searchsorted(offsets, i, side='right')) - 1}"
    else:
      where = f"padding slot {i}"
    raise BatchValidationError(f"{name}: {where}: id {int(ids[i])} is outside [0, {vocab})"
                               f" (vocab size {vocab})")


def _offsets_from_lengths(name: str, values, lengths, n: int, max_len: int, limit: str) -> np.ndarray:
  """Checks an Examples (values, lengths) pair and returns its offsets (no tail padding allowed)."""
  lengths = np.asarray(lengths)
  _check_vector(f"{name} lengths", lengths, n, "int")
  _first_bad(name, lengths < 0, lengths, "is a negative length")
  _first_bad(name, lengths > max_len, lengths, f"is a length over {limit} = {max_len}")
  offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
  if np.shape(values)[0] != offsets[-1]:
    raise BatchValidationError(f"{name}: lengths sum to {int(offsets[-1])} but there are"
                               f" {np.shape(values)[0]} values")
  return offsets


def _check_batch_offsets(name: str, offsets, capacity: int, B: int, max_len: int, limit: str) -> np.ndarray:
  offsets = np.asarray(offsets)
  _check_vector(f"{name} offsets", offsets, B + 1, "int32")
  try:
    validate_offsets(offsets, capacity, name)
  except ValueError as e:
    raise BatchValidationError(str(e)) from e
  lengths = np.diff(offsets)
  _first_bad(name, lengths > max_len, lengths, f"is a length over {limit} = {max_len}")
  return offsets


def _check_history_values(values, offsets: np.ndarray, spec: FeatureSpec) -> None:
  values = np.asarray(values)
  F = len(spec.sequence.fields)
  if values.ndim != 2 or values.shape[1] != F:
    raise BatchValidationError(f"history: values must be (tokens, {F}) for fields"
                               f" {[f.name for f in spec.sequence.fields]}, got {values.shape}")
  _check_dtype("history values", values, "int")
  for j, field in enumerate(spec.sequence.fields):
    _check_ids(f"history.{field.name}", values[:, j], spec.table(field.table).vocab_size, offsets)


# ---- dense, domain, labels --------------------------------------------------------------------------


def _dense_column_names(spec: FeatureSpec) -> list[str]:
  names = []
  for f in spec.dense:
    names += [f.name] if f.dim == 1 else [f"{f.name}[{i}]" for i in range(f.dim)]
  return names


def _check_dense(dense, spec: FeatureSpec, n: int) -> None:
  # float32 exactly, also in Examples: a float64 source would lose precision silently when packed.
  dense = _check_matrix("dense", dense, (n, spec.dense_dim), "float32")
  bad = ~np.isfinite(dense)
  if bad.any():
    r, c = (int(i[0]) for i in np.nonzero(bad))
    raise BatchValidationError(f"dense feature {_dense_column_names(spec)[c]!r}: row {r}: value"
                               f" {dense[r, c]} is not finite")


def _check_domain(domain, spec: FeatureSpec) -> None:
  domain = np.asarray(domain)
  D = len(spec.domains)
  _first_bad("domain", (domain < 0) | (domain >= D), domain, f"is outside [0, {D}) (domains {spec.domains})")


def _check_labels(labels, mask, planted, spec: FeatureSpec, n: int, exact_float32: bool) -> None:
  K = len(spec.tasks)
  kind = "float32" if exact_float32 else "float"
  labels = _check_matrix("labels", labels, (n, K), kind)
  mask = _check_matrix("label_mask", mask, (n, K), kind)
  planted = _check_matrix("planted_logits", planted, (n, K), kind)
  for k, task in enumerate(spec.tasks):
    _first_bad(f"labels.{task.name}", ~np.isin(labels[:, k], (0.0, 1.0)), labels[:, k], "is not 0 or 1")
    _first_bad(f"label_mask.{task.name}", ~np.isin(mask[:, k], (0.0, 1.0)), mask[:, k], "is not 0 or 1")
    # NaN means "unknown" (real data); an infinite planted logit is a bug in the source.
    _first_bad(f"planted_logits.{task.name}", np.isinf(planted[:, k]), planted[:, k], "is infinite")
    if task.parent is not None:
      p = spec.task_names.index(task.parent)
      undefined_parent = (mask[:, p] == 0) | (labels[:, p] == 0)
      _first_bad(f"label_mask.{task.name}", (mask[:, k] == 1) & undefined_parent, mask[:, k],
                 f"defines the label where its parent task {task.parent!r} is not a defined 1")
