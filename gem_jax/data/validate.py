"""Host-side validation of `Examples` and packed `Batch`es against a `FeatureSpec`.

Every batch is checked here before it reaches a device, because device code trusts its input: an
out-of-range id would be silently clamped by an XLA gather, a NaN would only show up as a diverged loss
steps later. Each check is vectorized numpy (cheap next to producing the data) and the first failure
raises `BatchValidationError` naming the feature, the row (example index) and the bad value.

Policies (what is accepted):
  ids, lengths, domains   any integer dtype in `Examples` (packing to int32 is exact once they are in range);
                          exactly int32 in a `Batch`; bool, float and object arrays are refused
  float parts             exactly float32 in both layouts: packing float64 would round (or overflow to inf)
                          silently; dense features must be finite, planted logits may be NaN (unknown)
  row counts              `Examples` counts rows by domain_n, a `Batch` by example_mask_B; a part with another
                          row count is reported naming that source as well
  empty parts             a row with an empty history or no multi-hot ids is valid, and so is a block of 0 rows

This module never repairs data: nothing is clipped, cast to a narrower type or dropped. It only reads.
"""

from __future__ import annotations

import numpy as np

from gem_jax.data.batch import Batch, Examples
from gem_jax.data.spec import FeatureSpec
from gem_jax.jagged import Jagged, validate_offsets


class BatchValidationError(ValueError):
  """Input data breaks the feature spec; the message names the feature and the row."""


def validate_examples(ex: Examples, spec: FeatureSpec) -> None:
  """Raises BatchValidationError unless `ex` holds well-formed examples of `spec`."""
  n = _check_vector("domain", ex.domain_n, None, "int").shape[0]
  _check_keys("sparse", ex.sparse, [f.name for f in spec.single_hot])
  for f in spec.single_hot:
    ids = _check_vector(f.name, ex.sparse[f.name], n, "int", _EXAMPLE_ROWS)
    _check_ids(f.name, ids, spec.table(f.table).vocab_size)
  _check_keys("multi_hot", ex.multi_hot, [f.name for f in spec.multi_hot])
  for f in spec.multi_hot:
    values, lengths = _pair(f.name, ex.multi_hot[f.name])
    offsets = _offsets_from_lengths(f.name, values, lengths, n, f.max_ids, "max_ids")
    values = _check_vector(f"{f.name} values", values, None, "int")
    _check_ids(f.name, values, spec.table(f.table).vocab_size, offsets)
  values, lengths = _pair("history", ex.history)
  offsets = _offsets_from_lengths("history", values, lengths, n, spec.sequence.max_len, "sequence.max_len")
  _check_history_values(values, offsets, spec)
  _check_dense(ex.dense_nxG, spec, n, _EXAMPLE_ROWS)
  _check_domain(ex.domain_n, spec)
  _check_labels(ex.labels_nxK, ex.label_mask_nxK, ex.planted_logits_nxK, spec, n, _EXAMPLE_ROWS)


def validate_batch(batch: Batch, spec: FeatureSpec) -> None:
  """Raises BatchValidationError unless `batch` is a well-formed static-shape batch of `spec`.

  Tail padding tokens of jagged arrays are checked too: a lookup reads every slot of the static capacity.
  """
  B = _check_vector("example_mask_B", batch.example_mask_B, None, "float32").shape[0]
  _check_vector("domain_B", batch.domain_B, B, "int32", _BATCH_ROWS)
  _check_keys("sparse", batch.sparse, [f.name for f in spec.single_hot])
  for f in spec.single_hot:
    ids = _check_vector(f.name, batch.sparse[f.name], B, "int32", _BATCH_ROWS)
    _check_ids(f.name, ids, spec.table(f.table).vocab_size)
  _check_keys("multi_hot", batch.multi_hot, [f.name for f in spec.multi_hot])
  row_lengths = {}
  for f in spec.multi_hot:
    jag = _jagged(f.name, batch.multi_hot[f.name])
    values = _tokens(f.name, jag.values)
    offsets = _check_batch_offsets(f.name, jag.offsets, values.shape[0], B, f.max_ids, "max_ids")
    row_lengths[f.name] = np.diff(offsets)
    values = _check_vector(f"{f.name} values", values, None, "int32")
    _check_ids(f.name, values, spec.table(f.table).vocab_size, offsets)
  history = _jagged("history", batch.history)
  values = _tokens("history", history.values)
  offsets = _check_batch_offsets("history", history.offsets, values.shape[0], B, spec.sequence.max_len,
                                 "sequence.max_len")
  row_lengths["history"] = np.diff(offsets)
  if values.dtype != np.int32:
    raise BatchValidationError(f"history: values must be int32, got {values.dtype}")
  _check_history_values(values, offsets, spec)
  _check_dense(batch.dense_BxG, spec, B, _BATCH_ROWS)
  _check_domain(batch.domain_B, spec)
  _check_labels(batch.labels_BxK, batch.label_mask_BxK, batch.planted_logits_BxK, spec, B, _BATCH_ROWS)
  example_mask = np.asarray(batch.example_mask_B)
  _first_bad("example_mask_B", ~np.isin(example_mask, (0.0, 1.0)), example_mask, "is not 0 or 1")
  label_mask = np.asarray(batch.label_mask_BxK)
  # A padding row must not carry a defined label, or it would count in the loss and the metrics.
  _first_bad("label_mask_BxK", np.any(label_mask > example_mask[:, None], axis=1), example_mask,
             "is a padding row (example_mask 0) with a defined label")
  # Nor tokens: they would cost attention and count as real work in the padding and imbalance figures.
  for name, lengths in row_lengths.items():
    _first_bad(f"{name} (tokens per row)", (example_mask == 0) & (lengths > 0), lengths,
               "is the length of a padding row (example_mask 0), which must be empty")


