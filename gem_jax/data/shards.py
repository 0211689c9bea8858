"""Host side of data parallelism: a global Batch -> S cost-balanced data shards -> arrays on the mesh.

A global batch of B rows is split into S = replica * fsdp * sparse data shards of b = B / S rows. Each
shard is a complete Batch of its own (its jagged parts re-packed with local offsets), and the S shards
are stacked along a new leading dim that is sharded over the data axes, so inside the SPMD step every
device sees one ordinary local Batch (gem_jax/parallel/spmd.py squeezes the leading dim). One data shard
(one device, or a mesh of tensor / context axes only) keeps the batch as it is, with that leading dim.

Which rows go to which shard: attention costs ~len^2 per sequence and the rest ~len, so round-robin on a
heavy-tailed batch leaves one shard with most of the work and every other device waiting on it. Rows are
assigned greedily, most expensive first, to the open shard (fewer than b rows) with the least cost so far
(LPT with a cardinality limit); ties go to the lower shard index, so the assignment is deterministic.
The loss is a sum over rows divided by a global count, so the assignment changes nothing but the order
of floating-point additions.

Letters: B global rows, S data shards, b rows per shard, T token capacity, F history fields.

This module never drops, truncates or reorders tokens inside a row; a shard whose tokens do not fit the
largest bucket raises.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from gem_jax.data.batch import Batch
from gem_jax.data.pipeline import PipelineConfig, pick_bucket
from gem_jax.data.spec import FeatureSpec
from gem_jax.data.validate import BatchValidationError
from gem_jax.jagged import Jagged


def row_costs(history_lengths_B: np.ndarray) -> np.ndarray:
  """Per row work: len^2 (attention) + len (projections, lookups); float64 so it never overflows."""
  lengths = np.asarray(history_lengths_B, np.float64)
  return lengths * lengths + lengths


def assign_rows(cost_B: np.ndarray, num_shards: int) -> np.ndarray:
  """(S, b) row indices: every shard gets b = B / S rows, total costs balanced (see module docstring)."""
  cost_B = np.asarray(cost_B, np.float64)
  n = cost_B.shape[0]
  if num_shards <= 0 or n % num_shards:
    raise ValueError(f"a batch of {n} rows does not split into {num_shards} equal data shards")
  per = n // num_shards
  order = np.argsort(-cost_B, kind="stable")
  load = np.zeros(num_shards)
  filled = np.zeros(num_shards, np.int64)
  out = np.zeros((num_shards, per), np.int64)
  for row in order:
    open_ = np.flatnonzero(filled < per)
    s = open_[np.argmin(load[open_])]
    out[s, filled[s]] = row
    filled[s] += 1
    load[s] += cost_B[row]
  out.sort(axis=1)  # rows keep their batch order inside a shard
  return out


def imbalance(cost_B: np.ndarray, rows_Sxb: np.ndarray) -> float:
  """max / mean of the per-shard cost (1.0 = perfectly balanced; an all-zero batch counts as balanced)."""
  loads = np.asarray(cost_B, np.float64)[rows_Sxb].sum(axis=1)
  mean = loads.mean()
  return float(loads.max() / mean) if mean > 0 else 1.0


def _jagged_rows(jag: Jagged) -> tuple[np.ndarray, np.ndarray]:
  offsets = np.asarray(jag.offsets)
  return np.asarray(jag.values), offsets


def pack_jagged(values: np.ndarray, offsets: np.ndarray, rows_Sxb: np.ndarray, capacity: int | None,
                 buckets: tuple[int, ...] | None, name: str) -> Jagged:
  """Re-packs the rows of one global jagged array into S local ones of a common static capacity."""
  S, b = rows_Sxb.shape
  lengths = offsets[1:] - offsets[:-1]
  tokens_S = lengths[rows_Sxb].sum(axis=1)
  if capacity is None:
    capacity = pick_bucket(int(tokens_S.max()), buckets)
  elif tokens_S.max() > capacity:
    raise BatchValidationError(f"{name}: a data shard holds {int(tokens_S.max())} tokens, more than its "
                               f"capacity {capacity}")
  out_values = np.zeros((S, capacity) + values.shape[1:], values.dtype)
  out_offsets = np.zeros((S, b + 1), np.int32)
  for s in range(S):
    pos = 0
    for j, row in enumerate(rows_Sxb[s]):
      lo, hi = offsets[row], offsets[row + 1]
      out_values[s, pos:pos + hi - lo] = values[lo:hi]
      pos += hi - lo
      out_offsets[s, j + 1] = pos
  return Jagged(out_values, out_offsets)


def shard_batch(batch: Batch, spec: FeatureSpec, cfg: PipelineConfig, num_shards: int,
                rows_Sxb: np.ndarray | None = None, history_capacity: int | None = None) -> Batch:
  """A host (numpy) global Batch -> a Batch whose every leaf has a leading dim of `num_shards`.

  rows_Sxb: the assignment to use (default: cost balanced on the history lengths). The local history
  capacity is the smallest bucket of the pipeline's schedule at b rows that holds the fullest shard (or
  `history_capacity`); multi-hot capacities are b * max_ids, as in the pipeline.
  """
  B = batch.batch_size
  if B % num_shards:
    raise ValueError(f"batch of {B} rows does not split into {num_shards} data shards (replica x fsdp x sparse)")
  if num_shards == 1 and rows_Sxb is None and history_capacity is None:  # nothing to assign or re-pack
    return jax.tree_util.tree_map(lambda x: np.asarray(x)[None], batch)
  lengths = np.diff(np.asarray(batch.history.offsets))
  if rows_Sxb is None:
    rows_Sxb = assign_rows(row_costs(lengths), num_shards)
  b = B // num_shards
  local_cfg = dataclasses.replace(cfg, batch_size=b)
  take = lambda x: np.asarray(x)[rows_Sxb]
  multi_hot = {}
  for f in spec.multi_hot:
    values, offsets = _jagged_rows(batch.multi_hot[f.name])
    multi_hot[f.name] = pack_jagged(values, offsets, rows_Sxb, local_cfg.multi_hot_capacity(f), None, f.name)
  values, offsets = _jagged_rows(batch.history)
  history = pack_jagged(values, offsets, rows_Sxb, history_capacity, local_cfg.history_buckets(spec), "history")
  return Batch(
      sparse={k: take(v) for k, v in batch.sparse.items()},
      multi_hot=multi_hot,
      dense_BxG=take(batch.dense_BxG),
      history=history,
      domain_B=take(batch.domain_B),
      labels_BxK=take(batch.labels_BxK),
      label_mask_BxK=take(batch.label_mask_BxK),
      example_mask_B=take(batch.example_mask_B),
      planted_logits_BxK=take(batch.planted_logits_BxK))


def place(sharded: Batch, mesh, data_axes: tuple[str, ...], shard_ids: list[int] | None = None,
          num_shards: int | None = None) -> Batch:
  """Puts a sharded host Batch on the mesh, leading dim over `data_axes`, replicated over the others.

  Built with make_array_from_callback, so in a multi-process run each process transfers only the data
  shards of its own devices. shard_ids: which of the `num_shards` data shards the leading dim holds (a
  process's Part); default all of them, in order.
  """
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(data_axes))
  at = None if shard_ids is None else {d: i for i, d in enumerate(shard_ids)}

  def put(x):
    x = np.asarray(x)
    if at is None:
      return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def local(index):
      start, stop, _ = index[0].indices(num_shards)
      missing = [d for d in range(start, stop) if d not in at]
      if missing:
        raise ValueError(f"data shards {missing} are on this process's devices, but its Part holds {shard_ids}")
      return x[[at[d] for d in range(start, stop)]][(slice(None),) + tuple(index[1:])]

    return jax.make_array_from_callback((num_shards,) + x.shape[1:], sharding, local)

  return jax.tree_util.tree_map(put, sharded)


def local_data_shards(mesh, num_shards: int, data_axes: tuple[str, ...]) -> list[int]:
  """The data shards whose devices this process holds (all of them in a one-process run)."""
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(data_axes))
  out = set()
  for index in sharding.addressable_devices_indices_map((num_shards,)).values():
    out.update(range(*index[0].indices(num_shards)[:2]))
  return sorted(out)


# ---- a process's share of a step: the pieces of some readers (gem_jax/data/parquet_source.py) ------------
@dataclasses.dataclass(frozen=True)
class Part:
  """The pieces of `readers` (of num_readers) of one training step, each a Batch of B / R rows; reader r's
  rows fill data shards [r S / R, (r + 1) S / R)."""
  readers: tuple[int, ...]
  num_readers: int
  batches: tuple[Batch, ...]


def shard_part(part: Part, spec: FeatureSpec, cfg: PipelineConfig, num_shards: int,
               agree=lambda tokens: tokens) -> tuple[Batch, list[int]]:
  """A Part -> (its data shards stacked on a leading dim, their shard ids). Each reader's rows are balanced
  over its own S / R shards (so the shards do not depend on which process holds which reader); the history
  capacity is the bucket of the fullest shard of the whole step: agree(this Part's fullest) must return the
  largest over every process's Part (one process: the identity)."""
  R = part.num_readers
  if num_shards % R:
    raise ValueError(f"data.readers={R} does not divide the mesh's {num_shards} data shards "
                     "(replica x fsdp x sparse): every reader fills whole shards")
  per = num_shards // R
  rows = [assign_rows(row_costs(np.diff(np.asarray(b.history.offsets))), per) for b in part.batches]
  fullest = max(int(np.diff(np.asarray(b.history.offsets))[r].sum(axis=1).max()) for b, r in zip(part.batches, rows))
  b_cfg = dataclasses.replace(cfg, batch_size=part.batches[0].batch_size)
  local_cfg = dataclasses.replace(cfg, batch_size=part.batches[0].batch_size // per)
  capacity = pick_bucket(int(agree(fullest)), local_cfg.history_buckets(spec))
  shards = [shard_batch(b, spec, b_cfg, per, rows_Sxb=r, history_capacity=capacity) for b, r in zip(part.batches, rows)]
  stacked = jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *shards)
  return stacked, [r * per + k for r in part.readers for k in range(per)]
