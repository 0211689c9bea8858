"""Embedding lookups on row-sharded tables: move ids to the shard that owns them and rows back.

A V x E table is model parallel over `axes` (the `sparse` mesh axis, or ("fsdp", "sparse")) and
replicated over the other mesh axes. Inside `jax.shard_map` each device holds the rows of its block,
global rows [s*V/P, (s+1)*V/P) where s = `jax.lax.axis_index(axes)` and P the product of the axis sizes,
and the ids of its own data shard. `sharded_lookup` returns, on every device, the rows of its ids.

Protocol (all of it inside `jax.named_scope("embedding_lookup")`, so profiles and HLO name it):
  1. Deduplicate: each distinct valid id is requested once per device. Ids outside [0, V) are never
     sent; they read a NaN row, like the single-device lookup.
  2. Bucket: unique ids come out sorted, so their owners (id // (V/P)) are sorted too; an id's slot is
     its rank within its owner's bucket. Slots < C (the capacity) fill a P x C send buffer, pad -1.
  3. Round 1: all_to_all the ids over `axes`; each owner gathers its rows for the ids it received
     (pad -> zeros) and all_to_all's the P x C x E rows back.
  4. Fallback: if any device anywhere has a bucket longer than C (a pmax over `uniform_axes` makes the
     decision the same on every device, so no collective is left waiting), a spill round under
     `lax.cond` moves the next ceil(spill_fraction * C) ids of every bucket; if that is still short, a
     second round of C more, and only then a last-resort round with room for all the rest. Round 1 stays cheap when C is sized for typical batches
     (`capacity_for`), a batch slightly over it pays a small extra round, and skewed batches stay exact.
Gradients come from JAX: call `jax.grad` outside the shard_map and it transposes the all_to_alls, the
gathers and the cond (the cotangent rows travel back to their owner and are scatter-added there).

This module must never drop an id (an overflowing id goes through the fallback, never silently to zero)
and never gather a table: only requested ids and their rows cross the wire.

Letters: N ids per device, U = N unique-id slots, V table rows, Vl = V/P local rows, E embedding width,
P shards of the table, C capacity (ids per destination per round).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax import scopes

_PAD = -1  # marks an empty slot of a send buffer


def _as_axes(axes: str | Sequence[str]) -> tuple[str, ...]:
  return (axes,) if isinstance(axes, str) else tuple(axes)


def fallback_rounds(n: int, capacity: int, spill_fraction: float = 0.125,
                    second: bool = True) -> list[tuple[str, int, int]]:
  """The rounds after the first of `capacity` slots, for n slots in all: [(name, first slot, slots)], empty
  rounds left out. "spill" takes ceil(spill_fraction x capacity) more, "second" (when asked for) another
  `capacity`, and the last round ("last_resort", or "rest" without a second round) everything left, so no
  slot is ever dropped. The lookup, the owner exchange and the sparse engine's syncs share these sizes."""
  capacity = int(min(max(1, capacity), n))
  spill = int(min(max(1, math.ceil(spill_fraction * capacity)), n - capacity))
  again = int(min(capacity, n - capacity - spill)) if second else 0
  rounds = [(scopes.SPILL, capacity, spill)]
  if second:
    rounds.append((scopes.SECOND, capacity + spill, again))
  rounds.append((scopes.LAST_RESORT if second else scopes.REST, capacity + spill + again,
                 n - capacity - spill - again))
  return rounds


