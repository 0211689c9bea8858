"""The table updates of the one train step (gem_jax/run/step.py): how tables are differentiated and updated.

  DenseTables    train.embedding_update = "dense": tables differentiated whole (V x E gradients) and the row
                 rule's dense form on every row; the exact reference
  SparseTables   "sparse" (the default), the sparse embedding engine: table work follows the ids a batch
                 reads, not V

Both answer the step's questions (`TableUpdate`): the lookup calls the update needs to know, what
value_and_grad differentiates for the tables, the tables the model sees, the lookup wrapped for the
backward, and the gradients applied to new tables and row-optimizer state (a TableStep).

Letters: V table rows, Vl rows of this device's block, E width, N ids a lookup call reads on one device,
U distinct ids, M rows an owner receives, D devices.

The sparse engine, in three stages of the one jitted train step:
  ids     the run's count-only trace of the task (gem_jax/parallel/lookups.py LookupTrace, once per batch
          shape; nothing runs) lists the lookup calls of this batch shape: (table, N) in call order.
  grads   the loss is differentiated with respect to the dense parameters and one zero "sink" per lookup
          call (N x E on every device) that the lookup adds to the rows it read. The tables themselves are
          not differentiated, so the backward produces each call's row cotangents (N x E) and nothing of
          size V. The forward lookup is the usual one (a local gather, or gem_jax/parallel/sparse.py's
          all-to-all on a row-sharded table); the lookup also returns the ids it read.
  update  (no gradient, under shard_map) per table, `merge_table` by its `Layout`: cotangents summed over
          the devices that hold the same data shard (context, tensor: one psum of N x E), ids deduplicated
          and their rows summed (sorted unique + segment sum, as FBGEMM's TBE backward), rows sent to their
          owner over all-to-all (sparse.send_to_owners; a table sharded over `sparse` or `fsdp x sparse`),
          merged again across copies of the table on other data axes, and the row rule
          (gem_jax/run/table_optim.py) applied to the touched rows only: gather rows and slots, update,
          scatter into the donated table. On one device, a table with no more rows than the ids it reads
          (`dense_rows`: the small tables of an ads batch) skips the sort: its rows' V x E scatter-add and
          the rule on the rows it touched.

Copies of a table on other data axes (rows over `sparse` while `fsdp`/`replica` > 1, or a replicated
table) must end the step identical. For n copies and U touched rows per copy, all-gathering (ids, rows)
moves (n - 1) U (E + 1) words to each device; a dense all-reduce of the block moves 2 (n - 1) / n V E.
The engine all-gathers unless the dense sync is smaller (small replicated tables: `dense_sync`), and
the cheapest layout of all is rows over every data axis holding a copy (no copies to sync; the
all-to-all then moves only the rows' gradients, once): a mesh file's `table_rows` rule chooses it.

Non-finite guard: the tables' squared gradient norm joins the dense one; a step whose loss or gradient is
not finite writes no row (and the dense parameters stay: gem_jax/run/state.py).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from gem_jax import scopes
from gem_jax.model.embeddings import Table
from gem_jax.parallel import sparse, spmd
from gem_jax.parallel.lookups import LookupCall
from gem_jax.parallel.rules import DATA_AXES
from gem_jax.run.state import ordered_sum, squared_norm

COPY_AXES = ("context", "tensor")  # devices along these hold the same data shard


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def table_names(tables) -> list[str]:
  """The table names of a Table-only nnx.State, in its leaf order."""
  return [str(getattr(path[-1], "key", path[-1])) for path, _ in
          jax.tree_util.tree_leaves_with_path(tables, is_leaf=_is_var)]


def sink_lookup(inner, calls: list[LookupCall], sinks, recorded):
  """The lookup of the grads stage: `inner`'s rows plus this call's sink, and the call's ids kept."""

  def fn(table, rows_VxE, ids):
    i = len(recorded)
    key = LookupCall(table, int(math.prod(ids.shape)))
    if i >= len(calls) or calls[i] != key:
      raise RuntimeError(f"sparse engine: lookup call {i} is {key}, but the count-only trace listed "
                         f"{calls[i] if i < len(calls) else 'no more calls'}; the model's lookups must not depend "
                         "on anything but the batch shape")
    out = inner(table, rows_VxE, ids)
    recorded.append(jnp.reshape(ids, (-1,)).astype(jnp.int32))
    return out + sinks[i].reshape(out.shape).astype(out.dtype)

  return fn


