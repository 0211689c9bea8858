"""The one train step and the one eval step: the model and the task's loss under shard_map on the run's mesh.

  train_step(state, batch) -> (state, metrics)     state donated; batch sharded over the data axes
  eval_step(params, batch) -> predictions          (S, b, ...) in the batch's shard order, replicated

One device is the 1x1x1x1x1 mesh, so there is no second path: the same program runs on a laptop CPU and on
a 5D mesh (gem_jax/parallel/spmd.py says what a device does inside). A step never reads anything back to
the host: the trainer fetches step N's metrics after dispatching N + 1.

One body for both table updates (gem_jax/run/table_update.py: DenseTables, SparseTables): the dropout key,
the loss under shard_map, value_and_grad with respect to the dense parameters and what the table update
differentiates, the table update, the dense optax update, one guard, one metrics dict, one jit. The state
and the guard are gem_jax/run/state.py's. The step's dropout key is fold_in(rng, step): the key itself
never changes, so a resumed run draws the same masks as an unbroken one.

Non-finite guard: a step whose loss or gradient norm (dense and tables together) is NaN or infinite leaves
the parameters and the optimizer state exactly as they were and reports `nonfinite` = 1 in its metrics;
`step` still advances, since the batch was consumed. The trainer's guard hook counts these and decides what
to do after several in a row (gem_jax/train/hooks.py).
"""

from __future__ import annotations

from typing import Callable

import chex
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from gem_jax import runtime, scopes
from gem_jax.model.embeddings import Table
from gem_jax.parallel import lookups, placement, spmd
from gem_jax.parallel import target as target_lib
from gem_jax.parallel.placement import Placement
from gem_jax.parallel.rules import DATA_AXES, MESH_AXES
from gem_jax.run import table_update as table_update_lib
from gem_jax.run.state import TrainState, keep, squared_norm


def table_update(embedding_update: str, optimizer, plan: Placement, state: TrainState, sync_capacities: dict,
                 lookup_trace: lookups.LookupTrace | None, cached_tables: dict[str, int] | None = None):
  """The table update of train.embedding_update: "sparse" (the engine, which reads its lookup calls off
  `lookup_trace`) or "dense" (V x E gradients). A model without tables takes the dense form."""
  tables, _ = nnx.split_state(state.params, Table, ...)
  if embedding_update == "sparse" and jax.tree_util.tree_leaves(tables):
    return table_update_lib.SparseTables(optimizer.rule, plan, tables, sync_capacities, lookup_trace.calls,
                                         cached_tables)
  return table_update_lib.DenseTables(optimizer.rule)


