"""The sparse embedding engine: a train step whose table work follows the ids a batch reads, not V.

Letters: V table rows, Vl rows of this device's block, E width, N ids a lookup call reads on one device,
U distinct ids, M rows an owner receives, D devices.

Three stages, in the one jitted train step (gem_jax/run/step.py picks this path for
train.embedding_update = "sparse"; "dense" keeps the V x E gradient as the reference):
  ids     before the step is traced, a count-only trace of the task (jax.eval_shape, nothing runs) lists
          the lookup calls of this batch shape: (table, N) in call order.
  grads   the loss is differentiated with respect to the dense parameters and one zero "sink" per lookup
          call (N x E on every device) that the lookup adds to the rows it read. The tables themselves are
          not differentiated, so the backward produces each call's row cotangents (N x E) and nothing of
          size V. The forward lookup is the usual one (a local gather, or gem_jax/parallel/sparse.py's
          all-to-all on a row-sharded table); the lookup also returns the ids it read.
  update  (no gradient, under shard_map) per table: cotangents summed over the devices that hold the same
          data shard (context, tensor: one psum of N x E), ids deduplicated and their rows summed (sorted
          unique + segment sum, as FBGEMM's TBE backward), rows sent to their owner over all-to-all
          (sparse.send_to_owners; a table sharded over `sparse` or `fsdp x sparse`), merged again across
          copies of the table on other data axes, and the row rule (gem_jax/run/table_optim.py) applied to
          the touched rows only: gather rows and slots, update, scatter into the donated table. On one
          device, a table with no more rows than the ids it reads (`dense_rows`: the small tables of an
          ads batch) skips the sort: its rows' V x E scatter-add and the rule on the rows it touched.

Copies of a table on other data axes (rows over `sparse` while `fsdp`/`replica` > 1, or a replicated
table) must end the step identical. For n copies and U touched rows per copy, all-gathering (ids, rows)
moves (n - 1) U (E + 1) words to each device; a dense all-reduce of the block moves 2 (n - 1) / n V E.
The engine all-gathers unless the dense sync is smaller (small replicated tables: `dense_sync`), and
the cheapest layout of all is rows over every data axis holding a copy (no copies to sync; the
all-to-all then moves only the rows' gradients, once): a mesh file's `table_rows` rule chooses it.

Non-finite guard: the merged row gradients' squared norm joins the dense one; a step whose loss or
gradient is not finite writes no row (and the dense parameters stay, as in step.guarded_update).
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from gem_jax import runtime
from gem_jax.model.embeddings import Table
from gem_jax.parallel import sparse, spmd
from gem_jax.parallel.rules import DATA_AXES

COPY_AXES = ("context", "tensor")  # devices along these hold the same data shard


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def table_names(tables) -> list[str]:
  """The table names of a Table-only nnx.State, in its leaf order."""
  return [str(getattr(path[-1], "key", path[-1])) for path, _ in
          jax.tree_util.tree_leaves_with_path(tables, is_leaf=_is_var)]


class _Calls:
  def __init__(self):
    self.calls: list[tuple[str, int]] = []

  def record(self, what: str, **facts) -> None:
    if what == "lookup":
      self.calls.append((facts["table"], int(math.prod(facts["ids"].shape))))


def lookup_calls(graphdef, rest, task, params, local_batch) -> list[tuple[str, int]]:
  """(table, ids read) of every lookup the task's loss makes on one data shard of this batch shape, in call
  order: an abstract, count-only trace (nothing is computed or allocated)."""
  recorder = _Calls()
  abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, local_batch))

  def trace(params, batch):
    with runtime.using(recorder=recorder, count_only=True):
      task.sums(nnx.merge(graphdef, params, rest), batch, None)
    return 0

  jax.eval_shape(trace, *abstract)
  return recorder.calls


def sink_lookup(inner, calls, sinks, recorded):
  """The lookup of the grads stage: `inner`'s rows plus this call's sink, and the call's ids kept."""

  def fn(table, rows_VxE, ids):
    i = len(recorded)
    key = (table, int(math.prod(ids.shape)))
    if i >= len(calls) or calls[i] != key:
      raise RuntimeError(f"sparse engine: lookup call {i} is {key}, but the count-only trace listed "
                         f"{calls[i] if i < len(calls) else 'no more calls'}; the model's lookups must not depend "
                         "on anything but the batch shape")
    out = inner(table, rows_VxE, ids)
    recorded.append(jnp.reshape(ids, (-1,)).astype(jnp.int32))
    return out + sinks[i].reshape(out.shape).astype(out.dtype)

  return fn


