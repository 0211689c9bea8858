"""Embedding tables in host memory with a device row cache (train.host_tables).

A host table keeps its V rows, and every per-row array of its row optimizer (the table's slots in
gem_jax/run/table_optim.py), in host memory as numpy arrays: its store. In the train state the table and
its slots are a cache of C rows each where a device table has all V. The host fills the cache ahead of the
step that reads it:

  feed   Run.feed deduplicates each host table's ids in the sharded batch and plans them (RowCache.plan):
         a cached row keeps its slot, a missed row takes an empty slot or a victim's (chosen by the policy
         among the rows that no staged batch reads), and the batch's ids are rewritten to cache slots. A
         row-sharded table caches per owner shard: owner o's rows (o Vo .. (o + 1) Vo - 1) live in its
         slots o c .. (o + 1) c - 1, so the lookup's all-to-all sends a slot where it sent the row.
  swap   right before the step, one small jitted program writes the staged rows (read from the store then)
         into the donated cache and gathers what the victims' slots held, as the steps before left them;
         those come back to the store before the next swap reads it (HostTables.land).
  step   the train step, unchanged: its lookups and the sparse engine's update address cache slots.

Exact: every row a step reads is in the cache when it runs, and a row's current value lives in one place
(the cache while it is cached, else the store), so training with host tables computes what training with
the same tables on the device computes, bit for bit. (The `grad_norm` metric can differ in its last bits:
its table part adds the touched rows in slot order instead of row order.)

Checkpoints and evaluation see whole tables: `full_state` writes every cached row back to the store and
returns the state with each host table's store where its cache was, so a checkpoint holds what a device
table's run holds and restores onto any tier, cache size or mesh (`load_full_state`).

Letters: V rows, E width, O owner shards, Vo = V / O rows per owner, c slots per owner, C = O c slots,
U distinct rows a batch reads, K rows a swap fills.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections import deque
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from gem_jax.data.batch import Batch
from gem_jax.jagged import Jagged
from gem_jax.model.embeddings import Table
from gem_jax.parallel.placement import path_names


class CacheTooSmall(ValueError):
  """The rows that the staged batches read do not fit a host table's cache."""


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


# ---- one owner shard's slots --------------------------------------------------------------------------------