# ---- shapes and dtypes ------------------------------------------------------------------------------

# The part each layout counts its rows by, named when another part has a different row count.
_EXAMPLE_ROWS = "domain_n"
_BATCH_ROWS = "example_mask_B"


def _check_keys(what: str, got: dict, expected: list[str]) -> None:
  if not isinstance(got, dict):
    raise BatchValidationError(f"{what}: expected a dict of features {expected}, got {type(got).__name__}")
  missing = [k for k in expected if k not in got]
  extra = [k for k in got if k not in expected]
  if missing or extra:
    # key=repr: a stray non-string key must be reported, not make sorted() raise TypeError.
    raise BatchValidationError(f"{what}: features {sorted(got, key=repr)} do not match the spec {expected}"
                               f" (missing {missing}, unexpected {extra})")


def _pair(name: str, part) -> tuple:
  """The (values, lengths) of an Examples jagged part."""
  if not isinstance(part, (tuple, list)) or len(part) != 2:
    raise BatchValidationError(f"{name}: expected a (values, lengths) pair, got {type(part).__name__}")
  return tuple(part)


def _jagged(name: str, part) -> Jagged:
  """A Batch jagged part, checked to be a Jagged."""
  if not isinstance(part, Jagged):
    raise BatchValidationError(f"{name}: expected a Jagged, got {type(part).__name__}")
  return part


def _tokens(name: str, values) -> np.ndarray:
  """Jagged values as numpy; they need a leading token dim (the capacity)."""
  values = np.asarray(values)
  if values.ndim == 0:
    raise BatchValidationError(f"{name}: values must have a leading token dim, got a scalar {values.dtype}")
  return values


def _shape_error(name: str, want, got, rows_from: str) -> BatchValidationError:
  where = f" (rows counted by {rows_from})" if rows_from else ""
  return BatchValidationError(f"{name}: expected shape {want}, got {got}{where}")


def _check_dtype(name: str, a: np.ndarray, kind: str) -> None:
  ok = {"int": np.issubdtype(a.dtype, np.integer), "int32": a.dtype == np.int32,
        "float32": a.dtype == np.float32}[kind]
  if not ok:
    want = "an integer dtype" if kind == "int" else kind
    raise BatchValidationError(f"{name}: expected {want}, got {a.dtype}")


def _check_vector(name: str, a, n: int | None, kind: str, rows_from: str = "") -> np.ndarray:
  """Checks a 1-D array of length n (any length if None; rows_from: the part n was read from) and dtype
  kind; returns it as numpy."""
  a = np.asarray(a)
  if a.ndim != 1 or (n is not None and a.shape[0] != n):
    raise _shape_error(name, "(n,)" if n is None else f"({n},)", a.shape, rows_from if n is not None else "")
  _check_dtype(name, a, kind)
  return a


def _check_matrix(name: str, a, shape: tuple[int, int], kind: str, rows_from: str) -> np.ndarray:
  a = np.asarray(a)
  if a.shape != shape:
    raise _shape_error(name, shape, a.shape, rows_from)
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
  lengths = _check_vector(f"{name} lengths", lengths, n, "int", _EXAMPLE_ROWS)
  _first_bad(name, lengths < 0, lengths, "is a negative length")
  _first_bad(name, lengths > max_len, lengths, f"is a length over {limit} = {max_len}")
  offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
  tokens = _tokens(name, values).shape[0]
  if tokens != offsets[-1]:
    raise BatchValidationError(f"{name}: lengths sum to {int(offsets[-1])} but there are {tokens} values")
  return offsets


def _check_batch_offsets(name: str, offsets, capacity: int, B: int, max_len: int, limit: str) -> np.ndarray:
  offsets = _check_vector(f"{name} offsets", offsets, B + 1, "int32", f"{_BATCH_ROWS}, plus one")
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


def _check_dense(dense, spec: FeatureSpec, n: int, rows_from: str) -> None:
  # float32 exactly, also in Examples: a float64 source would lose precision silently when packed.
  dense = _check_matrix("dense", dense, (n, spec.dense_dim), "float32", rows_from)
  bad = ~np.isfinite(dense)
  if bad.any():
    r, c = (int(i[0]) for i in np.nonzero(bad))
    raise BatchValidationError(f"dense feature {_dense_column_names(spec)[c]!r}: row {r}: value"
                               f" {dense[r, c]} is not finite")


def _check_domain(domain, spec: FeatureSpec) -> None:
  domain = np.asarray(domain)
  D = len(spec.domains)
  _first_bad("domain", (domain < 0) | (domain >= D), domain, f"is outside [0, {D}) (domains {spec.domains})")


def _check_labels(labels, mask, planted, spec: FeatureSpec, n: int, rows_from: str) -> None:
  # float32 exactly, as dense: a float64 planted logit would be rounded (or overflow to inf) when packed.
  K = len(spec.tasks)
  labels = _check_matrix("labels", labels, (n, K), "float32", rows_from)
  mask = _check_matrix("label_mask", mask, (n, K), "float32", rows_from)
  planted = _check_matrix("planted_logits", planted, (n, K), "float32", rows_from)
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