def _merge_rows(ids_M, g_MxE, num_rows: int, parts: tuple[int, ...] | None = None):
  """Distinct ids (sorted, `num_rows` in unused slots) and the summed rows of each: the segment sum.

  parts: the sizes of consecutive runs of ids_M (one per lookup call); each run is summed on its own and
  the runs' sums are added last run first, the order in which JAX's backward adds the V x E gradients of
  several lookups of one table, so the dense path's sums come out the same."""
  valid = (ids_M >= 0) & (ids_M < num_rows)
  # At most num_rows + 1 distinct values (the rows, and num_rows for every invalid id, sorted last).
  slots = min(ids_M.shape[0], num_rows + 1)
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


def _apply_rows(rule, block_VxE, slots, uniq_U, g_UxE, write_U, count):
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
  -> (the results, rows concatenated in order; {"spill" | "rest": 1 if that round ran}, also the named
  scopes of their collectives)."""
  n = parts[0].shape[0]
  capacity = int(min(max(1, capacity), n))
  spill = int(min(max(1, math.ceil(spill_fraction * capacity)), n - capacity))
  out, ran = [collective(*(x[:capacity] for x in parts))], {}
  for name, lo, hi in (("spill", capacity, capacity + spill), ("rest", capacity + spill, n)):
    if hi <= lo:
      continue
    rest = tuple(x[lo:hi] for x in parts)
    go = jax.lax.pmax((count > lo).astype(jnp.int32), uniform_axes)
    empty = lambda rest=rest: tuple(jnp.full((grow * x.shape[0],) + x.shape[1:], -1 if jnp.issubdtype(
        x.dtype, jnp.integer) else 0, x.dtype) for x in rest)  # ids -1 (no row), gradients 0
    with jax.named_scope(name):
      out.append(jax.lax.cond(go > 0, lambda rest=rest: collective(*rest), empty))
    ran[name] = go
  return tuple(jnp.concatenate(xs) for xs in zip(*out)), ran


def update_tables(rule, p, names, blocks, slots, ids_by_call, cots_by_call, calls, sync_caps, finite, count,
                  num_rows):
  """The update stage on one device (module docstring): -> (blocks, slots, table gradient sq-norm, stats).

  blocks / slots: this device's block of each table and of each of its slots; ids_by_call / cots_by_call:
  this device's ids and row cotangents per lookup call; sync_caps: per table, the slots of the update's
  collectives (lookups.sync_capacities; default every id read); finite: the dense side's verdict (loss and
  dense gradient finite); num_rows: global rows per table.

  stats per table: unique (distinct ids per data shard), touched (rows updated) and update_slots (rows the
  rule reads, valid or not; both summed over a row-sharded table's owners), sync_spill / sync_rest (1
  if a spill round / a later round of one of its sync collectives ran: named scopes "spill", and "rest",
  "second", "last_resort"), sync_ideal_bytes (what this device would move if every
  collective carried exactly its touched rows' ids and gradients, under hlo.py's traffic model; the mean
  over devices)."""
  mesh = p.mesh
  active = spmd.active_axes(mesh)
  copy_ct = spmd.active_axes(mesh, COPY_AXES)
  n_ct = math.prod(mesh.shape[a] for a in copy_ct)
  devices = math.prod(mesh.shape[a] for a in active)
  mean = lambda x: (jax.lax.psum(x, active) / devices) if active else x
  merged, sq, stats = {}, jnp.zeros((), jnp.float32), {}
  for t, name in enumerate(names):
    mine = [i for i, (table, _) in enumerate(calls) if table == name]
    if not mine:
      merged[name] = None
      continue
    with jax.named_scope(f"table={name}"):  # op names say whose collective it is (mesh_sweep counts per table)
      ids_N = jnp.concatenate([ids_by_call[i] for i in mine])
      g_NxE = jnp.concatenate([cots_by_call[i] for i in mine]).astype(jnp.float32)
      v, e = num_rows[name], g_NxE.shape[1]
      caps = sync_caps.get(name, {})
      own = spmd.active_axes(mesh, p.table_axes.get(name, ()))
      if not active and dense_rows(v, ids_N.shape[0]):  # one device: a small table takes the scatter-add
        grad_VxE = _dense_rows(ids_N, g_NxE, v, tuple(calls[i][1] for i in mine))
        sq = sq + jnp.sum(jnp.square(grad_VxE))
        hit_V = jnp.zeros((v,), jnp.int32).at[jnp.where((ids_N >= 0) & (ids_N < v), ids_N, v)].add(1, mode="drop")
        stats[f"emb/{name}/unique"] = jnp.sum(hit_V > 0, dtype=jnp.int32).astype(jnp.float32)
        stats[f"emb/{name}/touched"] = jnp.sum(jnp.any(grad_VxE != 0, axis=1), dtype=jnp.int32)
        stats[f"emb/{name}/update_slots"] = jnp.float32(v)
        merged[name] = ("dense", grad_VxE)
        continue
      uniq_U, g_UxE = _merge_rows(ids_N, g_NxE, v, tuple(calls[i][1] for i in mine))
      # At most V distinct ids, first in the sorted slots: the rest are always empty.
      uniq_U, g_UxE = uniq_U[:v], g_UxE[:v]
      n_unique = jnp.sum(uniq_U < v, dtype=jnp.int32)
      ran_spill, ran_rest, ideal = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)
      if copy_ct:  # devices along context / tensor read the same ids: sum their rows' gradients
        (g_UxE,), ran = _in_rounds(lambda g: (jax.lax.psum(g, copy_ct),), (g_UxE,), caps.get("unique", ids_N.shape[0]),
                                   active, n_unique)
        ran_spill, ran_rest = ran_spill | ran.get("spill", 0), ran_rest | ran.get("rest", 0)
        ideal += 2.0 * (n_ct - 1) / n_ct * n_unique.astype(jnp.float32) * e * 4
      # Per data shard (devices along context / tensor hold the same shard: counted once).
      stats[f"emb/{name}/unique"] = mean(n_unique.astype(jnp.float32))
      block = blocks[t]
      if own:
        rows_per_owner = v // math.prod(mesh.shape[a] for a in own)
        valid_U = uniq_U < v
        remote = jnp.sum(valid_U & (uniq_U // rows_per_owner != jax.lax.axis_index(own)), dtype=jnp.int32)
        ids_M, g_MxE, st = sparse.send_to_owners(uniq_U, g_UxE, axes=own, num_rows=v,
                                                 capacity=caps.get("owner", ids_N.shape[0]), uniform_axes=active)
        ran_spill |= st.get("spill", 0)
        ran_rest |= functools.reduce(jnp.maximum, [st.get(r, 0) for r in ("second", "last_resort")])
        ideal += remote.astype(jnp.float32) * (e + 1) * 4
        local_rows = block.shape[0]
      else:
        ids_M, g_MxE, local_rows = uniq_U, g_UxE, v
      copies = tuple(a for a in spmd.active_axes(mesh, DATA_AXES) if a not in own)
      n_copies = math.prod(mesh.shape[a] for a in copies)
      if not own and not copies:  # one device, or a table only context / tensor copies share: merged already
        touched_U = (uniq_U < v) & jnp.any(g_UxE != 0, axis=1)
        sq = sq + jnp.sum(jnp.square(g_UxE))
        stats[f"emb/{name}/touched"] = jnp.sum(touched_U, dtype=jnp.int32)
        stats[f"emb/{name}/update_slots"] = jnp.float32(uniq_U.shape[0])
        merged[name] = ("rows", uniq_U, g_UxE, touched_U)
      elif copies and not own and dense_sync(v, block.shape[1], ids_N.shape[0], n_copies):
        grad_VxE = jax.lax.psum(jnp.zeros(block.shape, jnp.float32).at[jnp.where(ids_M < v, ids_M, v)].add(
            g_MxE, mode="drop"), copies)
        sq = sq + jnp.sum(jnp.square(grad_VxE))
        ideal += (n_copies - 1) * n_unique.astype(jnp.float32) * (e + 1) * 4
        stats[f"emb/{name}/touched"] = jnp.sum(jnp.any(grad_VxE != 0, axis=1), dtype=jnp.int32)
        stats[f"emb/{name}/update_slots"] = jnp.float32(block.shape[0])
        merged[name] = ("dense", grad_VxE)
      else:
        uniq_R, g_RxE = _merge_rows(ids_M, g_MxE, local_rows)
        uniq_R, g_RxE = uniq_R[:local_rows], g_RxE[:local_rows]  # at most a block's rows are distinct
        if copies:  # the same table on other data axes: every copy merges every copy's rows
          n_rows = jnp.sum(uniq_R < local_rows, dtype=jnp.int32)
          ideal += (n_copies - 1) * n_rows.astype(jnp.float32) * (e + 1) * 4
          gather = lambda i, g: (jax.lax.all_gather(i, copies, axis=0, tiled=True),
                                 jax.lax.all_gather(g, copies, axis=0, tiled=True))
          (ids_G, g_GxE), ran = _in_rounds(gather, (jnp.where(uniq_R < local_rows, uniq_R, -1), g_RxE),
                                           caps.get("received" if own else "unique", uniq_R.shape[0]), active, n_rows,
                                           grow=n_copies)
          ran_spill, ran_rest = ran_spill | ran.get("spill", 0), ran_rest | ran.get("rest", 0)
          uniq_R, g_RxE = _merge_rows(ids_G, g_GxE, local_rows)
        touched_R = (uniq_R < local_rows) & jnp.any(g_RxE != 0, axis=1)
        part_sq = jnp.sum(jnp.square(g_RxE))
        touched = jnp.sum(touched_R, dtype=jnp.int32)
        # Each owner holds its own rows once; copies computed the same sums.
        sq = sq + (jax.lax.psum(part_sq, own) if own else part_sq)
        stats[f"emb/{name}/touched"] = jax.lax.psum(touched, own) if own else touched
        slots_R = jnp.float32(uniq_R.shape[0])
        stats[f"emb/{name}/update_slots"] = jax.lax.psum(slots_R, own) if own else slots_R
        merged[name] = ("rows", uniq_R, g_RxE, touched_R)
      if active:
        stats[f"emb/{name}/sync_spill"] = jax.lax.pmax(ran_spill, active)
        stats[f"emb/{name}/sync_rest"] = jax.lax.pmax(ran_rest, active)
        stats[f"emb/{name}/sync_ideal_bytes"] = mean(ideal)
  finite = finite & jnp.isfinite(sq)
  new_blocks, new_slots = list(blocks), [list(s) for s in slots]
  for t, name in enumerate(names):
    m = merged[name]
    if m is None:
      continue
    own_slots = tuple(s[t] for s in slots)
    if m[0] == "dense":
      u, out = rule.dense_update(m[1].astype(blocks[t].dtype), own_slots, count)
      keep = lambda new, old: jnp.where(finite, new, old)
      new_blocks[t] = keep((blocks[t] + u).astype(blocks[t].dtype), blocks[t])
      out = tuple(keep(n, o) for n, o in zip(out, own_slots))
    else:
      _, uniq_R, g_RxE, touched_R = m
      new_blocks[t], out = _apply_rows(rule, blocks[t], own_slots, uniq_R, g_RxE.astype(blocks[t].dtype),
                                       touched_R & finite, count)
    for k in range(len(slots)):
      new_slots[k][t] = out[k]
  return new_blocks, [list(s) for s in new_slots], sq, finite, stats


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


def make_step(graphdef, rest, optimizer, task, p, state, capacities, sync_capacities, *, global_norm,
              guarded_keep):
  """train_step(state, batch) -> (state, metrics) of the sparse engine (module docstring); the same contract
  as step.make_train_step's dense path."""
  from gem_jax.run.step import TrainState  # the step module owns the state type

  mesh = p.mesh
  tables0, dense0 = nnx.split_state(state.params, Table, ...)
  names = table_names(tables0)
  values = dict(zip(names, (v.get_value() for v in jax.tree_util.tree_leaves(tables0, is_leaf=_is_var))))
  num_rows = {n: int(x.shape[0]) for n, x in values.items()}
  dims = {n: int(x.shape[1]) for n, x in values.items()}
  dtypes = {n: x.dtype for n, x in values.items()}
  table_specs, dense_specs = spmd.step_specs(p, tables0), spmd.step_specs(p, dense0)
  all_specs = spmd.step_specs(p, state.params)
  dev = device_spec(mesh)
  devices = math.prod(mesh.shape[a] for a in spmd.active_axes(mesh))
  batch_spec = spmd.data_spec(mesh)
  rule = optimizer.rule

  def loss_body(calls, dense, tables, sinks, batch, dropout_rng):
    stats, recorded = {}, []
    with spmd.installed(p, capacities, stats):
      lookup = sink_lookup(runtime.current().lookup, calls, [s[0] for s in sinks], recorded)
      with runtime.using(lookup=lookup):
        model = spmd.merge(graphdef, rest, nnx.merge_state(dense, tables), all_specs, mesh)
        sums = task.sums(model, spmd.local(batch), spmd.device_key(dropout_rng, p))
    loss, metrics = task.loss({k: spmd.total(v, mesh) for k, v in sums.items()})
    return loss, ({**metrics, **spmd.stat_metrics(stats, p)}, [ids[None] for ids in recorded])

  def update_body(calls, blocks, slots, ids, cots, finite, count):
    return update_tables(rule, p, names, blocks, slots, [i[0] for i in ids], [c[0] for c in cots], calls,
                         sync_capacities, finite, count, num_rows)

  def train_step(st: TrainState, batch):
    tables, dense = nnx.split_state(st.params, Table, ...)
    local = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch)
    calls = lookup_calls(graphdef, rest, task, st.params, local)
    sinks = [jnp.zeros((devices, n, dims[t]), dtypes[t]) for t, n in calls]
    sharded = jax.shard_map(lambda d, t, s, b, r: loss_body(calls, d, t, s, b, r), mesh=mesh,
                            in_specs=(dense_specs, table_specs, [dev] * len(calls), batch_spec, P()),
                            out_specs=(P(), (P(), [dev] * len(calls))))
    dropout_rng = jax.random.fold_in(st.rng, st.step)
    (loss, (aux, ids)), (g_dense, g_sinks) = jax.value_and_grad(sharded, argnums=(0, 2), has_aux=True)(
        dense, tables, sinks, batch, dropout_rng)
    dense_sq = jnp.square(global_norm(g_dense))
    finite = jnp.isfinite(loss) & jnp.isfinite(dense_sq)
    table_state = optimizer.table_state(st.opt_state)
    flat_blocks = [v.get_value() for v in jax.tree_util.tree_leaves(tables, is_leaf=_is_var)]
    slot_leaves = [jax.tree_util.tree_leaves(s, is_leaf=_is_var) for s in table_state.slots]
    flat_slots = [[v.get_value() for v in leaves] for leaves in slot_leaves]
    block_specs = jax.tree_util.tree_leaves(table_specs, is_leaf=lambda x: isinstance(x, P))
    slot_specs = [jax.tree_util.tree_leaves(spmd.step_specs(p, s), is_leaf=lambda x: isinstance(x, P))
                  for s in table_state.slots]
    update = jax.shard_map(lambda b, s, i, c, f, k: update_body(calls, b, s, i, c, f, k), mesh=mesh,
                           in_specs=(block_specs, slot_specs, [dev] * len(calls), [dev] * len(calls), P(), P()),
                           out_specs=(block_specs, slot_specs, P(), P(), P()),
                           # Copies of a block end equal by construction (every copy merges the same rows),
                           # which vma types cannot express: an all-gather's result still counts as varying.
                           check_vma=False)
    with jax.named_scope("embedding_update"):  # HLO op names say which collectives the update runs
      blocks, slots, table_sq, finite, stats = update(flat_blocks, flat_slots, ids, g_sinks, finite,
                                                       table_state.count)
    # Dense side: optax on the dense gradients only (table leaves are masked out, whatever they hold).
    updates, dense_state = optimizer.dense.update(nnx.merge_state(g_dense, tables),
                                                  optimizer.dense_state(st.opt_state), st.params)
    _, dense_updates = nnx.split_state(updates, Table, ...)
    new_dense = guarded_keep(finite, optax.apply_updates(dense, dense_updates), dense)
    dense_state = guarded_keep(finite, dense_state, optimizer.dense_state(st.opt_state))
    # A Variable is a pytree node over its value: the structures' leaves are the arrays themselves.
    new_tables = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tables), blocks)
    new_slots = tuple(jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(s), bs)
                      for s, bs in zip(table_state.slots, slots))
    new_table_state = table_state._replace(slots=new_slots, count=table_state.count + finite.astype(jnp.int32))
    opt_state = optimizer.with_parts(st.opt_state, dense_state, new_table_state)
    params = nnx.merge_state(new_dense, new_tables)
    metrics = {"loss": loss, "grad_norm": jnp.sqrt(dense_sq + table_sq), "nonfinite": (~finite).astype(jnp.int32),
               **aux, **stats}
    return TrainState(params, opt_state, st.step + 1, st.rng), metrics

  return train_step
