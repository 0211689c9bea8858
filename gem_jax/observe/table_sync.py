"""The simulator's model of the sparse engine's update collectives (gem_jax/run/table_update.py): which
collective each table's sync runs, over which axes and how many bytes, from sample shards' ids. The engine
decides with the same rules (table_update.dense_sync, COPY_AXES), so a rule changed there changes here.
"""

from __future__ import annotations

import math

import numpy as np

from gem_jax.parallel import sparse
from gem_jax.parallel.rules import DATA_AXES
from gem_jax.run.table_update import COPY_AXES, dense_sync


def _worst(counts: list[int], groups: int, slack: float, cap: int) -> int:
  """slack x the largest of `groups` counts like `counts` (the sample's; with more groups than samples,
  mu + sqrt(2 ln(groups) mu), as gem_jax/observe/simulate.py extrapolates its capacities), at most `cap`."""
  if groups <= len(counts):
    worst = float(max(counts[:groups]))
  else:
    mu = float(np.mean(counts))
    worst = mu + math.sqrt(2.0 * math.log(max(groups, 2)) * mu)
  return sparse.round_capacity(worst, slack, at_most=cap)


def _received(uniq: list[np.ndarray], rows: int, owners: int) -> list[int]:
  """Distinct ids one owner receives from the `owners` shards it serves: unions of that many sample shards
  where there are enough, else each shard's share (an upper bound: unions overlap)."""
  if owners <= len(uniq):
    return [int(np.bincount(np.unique(np.concatenate(uniq[i:i + owners])) // rows, minlength=owners).max())
            for i in range(0, len(uniq) - owners + 1, owners)]
  return [int(np.unique(np.concatenate(uniq)).size / len(uniq))]


def sync_collectives(tables, table_axes, spec, shape, shards: int, slack: float, capacity,
                     memo: dict | None = None) -> tuple[list, dict]:
  """([(kind, axes, full bytes)] of the update's collectives, {table: (the (id, row) slots its largest merge
  takes, the rows it may sum them into, the rows of an earlier merge still held)}) on a mesh of axis sizes
  `shape` with `shards` data shards (the simulator's model of table_update.update_tables).

  A merge (table_update.merge_rows) sums (id, row) pairs into min(slots, rows + 1) distinct rows. Its
  slots are static: a collective's fallback rounds (table_update._in_rounds, sparse.send_to_owners) return
  every slot they might carry, run or not, so an owner merges P x U received slots (U = min(ids a device
  reads, V)) and the all-gather across n copies hands n x min(P x U, rows per owner) slots to the last
  merge, however few rows the batch touched: the capacities size the collectives' bytes, not the merges.

  tables: {table: (the distinct valid ids of each sample shard, all its calls together; ids per shard)}.
  capacity(uniq, ids per shard, rows, owners, shards, slack): the simulator's owner-slot estimate. memo: a
  dict kept across calls on the same sample shards (the planner simulates hundreds of layouts of one
  config), for the unions it would redo."""
  memo = {} if memo is None else memo
  out, merge = [], {}
  copy_ct = [a for a in COPY_AXES if shape[a] > 1]
  for table, (uniq, n) in tables.items():
    v, e = spec.table(table).vocab_size, spec.table(table).dim
    c_u = _worst([u.size for u in uniq], shards, slack, n)
    out.append(("all-reduce", copy_ct, c_u * e * 4))
    own = [a for a in table_axes.get(table, ()) if shape[a] > 1]
    copies = [a for a in DATA_AXES if shape[a] > 1 and a not in own]
    n_copies = math.prod(shape[a] for a in copies)
    if own:
      owners = math.prod(shape[a] for a in own)
      c_o = capacity(uniq, n, v, owners, shards, slack)
      out.append(("all-to-all", own, owners * c_o * (e + 1) * 4))
      key = ("received", table, owners)
      if key not in memo:
        memo[key] = _received(uniq, v // owners, owners)
      c_r = _worst(memo[key], shards // owners, slack, owners * c_o)
      if copies:
        out.append(("all-gather", copies, n_copies * c_r * (e + 1) * 4))
      received = owners * min(n, v)
      held = min(received, v // owners)  # the owner's merged rows, gathered across the copies
      merge[table] = (n_copies * held, v // owners, held) if copies else (received, v // owners, 0)
    elif copies and dense_sync(v, e, n, n_copies):
      out.append(("all-reduce", copies, v * e * 4))
      merge[table] = (n, v, 0)
    else:
      out.append(("all-gather", copies, n_copies * c_u * (e + 1) * 4))
      merge[table] = (n_copies * min(n, v), v, min(n, v)) if copies else (n, v, 0)
  return out, merge
