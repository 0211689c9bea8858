"""Data sources by name: what build(cfg) reads a run's batches from (gem_jax/run/build.py).

A source is registered by the type of its config (Config.data), so a new source is a config dataclass, a
class and `@register(ThatConfig)` in one new file (tests/test_run.py registers one in the test itself):

  name                        the registry name ("synthetic", "seqrec", ...)
  batch_size                  rows of a training batch
  train_iterator()            an endless iterator of host batches with get_state() / set_state(state) (JSON),
                              so a checkpoint resumes at the exact batch (a source with num_readers > 1
                              takes readers=... and yields shards.Part: build.Run.train_iterator)
  eval_batches(split)         a finite list of host batches of an evaluation split (splits: eval_splits)
  monitor_split               optional: the split the periodic evaluation reads during training (default
                              eval_splits[0]; None: none, nothing held out may be read before the end)
  first_batch()               a training batch with the run's shapes (placement, capacities, abstract traces)
  sample(rows, index)         a batch of `rows` training examples (the simulator's lookup samples)
  shard(batch, num_shards)    the batch split into data shards, every leaf with a leading dim of num_shards
  lengths(batch, real=True)   the sequence length of every real row (or of every row): the meter's FLOPs
                              and rank imbalance
  max_length()                the longest sequence a row may have
  row_batch(n)                a batch of one row with an n-token sequence, capacity exactly n (FLOP traces)
  steps_per_epoch()           batches in one pass over the training data, None for an endless stream
  stats(num_examples)         {"lengths": a sample of per-row sequence lengths, ...}: what the simulator
                              and the planner size a cluster from
  counters()                  {name: count} of what a tolerating input policy did (hashed ids, truncated
                              histories, masked labels), reported in the run's summary

BlockBatches: the batch methods of any source of Examples blocks. SyntheticSource, here: the planted-model
ads stream (gem_jax/data/synthetic.py) through the grain pipeline (gem_jax/data/pipeline.py), with an
evaluation set from an index range training never reaches. Parquet files are gem_jax/data/parquet_source.py,
the public next-item datasets gem_jax/data/seqrec_source.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Protocol

import numpy as np

from gem_jax.data import pipeline, shards
from gem_jax.data.pipeline import PipelineConfig
from gem_jax.data.spec import FeatureSpec
from gem_jax.data.synthetic import SyntheticAdsStream, SyntheticConfig
from gem_jax.jagged import Jagged
from gem_jax.registry import Registry

_SOURCES = Registry("data source")
register, names = _SOURCES.register, _SOURCES.names


class Source(Protocol):
  """What build(cfg) and the trainer read a run's batches through (module docstring)."""
  name: str
  batch_size: int
  eval_splits: tuple[str, ...]

  def train_iterator(self) -> Iterator: ...
  def eval_batches(self, split: str) -> list: ...
  def first_batch(self) -> Any: ...
  def sample(self, rows: int, index: int = 0) -> Any: ...
  def shard(self, batch, num_shards: int) -> Any: ...
  def lengths(self, batch, real: bool = True) -> np.ndarray: ...
  def max_length(self) -> int: ...
  def row_batch(self, n: int) -> Any: ...
  def steps_per_epoch(self) -> int | None: ...
  def stats(self, num_examples: int = 65536) -> dict: ...
  def counters(self) -> dict[str, int]: ...


def make(cfg) -> Source:
  """The source of a run config (its cfg.data picks the class; the whole cfg is passed for the rest)."""
  return _SOURCES.lookup(cfg.data)(cfg)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """The synthetic ads stream: its feature spec, its planted model and the batching pipeline."""
  spec: FeatureSpec
  synthetic: SyntheticConfig
  pipeline: PipelineConfig


EVAL_START_INDEX = 1 << 30  # eval blocks come from an index range training never reaches


class BlockBatches:
  """The batch methods of a source of `Examples` blocks (`self.block(index, size)`, deterministic in both),
  shared by the synthetic and the Parquet sources; `self.spec` and `self.pipe` (its PipelineConfig)."""

  def first_batch(self):
    return pipeline.pack(self.block(0, self.pipe.batch_size), self.spec, self.pipe)

  def sample(self, rows: int, index: int = 0):
    """A training-like batch of `rows` examples from block `index` (the simulator's samples)."""
    return pipeline.pack(self.block(index, rows), self.spec, dataclasses.replace(self.pipe, batch_size=rows))

  def shard(self, batch, num_shards: int):
    return shards.shard_batch(batch, self.spec, self.pipe, num_shards)

  def lengths(self, batch, real: bool = True) -> np.ndarray:
    if isinstance(batch, shards.Part):  # a process's readers (gem_jax/data/parquet_source.py): its rows only
      return np.concatenate([self.lengths(b, real) for b in batch.batches])
    lengths = np.asarray(batch.history.lengths())
    return lengths[np.asarray(batch.example_mask_B) > 0] if real else lengths

  def max_length(self) -> int:
    return self.spec.sequence.max_len

  def row_batch(self, n: int):
    """One example with an n-token history in a batch of exactly that capacity (the FLOP traces)."""
    batch = pipeline.pack(self.block(0, 1), self.spec, dataclasses.replace(self.pipe, batch_size=1))
    fields = len(self.spec.sequence.fields)
    return dataclasses.replace(batch, history=Jagged(np.zeros((n, fields), np.int32), np.array([0, n], np.int32)))

  def stats(self, num_examples: int = 65536) -> dict:
    """History lengths of `num_examples` training examples (blocks from index 0), and the ids they read."""
    block = self.block(0, num_examples)
    return {"lengths": np.asarray(block.history[1]), "examples": len(block)}

  def counters(self) -> dict[str, int]:
    """What a tolerating input policy did (hashed ids, truncated histories, masked labels); none here."""
    return {}


@register(DataConfig)
class SyntheticSource(BlockBatches):
  name = "synthetic"
  eval_splits = ("eval",)

  def __init__(self, cfg):
    self.cfg = cfg
    self.spec = cfg.data.spec
    self.pipe = cfg.data.pipeline
    self.batch_size = self.pipe.batch_size
    self.stream = SyntheticAdsStream(self.spec, cfg.data.synthetic)
    self.first_block = cfg.data.synthetic.first_block
    if self.first_block + cfg.train.steps > EVAL_START_INDEX:
      raise ValueError(f"data.synthetic.first_block={self.first_block}: {cfg.train.steps} training steps from "
                       f"there reach the evaluation blocks (from {EVAL_START_INDEX})")
    self._eval = None

  def block(self, index: int, size: int):
    return self.stream.block(index, size)

  def train_iterator(self):
    return pipeline.make_iterator(self.stream, self.spec, self.pipe, start_index=self.first_block)

  def eval_batches(self, split: str = "eval") -> list:
    if split != "eval":
      raise KeyError(f"the synthetic source has one evaluation split, 'eval'; got {split!r}")
    if self._eval is None:
      self._eval = pipeline.eval_batches(self.stream, self.spec, self.pipe,
                                         num_examples=self.cfg.train.eval_examples, start_index=EVAL_START_INDEX)
    return self._eval

  def steps_per_epoch(self):
    return None