def make_train_step(graphdef, rest, optimizer, task, plan: Placement, state: TrainState,
                    capacities: dict[str, int] | None = None, embedding_update: str = "dense",
                    sync_capacities: dict[str, dict[str, int]] | None = None,
                    lookup_trace: lookups.LookupTrace | None = None,
                    cached_tables: dict[str, int] | None = None) -> Callable:
  """train_step(state, sharded batch) -> (state, metrics); `state` (placed by placement.place_state) is
  donated. The task gives the per-shard sums (task.sums) and the loss of their totals (task.loss).
  optimizer: a run.optim.Optimizer (`dense` for the dense parameters, `rule` for the tables).

  capacities: per lookup call, the per-destination slots of the embedding all-to-all
  (sparse.capacity_for); a lookup that needs more runs an exact fallback round and says so in
  `emb/<call>/overflow`.
  embedding_update: "sparse" differentiates the rows the batch read and updates only those; "dense"
  differentiates the tables whole (a V x E gradient per table) (gem_jax/run/table_update.py).
  sync_capacities: the sparse engine's update slots per table (lookups.sync_capacities); a table without
  them gets slots for every id it read.
  lookup_trace: the run's lookups.LookupTrace (the sparse engine's lookup calls per batch shape; default a
  new one of this model and task).
  cached_tables: {table: its whole rows} of the tables whose state leaves are a host table's device cache
  (train.host_tables).
  """
  capacities = dict(capacities or {})
  mesh = plan.mesh
  shardings = placement.state_shardings(state, plan)
  tables0, dense0 = nnx.split_state(state.params, Table, ...)
  table_specs, dense_specs = spmd.step_specs(plan, tables0), spmd.step_specs(plan, dense0)
  param_specs = spmd.step_specs(plan, state.params)
  batch_spec = spmd.data_spec(mesh)
  lookup_trace = lookup_trace or lookups.LookupTrace(graphdef, rest, state.params, task)
  update = table_update(embedding_update, optimizer, plan, state, dict(sync_capacities or {}), lookup_trace,
                        cached_tables)

  def sharded_loss(calls):
    def body(dense, wrt, tables, batch, dropout_rng):
      stats, reads = {}, []
      with spmd.installed(plan, capacities, stats):
        with runtime.using(lookup=update.lookup(runtime.current().lookup, calls, wrt, reads)):
          params = nnx.merge_state(dense, update.model_tables(wrt, tables))
          model = spmd.merge(graphdef, rest, params, param_specs, mesh)
          sums = task.sums(model, spmd.local(batch), spmd.device_key(dropout_rng, plan))
      loss, metrics = task.loss({k: spmd.total(v, mesh) for k, v in sums.items()})
      return loss, ({**metrics, **spmd.stat_metrics(stats, plan)}, [ids[None] for ids in reads])

    return jax.shard_map(body, mesh=mesh,
                         in_specs=(dense_specs, update.wrt_specs(table_specs, calls), table_specs, batch_spec, P()),
                         out_specs=(P(), (P(), update.read_specs(calls))))

  def train_step(state: TrainState, batch):
    # The whole step sees the target it is built for (squared_norm's form; inside shard_map, spmd.installed).
    with runtime.using(target=target_lib.of(plan.mesh, plan.spec)):
      return step_body(state, batch)

  def step_body(state: TrainState, batch):
    chex.assert_tree_shape_prefix(batch, (plan.num_data_shards,))  # one slice per data shard (at trace time)
    calls = update.calls(batch)
    tables, dense = nnx.split_state(state.params, Table, ...)
    dropout_rng = jax.random.fold_in(state.rng, state.step)
    (loss, (aux, reads)), (g_dense, g_tables) = jax.value_and_grad(sharded_loss(calls), argnums=(0, 1), has_aux=True)(
        dense, update.wrt(tables, calls), tables, batch, dropout_rng)
    dense_sq = squared_norm(g_dense)
    finite = jnp.isfinite(loss) & jnp.isfinite(dense_sq)
    with jax.named_scope(scopes.EMBEDDING_UPDATE):  # HLO op names say which collectives the table update runs
      t = update.apply(tables, optimizer.table_state(state.opt_state), g_tables, reads, calls, finite)
    dense_state = optimizer.dense_state(state.opt_state)
    new_dense, new_dense_state = dense_update(optimizer, state.params, state.opt_state, g_dense)
    new_dense = keep(t.finite, new_dense, dense)
    new_dense_state = keep(t.finite, new_dense_state, dense_state)
    opt_state = optimizer.with_parts(state.opt_state, new_dense_state, t.table_state)
    metrics = {"loss": loss, "grad_norm": jnp.sqrt(dense_sq + t.sq_norm), "nonfinite": (~t.finite).astype(jnp.int32),
               **aux, **t.stats}
    return TrainState(nnx.merge_state(new_dense, t.tables), opt_state, state.step + 1, state.rng), metrics

  return jax.jit(train_step, in_shardings=(shardings, NamedSharding(mesh, P(DATA_AXES))),
                 out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)


def dense_update(optimizer, params, opt_state, g_dense):
  """The dense side of a train step: optax on the dense gradients only (table leaves masked out, whatever they
  hold) -> (the new dense parameters, the new dense optimizer state). Also what the efficiency report counts as
  the optimizer's FLOPs (gem_jax/train/efficiency.py)."""
  tables, dense = nnx.split_state(params, Table, ...)
  updates, new_state = optimizer.dense.update(nnx.merge_state(g_dense, tables), optimizer.dense_state(opt_state),
                                              params)
  _, dense_updates = nnx.split_state(updates, Table, ...)
  return optax.apply_updates(dense, dense_updates), new_state


def make_eval_step(graphdef, rest, task, plan: Placement, params, capacities: dict[str, int] | None = None) -> Callable:
  """eval_step(params, sharded batch) -> task.predict per example, (S, b, ...) in the batch's shard order."""
  capacities = dict(capacities or {})
  param_specs = spmd.step_specs(plan, params)

  def body(params, batch):
    with spmd.installed(plan, capacities, {}):
      model = spmd.merge(graphdef, rest, params, param_specs, plan.mesh)
      return task.predict(model, spmd.local(batch))[None]

  # Every device returns its shard's predictions (context/tensor copies included); keep one copy each.
  per_device = jax.shard_map(body, mesh=plan.mesh, in_specs=(param_specs, spmd.data_spec(plan.mesh)),
                             out_specs=P(MESH_AXES))
  shape = tuple(plan.mesh.shape[a] for a in MESH_AXES)

  def eval_step(params, batch):
    chex.assert_tree_shape_prefix(batch, (plan.num_data_shards,))
    out = per_device(params, batch)
    out = out.reshape(shape + out.shape[1:])[:, :, :, 0, 0]
    return out.reshape((-1,) + out.shape[3:])

  # Replicated output: every process of a multi-process run can read all predictions.
  return jax.jit(eval_step, out_shardings=NamedSharding(plan.mesh, P()))