def merge_rows(ids_M, g_MxE, num_rows: int, parts: tuple[int, ...] | None = None, size_rows: int | None = None):
  """Distinct ids (sorted, `num_rows` in unused slots) and the summed rows of each: the segment sum.

  size_rows: the row count that sizes the result (default num_rows): a host table's cache passes its whole
  table's, so that its arrays have the shapes the same table's would have on the device (Layout.whole_rows).

  parts: the sizes of consecutive runs of ids_M (one per lookup call); each run is summed on its own and
  the runs' sums are added last run first, the order in which JAX's backward adds the V x E gradients of
  several lookups of one table, so the dense path's sums come out the same."""
  valid = (ids_M >= 0) & (ids_M < num_rows)
  # At most num_rows + 1 distinct values (the rows, and num_rows for every invalid id, sorted last).
  slots = min(ids_M.shape[0], (num_rows if size_rows is None else size_rows) + 1)
  uniq_U, inv_M = jnp.unique(jnp.where(valid, ids_M, num_rows), size=slots, fill_value=num_rows,
                             return_inverse=True)
  inv_M = jnp.reshape(inv_M, (-1,))
  g_MxE = jnp.where(valid[:, None], g_MxE, 0)
  bounds = list(itertools.accumulate(parts or (ids_M.shape[0],), initial=0))
  g_UxE = None
  for lo, hi in reversed(list(zip(bounds[:-1], bounds[1:]))):
    part = jnp.zeros((slots, g_MxE.shape[1]), g_MxE.dtype).at[inv_M[lo:hi]].add(g_MxE[lo:hi])
    g_UxE = part if g_UxE is None else g_UxE + part
  return uniq_U, g_UxE


def apply_rows(rule, block_VxE, slots, uniq_U, g_UxE, write_U, count):
  """The rule on the rows `uniq_U` of this block, scattered back where write_U (in place when donated)."""
  num_rows = block_VxE.shape[0]
  safe_U = jnp.where(uniq_U < num_rows, uniq_U, 0)
  rows_UxE = block_VxE[safe_U]
  u_UxE, new_slots = rule.update_rows(g_UxE, tuple(s[safe_U] for s in slots), count)
  new_rows = (rows_UxE + u_UxE).astype(block_VxE.dtype)  # optax.apply_updates' arithmetic, as the dense path
  index_U = jnp.where(write_U, uniq_U, num_rows)          # out of range: mode="drop" writes nothing
  block_VxE = block_VxE.at[index_U].set(new_rows, mode="drop")
  slots = tuple(s.at[index_U].set(n.astype(s.dtype), mode="drop") for s, n in zip(slots, new_slots))
  return block_VxE, slots


def dense_rows(num_rows: int, ids: int) -> bool:
  """The size rule for a table on one device: its V x E gradient (the scatter-add of the ids' rows, as the
  dense path builds it) and an update of all V rows when V <= N, the ids it reads in a step. The sort that
  deduplicates N ids then costs more than touching every row (the action, hour or category tables of an
  ads batch: 4 to 5,000 rows against ~10^4 history ids)."""
  return num_rows <= ids


