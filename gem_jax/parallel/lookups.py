"""The embedding lookups a model makes, read off the model itself, and the all-to-all capacities they need.

`lookup_ids` traces the task's loss on one data shard's batch with a recording runtime (gem_jax/runtime.py):
every EmbeddingCollection.lookup tells the recorder its table and ids, and the jitted function returns those
ids, everything else being dead code (count_only: lookups and attention return zeros, so no parameter or
table is read and XLA drops the rest; the parameters are zeros made inside the function, never allocated).
A lookup call is keyed "table/N" by its table and how many ids it reads, as the SPMD step keys it
(gem_jax/parallel/spmd.py), so a lookup added to the model gets a capacity without anyone listing it.

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