class RowCache:
  """Which row each of `slots` cache slots holds, for one owner shard of one table (rows 0 .. num_rows - 1),
  and which slots to give up for rows that miss.

  policy "lru": the victim is the slot read longest ago; "lfu": the slot whose row was read in the fewest
  batches so far (ties: longest ago). Empty slots go first, and a slot is never given up while a staged
  batch reads it (`pins`)."""

  def __init__(self, num_rows: int, slots: int, policy: str = "lru"):
    if policy not in ("lru", "lfu"):
      raise ValueError(f"RowCache: policy must be 'lru' or 'lfu', got {policy!r}")
    if slots < 1 or num_rows < 1:
      raise ValueError(f"RowCache: need slots >= 1 and num_rows >= 1, got {slots} and {num_rows}")
    self.num_rows, self.slots, self.policy = num_rows, slots, policy
    self.slot_of = np.full(num_rows, -1, np.int32 if slots < 2**31 else np.int64)  # row -> slot, -1: not cached
    self.row_at = np.full(slots, -1, np.int64)       # slot -> row, -1 when empty
    self.last_read = np.full(slots, -1, np.int64)    # the plan that last read each slot
    self.reads = np.zeros(num_rows, np.int64) if policy == "lfu" else None  # batches that read each row
    self.pins = np.zeros(slots, np.int64)            # staged batches reading each slot
    self.clock = 0
    self.hits = self.misses = self.evictions = 0
    self._undo = None

  def plan(self, rows_U: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Slots for the distinct rows `rows_U` of one batch, pinned until `unpin(slots)`.
    -> (slots_U, fill_slots_K, fill_rows_K, evicted_K): the misses' slots and rows, and the row each of those
    slots held before (-1: it was empty), whose value the caller must write back. A batch that does not fit
    raises CacheTooSmall and changes nothing; `rollback()` takes back the last plan that did fit."""
    rows_U = np.asarray(rows_U, np.int64)
    slots_U = self.slot_of[rows_U]
    miss = slots_U < 0
    k = int(miss.sum())
    pinned = slots_U[~miss]
    self.pins[pinned] += 1
    free = self.pins == 0
    if k and int(free.sum()) < k:
      self.pins[pinned] -= 1
      raise CacheTooSmall(f"{k} rows missed and only {int(free.sum())} of {self.slots} slots are free of the "
                          f"staged batches' rows ({len(rows_U)} distinct rows in this batch)")
    self.clock += 1
    self.hits += len(rows_U) - k
    self.misses += k
    if k:
      order = self._victims(free, k)
      evicted = self.row_at[order].copy()
      held = evicted >= 0
      self.slot_of[evicted[held]] = -1
      self.evictions += int(held.sum())
      self.row_at[order] = rows_U[miss]
      self.slot_of[rows_U[miss]] = order
      slots_U[miss] = order
      self.pins[order] += 1
    else:
      order = evicted = np.zeros(0, np.int64)
    self._undo = (rows_U, slots_U.copy(), order, rows_U[miss], evicted, self.last_read[slots_U].copy())
    self.last_read[slots_U] = self.clock
    if self.reads is not None:
      self.reads[rows_U] += 1
    return slots_U, order, rows_U[miss], evicted

  def rollback(self) -> None:
    """Undo the last plan (its slots, evictions, pins and counters), which must be the last change made here:
    for a batch whose plan failed in another owner shard or table, so that no row stays marked cached in a
    slot whose fill never went out and no evicted row's value goes unwritten."""
    rows_U, slots_U, order, filled, evicted, last_read = self._undo
    self._undo = None
    if self.reads is not None:
      self.reads[rows_U] -= 1
    self.last_read[slots_U] = last_read
    self.pins[slots_U] -= 1
    self.slot_of[filled] = -1
    self.row_at[order] = evicted
    held = evicted >= 0
    self.slot_of[evicted[held]] = order[held]
    self.evictions -= int(held.sum())
    self.hits -= len(rows_U) - len(filled)
    self.misses -= len(filled)
    self.clock -= 1

  def _victims(self, free: np.ndarray, k: int) -> np.ndarray:
    """The k best victims among the free slots (empty ones first: they were never read), in O(slots)."""
    cand = np.flatnonzero(free)
    key = self.last_read[cand]
    if self.reads is not None:   # fewest reads first, then longest ago (last_read <= clock)
      held = self.row_at[cand]
      key = np.where(held < 0, -1, self.reads[np.maximum(held, 0)] * (self.clock + 2) + key + 1)
    if k < len(cand):
      cand = cand[np.argpartition(key, k - 1)[:k]]
    return cand

  def unpin(self, slots_U: np.ndarray) -> None:
    self.pins[slots_U] -= 1

  def cached(self) -> tuple[np.ndarray, np.ndarray]:
    """(slots, rows) of every cached row."""
    slots = np.flatnonzero(self.row_at >= 0)
    return slots, self.row_at[slots]


# ---- one table ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Fill:
  """One table's part of a staged swap: the global slots to fill and their rows, the rows they held."""
  slots: np.ndarray
  rows: np.ndarray
  evicted: np.ndarray


class HostTable:
  """One host table: its store (the rows and every per-row optimizer array, numpy, V first) and one
  RowCache per owner shard."""

  def __init__(self, name: str, store: list[np.ndarray], owners: int, slots_per_owner: int, policy: str):
    self.name, self.store = name, store
    self.num_rows = int(store[0].shape[0])
    if self.num_rows % owners:
      raise ValueError(f"host table {name!r}: {self.num_rows} rows do not divide over {owners} owner shards")
    self.owners, self.per_owner = owners, self.num_rows // owners
    self.slots_per_owner = slots_per_owner
    self.caches = [RowCache(self.per_owner, slots_per_owner, policy) for _ in range(owners)]
    self._hold_row_zero()

  def _hold_row_zero(self) -> None:
    """Row 0 in slot 0 for good: the model reads jagged padding as id 0 (gem_jax/model/embeddings.py), which
    here is slot 0, and padding must read what it reads from the whole table (row 0) for the step to compute
    the same bits; its fill goes out with the next plan."""
    cache = self.caches[0]
    cache.row_at[0], cache.slot_of[0], cache.pins[0] = 0, 0, 1
    self._row_zero = Fill(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, -1, np.int64))
    self._row_zero_sent = None

  @property
  def cache_rows(self) -> int:
    return self.owners * self.slots_per_owner

  def reset(self) -> None:
    """Every cache empty (its counters kept)."""
    old = self.caches
    self.caches = [RowCache(self.per_owner, self.slots_per_owner, c.policy) for c in old]
    for new, c in zip(self.caches, old):
      new.hits, new.misses, new.evictions = c.hits, c.misses, c.evictions
    self._hold_row_zero()

  def plan(self, rows_U: np.ndarray) -> tuple[np.ndarray, Fill, list]:
    """Global slots for the sorted distinct rows `rows_U`, what to fill, and the pins to release once the
    batch's step is dispatched (unpin)."""
    owner_U = rows_U // self.per_owner
    slots_U = np.empty(len(rows_U), np.int64)
    fills, pins = [], []
    for o in np.unique(owner_U):
      mine = owner_U == o
      try:
        s, fs, fr, ev = self.caches[o].plan(rows_U[mine] - o * self.per_owner)
      except CacheTooSmall as e:
        self.rollback(pins)
        raise CacheTooSmall(f"host table {self.name!r}, owner shard {o}: {e}; its cache has "
                            f"{self.slots_per_owner} slots per owner shard (train.host_cache_rows / "
                            "host_cache_fraction)") from None
      pins.append((o, s))
      base, first = o * self.slots_per_owner, o * self.per_owner
      slots_U[mine] = base + s
      fills.append((base + fs, first + fr, np.where(ev >= 0, first + ev, -1)))
    self._row_zero_sent = self._row_zero
    if self._row_zero is not None:
      z, self._row_zero = self._row_zero, None
      fills.insert(0, (z.slots, z.rows, z.evicted))
    cat = lambda i: np.concatenate([f[i] for f in fills]) if fills else np.zeros(0, np.int64)
    return slots_U, Fill(cat(0), cat(1), cat(2)), pins

  def unpin(self, pins: list) -> None:
    for o, s in pins:
      self.caches[o].unpin(s)

  def rollback(self, pins: list, whole: bool = False) -> None:
    """Undo the owner shards' plans named by `pins` (the last plan of each; `whole`: the table's last plan
    finished, so its row-0 fill is taken back too)."""
    for o, _ in reversed(pins):
      self.caches[o].rollback()
    if whole and self._row_zero_sent is not None:
      self._row_zero, self._row_zero_sent = self._row_zero_sent, None

  def cached(self) -> tuple[np.ndarray, np.ndarray]:
    """(global slots, rows) of every row whose values are in the cache. Slot 0 is row 0's from the start,
    but holds its values only once the next plan's fill went out: until then (a fresh or just restored
    table) it is left out, so a write-back does not put the empty slot over row 0."""
    slots, rows = [], []
    for o, cache in enumerate(self.caches):
      s, r = cache.cached()
      slots.append(o * self.slots_per_owner + s)
      rows.append(o * self.per_owner + r)
    slots, rows = np.concatenate(slots), np.concatenate(rows)
    if self._row_zero is not None:
      keep = slots != 0
      slots, rows = slots[keep], rows[keep]
    return slots, rows

  def stats(self) -> dict:
    hits = sum(c.hits for c in self.caches)
    misses = sum(c.misses for c in self.caches)
    return {"hits": hits, "misses": misses, "evictions": sum(c.evictions for c in self.caches),
            "hit_rate": hits / (hits + misses) if hits + misses else None, "cache_rows": self.cache_rows,
            "rows": self.num_rows}