def _dense_rows(ids_N, g_NxE, num_rows: int, parts: tuple[int, ...]):
  """The V x E gradient of one table from its lookup calls' ids and row cotangents, each call scattered on
  its own and the calls added last first (JAX's backward order: the dense path's sums, bit for bit)."""
  index_N = jnp.where((ids_N >= 0) & (ids_N < num_rows), ids_N, num_rows)  # out of range: dropped
  bounds = list(itertools.accumulate(parts, initial=0))
  grad_VxE = None
  for lo, hi in reversed(list(zip(bounds[:-1], bounds[1:]))):
    part = jnp.zeros((num_rows, g_NxE.shape[1]), g_NxE.dtype).at[index_N[lo:hi]].add(g_NxE[lo:hi], mode="drop")
    grad_VxE = part if grad_VxE is None else grad_VxE + part
  return grad_VxE


def dense_sync(num_rows: int, dim: int, ids: int, copies: int) -> bool:
  """The size rule for a table replicated over `copies` devices of the data axes: a ring all-reduce of its
  V x E gradient (2 (n - 1) / n V E words per device) when that is no more than all-gathering every copy's
  touched rows with their ids ((n - 1) U (E + 1) words, U = ids read per device)."""
  if copies <= 1:
    return False
  return 2 * num_rows * dim / copies <= ids * (dim + 1)


def _in_rounds(collective, parts, capacity: int, uniform_axes, count, grow: int = 1, spill_fraction: float = 0.125):
  """collective(*parts) on the first `capacity` rows of each part, then on a spill of spill_fraction x
  `capacity` more and on all the rest, each only when some device holds valid rows there (`count`: this
  device's valid rows, which come first; a cond on a flag every device agrees on), so no row is ever
  dropped and a batch a little over the capacity pays for the spill only, as sparse.send_to_owners. The
  collective returns `grow` x the rows it is given (an all-gather: the group size).
  -> (the results, each group member's rows together in its order (sparse.by_source); {"spill" | "rest": 1
  if that round ran}, also the named scopes of their collectives)."""
  n = parts[0].shape[0]
  capacity = int(min(max(1, capacity), n))
  out, ran = [collective(*(x[:capacity] for x in parts))], {}
  for name, lo, size in sparse.fallback_rounds(n, capacity, spill_fraction, second=False):
    if size <= 0:
      continue
    rest = tuple(x[lo:lo + size] for x in parts)
    go = jax.lax.pmax((count > lo).astype(jnp.int32), uniform_axes)
    empty = lambda rest=rest: tuple(jnp.full((grow * x.shape[0],) + x.shape[1:], -1 if jnp.issubdtype(
        x.dtype, jnp.integer) else 0, x.dtype) for x in rest)  # ids -1 (no row), gradients 0
    with jax.named_scope(name):
      out.append(jax.lax.cond(go > 0, lambda rest=rest: collective(*rest), empty))
    ran[name] = go
  # Each group member's rows together (sparse.by_source), so a row's sums do not depend on its round.
  return tuple(sparse.by_source(list(xs), grow) for xs in zip(*out)), ran


# ---- the update stage: one function per layout of a table --------------------------------------------------

@dataclasses.dataclass
class Merged:
  """One table's gradient after its layout's merge, on this device: either `grad_VxE` (its block's V x E
  gradient, for the rule's dense form) or `rows_R` (distinct rows of its block, `rows` past the block in
  unused slots) with their summed gradients `g_RxE` and `touched_R` (valid, nonzero gradient). `sq`: the
  table's squared gradient norm (every row counted once over the mesh); `stats`: emb/<table>/... metrics."""
  sq: jax.Array
  stats: dict
  grad_VxE: jax.Array | None = None
  rows_R: jax.Array | None = None
  g_RxE: jax.Array | None = None
  touched_R: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where one table's rows and copies are on the mesh, as the update stage sees it from one device."""
  name: str
  num_rows: int           # global rows V
  active: tuple           # every mesh axis of size > 1
  copy_ct: tuple          # context / tensor axes of size > 1 (same data shard, same ids)
  own: tuple              # axes its rows are sharded over (size > 1)
  copies: tuple           # data axes holding another copy of its rows (size > 1, not in own)
  caps: dict              # its sync capacities (lookups.sync_capacities)
  mesh_shape: dict        # axis -> size
  whole_rows: int = 0     # a host table's rows (its cache has num_rows): sizes the merge arrays; 0 = num_rows

  @property
  def cached(self) -> bool:
    """Its rows here are a host table's device cache (gem_jax/run/host_tables.py)."""
    return self.whole_rows > 0

  @property
  def sized(self) -> int:
    """Rows that size its merge arrays: the whole table's, so that a cache's arrays have the shapes its
    table's have on the device, and XLA rounds their rows' arithmetic alike."""
    return self.whole_rows or self.num_rows

  def size(self, axes) -> int:
    return math.prod(self.mesh_shape[a] for a in axes)

  def mean(self, x):
    """The mean over every device (a per-device stat)."""
    return jax.lax.psum(x, self.active) / self.size(self.active) if self.active else x


