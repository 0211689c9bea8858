"""Parquet row groups -> checked `Examples` (gem_jax/data/batch.py) for the Parquet source
(gem_jax/data/parquet_source.py).

Every row group is checked when it is read, with the file, the row (within the file) and the
column in the error: a missing column or one of the wrong type, a null where a value is needed, an id
outside its table (or hashed into range, counted, when the table says `out_of_range: hash`), a non-finite
dense value, a history longer than max_len (or truncated to its most recent tokens, counted, when the
spec says `overflow: truncate`), a label outside {0, 1} or a child's label where its parent is not 1 (or
masked, counted, with `bad_labels: mask`). Nothing is clamped or dropped silently; `counters()` says what
a tolerating policy did, each row of the files read counted once however often it is read (a process
counts what it read since it started: a resumed run counts again from zero).

This module never repairs a value silently and never opens a file: it converts the Arrow tables the source
reads.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from gem_jax.data import spec_file
from gem_jax.data.batch import Examples
from gem_jax.data.counter_hash import mix
from gem_jax.data.validate import BatchValidationError

PLANTED = "planted_logit_{}"


class DataFileError(BatchValidationError):
  """A data file breaks the spec; the message names the file, the row and the column."""


class Converter:
  """Arrow tables of one spec's columns -> Examples, checking every value (module docstring)."""

  def __init__(self, spec, columns: spec_file.Columns, history: bool = True):
    self.spec, self.columns, self.history = spec, columns, history
    self.sparse_col, self.dense_col = dict(columns.sparse), dict(columns.dense)
    self.history_col, self.task_col = dict(columns.history), dict(columns.tasks)
    self.counters: collections.Counter = collections.Counter()
    self._counted: set[tuple[str, int]] = set()   # (file, first row) of each row group already in the counters
    self._lock = threading.Lock()

  def needed(self, schema_names) -> list[str]:
    history = [self.history_col[f.name] for f in self.spec.sequence.fields] if self.history else []
    cols = ([self.sparse_col[f.name] for f in self.spec.sparse] + [self.dense_col[f.name] for f in self.spec.dense]
            + history + [self.columns.domain]
            + [self.task_col[t.name] for t in self.spec.tasks])
    return cols + [PLANTED.format(t.name) for t in self.spec.tasks if PLANTED.format(t.name) in schema_names]

  def __call__(self, table, file: str, first_row: int) -> Examples:
    import pyarrow as pa
    spec, n = self.spec, table.num_rows
    count: collections.Counter = collections.Counter()

    def fail(col: str, local_row: int, msg: str):
      raise DataFileError(f"{file}: row {first_row + int(local_row)}: column {col!r}: {msg}")

    # uint64 columns become int64 with their bits kept (what out_of_range: hash mixes); a message shows the
    # value the file holds.
    unsigned64: set[str] = set()

    def column(col: str):
      if col not in table.column_names:
        raise DataFileError(f"{file}: missing column {col!r} (columns: {table.column_names})")
      return table.column(col).combine_chunks()

    def no_nulls(arr, col):
      if arr.null_count:
        fail(col, np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0], "null value")

    def ints(col: str) -> np.ndarray:
      arr = column(col)
      if not pa.types.is_integer(arr.type):
        raise DataFileError(f"{file}: column {col!r} must hold integers, has {arr.type}")
      no_nulls(arr, col)
      if arr.type == pa.uint64():
        unsigned64.add(col)
      return arr.to_numpy(zero_copy_only=False).astype(np.int64)

    def int_lists(col: str) -> tuple[np.ndarray, np.ndarray]:
      arr = column(col)
      if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)) or not pa.types.is_integer(arr.type.value_type):
        raise DataFileError(f"{file}: column {col!r} must hold lists of integers, has {arr.type}")
      no_nulls(arr, col)
      values = arr.flatten()
      lengths = arr.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
      if values.null_count:
        row = np.searchsorted(np.cumsum(lengths), np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0],
                              side="right")
        fail(col, row, "null inside the list")
      if values.type == pa.uint64():
        unsigned64.add(col)
      return values.to_numpy(zero_copy_only=False).astype(np.int64), lengths

    def in_table(ids: np.ndarray, lengths: np.ndarray | None, table_name: str, col: str) -> np.ndarray:
      t = spec.table(table_name)
      bad = (ids < 0) | (ids >= t.vocab_size)
      if not bad.any():
        return ids
      if t.out_of_range == "error":
        k = int(np.flatnonzero(bad)[0])
        row = k if lengths is None else int(np.searchsorted(np.cumsum(lengths), k, side="right"))
        value = int(ids[k]) + (1 << 64 if col in unsigned64 and ids[k] < 0 else 0)
        fail(col, row, f"id {value} is outside table {t.name!r} of {t.vocab_size} rows (the spec can "
                       f"say out_of_range: hash)")
      count[f"hashed_ids/{t.name}"] += int(bad.sum())
      hashed = (mix(ids[bad].astype(np.uint64)) % np.uint64(t.vocab_size)).astype(np.int64)
      return _put(ids, bad, hashed)

    sparse, multi_hot = {}, {}
    for f in spec.sparse:
      col = self.sparse_col[f.name]
      if f.multi_hot:
        values, lengths = int_lists(col)
        over = np.flatnonzero(lengths > f.max_ids)
        if over.size:
          fail(col, over[0], f"{int(lengths[over[0]])} ids, more than max_ids {f.max_ids}")
        multi_hot[f.name] = (in_table(values, lengths, f.table, col), lengths)
      else:
        sparse[f.name] = in_table(ints(col), None, f.table, col)
    history, lengths = [], None if self.history else np.zeros(n, np.int64)
    for field in spec.sequence.fields if self.history else ():
      col = self.history_col[field.name]
      values, field_lengths = int_lists(col)
      if lengths is None:
        lengths, first_col = field_lengths, col
      elif not np.array_equal(lengths, field_lengths):
        row = int(np.flatnonzero(lengths != field_lengths)[0])
        fail(col, row, f"history length {int(field_lengths[row])} differs from {first_col!r}'s {int(lengths[row])}")
      history.append(in_table(values, field_lengths, field.table, col))
    values_TxF = np.stack(history, axis=1) if history else np.zeros((0, len(spec.sequence.fields)), np.int64)
    values_TxF, lengths = self._fit_history(values_TxF, lengths, count, fail)
    dense = [self._dense(column(self.dense_col[f.name]), f, fail, file) for f in spec.dense]
    dense_nxG = np.concatenate(dense, axis=1) if dense else np.zeros((n, 0), np.float32)
    domain = ints(self.columns.domain)
    bad = np.flatnonzero((domain < 0) | (domain >= len(spec.domains)))
    if bad.size:
      fail(self.columns.domain, bad[0], f"domain {int(domain[bad[0]])} outside [0, {len(spec.domains)}) "
                                        f"({list(spec.domains)})")
    labels, mask = self._labels(column, fail, count, n, file)
    planted = np.full((n, len(spec.tasks)), np.nan, np.float32)
    for k, t in enumerate(spec.tasks):
      name = PLANTED.format(t.name)
      if name in table.column_names:   # the true logit of a synthetic export (null or NaN: not known)
        arr = column(name)
        if not (pa.types.is_floating(arr.type) or pa.types.is_integer(arr.type)):
          raise DataFileError(f"{file}: column {name!r} (the planted logit of task {t.name!r}) must hold numbers, "
                              f"has {arr.type}")
        values = arr.to_numpy(zero_copy_only=False).astype(np.float64)
        inf = np.flatnonzero(np.isinf(values) | (np.abs(values) > np.finfo(np.float32).max))
        if inf.size:
          fail(name, inf[0], f"planted logit {values[inf[0]]} is not finite in float32")
        planted[:, k] = values.astype(np.float32)
    with self._lock:   # a row group read again (a later epoch, after the cache let it go) counts once
      if (file, first_row) not in self._counted:
        self._counted.add((file, first_row))
        self.counters.update(count)
    return Examples(sparse=sparse, multi_hot=multi_hot, dense_nxG=dense_nxG, history=(values_TxF, lengths),
                    domain_n=domain, labels_nxK=labels, label_mask_nxK=mask, planted_logits_nxK=planted)

  def _fit_history(self, values_TxF, lengths, count, fail):
    seq = self.spec.sequence
    over = np.flatnonzero(lengths > seq.max_len)
    if not over.size:
      return values_TxF, lengths
    if seq.overflow == "error":
      fail(self.history_col[seq.fields[0].name], over[0],
           f"history of {int(lengths[over[0]])} tokens, more than max_len {seq.max_len} (the spec can say "
           "overflow: truncate)")
    ends = np.cumsum(lengths)
    kept = np.minimum(lengths, seq.max_len)
    # Keep the most recent max_len tokens of each row: token j of row r is kept when j >= end - kept.
    row_of = np.repeat(np.arange(lengths.size), lengths)
    keep = np.arange(values_TxF.shape[0]) >= (ends - kept)[row_of]
    count["truncated_histories"] += int(over.size)
    count["truncated_tokens"] += int((lengths - kept).sum())
    return values_TxF[keep], kept

  def _dense(self, arr, f, fail, file) -> np.ndarray:
    import pyarrow as pa
    col = self.dense_col[f.name]
    if arr.null_count:
      fail(col, np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0], "null value")
    if f.dim == 1 and pa.types.is_floating(arr.type):
      out = arr.to_numpy(zero_copy_only=False).reshape(-1, 1)
    elif (pa.types.is_list(arr.type) or pa.types.is_fixed_size_list(arr.type)) and pa.types.is_floating(arr.type.value_type):
      lengths = arr.value_lengths().to_numpy(zero_copy_only=False)
      wrong = np.flatnonzero(lengths != f.dim)
      if wrong.size:
        fail(col, wrong[0], f"{int(lengths[wrong[0]])} values, the spec says dim {f.dim}")
      out = arr.flatten().to_numpy(zero_copy_only=False).reshape(-1, f.dim)
    else:
      raise DataFileError(f"{file}: column {col!r} must hold floats (dim {f.dim}), has {arr.type}")
    with np.errstate(over="ignore"):  # a float64 past float32's range becomes inf, refused just below
      out32 = out.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(out32).all(axis=1))
    if bad.size:
      fail(col, bad[0], f"non-finite dense value {out[bad[0]].tolist()} (as float32)")
    return out32

  def _labels(self, column, fail, count, n, file):
    import pyarrow as pa
    spec = self.spec
    labels = np.zeros((n, len(spec.tasks)), np.float32)
    mask = np.zeros((n, len(spec.tasks)), np.float32)
    index = {t.name: k for k, t in enumerate(spec.tasks)}
    for k, t in enumerate(spec.tasks):
      col = self.task_col[t.name]
      arr = column(col)
      if not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type)
              or pa.types.is_null(arr.type)):
        raise DataFileError(f"{file}: column {col!r} must hold labels (integers, floats or booleans), has {arr.type}")
      defined = ~arr.is_null().to_numpy(zero_copy_only=False)
      value = np.zeros(n, np.float64)
      if defined.any():
        value[defined] = arr.drop_null().to_numpy(zero_copy_only=False).astype(np.float64)
      bad = defined & (value != 0) & (value != 1)
      if t.parent is not None:
        p = index[t.parent]
        orphan = defined & ~bad & ~((mask[:, p] > 0) & (labels[:, p] == 1))
      else:
        orphan = np.zeros(n, bool)
      for what, rows in (("label outside {0, 1}", bad), (f"label set where its parent {t.parent!r} is not 1", orphan)):
        if rows.any():
          if spec.bad_labels == "error":
            r = int(np.flatnonzero(rows)[0])
            fail(col, r, f"{what} (value {value[r]!r}; the spec can say bad_labels: mask)")
          count[f"masked_labels/{t.name}"] += int(rows.sum())
      ok = defined & ~bad & ~orphan
      labels[ok, k] = value[ok]
      mask[ok, k] = 1.0
    return labels, mask


def _put(ids: np.ndarray, where: np.ndarray, values: np.ndarray) -> np.ndarray:
  out = ids.copy()
  out[where] = values
  return out


def take(ex: Examples, rows: np.ndarray) -> Examples:
  """The examples `rows` of `ex`, in that order (jagged parts gathered token by token)."""
  def jagged(values, lengths):
    starts = np.cumsum(lengths) - lengths
    sel = lengths[rows]
    index = np.repeat(starts[rows] - np.cumsum(sel) + sel, sel) + np.arange(int(sel.sum()))
    return values[index], sel
  return Examples(sparse={k: v[rows] for k, v in ex.sparse.items()},
                  multi_hot={k: jagged(*v) for k, v in ex.multi_hot.items()},
                  dense_nxG=ex.dense_nxG[rows], history=jagged(*ex.history), domain_n=ex.domain_n[rows],
                  labels_nxK=ex.labels_nxK[rows], label_mask_nxK=ex.label_mask_nxK[rows],
                  planted_logits_nxK=ex.planted_logits_nxK[rows])
