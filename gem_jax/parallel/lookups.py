"""The embedding lookups a model makes, read off the model itself, and the all-to-all capacities they need.

`lookup_ids` traces the task's loss on one data shard's batch with a recording runtime (gem_jax/runtime.py):
every EmbeddingCollection.lookup tells the recorder its table and ids, and the jitted function returns those
ids, everything else being dead code (count_only: lookups and attention return zeros, so no parameter or
table is read and XLA drops the rest; the parameters are zeros made inside the function, never allocated).
A lookup call is keyed "table/N" by its table and how many ids it reads, as the SPMD step keys it
(gem_jax/parallel/spmd.py), so a lookup added to the model gets a capacity without anyone listing it.

`sync_capacities`: per table, the slots of the sparse engine's three update stages (gem_jax/run/table_update.py)
on the same ids, all calls of a table together.

`capacities`: per call, the per-destination slots of the all-to-all (parallel/sparse.py capacity_for) that the
ids of every data shard of a batch need, times a slack. The simulator (gem_jax/observe/simulate.py) reads the
distinct ids per call of sample batches the same way.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gem_jax import runtime
from gem_jax.parallel import sparse
from gem_jax.parallel.rules import DATA_AXES


class _Recorder:
  def __init__(self):
    self.calls: list[tuple[str, jax.Array]] = []

  def record(self, what: str, **facts) -> None:
    if what == "lookup":
      self.calls.append((f"{facts['table']}/{int(np.prod(facts['ids'].shape))}", facts["ids"].reshape(-1)))


def lookup_ids(graphdef, rest, params, task, sharded_batch) -> list[tuple[str, np.ndarray]]:
  """[(call key, ids of every data shard: S x N)] of the model's lookups on a sharded host batch.

  graphdef / rest / params: the model (params and rest may be abstract: only shapes are read)."""
  shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), (params, rest))
  keys: list[str] = []

  def ids_of(batch):
    recorder = _Recorder()
    p, r = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    with runtime.using(recorder=recorder, count_only=True):
      task.sums(nnx.merge(graphdef, p, r), batch, None)
    keys[:] = [key for key, _ in recorder.calls]
    return [ids for _, ids in recorder.calls]

  local = jax.tree_util.tree_map(lambda x: np.asarray(x)[0], sharded_batch)
  fn = jax.jit(ids_of)
  fn.lower(local)  # the keys come from the trace
  shards = np.shape(jax.tree_util.tree_leaves(sharded_batch)[0])[0]
  per_shard = [fn(jax.tree_util.tree_map(lambda x: np.asarray(x)[s], sharded_batch)) for s in range(shards)]
  return [(key, np.stack([np.asarray(out[i]) for out in per_shard])) for i, key in enumerate(keys)]


def capacities(calls: list[tuple[str, np.ndarray]], plan, vocab_of, slack: float = 1.05,
               multiple: int = 1) -> dict[str, int]:
  """Per lookup call of a row-sharded table: the all-to-all capacity its ids need on the worst data shard
  (sparse.capacity_for), the largest over calls that share a key. vocab_of(table) -> rows of the table."""
  out: dict[str, int] = {}
  for key, ids_SxN in calls:
    table = key.rsplit("/", 1)[0]
    axes = plan.table_axes.get(table, ())
    if not axes:
      continue
    owners = math.prod(plan.mesh.shape[a] for a in axes)
    need = sparse.capacity_for(list(ids_SxN), vocab_of(table), owners, slack, multiple)
    out[key] = max(out.get(key, 0), need)
  return out


def sync_capacities(calls: list[tuple[str, np.ndarray]], plan, vocab_of, slack: float = 1.05,
                    multiple: int = 1) -> dict[str, dict[str, int]]:
  """Per table read by `calls` (all its calls' ids together), slack x the worst case over the batch of:
    unique    distinct ids of one data shard (the rows summed over context / tensor copies, and the rows a
              replicated table's copies all-gather)
    owner     distinct ids one data shard sends one owner (row-sharded tables: sparse.capacity_for)
    received  distinct ids one owner receives from the data shards it serves (the rows its copies on the
              other data axes all-gather)
  Data shards are numbered row-major over the mesh's data axes of size > 1 (spmd.data_spec)."""
  by_table: dict[str, list[np.ndarray]] = {}
  for key, ids_SxN in calls:
    by_table.setdefault(key.rsplit("/", 1)[0], []).append(np.asarray(ids_SxN).reshape(len(ids_SxN), -1))
  shape = plan.mesh.shape
  data = [a for a in DATA_AXES if shape[a] > 1]
  grid = [shape[a] for a in data]
  round_up = lambda worst: -(-max(1, math.ceil(round(slack * worst, 9))) // multiple) * multiple
  out = {}
  for table, parts in by_table.items():
    v = vocab_of(table)
    ids_SxN = np.concatenate(parts, axis=1)
    shards = [np.unique(row[(row >= 0) & (row < v)]) for row in ids_SxN]
    caps = {"unique": round_up(max((u.size for u in shards), default=0))}
    own = [a for a in plan.table_axes.get(table, ()) if shape[a] > 1]
    if own:
      owners = math.prod(shape[a] for a in own)
      caps["owner"] = sparse.capacity_for(shards, v, owners, slack, multiple)
      # The shards one owner serves share their coordinates on the other data axes (its copy group).
      groups: dict[tuple, list[np.ndarray]] = {}
      for s, u in enumerate(shards):
        coords = np.unravel_index(s, grid) if grid else ()
        groups.setdefault(tuple(int(c) for a, c in zip(data, coords) if a not in own), []).append(u)
      worst = max(int(np.bincount(np.unique(np.concatenate(g)) // (v // owners), minlength=owners).max())
                  for g in groups.values())
      caps["received"] = round_up(worst)
    out[table] = caps
  return out
