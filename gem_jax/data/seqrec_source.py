"""The public next-item datasets as a data source ("seqrec"): leave-one-out splits of MovieLens / Amazon files
(gem_jax/data/seqrec.py) as training epochs and full-ranking evaluation batches.

Training: each epoch visits the users with at least two training items in a random order, a batch of
`batch_size` rows, each row the user's last max_len + 1 training items as (input, next item) pairs (with
train_window="random", max_len + 1 consecutive ones ending at a position drawn per row and batch). Every
batch carries one set of negatives shared by all its tokens: `uniform_negatives` items drawn uniformly from
the catalog plus `batch_negatives` targets of the batch itself (so popular items appear as often as they
are targets), with the log of each item's expected count in the set (the logQ correction). One numpy
generator (seed) draws the epoch orders, the windows and the negatives, in that order, so the stream is a
function of the seed alone; its state (epoch, batch, generator states) resumes at the exact batch.

Evaluation ("valid", "test"): every user once, the input the most recent max_len items before the target;
each batch carries its rows' targets and a mask of every item of each row's whole history (excluded from
the ranking; column 0, the padding id, too). exclude_history=False masks only column 0, to measure what the
exclusion is worth. train_through_valid=True is HSTU's protocol: the validation item is trained on too, so
the only evaluation is the test split, once, after a fixed number of epochs (the config must ask for no
periodic evaluation and no model selection; ValueError otherwise).

Letters: B rows, T token capacity, K negatives, I items (+1: id 0 is padding). This module never drops a
user silently: a user without a training pair is skipped by the protocol (said in its docstring), a row
longer than max_len raises.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from gem_jax.data import seqrec as data
from gem_jax.data import shards
from gem_jax.data.sources import register
from gem_jax.jagged import Jagged

DEFAULT_DATA_DIR = os.environ.get(
    "GEM_JAX_DATA_DIR", os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data")))


@dataclasses.dataclass(frozen=True)
class SeqRecDataConfig:
  dataset: str                      # gem_jax/data/seqrec.py DATASETS
  data_dir: str = DEFAULT_DATA_DIR  # the root holding ml-1m/, ml-100k/, amazon-s3rec/ ($GEM_JAX_DATA_DIR)
  max_len: int = 200                # most recent items kept per row (the model's max_len)
  batch_size: int = 128             # user rows per training step
  eval_batch_size: int = 256
  token_multiple: int = 2048        # static token capacities are multiples of this (one compile each)
  uniform_negatives: int = 512
  batch_negatives: int = 512
  seed: int = 0
  exclude_history: bool = True      # rank every item but the row's history (the protocol); False: every item
  train_through_valid: bool = False  # HSTU's protocol: train on the validation item too, test at a fixed epoch
  train_window: str = "last"        # a training row's items: "last" max_len + 1, or a "random" window of them

  def __post_init__(self):
    if self.dataset not in data.DATASETS:
      raise ValueError(f"data.dataset: unknown dataset {self.dataset!r}; known: {sorted(data.DATASETS)}")
    if min(self.max_len, self.batch_size, self.eval_batch_size, self.token_multiple) < 1:
      raise ValueError(f"data: sizes must be positive: {self}")
    if self.uniform_negatives < 0 or self.batch_negatives < 0 or self.uniform_negatives + self.batch_negatives < 1:
      raise ValueError("data: need at least one negative (uniform_negatives + batch_negatives >= 1), got "
                       f"{self.uniform_negatives} + {self.batch_negatives}")
    if self.train_window not in ("last", "random"):
      raise ValueError(f"data.train_window: {self.train_window!r} is not 'last' or 'random'")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NextItemBatch:
  """A training batch: input tokens, the next item of every token (0: none), the shared negatives."""
  items: Jagged        # ids_T int32, offsets_Bp1
  targets_T: Any
  negatives_K: Any
  logq_neg_K: Any
  logq_pos_T: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NextItemEvalBatch:
  """An evaluation batch: each row's input, its held-out target (0 on padding rows) and the items ranked
  out of the way (its history and the padding id)."""
  items: Jagged
  targets_B: Any
  exclude_BxI: Any     # bool, (B, I + 1)
  row_mask_B: Any      # float32, 1 on real rows


def sample_negatives(rng: np.random.Generator, targets_T: np.ndarray, num_items: int, uniform: int, in_batch: int):
  """(negatives_K, logq_neg_K, logq_pos_T): K = uniform + in_batch shared negatives and the log of each
  item's expected count in the set (0 at padding targets)."""
  valid = targets_T > 0
  tgt = targets_T[valid]
  neg = [rng.integers(1, num_items + 1, uniform, dtype=np.int64)]
  expected = np.full(num_items + 1, uniform / num_items, np.float64)
  if in_batch:
    if tgt.size == 0:
      raise ValueError("sample_negatives: a batch without targets cannot supply in-batch negatives")
    neg.append(tgt[rng.integers(0, tgt.size, in_batch)])
    expected += in_batch * np.bincount(tgt, minlength=num_items + 1) / tgt.size
  negatives = np.concatenate(neg).astype(np.int32)
  logq_pos = np.where(valid, np.log(expected[targets_T]), 0.0).astype(np.float32)
  return negatives, np.log(expected[negatives]).astype(np.float32), logq_pos