def _small_table(t: Layout, ids_N, g_NxE, parts) -> Merged:
  """One device, V <= N (dense_rows): the V x E scatter-add, as the dense path builds it."""
  v = t.num_rows
  grad_VxE = _dense_rows(ids_N, g_NxE, v, parts)
  hit_V = jnp.zeros((v,), jnp.int32).at[jnp.where((ids_N >= 0) & (ids_N < v), ids_N, v)].add(1, mode="drop")
  stats = {"unique": jnp.sum(hit_V > 0, dtype=jnp.int32).astype(jnp.float32),
           "touched": jnp.sum(jnp.any(grad_VxE != 0, axis=1), dtype=jnp.int32),
           "update_slots": jnp.float32(v)}
  return Merged(jnp.sum(jnp.square(grad_VxE)), stats, grad_VxE=grad_VxE)


def _local_rows(t: Layout, uniq_U, g_UxE) -> Merged:
  """No owner and no copy on a data axis (one device, or copies along context / tensor only, which summed
  already): the rows merged on this device are the update."""
  touched_U = (uniq_U < t.num_rows) & jnp.any(g_UxE != 0, axis=1)
  stats = {"touched": jnp.sum(touched_U, dtype=jnp.int32), "update_slots": jnp.float32(uniq_U.shape[0])}
  return Merged(jnp.sum(jnp.square(g_UxE)), stats, rows_R=uniq_U, g_RxE=g_UxE, touched_R=touched_U)


def _dense_synced(t: Layout, block_shape, ids_M, g_MxE) -> Merged:
  """A replicated table whose V x E all-reduce over its copies is the cheaper sync (dense_sync)."""
  v = t.num_rows
  grad_VxE = jax.lax.psum(jnp.zeros(block_shape, jnp.float32).at[jnp.where(ids_M < v, ids_M, v)].add(
      g_MxE, mode="drop"), t.copies)
  stats = {"touched": jnp.sum(jnp.any(grad_VxE != 0, axis=1), dtype=jnp.int32),
           "update_slots": jnp.float32(block_shape[0])}
  return Merged(jnp.sum(jnp.square(grad_VxE)), stats, grad_VxE=grad_VxE)


