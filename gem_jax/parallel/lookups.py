"""The embedding lookups a model makes, read off the model itself, and the all-to-all capacities they need.

`LookupTrace` traces the task's loss on one data shard's batch with a recording runtime (gem_jax/runtime.py),
once per batch shape:
every EmbeddingCollection.lookup tells the recorder its table and ids, and the jitted function returns those
ids, everything else being dead code (count_only: lookups and attention return zeros, so no parameter or
table is read and XLA drops the rest; the parameters are zeros made inside the function, never allocated).
A lookup call (`LookupCall`) is its table and how many ids it reads, keyed "table/N" as the SPMD step keys it
(gem_jax/parallel/spmd.py), so a lookup added to the model gets a capacity without anyone listing it. The
same trace gives the sparse engine its calls (`calls`) and the capacities their ids (`ids`).

`sync_capacities`: per table, the slots of the sparse engine's three update stages (gem_jax/run/table_update.py)
on the same ids, all calls of a table together.

`capacities`: per call, the per-destination slots of the all-to-all (parallel/sparse.py capacity_for) that the
ids of every data shard of a batch need, times a slack. The simulator (gem_jax/observe/simulate.py) reads the
distinct ids per call of sample batches the same way.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gem_jax import runtime
from gem_jax.parallel import sparse
from gem_jax.parallel.rules import DATA_AXES


@dataclasses.dataclass(frozen=True)
class LookupCall:
  """One lookup call of the model on one data shard: its table and how many ids it reads."""
  table: str
  ids: int

  @property
  def key(self) -> str:
    """How capacities and stats name the call: "table/N" (table_of reads the table back)."""
    return f"{self.table}/{self.ids}"


def table_of(call_key: str) -> str:
  """The table of a lookup call's key (LookupCall.key)."""
  return call_key.rsplit("/", 1)[0]


class _Recorder:
  def __init__(self):
    self.calls: list[tuple[LookupCall, jax.Array]] = []

  def record(self, what: str, **facts) -> None:
    if what == "lookup":
      ids = facts["ids"]
      self.calls.append((LookupCall(facts["table"], int(np.prod(ids.shape))), ids.reshape(-1)))


def _shape_key(tree):
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef, tuple((tuple(np.shape(x)), str(x.dtype)) for x in leaves)


class LookupTrace:
  """The lookups of one model and task, read off one count-only trace per batch shape (module docstring):
  `calls(local)` for the sparse engine and the step, `ids(sharded)` for capacities and the simulator, from
  the same trace. params / rest may be abstract: only shapes are read."""

  def __init__(self, graphdef, rest, params, task):
    self.graphdef, self.task = graphdef, task
    self.shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), (params, rest))
    self.traces = 0                      # count-only traces run so far (one per batch shape)
    self._programs: dict = {}

  def _program(self, local):
    """(the calls, the jitted ids function) of a data shard's batch of this shape, traced once."""
    key = _shape_key(local)
    if key not in self._programs:
      calls: list[LookupCall] = []

      def ids_of(batch):
        recorder = _Recorder()
        params, rest = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), self.shapes)
        with runtime.using(recorder=recorder, count_only=True):
          self.task.sums(nnx.merge(self.graphdef, params, rest), batch, None)
        calls[:] = [call for call, _ in recorder.calls]
        return [ids for _, ids in recorder.calls]

      fn = jax.jit(ids_of)
      structs = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), local)
      fn.lower(structs)  # the trace: the calls come from it; calls with arrays of this shape reuse it
      self.traces += 1
      self._programs[key] = (list(calls), fn)
    return self._programs[key]

  def calls(self, local) -> list[LookupCall]:
    """The lookup calls, in call order, of one data shard's batch (arrays or ShapeDtypeStructs)."""
    return self._program(local)[0]

  def ids(self, sharded_batch) -> list[tuple[str, np.ndarray]]:
    """[(call key, ids of every data shard: S x N)] of the model's lookups on a sharded host batch."""
    local = jax.tree_util.tree_map(lambda x: np.asarray(x)[0], sharded_batch)
    calls, fn = self._program(local)
    shards = np.shape(jax.tree_util.tree_leaves(sharded_batch)[0])[0]
    per_shard = [fn(jax.tree_util.tree_map(lambda x: np.asarray(x)[s], sharded_batch)) for s in range(shards)]
    return [(call.key, np.stack([np.asarray(out[i]) for out in per_shard])) for i, call in enumerate(calls)]


def capacities(calls: list[tuple[str, np.ndarray]], plan, vocab_of, slack: float = 1.05,
               multiple: int = 1) -> dict[str, int]:
  """Per lookup call of a row-sharded table: the all-to-all capacity its ids need on the worst data shard
  (sparse.capacity_for), the largest over calls that share a key. vocab_of(table) -> rows of the table."""
  out: dict[str, int] = {}
  for key, ids_SxN in calls:
    table = table_of(key)
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
    by_table.setdefault(table_of(key), []).append(np.asarray(ids_SxN).reshape(len(ids_SxN), -1))
  shape = plan.mesh.shape
  data = [a for a in DATA_AXES if shape[a] > 1]
  grid = [shape[a] for a in data]
  round_up = lambda worst: sparse.round_capacity(worst, slack, multiple)
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
