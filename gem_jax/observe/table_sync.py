"""The simulator's model of the sparse engine's update collectives (gem_jax/run/table_update.py): which
collective each table's sync runs, over which axes and how many bytes, from sample shards' ids. The engine
decides with the same rules (table_update.dense_sync, COPY_AXES), so a rule changed there changes here.
"""

from __future__ import annotations

import math

import numpy as np

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
  return int(max(1, min(cap, math.ceil(round(slack * worst, 9)))))


def sync_collectives(calls, table_axes, spec, shape, shards: int, slack: float, capacity) -> list:
  """[(kind, axes, full bytes)] of the update's collectives on a mesh of axis sizes `shape` with `shards`
  data shards, from sample shards' ids of the lookup calls (the simulator's model of
  table_update.update_tables). capacity(ids_SxN, rows, owners, shards, slack): the simulator's
  owner-slot estimate."""
  out = []
  by_table: dict[str, list[np.ndarray]] = {}
  for key, ids_SxN in calls:
    by_table.setdefault(key.rsplit("/", 1)[0], []).append(np.asarray(ids_SxN).reshape(len(ids_SxN), -1))
  copy_ct = [a for a in COPY_AXES if shape[a] > 1]
  for table, parts in by_table.items():
    v, e = spec.table(table).vocab_size, spec.table(table).dim
    ids_SxN = np.concatenate(parts, axis=1)
    n = ids_SxN.shape[1]
    uniq = [np.unique(row[(row >= 0) & (row < v)]) for row in ids_SxN]
    c_u = _worst([u.size for u in uniq], shards, slack, n)
    out.append(("all-reduce", copy_ct, c_u * e * 4))
    own = [a for a in table_axes.get(table, ()) if shape[a] > 1]
    copies = [a for a in DATA_AXES if shape[a] > 1 and a not in own]
    n_copies = math.prod(shape[a] for a in copies)
    if own:
      owners = math.prod(shape[a] for a in own)
      c_o = capacity(ids_SxN, v, owners, shards, slack)
      out.append(("all-to-all", own, owners * c_o * (e + 1) * 4))
      # Distinct ids one owner receives from the `owners` shards it serves: unions of that many sample
      # shards where there are enough, else each shard's share (an upper bound: unions overlap).
      rows = v // owners
      if owners <= len(uniq):
        counts = [int(np.bincount(np.unique(np.concatenate(uniq[i:i + owners])) // rows, minlength=owners).max())
                  for i in range(0, len(uniq) - owners + 1, owners)]
      else:
        counts = [int(np.unique(np.concatenate(uniq)).size / len(uniq))]
      c_r = _worst(counts, shards // owners, slack, owners * c_o)
      out.append(("all-gather", copies, n_copies * c_r * (e + 1) * 4))
    elif copies and dense_sync(v, e, n, n_copies):
      out.append(("all-reduce", copies, v * e * 4))
    else:
      out.append(("all-gather", copies, n_copies * c_u * (e + 1) * 4))
  return out