def _gathered_rows(t: Layout, ids_M, g_MxE, local_rows: int, rounds: dict) -> tuple[Merged, jax.Array]:
  """Rows that arrived at their owner (or a replicated table's rows), merged, then all-gathered over the
  copies on other data axes and merged again, so every copy applies the same sums. -> (merged, the ideal
  bytes of the gather)."""
  sized = t.sized // (t.size(t.own) if t.own else 1)
  uniq_R, g_RxE = merge_rows(ids_M, g_MxE, local_rows, size_rows=sized)
  uniq_R, g_RxE = uniq_R[:sized], g_RxE[:sized]  # at most a block's rows are distinct
  ideal = jnp.zeros((), jnp.float32)
  if t.copies:
    n_copies = t.size(t.copies)
    n_rows = jnp.sum(uniq_R < local_rows, dtype=jnp.int32)
    ideal = (n_copies - 1) * n_rows.astype(jnp.float32) * (g_RxE.shape[1] + 1) * 4
    gather = lambda i, g: (jax.lax.all_gather(i, t.copies, axis=0, tiled=True),
                           jax.lax.all_gather(g, t.copies, axis=0, tiled=True))
    (ids_G, g_GxE), ran = _in_rounds(gather, (jnp.where(uniq_R < local_rows, uniq_R, -1), g_RxE),
                                     t.caps.get("received" if t.own else "unique", uniq_R.shape[0]), t.active,
                                     n_rows, grow=n_copies)
    rounds["spill"], rounds["rest"] = rounds["spill"] | ran.get("spill", 0), rounds["rest"] | ran.get("rest", 0)
    uniq_R, g_RxE = merge_rows(ids_G, g_GxE, local_rows, size_rows=sized)
  touched_R = (uniq_R < local_rows) & jnp.any(g_RxE != 0, axis=1)
  # Each owner holds its own rows once; copies computed the same sums.
  over_owners = (lambda x: jax.lax.psum(x, t.own)) if t.own else (lambda x: x)
  stats = {"touched": over_owners(jnp.sum(touched_R, dtype=jnp.int32)),
           "update_slots": over_owners(jnp.float32(uniq_R.shape[0]))}
  return Merged(over_owners(jnp.sum(jnp.square(g_RxE))), stats, rows_R=uniq_R, g_RxE=g_RxE,
                touched_R=touched_R), ideal