def exclusion_mask(prefixes: list[np.ndarray], users: np.ndarray, num_items: int) -> np.ndarray:
  """B x (I + 1) bool: the padding column and every item of each row's whole history (not only the kept
  max_len window). Rows of padding users (-1) exclude only the padding column."""
  mask = np.zeros((users.shape[0], num_items + 1), bool)
  mask[:, 0] = True
  for row, u in enumerate(users):
    if u >= 0:
      mask[row, prefixes[u]] = True
  return mask


def check_rows(batch, max_len: int) -> None:
  longest = int(np.max(np.diff(np.asarray(batch.items.offsets))))
  if longest > max_len:
    raise ValueError(f"seqrec batch has a row of {longest} items; the model's max_len is {max_len}")


class _Epochs:
  """The endless training stream: epochs of shuffled users (module docstring), with a JSON state."""

  def __init__(self, source: "SeqRecSource"):
    self.src = source
    self.rng = np.random.default_rng(source.config.seed)
    self.epoch, self.index, self.users, self.epoch_rng = 0, 0, None, None

  def _start_epoch(self) -> None:
    self.epoch_rng = self.rng.bit_generator.state
    self.users = data.epoch_users(self.src.split.train, self.rng)
    self.index = 0

  def __iter__(self):
    return self

  def __next__(self) -> NextItemBatch:
    c = self.src.config
    if self.users is None or self.index * c.batch_size >= len(self.users):
      if self.users is not None:
        self.epoch += 1
      self._start_epoch()
    chunk = self.users[self.index * c.batch_size:(self.index + 1) * c.batch_size]
    self.index += 1
    batch = data.train_batch(self.src.split.train, chunk, batch_size=c.batch_size, max_len=c.max_len,
                             multiple=c.token_multiple,
                             window_rng=self.rng if c.train_window == "random" else None)
    check_rows(batch, c.max_len)
    neg, logq_neg, logq_pos = sample_negatives(self.rng, batch.targets_T, self.src.num_items,
                                               c.uniform_negatives, c.batch_negatives)
    return NextItemBatch(batch.items, batch.targets_T, neg, logq_neg, logq_pos)

  def get_state(self) -> dict:
    return {"epoch": self.epoch, "index": self.index, "epoch_rng": self.epoch_rng,
            "rng": self.rng.bit_generator.state}

  def set_state(self, state: dict) -> None:
    self.epoch, self.index = state["epoch"], state["index"]
    self.users = None
    if state["epoch_rng"] is not None:  # replay the epoch's order, then go on from where the stream was
      self.rng.bit_generator.state = state["epoch_rng"]
      self.epoch_rng = state["epoch_rng"]
      self.users = data.epoch_users(self.src.split.train, self.rng)
    self.rng.bit_generator.state = state["rng"]


def _check_fixed_epochs(train) -> None:
  """data.train_through_valid: no evaluation before the end and no selection (the source has no monitor
  split, so a periodic evaluation asked for would silently not happen)."""
  wrong = {k: getattr(train, k) for k in ("select_metric", "patience", "eval_every_epochs", "max_train_minutes")
           if getattr(train, k)}
  if wrong or not train.epochs:
    raise ValueError("data.train_through_valid=true trains on the validation item, so the test split is read once "
                     "after a fixed number of epochs: set train.epochs and leave train.select_metric, patience, "
                     "eval_every_epochs and max_train_minutes (a time limit would end it at another epoch) unset (got "
                     + ", ".join(f"train.{k}={v!r}" for k, v in {"epochs": train.epochs, **wrong}.items()) + ")")


