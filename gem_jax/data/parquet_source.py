"""The Parquet data source: impression logs (one row per impression) read by row group, never whole.

  data.path/spec.yaml    the feature spec and its columns (gem_jax/data/spec_file.py)
  data.path/train/       *.parquet, read in sorted file order, row groups in file order
  data.path/eval/        the evaluation split, read in order, every row once

Columns, by the part of the spec they fill (names from the spec file):
  single-hot sparse, domain   an integer column, no nulls
  multi-hot sparse            a list of integers per row, at most max_ids long
  history fields              a list of integers per row and field; a row's fields have one length
  dense                       a float column (dim 1) or a list of dim floats, finite
  task labels                 0 or 1 (integer, float or bool); null: undefined for that row (a masked loss)
  planted_logit_<task>        optional float: a synthetic stream's ground truth (NaN when absent)

Order. Training block i (of batch_size rows) is rows [i B, (i + 1) B) of epoch i // steps_per_epoch's order;
the last block of an epoch may be short (padded by the pipeline with example_mask 0 rows). With
shuffle_window 0 the order is the files' order; with W > 0, epoch e permutes the row groups and then the rows
inside every window of W consecutive rows, both by (seed, e), so a block is a pure function of its index
and the grain iterator's block counter (saved in checkpoints) resumes at the exact example
(`position(i)` names that example's file, row group and row). Memory: the row groups of the windows in use
(a small cache), never the dataset.

Readers (data.readers = R, 0: one per process). An epoch's positions split into R contiguous ranges
[r N / R, (r + 1) N / R); training block i is reader r's rows [i b, (i + 1) b) of its range for every r
(b = B / R, each piece padded on its own), and reader r's rows fill data shards [r S / R, (r + 1) S / R)
(gem_jax/data/shards.py Part). A process reads only the readers of its own data shards, so P processes with
R = P read disjoint rows and, with the files' order, row groups that meet only at the ranges' edges. The
examples of a step depend on R, never on the process count: one process with data.readers=P trains what P
processes train. R = 1 is the order above (the file order, or its shuffle).

Bad input is checked row group by row group, with the file, the row and the column in every error
(gem_jax/data/parquet_rows.py); `counters()` says what a tolerating policy did.

Reader: pyarrow.parquet (ParquetFile.read_row_group). grain's Parquet dataset reads rows one at a time as
Python dicts; the columnar read keeps the checks and the conversion vectorized.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import os
import threading

import numpy as np

from gem_jax.data import pipeline, spec_file
from gem_jax.data.batch import Examples
from gem_jax.data.parquet_rows import Converter, DataFileError, take
from gem_jax.data.pipeline import PipelineConfig
from gem_jax.data.shards import Part
from gem_jax.data.sources import BlockBatches, register

@dataclasses.dataclass(frozen=True)
class ParquetDataConfig:
  """Parquet files and their spec. `path` holds spec.yaml, train/ and eval/ unless spec_file, train or
  eval name them (a folder or a glob). shuffle_window: rows per shuffle window (0: file order)."""
  path: str
  pipeline: PipelineConfig
  spec_file: str = ""
  train: str = ""
  eval: str = ""
  shuffle_window: int = 0
  seed: int = 0
  history: bool = True  # False: every row's history is empty (the ablation "GEM without the sequence")
  readers: int = 0      # training readers (module docstring: Readers); 0: one per process

  def __post_init__(self):
    for name in ("shuffle_window", "readers"):
      if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
        raise ValueError(f"data.{name} must be an integer >= 0, got {getattr(self, name)!r}")

  @property
  def spec_path(self) -> str:
    return self.spec_file or os.path.join(self.path, "spec.yaml")

  @property
  def spec(self):
    return _load_spec(self.spec_path).spec

  @property
  def columns(self) -> spec_file.Columns:
    return _load_spec(self.spec_path).columns


@functools.lru_cache(maxsize=16)
def _load_spec(path: str) -> spec_file.SpecFile:
  if not os.path.exists(path):
    raise FileNotFoundError(f"data: no feature-spec file at {path} (set data.path or data.spec_file)")
  return spec_file.load(path)


def list_files(where: str) -> list[str]:
  """The Parquet files of a folder (*.parquet directly inside it) or a glob (`**` reaches into subfolders),
  sorted; raises when there are none, and when a folder also holds Parquet files in subfolders (a partitioned
  dataset, say), which reading its top alone would leave out without a word."""
  if not os.path.isdir(where):
    files = sorted(f for f in glob.glob(where, recursive=True) if os.path.isfile(f))
    if not files:
      raise FileNotFoundError(f"data: no Parquet files at {where!r}")
    return files
  files = sorted(glob.glob(os.path.join(where, "*.parquet")))
  deeper = sorted(f for f in glob.glob(os.path.join(where, "*", "**", "*.parquet"), recursive=True))
  if deeper:
    raise ValueError(f"data: {where!r} holds {len(deeper)} Parquet file(s) in subfolders (first: "
                     f"{os.path.relpath(deeper[0], where)!r}), which a folder does not read; name every file to "
                     f"read with a glob, e.g. {os.path.join(where, '**', '*.parquet')!r}")
  if not files:
    raise FileNotFoundError(f"data: no Parquet files at {where!r}")
  return files


# ---- a set of files: row groups, a cache of checked ones, and the order of an epoch ---------------------
class RowGroups:
  """The row groups of `files` in order, read and checked on demand (the last `cache` of them kept)."""

  def __init__(self, files: list[str], converter: Converter, cache: int = 16):
    import pyarrow.parquet as pq
    self.files, self.converter, self.cache = files, converter, cache
    self.groups = []  # (file index, row group, rows, first row in the file)
    for fi, f in enumerate(files):
      try:
        meta = pq.ParquetFile(f).metadata
      except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise DataFileError(f"{f}: not a readable Parquet file: {e}") from e
      first = 0
      for g in range(meta.num_row_groups):
        rows = meta.row_group(g).num_rows
        self.groups.append((fi, g, rows, first))
        first += rows
    self.sizes = np.array([g[2] for g in self.groups], np.int64)
    self.num_rows = int(self.sizes.sum())
    if self.num_rows == 0:
      raise DataFileError(f"data: the files {files[:3]}... hold no rows")
    self._cache: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()

  def group(self, k: int) -> Examples:
    with self._lock:
      if k in self._cache:
        self._cache.move_to_end(k)
        return self._cache[k]
    import pyarrow.parquet as pq
    fi, g, _, first = self.groups[k]
    pf = pq.ParquetFile(self.files[fi])
    names = pf.schema_arrow.names
    table = pf.read_row_group(g, columns=[c for c in self.converter.needed(names) if c in names])
    ex = self.converter(table, self.files[fi], first)
    with self._lock:
      self._cache[k] = ex
      while len(self._cache) > self.cache:
        self._cache.popitem(last=False)
    return ex

  def read(self, group_order: np.ndarray, rows: np.ndarray) -> Examples:
    """Rows (indices into the concatenation of the row groups taken in `group_order`), in that order."""
    sizes = self.sizes[group_order]
    ends = np.cumsum(sizes)
    at = np.searchsorted(ends, rows, side="right")
    local = rows - (ends - sizes)[at]
    parts, where = [], []
    for a in np.unique(at):
      sel = np.flatnonzero(at == a)
      parts.append(take(self.group(int(group_order[a])), local[sel]))
      where.append(sel)
    ex = Examples.concat(parts)
    return take(ex, np.argsort(np.concatenate(where), kind="stable")) if len(parts) > 1 else ex

  def locate(self, group_order: np.ndarray, row: int) -> dict:
    sizes = self.sizes[group_order]
    ends = np.cumsum(sizes)
    a = int(np.searchsorted(ends, row, side="right"))
    fi, g, _, first = self.groups[int(group_order[a])]
    return {"file": self.files[fi], "row_group": g, "row": first + int(row - (ends[a] - sizes[a]))}


class EpochOrder:
  """Which rows of a RowGroups an epoch reads, by position (module docstring: Order)."""

  def __init__(self, groups: RowGroups, window: int, seed: int):
    self.groups, self.window, self.seed = groups, window, seed

  def rows(self, epoch: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """(the row-group order of `epoch`, the rows of positions [start, stop) in that order)."""
    G, N, W = len(self.groups.groups), self.groups.num_rows, self.window
    pos = np.arange(start, stop, dtype=np.int64)
    if W == 0:
      return np.arange(G), pos
    order = np.random.default_rng([self.seed, epoch]).permutation(G)
    rows = np.empty_like(pos)
    for w in np.unique(pos // W):
      lo = int(w) * W
      perm = np.random.default_rng([self.seed, epoch, int(w)]).permutation(min(W, N - lo))
      sel = (pos // W) == w
      rows[sel] = lo + perm[pos[sel] - lo]
    return order, rows


# ---- the source ------------------------------------------------------------------------------------------
@register(ParquetDataConfig)
class ParquetSource(BlockBatches):
  name = "parquet"
  eval_splits = ("eval",)

  def __init__(self, cfg):
    data = cfg.data
    self.cfg, self.spec, self.pipe = cfg, data.spec, data.pipeline
    self.batch_size = self.pipe.batch_size
    self.converter = Converter(self.spec, data.columns, history=data.history)
    files = list_files(data.train or os.path.join(data.path, "train"))
    self.train_groups = RowGroups(files, self.converter)
    if data.shuffle_window:  # keep every row group of a window (and one on each side) in the cache
      smallest = int(self.train_groups.sizes[self.train_groups.sizes > 0].min())   # empty groups hold no rows
      self.train_groups.cache = max(16, -(-data.shuffle_window // smallest) + 2)
    self.order = EpochOrder(self.train_groups, data.shuffle_window, data.seed)
    self._eval_where = data.eval or os.path.join(data.path, "eval")
    self._eval = None
    if data.readers:
      self.num_readers = data.readers
    else:
      import jax
      self.num_readers = jax.process_count()
    if self.batch_size % self.num_readers:
      raise ValueError(f"data.readers={self.num_readers} does not divide data.pipeline.batch_size="
                       f"{self.batch_size}: every reader fills batch_size / readers rows of a step")

  # Block i of `size` rows: epoch i // blocks-per-epoch, rows [j size, (j + 1) size) of its order.
  def _span(self, index: int, size: int) -> tuple[int, int, int]:
    if index < 0 or size < 1:
      raise ValueError(f"block(index={index}, size={size}): need index >= 0 and size >= 1")
    N = self.train_groups.num_rows
    per_epoch = -(-N // size)
    epoch, j = divmod(int(index), per_epoch)
    return epoch, j * size, min(N, (j + 1) * size)

  def block(self, index: int, size: int) -> Examples:
    epoch, start, stop = self._span(index, size)
    return self.train_groups.read(*self.order.rows(epoch, start, stop))

  # Reader r's piece of block i: rows [i b, (i + 1) b) of its range (module docstring: Readers).
  def _reader_span(self, reader: int, index: int) -> tuple[int, int, int]:
    N, R = self.train_groups.num_rows, self.num_readers
    b, lo, hi = self.batch_size // R, reader * N // R, (reader + 1) * N // R
    epoch, j = divmod(int(index), self.steps_per_epoch())
    return epoch, min(hi, lo + j * b), min(hi, lo + (j + 1) * b)

  def reader_block(self, reader: int, index: int) -> Examples:
    """Reader `reader`'s rows of training block `index` (fewer than B / R at an epoch's end, maybe none)."""
    epoch, start, stop = self._reader_span(reader, index)
    order, rows = self.order.rows(epoch, start, stop)
    if not len(rows):
      return take(self.train_groups.group(int(order[0])), np.zeros(0, np.int64))
    return self.train_groups.read(order, rows)

  def position(self, index: int) -> dict:
    """Where training block `index` starts: epoch, file, row group and row (in the file); with several
    readers, where each reader's piece starts (None for a reader with no rows left in that epoch)."""
    if self.num_readers == 1:
      epoch, start, _ = self._span(index, self.batch_size)
      order, rows = self.order.rows(epoch, start, start + 1)
      return {"epoch": epoch, **self.train_groups.locate(order, int(rows[0]))}
    where = []
    for r in range(self.num_readers):
      epoch, start, stop = self._reader_span(r, index)
      order, rows = self.order.rows(epoch, start, min(stop, start + 1))
      where.append(self.train_groups.locate(order, int(rows[0])) if len(rows) else None)
    return {"epoch": epoch, "readers": where}

  def train_iterator(self, readers: tuple[int, ...] | None = None):
    """Training batches: Batches of B rows with one reader; with several, a Part per step holding the
    pieces of `readers` (default all; build.Run.train_iterator passes this process's)."""
    if self.num_readers == 1 and readers in (None, (0,)):
      return _Iterator(self)
    readers = tuple(range(self.num_readers)) if readers is None else tuple(readers)
    if not readers or any(not 0 <= r < self.num_readers for r in readers):
      raise ValueError(f"readers {readers} are not a choice of the {self.num_readers} readers")
    return _Iterator(self, readers)

  def eval_batches(self, split: str = "eval") -> list:
    if split != "eval":
      raise KeyError(f"the Parquet source has one evaluation split, 'eval'; got {split!r}")
    if self._eval is None:
      groups = RowGroups(list_files(self._eval_where), self.converter, cache=1)
      order, B = np.arange(len(groups.groups)), self.batch_size
      self._eval = [pipeline.pack(groups.read(order, np.arange(lo, min(lo + B, groups.num_rows))), self.spec,
                                  self.pipe) for lo in range(0, groups.num_rows, B)]
    return self._eval

  def steps_per_epoch(self) -> int:
    N, R = self.train_groups.num_rows, self.num_readers
    largest = -(-N // R)  # rows of the longest reader range
    return -(-largest // (self.batch_size // R))

  def counters(self) -> dict[str, int]:
    return dict(sorted(self.converter.counters.items()))


class _PackReaders:
  """grain map: block index -> the Part of `readers` (each reader's piece packed at B / R rows)."""

  def __init__(self, source: ParquetSource, readers: tuple[int, ...]):
    self.source, self.readers = source, readers
    self.pipe = dataclasses.replace(source.pipe, batch_size=source.batch_size // source.num_readers)

  def __call__(self, index: int) -> Part:
    src = self.source
    return Part(self.readers, src.num_readers,
                tuple(pipeline.pack(src.reader_block(r, int(index)), src.spec, self.pipe) for r in self.readers))


class _Iterator:
  """The grain pipeline over a ParquetSource (whole blocks, or the Parts of some readers), with a state that
  also says where it is in the files: resuming checks the files still hold that example there (a changed
  dataset fails loudly instead of shifting). Every process's state is the same (block counter, and the
  position of every reader), so process 0's checkpoint resumes them all."""

  def __init__(self, source: ParquetSource, readers: tuple[int, ...] | None = None):
    self.source = source
    self._it = (pipeline.make_iterator(source, source.spec, source.pipe) if readers is None else
                pipeline.indexed_iterator(_PackReaders(source, readers), source.pipe))
    self._next = 0

  def __iter__(self):
    return self

  def __next__(self):
    batch = next(self._it)
    self._next += 1
    return batch

  def get_state(self) -> dict:
    return {"pipeline": self._it.get_state(), "next_block": self._next,
            "next_example": self.source.position(self._next)}

  def set_state(self, state: dict) -> None:
    here = self.source.position(int(state["next_block"]))
    if here != state["next_example"]:
      raise DataFileError(f"data: the checkpoint's next example is {state['next_example']}, but these files put "
                          f"block {state['next_block']} at {here}: the training files changed since it was saved")
    self._it.set_state(state["pipeline"])
    self._next = int(state["next_block"])


def with_files(cfg, path: str):
  """`cfg` reading the Parquet files of `path` (spec.yaml, train/, eval/) with its own batching: a named
  config's model, optimizer and mesh on a user's logs (experiments/train.py --data)."""
  data = cfg.data
  if isinstance(data, ParquetDataConfig):
    return dataclasses.replace(cfg, data=dataclasses.replace(data, path=path))
  pipe = getattr(data, "pipeline", None)
  if not isinstance(pipe, PipelineConfig):
    raise ValueError(f"config {cfg.name!r}: its data ({type(data).__name__}) has no ads batching pipeline to reuse")
  return dataclasses.replace(cfg, data=ParquetDataConfig(path, pipe))