def _host_value(x) -> np.ndarray:
  """The whole value of a device array on this host, also when other processes hold parts of it."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


# ---- the ids of a batch -------------------------------------------------------------------------------------

def id_fields(batch: Batch, spec) -> list[tuple[str, str, Any]]:
  """(table, where, valid) of every id array of a sharded ads batch (leading dim S): `where` names the field
  ("sparse/<f>", "multi_hot/<f>", "history/<i>"), `valid` marks the real ids (jagged padding is not read:
  the model masks it to id 0, which is slot 0 here)."""
  out = []
  for name in batch.sparse:
    out.append((spec.sparse_feature(name).table, f"sparse/{name}", None))
  for name, jag in batch.multi_hot.items():
    out.append((spec.sparse_feature(name).table, f"multi_hot/{name}", _jagged_valid(jag)))
  valid = _jagged_valid(batch.history)
  for i, field in enumerate(spec.sequence.fields):
    out.append((field.table, f"history/{i}", valid))
  return out


def _jagged_valid(jag: Jagged) -> np.ndarray:
  """S x T: positions below each shard's offsets[-1]."""
  values, offsets = np.asarray(jag.values), np.asarray(jag.offsets)
  return np.arange(values.shape[1])[None, :] < offsets[:, -1:]


def field_values(batch: Batch, where: str) -> np.ndarray:
  kind, key = where.split("/", 1)
  if kind == "sparse":
    return np.asarray(batch.sparse[key])
  if kind == "multi_hot":
    return np.asarray(batch.multi_hot[key].values)
  return np.asarray(batch.history.values)[..., int(key)]