@register(SeqRecDataConfig)
class SeqRecSource:
  name = "seqrec"
  splits = ("valid", "test")

  def __init__(self, cfg):
    self.config: SeqRecDataConfig = cfg.data
    self.batch_size = self.config.batch_size
    through = self.config.train_through_valid
    if through:
      _check_fixed_epochs(cfg.train)
    # What the trainer evaluates, and reads during training: with the validation item trained on, its split
    # measures nothing held out, and the test split is read once, at the end.
    self.eval_splits = ("test",) if through else self.splits
    self.monitor_split = None if through else "valid"
    self.dataset = data.load(self.config.dataset, self.config.data_dir)
    self.split = data.leave_one_out(self.dataset, through_valid=through)
    if not any(t.shape[0] >= 2 for t in self.split.train):
      raise ValueError(f"seqrec: no user of {self.config.dataset!r} has two training items (an input and its next "
                       f"item), so there is nothing to train on; leave-one-out holds back each user's last "
                       f"{1 if through else 2}, so a user needs at least {3 if through else 4} interactions")
    self.num_items = self.dataset.num_items
    self._eval: dict[str, list] = {}

  def train_iterator(self) -> _Epochs:
    return _Epochs(self)

  def steps_per_epoch(self) -> int:
    users = sum(1 for s in self.split.train if s.shape[0] >= 2)
    return -(-users // self.config.batch_size)

  def first_batch(self) -> NextItemBatch:
    return next(_Epochs(self))

  def eval_batches(self, split: str) -> list[NextItemEvalBatch]:
    if split not in self.splits:
      raise KeyError(f"the seqrec source's evaluation splits are {self.splits}; got {split!r}")
    if split not in self._eval:
      c, s = self.config, getattr(self.split, split)
      out = []
      for batch in data.eval_batches(s, batch_size=c.eval_batch_size, max_len=c.max_len, multiple=c.token_multiple):
        check_rows(batch, c.max_len)
        users, real = batch.row_user_B, batch.row_user_B >= 0
        targets = np.where(real, s.targets[np.maximum(users, 0)], 0).astype(np.int32)
        excluded = users if c.exclude_history else np.full_like(users, -1)  # -1: only the padding column
        out.append(NextItemEvalBatch(batch.items, targets, exclusion_mask(s.prefixes, excluded, self.num_items),
                                     real.astype(np.float32)))
      self._eval[split] = out
    return self._eval[split]

  def lengths(self, batch, real: bool = True) -> np.ndarray:
    lengths = np.diff(np.asarray(batch.items.offsets))
    return lengths[lengths > 0] if real else lengths

  def max_length(self) -> int:
    return self.config.max_len

  def row_batch(self, n: int) -> NextItemBatch:
    """One training row of n tokens, capacity exactly n, with the configured number of negatives."""
    k = self.config.uniform_negatives + self.config.batch_negatives
    zeros = lambda shape, dtype: np.zeros(shape, dtype)
    return NextItemBatch(Jagged(zeros(n, np.int32), np.array([0, n], np.int32)), np.ones(n, np.int32),
                         zeros(k, np.int32), zeros(k, np.float32), zeros(n, np.float32))

  def shard(self, batch, num_shards: int):
    if num_shards == 1:
      return jax.tree_util.tree_map(lambda x: np.asarray(x)[None], batch)
    lengths = np.diff(np.asarray(batch.items.offsets))
    rows_Sxb = shards.assign_rows(shards.row_costs(lengths), num_shards)
    capacity = data.bucket_capacity(int(lengths[rows_Sxb].sum(axis=1).max()), self.config.token_multiple)
    items = shards.pack_jagged(np.asarray(batch.items.values), np.asarray(batch.items.offsets), rows_Sxb,
                               capacity, None, "items")
    if isinstance(batch, NextItemEvalBatch):
      take = lambda x: np.asarray(x)[rows_Sxb]
      return NextItemEvalBatch(items, take(batch.targets_B), take(batch.exclude_BxI), take(batch.row_mask_B))
    per_token = lambda x, name: shards.pack_jagged(np.asarray(x), np.asarray(batch.items.offsets), rows_Sxb,
                                                   capacity, None, name).values
    tile = lambda x: np.broadcast_to(np.asarray(x), (num_shards,) + np.shape(x)).copy()
    return NextItemBatch(items, per_token(batch.targets_T, "targets"), tile(batch.negatives_K),
                         tile(batch.logq_neg_K), per_token(batch.logq_pos_T, "logq_pos"))

  def stats(self, num_examples: int = 65536) -> dict:
    lengths = np.asarray([min(s.shape[0] - 1, self.config.max_len) for s in self.split.train if s.shape[0] >= 2])
    return {"lengths": lengths, "examples": int(lengths.size)}

  def popularity_baseline(self, split: str, ks) -> dict[str, float]:
    """The most-popular ranking of a split through the same metric code: items by training count (test
    counts the validation targets too), each user's history excluded."""
    from gem_jax import metrics
    counts = np.bincount(np.concatenate(self.split.train), minlength=self.num_items + 1)
    if split == "test" and not self.config.train_through_valid:  # (trained through: already counted)
      counts = counts + np.bincount(self.split.valid.targets, minlength=self.num_items + 1)
    s = getattr(self.split, split)
    scores = counts.astype(np.float32)
    ranks = []
    for start in range(0, len(s.prefixes), 512):
      users = np.arange(start, min(start + 512, len(s.prefixes)))
      excluded = users if self.config.exclude_history else np.full_like(users, -1)
      r = metrics.full_ranking_ranks(np.broadcast_to(scores, (users.size, self.num_items + 1)), s.targets[users],
                                     exclusion_mask(s.prefixes, excluded, self.num_items))
      ranks.append(np.asarray(r))
    return metrics.hit_rate_ndcg(np.concatenate(ranks), ks)

  def describe(self) -> dict:
    ds = self.dataset
    return {"dataset": ds.name, "users": ds.num_users, "items": ds.num_items, "interactions": ds.num_interactions,
            "file": ds.file, "sha256": ds.sha256}