def merge_table(t: Layout, block_shape, ids_N, g_NxE, parts) -> Merged:
  """One table's row gradients on this device (its lookup calls' ids and cotangents, in call order, `parts`
  ids each) merged as its layout needs (module docstring). stats: unique (distinct ids per data shard),
  touched (rows updated), update_slots (rows the rule reads, valid or not; both summed over a row-sharded
  table's owners) and, on a mesh, sync_spill / sync_rest (1 if a spill round / a later round of one of its
  sync collectives ran: named scopes "spill", and "rest", "second", "last_resort") and sync_ideal_bytes
  (what this device would move if every collective carried exactly its touched rows' ids and gradients,
  under hlo.py's traffic model; the mean over devices)."""
  v, e = t.num_rows, g_NxE.shape[1]
  # A host table's cache takes the path of its whole table, which is larger than a step's ids (a cache no
  # larger than them would otherwise take the V x E form and round differently from the same table on the
  # device).
  if not t.active and not t.cached and dense_rows(v, ids_N.shape[0]):
    return _small_table(t, ids_N, g_NxE, parts)
  uniq_U, g_UxE = merge_rows(ids_N, g_NxE, v, parts, size_rows=t.sized)
  # At most V distinct ids, first in the sorted slots: the rest are always empty.
  uniq_U, g_UxE = uniq_U[:t.sized], g_UxE[:t.sized]
  n_unique = jnp.sum(uniq_U < v, dtype=jnp.int32)
  rounds = {"spill": jnp.zeros((), jnp.int32), "rest": jnp.zeros((), jnp.int32)}
  ideal = jnp.zeros((), jnp.float32)
  if t.copy_ct:  # devices along context / tensor read the same ids: sum their rows' gradients
    (g_UxE,), ran = _in_rounds(lambda g: (jax.lax.psum(g, t.copy_ct),), (g_UxE,),
                               t.caps.get("unique", ids_N.shape[0]), t.active, n_unique)
    rounds["spill"], rounds["rest"] = rounds["spill"] | ran.get("spill", 0), rounds["rest"] | ran.get("rest", 0)
    n_ct = t.size(t.copy_ct)
    ideal += 2.0 * (n_ct - 1) / n_ct * n_unique.astype(jnp.float32) * e * 4
  # Per data shard (devices along context / tensor hold the same shard: counted once).
  unique = t.mean(n_unique.astype(jnp.float32))
  if t.own:
    rows_per_owner = v // t.size(t.own)
    remote = jnp.sum((uniq_U < v) & (uniq_U // rows_per_owner != jax.lax.axis_index(t.own)), dtype=jnp.int32)
    ids_M, g_MxE, st = sparse.send_to_owners(uniq_U, g_UxE, axes=t.own, num_rows=v,
                                             capacity=t.caps.get("owner", ids_N.shape[0]), uniform_axes=t.active)
    rounds["spill"] |= st.get("spill", 0)
    rounds["rest"] |= functools.reduce(jnp.maximum, [st.get(r, 0) for r in ("second", "last_resort")])
    ideal += remote.astype(jnp.float32) * (e + 1) * 4
    local_rows = block_shape[0]
  else:
    ids_M, g_MxE, local_rows = uniq_U, g_UxE, v
  if not t.own and not t.copies:
    merged = _local_rows(t, uniq_U, g_UxE)
  elif t.copies and not t.own and dense_sync(v, block_shape[1], ids_N.shape[0], t.size(t.copies)):
    merged = _dense_synced(t, block_shape, ids_M, g_MxE)
    ideal += (t.size(t.copies) - 1) * n_unique.astype(jnp.float32) * (e + 1) * 4
  else:
    merged, gathered = _gathered_rows(t, ids_M, g_MxE, local_rows, rounds)
    ideal += gathered
  merged.stats["unique"] = unique
  if t.active:
    merged.stats["sync_spill"] = jax.lax.pmax(rounds["spill"], t.active)
    merged.stats["sync_rest"] = jax.lax.pmax(rounds["rest"], t.active)
    merged.stats["sync_ideal_bytes"] = t.mean(ideal)
  return merged


def _dense_rule(rule, block_VxE, slots, grad_VxE, count, finite):
  """The rule's dense form on a whole block (every row; untouched rows keep their values and slots), all of
  it kept as it was unless `finite`."""
  u, out = rule.dense_update(grad_VxE.astype(block_VxE.dtype), slots, count)
  new_block = jnp.where(finite, (block_VxE + u).astype(block_VxE.dtype), block_VxE)
  return new_block, tuple(jnp.where(finite, n, o) for n, o in zip(out, slots))


def apply_merged(rule, block_VxE, slots, m: Merged, count, finite):
  """The rule on one table's merged gradient: (new block, new slots); nothing written unless `finite`."""
  if m.grad_VxE is not None:
    return _dense_rule(rule, block_VxE, slots, m.grad_VxE, count, finite)
  return apply_rows(rule, block_VxE, slots, m.rows_R, m.g_RxE.astype(block_VxE.dtype), m.touched_R & finite, count)


# ---- the two table updates of the train step -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TableStep:
  """What a table update gives back to the train step (gem_jax/run/step.py)."""
  tables: Any             # the new tables: an nnx.State of Table variables, laid out as the state's
  table_state: Any        # the row rule's new table_optim.TableState
  sq_norm: jax.Array      # the tables' squared gradient norm (float32)
  finite: jax.Array       # the step's verdict, the tables' gradient included
  stats: dict             # emb/<table>/<stat> metrics (the sparse engine's)


def _leaves(tree) -> list:
  # A Variable is a pytree node over its value: a State's leaves are the arrays themselves.
  return jax.tree_util.tree_leaves(tree)


def _like(tree, leaves):
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), leaves)