def _with(batch: Batch, new: dict[str, np.ndarray]) -> Batch:
  sparse = {k: new.get(f"sparse/{k}", v) for k, v in batch.sparse.items()}
  multi = {k: Jagged(new[f"multi_hot/{k}"], v.offsets) if f"multi_hot/{k}" in new else v
           for k, v in batch.multi_hot.items()}
  history = batch.history
  cols = [new.get(f"history/{i}") for i in range(np.shape(history.values)[-1])]
  if any(c is not None for c in cols):
    values = np.array(history.values, copy=True)
    for i, c in enumerate(cols):
      if c is not None:
        values[..., i] = c
    history = Jagged(values, history.offsets)
  return dataclasses.replace(batch, sparse=sparse, multi_hot=multi, history=history)


# ---- the tables of a run ------------------------------------------------------------------------------------

def host_leaves(state, names) -> dict[str, list]:
  """{table: [its Table-typed leaves in `state`, in flatten order]}: the table itself, then its slots."""
  out = {n: [] for n in names}
  for path, x in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)[0]:
    if isinstance(x, Table) and str(path_names(path)[-1]) in out:
      out[str(path_names(path)[-1])].append(x.get_value())
  return out


def replace_host_leaves(state, new: dict[str, list]):
  """`state` with each named table's Table-typed leaves replaced, in host_leaves' order."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)
  taken = {n: 0 for n in new}
  leaves = []
  for path, x in flat:
    name = str(path_names(path)[-1]) if isinstance(x, Table) else None
    if name in new:
      x = x.replace(value=new[name][taken[name]])
      taken[name] += 1
    leaves.append(x)
  return jax.tree_util.tree_unflatten(treedef, leaves)


def cache_rows(cfg_train, num_rows: int, owners: int) -> int:
  """Slots per owner shard: train.host_cache_rows (over all owners) or the fraction of the rows, rounded up."""
  total = cfg_train.host_cache_rows or math.ceil(cfg_train.host_cache_fraction * num_rows)
  return max(1, -(-min(total, num_rows) // owners))


def _bucket(k: int) -> int:
  """Swap sizes come in powers of two (at least 16), so a run compiles a few swap programs."""
  return max(16, 1 << max(0, k - 1).bit_length())


@dataclasses.dataclass
class _Staged:
  fills: dict[str, Fill]
  pins: dict[str, list]


class HostTables:
  """The host tables of a run (module docstring): their stores and caches, the batches staged for the
  step, and the swap program."""

  def __init__(self, tables: dict[str, HostTable], spec, mesh, state_shardings):
    self.tables, self.spec = tables, spec
    self.staged: deque[_Staged] = deque()
    self.pending: list[tuple[dict[str, np.ndarray], dict[str, list]]] = []  # write-backs in flight
    self.moved = {n: {"h2d_bytes": 0, "d2h_bytes": 0} for n in tables}   # rows and slots, each way
    self.wait_s, self.swaps = 0.0, 0
    replicated = NamedSharding(mesh, P())
    self._swap = jax.jit(self._swap_body, donate_argnums=0, out_shardings=(state_shardings, replicated))

  # -- feed ------------------------------------------------------------------------------------------------
  def _rewrite(self, sharded: Batch, slots_of: Callable) -> Batch:
    """The batch with each host table's ids i replaced by slots_of(name, table, rows_U)[j] where
    rows_U[j] = i (rows_U: the table's distinct ids in the batch, sorted)."""
    if not isinstance(sharded, Batch):
      raise TypeError(f"host tables need the ads batch (gem_jax/data/batch.py Batch), got {type(sharded).__name__}")
    fields = [(t, w, v) for t, w, v in id_fields(sharded, self.spec) if t in self.tables]
    new = {}
    for name, table in self.tables.items():
      mine = [(w, v) for t, w, v in fields if t == name]
      if not mine:
        continue
      arrays = [field_values(sharded, w) for w, _ in mine]
      picked = [a if v is None else a[v] for a, (_, v) in zip(arrays, mine)]
      ids = np.concatenate([np.reshape(p, -1) for p in picked]).astype(np.int64)
      bad = (ids < 0) | (ids >= table.num_rows)
      if bad.any():
        raise ValueError(f"host table {name!r}: id {int(ids[bad][0])} is outside its {table.num_rows} rows")
      rows_U, inverse = np.unique(ids, return_inverse=True)
      slots = np.asarray(slots_of(name, table, rows_U))[np.reshape(inverse, -1)].astype(np.int32)
      at = 0
      for a, (w, v), p in zip(arrays, mine, picked):
        out = np.zeros_like(a)  # jagged padding: slot 0 (the model masks it to id 0 anyway)
        if v is None:
          out[...] = slots[at:at + p.size].reshape(a.shape)
        else:
          out[v] = slots[at:at + p.size]
        new[w] = out
        at += p.size
    return _with(sharded, new)

  def remap(self, sharded: Batch) -> Batch:
    """The batch with every host table's ids rewritten to cache slots, its fills staged for the swap."""
    fills, pins = {}, {}

    def plan(name, table, rows_U):
      slots_U, fills[name], pins[name] = table.plan(rows_U)
      return slots_U

    try:
      out = self._rewrite(sharded, plan)
    except Exception:   # the tables planned before the one that failed take their plans back
      for name, ps in reversed(list(pins.items())):
        self.tables[name].rollback(ps, whole=True)
      raise
    self.staged.append(_Staged(fills, pins))
    return out

  def eval_views(self, params, batches: list):
    """(params, batch) per batch of an evaluation, for the eval step, from whole parameters
    (Run.whole_params): each host table replaced by just the rows that batch reads, packed per owner shard
    (owner o's rows in o u .. (o + 1) u - 1), and the batch's ids rewritten to those positions. u is one
    size per table for the whole evaluation (the largest owner's share of the largest batch, rounded up to a
    power of two), so an evaluation compiles one eval program however its batches' rows spread (one per
    batch's size bucket before: three programs for 256 examples of tiny on cpu_2). Made one batch at a time;
    nothing of the caches is read or changed."""
    sizes = {}

    def owner_counts(table, batch_rows):
      rows_U = np.union1d(batch_rows, [0])   # row 0 first: padding reads position 0 (HostTable._hold_row_zero)
      owner_U = rows_U // table.per_owner
      return rows_U, owner_U, np.bincount(owner_U, minlength=table.owners)

    def measure(name, table, batch_rows):
      sizes[name] = max(sizes.get(name, 0), int(owner_counts(table, batch_rows)[2].max()))
      return np.zeros(len(batch_rows), np.int32)

    for sharded in batches:
      self._rewrite(sharded, measure)
    whole = host_leaves(params, list(self.tables))

    def pack(packed, name, table, batch_rows):
      rows_U, owner_U, counts = owner_counts(table, batch_rows)
      u = _bucket(sizes[name])
      rank = np.arange(len(rows_U)) - np.repeat(np.cumsum(counts) - counts, counts)
      at = owner_U * u + rank
      rows = np.asarray(whole[name][0])
      out = np.zeros((table.owners * u,) + rows.shape[1:], rows.dtype)
      out[at] = rows[rows_U]
      packed[name] = [out]
      return at[np.searchsorted(rows_U, batch_rows)]

    for sharded in batches:
      packed = {}
      batch = self._rewrite(sharded, functools.partial(pack, packed))
      yield replace_host_leaves(params, packed), batch

  # -- swap ------------------------------------------------------------------------------------------------
  def _swap_body(self, state, loads):
    olds = {}
    new = {}
    current = host_leaves(state, list(loads))
    for name, (slots_K, values) in loads.items():
      olds[name] = [leaf.at[slots_K].get(mode="fill", fill_value=0) for leaf in current[name]]
      new[name] = [leaf.at[slots_K].set(v.astype(leaf.dtype), mode="drop")
                   for leaf, v in zip(current[name], values)]
    return replace_host_leaves(state, new), olds

  def land(self) -> None:
    """Writes the victims' rows of every dispatched swap back into the stores (waits for them)."""
    t0 = time.perf_counter()
    for evicted, olds in self.pending:
      for name, rows in evicted.items():
        held = rows >= 0
        if not held.any():
          continue
        table = self.tables[name]
        for store, old in zip(table.store, olds[name]):
          got = _host_value(old)[:len(rows)]
          store[rows[held]] = got[held]
          self.moved[name]["d2h_bytes"] += got[held].nbytes
    self.pending = []
    self.wait_s += time.perf_counter() - t0

  def swap(self, state):
    """The oldest staged batch's fills written into `state`'s caches (donated); returns the new state. Call
    it right before the step that reads that batch, then `step_dispatched()`."""
    if not self.staged:
      raise RuntimeError("host tables: a train step ran on a batch that was not fed (Run.feed / Run.device_batch "
                         "stage each batch's cache fills)")
    staged = self.staged[0]
    self.land()
    loads, evicted = {}, {}
    for name, fill in staged.fills.items():
      k = len(fill.slots)
      if not k:
        continue
      table, kp = self.tables[name], _bucket(k)
      slots = np.full(kp, table.cache_rows, np.int32)
      slots[:k] = fill.slots
      values = []
      for store in table.store:
        v = np.zeros((kp,) + store.shape[1:], store.dtype)
        v[:k] = store[fill.rows]
        values.append(v)
        self.moved[name]["h2d_bytes"] += v[:k].nbytes
      loads[name] = (slots, values)
      evicted[name] = fill.evicted
    if loads:
      state, olds = self._swap(state, loads)
      self.pending.append((evicted, olds))
      self.swaps += 1
    return state

  def step_dispatched(self) -> None:
    """The step of the oldest staged batch is dispatched: its rows may be victims of later swaps."""
    staged = self.staged.popleft()
    for name, ps in staged.pins.items():
      self.tables[name].unpin(ps)

  # -- whole tables ------------------------------------------------------------------------------------------
  def flush(self, state) -> None:
    """Every cached row written back to the stores (the cache keeps it), with its slots when `state` is the
    train state (params alone hold only the rows)."""
    if self.staged:
      raise RuntimeError("host tables: flush with batches staged for a step; their rows are not in the cache yet")
    self.land()
    leaves = host_leaves(state, list(self.tables))
    for name, table in self.tables.items():
      slots, rows = table.cached()
      if not len(slots):
        continue
      for store, leaf in zip(table.store, leaves[name]):
        store[rows] = _host_value(leaf)[slots]

  def whole_params(self, params):
    """`params` (the train state's, with caches) with each host table's store, brought up to date, in place of
    its cache: a view of the stores, for an evaluation right away."""
    self.flush(params)
    return replace_host_leaves(params, {n: [t.store[0]] for n, t in self.tables.items()})

  def full_state(self, state, copy: bool = True):
    """`state` with each host table's store (a copy unless `copy` is False) where its cache is; flushed
    first."""
    self.flush(state)
    return replace_host_leaves(state, {n: [np.array(s, copy=copy) for s in t.store]
                                       for n, t in self.tables.items()})

  def whole_target(self, structs):
    """A restore target (ShapeDtypeStructs of the run's state) with each host table whole as numpy: a numpy
    target is read into host memory (gem_jax/train/checkpoint.py), here a zero-strided view that allocates
    nothing."""
    return replace_host_leaves(structs, {n: [np.broadcast_to(np.zeros((), s.dtype), s.shape) for s in t.store]
                                         for n, t in self.tables.items()})

  def load_whole(self, state):
    """The stores from a state with host tables whole (a restored checkpoint), every cache emptied; returns
    the state with empty caches (numpy, to be placed)."""
    if self.staged:
      raise RuntimeError("host tables: a state was loaded with batches staged for a step")
    self.pending = []
    leaves = host_leaves(state, list(self.tables))
    for name, table in self.tables.items():
      if [np.shape(x) for x in leaves[name]] != [s.shape for s in table.store]:
        raise ValueError(f"host table {name!r}: the state holds {[np.shape(x) for x in leaves[name]]}, its store is "
                         f"{[s.shape for s in table.store]}")
      table.store = [np.array(_host_value(x)) for x in leaves[name]]
      table.reset()
    return cache_state(state, list(self.tables), lambda n, v: self.tables[n].cache_rows)

  def stats(self) -> dict:
    """Counters since the run was built: per table hits, misses, evictions and bytes moved; the host's wait."""
    return {"tables": {n: {**t.stats(), **self.moved[n]} for n, t in self.tables.items()}, "host_wait_s": self.wait_s,
            "swaps": self.swaps}

  def report(self, steps: int) -> dict:
    """report.json's `host_tables`: per table its hit rate and, per step, misses, evictions and bytes moved
    host to device (rows and slots filled) and back (victims written back); `host_wait_s_per_step`: the time
    the host waited for victims' rows to come back before it could fill the next step's cache."""
    per = lambda x: x / steps if steps else None
    tables = {}
    for name, st in self.stats()["tables"].items():
      tables[name] = {"rows": st["rows"], "cache_rows": st["cache_rows"], "policy": self.tables[name].caches[0].policy,
                      "hit_rate": st["hit_rate"], "misses_per_step": per(st["misses"]),
                      "evictions_per_step": per(st["evictions"]), "h2d_bytes_per_step": per(st["h2d_bytes"]),
                      "d2h_bytes_per_step": per(st["d2h_bytes"])}
    return {"tables": tables, "host_wait_s_per_step": per(self.wait_s), "swaps": self.swaps}


def cache_state(state, names, slots_of: Callable[[str, int], int]):
  """`state` with each named table's leaves replaced by zeros of slots_of(name, V) rows (an abstract state
  gets ShapeDtypeStructs)."""
  leaves = host_leaves(state, names)
  new = {}
  for name, xs in leaves.items():
    c = slots_of(name, int(xs[0].shape[0]))
    if isinstance(xs[0], jax.ShapeDtypeStruct):
      new[name] = [jax.ShapeDtypeStruct((c,) + x.shape[1:], x.dtype) for x in xs]
    else:
      new[name] = [np.zeros((c,) + x.shape[1:], x.dtype) for x in xs]
  return replace_host_leaves(state, new)


def host_bytes(cfg, spec) -> dict[str, int]:
  """The host memory each of cfg.train.host_tables needs: its rows and its row optimizer's per-row arrays."""
  from gem_jax.run import table_optim
  kinds = table_optim.make_rule(cfg.train).slot_kinds
  out = {}
  for name in cfg.train.host_tables:
    t = spec.table(name)
    row = t.dim * np.dtype(cfg.model.params_dtype).itemsize
    slots = sum(4 * (t.dim if k == table_optim.FULL else 1) for k in kinds)
    out[name] = t.vocab_size * (row + slots)
  return out


def check_host_memory(cfg, spec, available: int | None = None) -> None:
  """Raises when the host tables need more than `available` bytes (default: this host's physical memory),
  naming each table and its bytes, before anything is allocated."""
  if available is None:
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  need = host_bytes(cfg, spec)
  if sum(need.values()) > available:
    parts = ", ".join(f"{n} {b / 2**30:.2f} GiB" for n, b in need.items())
    raise ValueError(f"train.host_tables need {sum(need.values()) / 2**30:.2f} GiB of host memory ({parts}: rows and "
                     f"row-optimizer state), more than this host's {available / 2**30:.2f} GiB")


def make(cfg, state, placed, spec, mesh_shape: dict) -> tuple[dict[str, HostTable], Any]:
  """The host tables of cfg.train.host_tables from a state holding them whole (numpy copies become their
  stores), and the state with their caches (empty) in their place; an abstract state gets cache shapes and
  no stores (None)."""
  names = tuple(cfg.train.host_tables)
  known = [t.name for t in spec.tables]
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(f"train.host_tables names {unknown}, which the feature spec has no table of; its tables: "
                     f"{known}")
  leaves = host_leaves(state, names)
  tables, slots = {}, {}
  for name in names:
    xs = leaves[name]
    rows = int(xs[0].shape[0])
    owners = math.prod(mesh_shape[a] for a in placed.table_axes.get(name, ()))
    per_owner = cache_rows(cfg.train, rows, owners)
    slots[name] = owners * per_owner
    if not isinstance(xs[0], jax.ShapeDtypeStruct):
      tables[name] = HostTable(name, [np.array(_host_value(x)) for x in xs], owners, per_owner,
                               cfg.train.host_cache_policy)
  return tables, cache_state(state, names, lambda n, v: slots[n])


class SwappingStep:
  """The jitted train step of a run with host tables: each call first swaps the oldest staged batch's rows
  into the state's caches. `lower`, `trace` and the rest are the jitted step's."""

  def __init__(self, step, tables: HostTables):
    self._step, self._tables = step, tables

  def __call__(self, state, batch):
    state = self._tables.swap(state)
    out = self._step(state, batch)
    self._tables.step_dispatched()
    return out

  def __getattr__(self, name):
    return getattr(self._step, name)
