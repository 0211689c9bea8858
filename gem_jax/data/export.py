"""Examples -> Parquet files and a spec file: the layout the Parquet source reads (gem_jax/data/parquet_source.py).

  write_dataset(out, spec, train_blocks, eval_blocks)   out/spec.yaml, out/train/*.parquet, out/eval/*.parquet

Column types: ids int64, lists of ids list<int64>, dense float32 (a list of float32 when dim > 1), labels
float32 with null where a label is undefined (label_mask 0), the domain int32, planted logits float32 when
they are known. Reading the files back gives the same Examples bit for bit.

This module never changes a value: what it cannot write as it is (a defined label outside {0, 1}) raises.
"""

from __future__ import annotations

import os
from typing import Iterable

import numpy as np

from gem_jax.data import spec_file
from gem_jax.data.batch import Examples
from gem_jax.data.parquet_rows import PLANTED
from gem_jax.data.spec import FeatureSpec


def to_table(ex: Examples, spec: FeatureSpec, columns: spec_file.Columns | None = None):
  """One pyarrow Table of `ex`, its columns named by `columns` (default: Columns.default(spec))."""
  import pyarrow as pa
  columns = columns or spec_file.Columns.default(spec)
  sc, dc, hc, tc = (dict(x) for x in (columns.sparse, columns.dense, columns.history, columns.tasks))

  def lists(values: np.ndarray, lengths: np.ndarray, typ):
    offsets = np.zeros(lengths.size + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, typ))

  out = {}
  for f in spec.sparse:
    out[sc[f.name]] = (lists(ex.multi_hot[f.name][0].astype(np.int64), ex.multi_hot[f.name][1], pa.int64())
                       if f.multi_hot else pa.array(ex.sparse[f.name].astype(np.int64), pa.int64()))
  at = 0
  for f in spec.dense:
    block = ex.dense_nxG[:, at:at + f.dim].astype(np.float32)
    at += f.dim
    out[dc[f.name]] = (pa.array(block[:, 0], pa.float32()) if f.dim == 1
                       else lists(block.reshape(-1), np.full(len(ex), f.dim), pa.float32()))
  values_TxF, lengths = ex.history
  for i, field in enumerate(spec.sequence.fields):
    out[hc[field.name]] = lists(values_TxF[:, i].astype(np.int64), lengths, pa.int64())
  out[columns.domain] = pa.array(ex.domain_n.astype(np.int32), pa.int32())
  for k, t in enumerate(spec.tasks):
    defined = ex.label_mask_nxK[:, k] > 0
    label = ex.labels_nxK[:, k]
    bad = defined & (label != 0) & (label != 1)
    if bad.any():
      raise ValueError(f"task {t.name!r}: row {int(np.flatnonzero(bad)[0])} has label {label[bad][0]}, not 0 or 1")
    out[tc[t.name]] = pa.array(label.astype(np.float32), pa.float32(), mask=~defined)
    planted = ex.planted_logits_nxK[:, k]
    if not np.isnan(planted).all():
      out[PLANTED.format(t.name)] = pa.array(planted.astype(np.float32), pa.float32())
  return pa.table(out)


def write_split(folder: str, blocks: Iterable[Examples], spec: FeatureSpec, columns=None, *,
                rows_per_file: int = 1 << 20, row_group_rows: int = 65536) -> int:
  """Writes `blocks` in order as folder/part-00000.parquet, ... (a new file every rows_per_file rows, row
  groups of row_group_rows, the last of a file shorter); returns the rows written."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  if rows_per_file < 1 or row_group_rows < 1:
    raise ValueError(f"rows_per_file and row_group_rows must be >= 1, got {rows_per_file}, {row_group_rows}")
  os.makedirs(folder, exist_ok=True)
  state = {"writer": None, "in_file": 0, "files": 0, "total": 0}

  def flush(table) -> None:
    """Writes `table` (at most what the current file still holds) as one row group."""
    if state["writer"] is None:
      state["writer"] = pq.ParquetWriter(os.path.join(folder, f"part-{state['files']:05d}.parquet"), table.schema)
      state["files"] += 1
    state["writer"].write_table(table, row_group_size=table.num_rows)
    state["in_file"] += table.num_rows
    state["total"] += table.num_rows
    if state["in_file"] == rows_per_file:
      state["writer"].close()
      state["writer"], state["in_file"] = None, 0

  pending = []
  try:
    for ex in blocks:
      pending.append(to_table(ex, spec, columns))
      buffered = pa.concat_tables(pending)
      while True:
        size = min(row_group_rows, rows_per_file - state["in_file"])
        if buffered.num_rows < size:
          break
        flush(buffered.slice(0, size))
        buffered = buffered.slice(size)
      pending = [buffered] if buffered.num_rows else []
    while pending and pending[0].num_rows:
      size = min(row_group_rows, rows_per_file - state["in_file"])
      flush(pending[0].slice(0, size))
      pending = [pending[0].slice(size)]
  finally:
    if state["writer"] is not None:
      state["writer"].close()
  return state["total"]


def write_dataset(out: str, spec: FeatureSpec, train_blocks: Iterable[Examples], eval_blocks: Iterable[Examples],
                  columns=None, **kw) -> dict:
  """out/spec.yaml, out/train/ and out/eval/ (the Parquet source's layout); returns the rows of each split."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "spec.yaml"), "w") as f:
    f.write(spec_file.dump(spec, columns))
  return {"train": write_split(os.path.join(out, "train"), train_blocks, spec, columns, **kw),
          "eval": write_split(os.path.join(out, "eval"), eval_blocks, spec, columns, **kw)}


def export_synthetic(cfg, out: str, examples: int, *, readers: int = 1, **kw) -> dict:
  """The synthetic stream of `cfg` (a config whose data is the synthetic source) as Parquet: training blocks
  0, 1, ... of the config's batch size (whole blocks, at least `examples` rows) and the evaluation set the
  synthetic source evaluates on. A Parquet run of the same config (shuffle off) reads the same batches;
  with `readers` R, the rows are laid out for data.readers = R (reader r's range holds the r-th B / R rows of
  every block, in block order), so that run reads them."""
  from gem_jax.data.sources import EVAL_START_INDEX, SyntheticSource
  source = SyntheticSource(cfg)
  B = source.batch_size
  if readers < 1 or B % readers:
    raise ValueError(f"readers={readers} must be >= 1 and divide the batch size {B}")
  blocks, b = range(-(-examples // B)), B // readers
  train = (source.block(i, B).slice(r * b, (r + 1) * b) for r in range(readers) for i in blocks)
  full, rest = divmod(cfg.train.eval_examples, B)
  evals = [source.block(EVAL_START_INDEX + i, B) for i in range(full)]
  if rest:
    evals.append(source.block(EVAL_START_INDEX + full, rest))
  return write_dataset(out, source.spec, train, evals, **kw)