class TableUpdate:
  """What the train step asks of its table update (gem_jax/run/step.py). The answers here differentiate the
  tables themselves; SparseTables gives its own.

    calls(batch)                 the lookup calls it needs to know of this batch shape ([] : none)
    wrt(tables, calls)           what value_and_grad differentiates for the tables (and its shard_map specs)
    model_tables(wrt, tables)    the tables the model reads
    lookup(inner, calls, wrt, reads)   the lookup the model calls (inner: the step's distributed lookup);
                                 it may append what the update needs to `reads` (shard_map specs: read_specs)
    apply(tables, table_state, grads, reads, calls, finite) -> TableStep
  """

  def calls(self, batch) -> list:
    return []

  def wrt(self, tables, calls):
    return tables

  def wrt_specs(self, table_specs, calls):
    return table_specs

  def read_specs(self, calls) -> list:
    return []

  def model_tables(self, wrt, tables):
    return wrt

  def lookup(self, inner, calls, wrt, reads):
    return inner

  def apply(self, tables, table_state, grads, reads, calls, finite) -> TableStep:
    raise NotImplementedError


class DenseTables(TableUpdate):
  """train.embedding_update = "dense": the tables are differentiated whole (a V x E gradient each, which JAX's
  backward sums over the mesh) and every row takes the rule's dense form: the exact reference of the
  sparse engine."""

  def __init__(self, rule):
    self.rule = rule

  def apply(self, tables, table_state, grads, reads, calls, finite) -> TableStep:
    sq = squared_norm(grads)
    finite = finite & jnp.isfinite(sq)
    blocks, slots = [], [[] for _ in table_state.slots]
    for t, (block, grad) in enumerate(zip(_leaves(tables), _leaves(grads))):
      own = tuple(_leaves(s)[t] for s in table_state.slots)
      block, out = _dense_rule(self.rule, block, own, grad, table_state.count, finite)
      blocks.append(block)
      for k, o in enumerate(out):
        slots[k].append(o)
    new_state = table_state._replace(slots=tuple(_like(s, leaves) for s, leaves in zip(table_state.slots, slots)),
                                     count=table_state.count + finite.astype(jnp.int32))
    return TableStep(_like(tables, blocks), new_state, sq, finite, {})