def _buckets(ids_U, num_rows: int, rows_per_shard: int):
  """Owner buckets of sorted distinct ids (invalid ones, < 0 or >= num_rows, last): (valid, owner shard,
  row inside the owner's block (_PAD if invalid), slot in the owner's bucket)."""
  valid_U = (ids_U >= 0) & (ids_U < num_rows)
  owner_U = jnp.where(valid_U, ids_U // rows_per_shard, 0)
  local_U = jnp.where(valid_U, ids_U - owner_U * rows_per_shard, _PAD)
  # Owners are sorted, so an id's rank in its bucket is its distance from the bucket's first id.
  start_U = jnp.searchsorted(ids_U, owner_U * rows_per_shard, side="left")
  slot_U = jnp.arange(ids_U.shape[0], dtype=jnp.int32) - start_U.astype(jnp.int32)
  return valid_U, owner_U, local_U, slot_U


def _exchange(table_VlxE, local_U, owner_U, slot_U, send_U, *, axes, num_shards, capacity):
  """One round: ids with `send_U` go to `owner_U` at `slot_U` (< capacity); returns their rows (U x E).

  `local_U` is the id's row inside its owner's block. Rows of ids not sent are zeros."""
  # Ids not sent get an out-of-bounds scatter index, which mode="drop" discards.
  dest_U = jnp.where(send_U, owner_U, num_shards)
  send_PxC = jnp.full((num_shards, capacity), _PAD, jnp.int32)
  send_PxC = send_PxC.at[dest_U, slot_U].set(local_U, mode="drop")
  # recv_PxC[q] = the ids device q asked this device for.
  recv_PxC = jax.lax.all_to_all(send_PxC, axes, 0, 0)
  has_id_PxC = recv_PxC != _PAD
  safe_PxC = jnp.where(has_id_PxC, recv_PxC, 0)
  rows_PxCxE = jnp.take(table_VlxE, safe_PxC, axis=0)
  rows_PxCxE = jnp.where(has_id_PxC[..., None], rows_PxCxE, jnp.zeros((), table_VlxE.dtype))
  # reply_PxCxE[p] = the rows owner p sent back for this device's bucket p, in slot order.
  reply_PxCxE = jax.lax.all_to_all(rows_PxCxE, axes, 0, 0)
  rows_UxE = reply_PxCxE[jnp.where(send_U, owner_U, 0), jnp.where(send_U, slot_U, 0)]
  return jnp.where(send_U[:, None], rows_UxE, jnp.zeros((), table_VlxE.dtype))


def _check_lookup(table_VlxE, axes, uniform_axes, num_rows: int, capacity) -> tuple[int, int]:
  """sharded_lookup's arguments checked: -> (shards of the table, rows per shard)."""
  if table_VlxE.ndim != 2:
    raise ValueError(f"sharded_lookup: table block must be Vl x E, got shape {table_VlxE.shape}")
  missing = [a for a in axes if a not in uniform_axes]
  if missing:
    raise ValueError(f"sharded_lookup: uniform_axes {uniform_axes} must include the table axes {axes}; "
                     f"missing {missing} (devices of one all_to_all group could take different branches)")
  if not isinstance(capacity, (int, np.integer)) or capacity < 1:
    raise ValueError(f"sharded_lookup: capacity must be an int >= 1, got {capacity!r}")
  num_shards = jax.lax.axis_size(axes)
  if num_rows % num_shards:
    raise ValueError(f"sharded_lookup: num_rows={num_rows} is not divisible by the {num_shards} shards "
                     f"of axes {axes}")
  rows_per_shard = num_rows // num_shards
  if table_VlxE.shape[0] != rows_per_shard:
    raise ValueError(f"sharded_lookup: table block has {table_VlxE.shape[0]} rows, expected "
                     f"num_rows / shards = {num_rows} / {num_shards} = {rows_per_shard}")
  return num_shards, rows_per_shard


def sharded_lookup(table_VlxE: jax.Array, ids: jax.Array, *, axes: str | Sequence[str], num_rows: int,
                   capacity: int, uniform_axes: Sequence[str],
                   spill_fraction: float = 0.125) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Rows of a row-sharded table for this device's ids; call inside `jax.shard_map`.

  table_VlxE: this device's block of the table (Vl = num_rows / P rows), sharded P(axes, None).
  ids: int ids of any shape (N = ids.size). Ids in [0, num_rows) read their row exactly; others a NaN row.
  axes: the mesh axes the table rows are sharded over, outermost first (as in its PartitionSpec).
  capacity: ids per destination in round 1 (`capacity_for` sizes it); larger buckets take the fallback:
    a spill round of ceil(spill_fraction * capacity) more slots, then (if still short) a second round
    of `capacity`, then a last-resort round with room for all remaining ids.
  uniform_axes: the mesh axes over which the fallback decision is made uniform; must hold all of `axes`
    (pass every mesh axis of the shard_map, so every device takes the same branch).
  Returns (rows, stats): rows has shape ids.shape + (E,) in the table's dtype; stats are int32 scalars
  local to this device: "unique" (distinct valid ids), "max_bucket" (most unique ids for one owner),
  "overflow" (1 if any fallback round ran), "spill" / "second" / "last_resort" (1 if that round ran),
  "remote_unique" (distinct valid ids owned by another shard).
  """
  axes, uniform_axes = _as_axes(axes), _as_axes(uniform_axes)
  num_shards, rows_per_shard = _check_lookup(table_VlxE, axes, uniform_axes, num_rows, capacity)

  with jax.named_scope(scopes.EMBEDDING_LOOKUP):
    ids_N = jnp.reshape(ids, (-1,)).astype(jnp.int32)
    n = ids_N.shape[0]
    # No bucket can hold more than N unique ids, so a larger capacity only pads the wire.
    capacity = int(min(capacity, n))
    valid_N = (ids_N >= 0) & (ids_N < num_rows)
    # Every invalid id becomes `num_rows`, so they collapse into one unique entry that sorts last.
    uniq_U, inv_N = jnp.unique(jnp.where(valid_N, ids_N, num_rows), size=n, fill_value=num_rows,
                               return_inverse=True)
    inv_N = jnp.reshape(inv_N, (n,))
    valid_U, owner_U, local_U, slot_U = _buckets(uniq_U, num_rows, rows_per_shard)
    count_P = jnp.zeros((num_shards,), jnp.int32).at[owner_U].add(valid_U.astype(jnp.int32))
    me = jax.lax.axis_index(axes)

    first_U = valid_U & (slot_U < capacity)
    rows_UxE = _exchange(table_VlxE, local_U, owner_U, slot_U, first_U, axes=axes,
                         num_shards=num_shards, capacity=capacity)

    # Overflow tiers: a small spill round (typical excess over a capacity sized on one batch), then a
    # last-resort round with room for every remaining id. Each runs only when some device needs it.
    ran = {}
    for name, lo, size in fallback_rounds(n, capacity, spill_fraction):
      if size <= 0:
        ran[name] = jnp.zeros((), jnp.int32)
        continue
      extra_U = valid_U & (slot_U >= lo) & (slot_U < lo + size)
      # One decision for every device: the round's all_to_alls must run everywhere or nowhere.
      ran[name] = jax.lax.pmax(jnp.any(extra_U).astype(jnp.int32), uniform_axes)

      def more(table_VlxE, rows_UxE, extra_U=extra_U, lo=lo, size=size, name=name):
        with jax.named_scope(name):
          extra_rows_UxE = _exchange(table_VlxE, local_U, owner_U, slot_U - lo, extra_U, axes=axes,
                                     num_shards=num_shards, capacity=size)
        return jnp.where(extra_U[:, None], extra_rows_UxE, rows_UxE)

      def keep(table_VlxE, rows_UxE):
        return rows_UxE

      rows_UxE = jax.lax.cond(ran[name] > 0, more, keep, table_VlxE, rows_UxE)
    overflow = jnp.maximum(jnp.maximum(ran["spill"], ran["second"]), ran["last_resort"])

    rows_NxE = jnp.where(valid_N[:, None], rows_UxE[inv_N], jnp.full((), jnp.nan, table_VlxE.dtype))
    stats = {
        "unique": jnp.sum(valid_U, dtype=jnp.int32),
        "max_bucket": jnp.max(count_P),
        "overflow": overflow,
        "spill": ran["spill"],
        "second": ran["second"],
        "last_resort": ran["last_resort"],
        "remote_unique": jnp.sum(valid_U & (owner_U != me), dtype=jnp.int32),
    }
  return jnp.reshape(rows_NxE, ids.shape + (table_VlxE.shape[1],)), stats


def send_to_owners(ids_U: jax.Array, values_UxE: jax.Array, *, axes: str | Sequence[str], num_rows: int,
                   capacity: int, uniform_axes: Sequence[str], spill_fraction: float = 0.125):
  """The reverse of a lookup: each device's (id, row) pairs to the shard that owns the id; call inside
  `jax.shard_map`. The sparse engine sends row gradients this way (gem_jax/run/table_update.py).

  ids_U: distinct ids, sorted ascending, invalid slots (>= num_rows or < 0) last, as jnp.unique with
  fill_value=num_rows gives them; values_UxE: one row per id. Rounds as in `sharded_lookup`: `capacity`
  slots per owner, then the spill, second and last-resort rounds only when some device needs them, so
  no id is ever dropped. Returns (local_M, values_MxE, stats) on the owner: the rows it received, M = P x
  (the rounds' slots), with the id as a row of its own block (local_M = -1 in an empty slot, whose value
  is zeros); an id may arrive from several devices. stats: "overflow" (1 if any fallback round ran) and,
  per fallback round the sizes allow ("spill", "second", "last_resort": also the named scope of its
  collectives), 1 if it ran.
  """
  axes, uniform_axes = _as_axes(axes), _as_axes(uniform_axes)
  num_shards = jax.lax.axis_size(axes)
  if num_rows % num_shards:
    raise ValueError(f"send_to_owners: num_rows={num_rows} is not divisible by the {num_shards} shards of {axes}")
  rows_per_shard = num_rows // num_shards
  n = ids_U.shape[0]
  capacity = int(min(max(1, capacity), n))
  with jax.named_scope(scopes.GRAD_TO_OWNER):
    valid_U, owner_U, local_U, slot_U = _buckets(ids_U, num_rows, rows_per_shard)

    def send(send_U, slot_U, size):
      dest_U = jnp.where(send_U, owner_U, num_shards)
      ids_PxC = jnp.full((num_shards, size), _PAD, jnp.int32).at[dest_U, slot_U].set(local_U, mode="drop")
      rows_PxCxE = jnp.zeros((num_shards, size) + values_UxE.shape[1:], values_UxE.dtype)
      rows_PxCxE = rows_PxCxE.at[dest_U, slot_U].set(values_UxE, mode="drop")
      return (jax.lax.all_to_all(ids_PxC, axes, 0, 0).reshape(-1),
              jax.lax.all_to_all(rows_PxCxE, axes, 0, 0).reshape((-1,) + values_UxE.shape[1:]))

    ids, rows = send(valid_U & (slot_U < capacity), slot_U, capacity)
    received_ids, received_rows, ran, stats = [ids], [rows], [], {}
    for name, lo, size in fallback_rounds(n, capacity, spill_fraction):
      if size <= 0:
        continue
      extra_U = valid_U & (slot_U >= lo) & (slot_U < lo + size)
      go = jax.lax.pmax(jnp.any(extra_U).astype(jnp.int32), uniform_axes)
      ran.append(go)
      # Typed like the received arrays (varying where the inputs vary), whatever the inputs hold.
      empty = (jnp.where(True, _PAD, jnp.broadcast_to(local_U[:1], (num_shards * size,))),
               jnp.where(True, jnp.zeros((), values_UxE.dtype),
                         jnp.broadcast_to(values_UxE[:1], (num_shards * size,) + values_UxE.shape[1:])))
      with jax.named_scope(name):
        ids, rows = jax.lax.cond(go > 0, lambda e=extra_U, lo=lo, size=size: send(e, slot_U - lo, size),
                                 lambda empty=empty: empty)
      stats[name] = go
      received_ids.append(ids)
      received_rows.append(rows)
    overflow = functools.reduce(jnp.maximum, ran, jnp.zeros((), jnp.int32))
  return (by_source(received_ids, num_shards), by_source(received_rows, num_shards),
          {"overflow": overflow, **stats})


def by_source(rounds: list, sources: int) -> jax.Array:
  """The rounds' received arrays (each [source 0's slots | source 1's | ...]) as one array holding each
  source's rows together, in its own order: the order in which an owner then adds a row's contributions is
  that of the sources, whichever round carried them (so neither the capacities nor the ids' labels, which set
  a row's round, change the sums' bits: a host table's cache slots, gem_jax/run/host_tables.py)."""
  parts = [x.reshape((sources, -1) + x.shape[1:]) for x in rounds]
  return jnp.concatenate(parts, axis=1).reshape((-1,) + rounds[0].shape[1:])


def capacity_for(ids_per_shard: Sequence[np.ndarray], num_rows: int, num_shards: int, slack: float = 1.1,
                 multiple: int = 8) -> int:
  """Round-1 capacity for a table: >= slack x the most unique ids any data shard asks one owner for.

  ids_per_shard: one array per data shard, all the ids that shard looks up in this table (any shape).
  Ids outside [0, num_rows) are ignored (they are never sent). The result is >= 1 and a multiple of
  `multiple`. Later batches may need more; `sharded_lookup` then takes its fallback round.
  """
  if num_shards < 1 or num_rows % num_shards:
    raise ValueError(f"capacity_for: num_rows={num_rows} is not divisible by num_shards={num_shards}")
  if slack < 1 or multiple < 1:
    raise ValueError(f"capacity_for: need slack >= 1 and multiple >= 1, got slack={slack}, "
                     f"multiple={multiple}")
  rows_per_shard = num_rows // num_shards
  worst = 0
  for ids in ids_per_shard:
    ids = np.asarray(ids).reshape(-1)
    uniq = np.unique(ids[(ids >= 0) & (ids < num_rows)])
    if uniq.size:
      worst = max(worst, int(np.bincount(uniq // rows_per_shard, minlength=num_shards).max()))
  return round_capacity(worst, slack, multiple)


def round_capacity(worst: float, slack: float, multiple: int = 1, at_most: int | None = None) -> int:
  """slack x `worst` slots rounded up to a multiple of `multiple` (at least 1, at most `at_most`): how every
  capacity of the lookups and the sparse engine is sized from the worst count it must hold."""
  # Round before ceil so 1.1 * 10 = 11.000000000000002 asks for 11, not 12.
  need = max(1, math.ceil(round(slack * worst, 9)))
  if at_most is not None:
    need = max(1, min(at_most, need))
  return int(-(-need // multiple) * multiple)


def ideal_bytes(remote_unique, dim: int, id_bytes: int = 4, row_bytes_per_elem: int = 4):
  """Bytes a perfect lookup moves: each remote unique id goes out once and its row comes back once."""
  return remote_unique * (id_bytes + dim * row_bytes_per_elem)