class SparseTables(TableUpdate):
  """train.embedding_update = "sparse": the engine (module docstring). What is differentiated is one zero
  sink per lookup call (N x E per device), which the lookup adds to the rows it read, so the backward gives
  each call's row cotangents and nothing of size V; the update merges them per table by its layout and
  applies the rule to the touched rows only."""

  def __init__(self, rule, plan, tables, sync_capacities: dict, lookup_calls_of: Callable,
               cached: dict[str, int] | None = None):
    self.rule, self.plan, self.sync_capacities = rule, plan, dict(sync_capacities)
    self.cached = dict(cached or {})  # host table -> its whole rows; its leaves are device caches (Layout)
    self.lookup_calls_of = lookup_calls_of   # local batch structs -> [LookupCall] (lookups.LookupTrace.calls)
    self.names = table_names(tables)
    values = dict(zip(self.names, _leaves(tables)))
    self.num_rows = {n: int(x.shape[0]) for n, x in values.items()}
    self.dims = {n: int(x.shape[1]) for n, x in values.items()}
    self.dtypes = {n: x.dtype for n, x in values.items()}
    self.device_spec = device_spec(plan.mesh)
    self.devices = math.prod(plan.mesh.shape[a] for a in spmd.active_axes(plan.mesh))

  def calls(self, batch) -> list[LookupCall]:
    return self.lookup_calls_of(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch))

  def wrt(self, tables, calls):
    return [jnp.zeros((self.devices, c.ids, self.dims[c.table]), self.dtypes[c.table]) for c in calls]

  def wrt_specs(self, table_specs, calls):
    return [self.device_spec] * len(calls)

  def read_specs(self, calls) -> list:
    return [self.device_spec] * len(calls)

  def model_tables(self, wrt, tables):
    return tables

  def lookup(self, inner, calls, wrt, reads):
    return sink_lookup(inner, calls, [s[0] for s in wrt], reads)

  def layout(self, name: str) -> Layout:
    mesh = self.plan.mesh
    own = spmd.active_axes(mesh, self.plan.table_axes.get(name, ()))
    return Layout(name, self.num_rows[name], spmd.active_axes(mesh), spmd.active_axes(mesh, COPY_AXES), own,
                  tuple(a for a in spmd.active_axes(mesh, DATA_AXES) if a not in own),
                  self.sync_capacities.get(name, {}), dict(mesh.shape), self.cached.get(name, 0))

  def _update(self, calls, blocks, slots, ids_by_call, cots_by_call, finite, count):
    """The update stage on one device: -> (blocks, slots, tables' squared norm, finite, stats)."""
    merged = {}
    for t, name in enumerate(self.names):
      mine = [i for i, c in enumerate(calls) if c.table == name]
      if not mine:
        continue
      with jax.named_scope(scopes.table(name)):  # op names say whose collective it is (mesh_sweep counts per table)
        ids_N = jnp.concatenate([ids_by_call[i] for i in mine])
        g_NxE = jnp.concatenate([cots_by_call[i] for i in mine]).astype(jnp.float32)
        merged[name] = merge_table(self.layout(name), blocks[t].shape, ids_N, g_NxE, tuple(calls[i].ids for i in mine))
    sq = ordered_sum(m.sq for m in merged.values())
    finite = finite & jnp.isfinite(sq)
    new_blocks, new_slots = list(blocks), [list(s) for s in slots]
    for t, name in enumerate(self.names):
      if name in merged:
        new_blocks[t], out = apply_merged(self.rule, blocks[t], tuple(s[t] for s in slots), merged[name], count,
                                          finite)
        for k, o in enumerate(out):
          new_slots[k][t] = o
    stats = {f"emb/{name}/{k}": x for name, m in merged.items() for k, x in m.stats.items()}
    return new_blocks, new_slots, sq, finite, stats

  def apply(self, tables, table_state, grads, reads, calls, finite) -> TableStep:
    spec_leaves = lambda tree: jax.tree_util.tree_leaves(spmd.step_specs(self.plan, tree),
                                                         is_leaf=lambda x: isinstance(x, P))
    block_specs = spec_leaves(tables)
    slot_specs = [spec_leaves(s) for s in table_state.slots]
    dev = [self.device_spec] * len(calls)
    update = jax.shard_map(
        lambda b, s, i, c, f, k: self._update(calls, b, s, [x[0] for x in i], [x[0] for x in c], f, k),
        mesh=self.plan.mesh, in_specs=(block_specs, slot_specs, dev, dev, P(), P()),
        out_specs=(block_specs, slot_specs, P(), P(), P()),
        # Copies of a block end equal by construction (every copy merges the same rows), which vma types
        # cannot express: an all-gather's result still counts as varying.
        check_vma=False)
    blocks, slots, sq, finite, stats = update(_leaves(tables), [_leaves(s) for s in table_state.slots], reads,
                                              grads, finite, table_state.count)
    new_state = table_state._replace(slots=tuple(_like(s, b) for s, b in zip(table_state.slots, slots)),
                                     count=table_state.count + finite.astype(jnp.int32))
    return TableStep(_like(tables, blocks), new_state, sq, finite, stats)


def row_bytes(params, optimizer, opt_state) -> dict[str, float]:
  """Per table: the bytes of one row and of its optimizer slots (what the rule reads and writes per row)."""
  tables, _ = nnx.split_state(params, Table, ...)
  names = table_names(tables)
  per_row = lambda x: float(x.size // max(x.shape[0], 1) * x.dtype.itemsize)
  out = {n: per_row(v.get_value()) for n, v in zip(names, jax.tree_util.tree_leaves(tables, is_leaf=_is_var))}
  for slot in optimizer.table_state(opt_state).slots:
    for n, v in zip(table_names(slot), jax.tree_util.tree_leaves(slot, is_leaf=_is_var)):
      out[n] += per_row(v.get_value())
  return out


def device_spec(mesh) -> P:
  """Arrays with one slice per device (sinks, ids, cotangents): leading dim over every active axis."""
  active = spmd.active_axes(mesh)
  return P(active) if active else P()
