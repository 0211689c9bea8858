"""The one train step and the one eval step: the model and the task's loss under shard_map on the run's mesh.

  train_step(state, batch) -> (state, metrics)     state donated; batch sharded over the data axes
  eval_step(params, batch) -> predictions          (S, b, ...) in the batch's shard order, replicated

One device is the 1x1x1x1x1 mesh, so there is no second path: the same program runs on a laptop CPU and on
a 5D mesh (gem_jax/parallel/spmd.py says what a device does inside). A step never reads anything back to
the host: the trainer fetches step N's metrics after dispatching N + 1.

The train state is a plain pytree (params, optimizer state, step, rng) so it can be donated, checkpointed
and sharded without knowing about Flax; the model's graph definition stays outside as a static value. The
step's dropout key is fold_in(rng, step): the key itself never changes, so a resumed run draws the same
masks as an unbroken one.

Non-finite guard: a step whose loss or gradient norm is NaN or infinite leaves the parameters and the
optimizer state exactly as they were (so Adam's moments and the learning-rate schedule do not move either)
and reports `nonfinite` = 1 in its metrics; `step` still advances, since the batch was consumed. The
trainer's guard hook counts these and decides what to do after several in a row (gem_jax/train/hooks.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from gem_jax.model.embeddings import Table

from gem_jax.parallel import placement, spmd
from gem_jax.parallel.placement import Plan
from gem_jax.parallel.rules import DATA_AXES, MESH_AXES


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  params: Any      # nnx.State of the model's nnx.Param variables (tables included)
  opt_state: Any
  step: Any        # int32 scalar: batches consumed
  rng: Any         # typed PRNG key; step N's dropout key is fold_in(rng, N); checkpointed with the rest


def init_state(params, optimizer: optax.GradientTransformation, rng) -> TrainState:
  return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32), rng)


def global_norm(tree) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree_util.tree_leaves(tree)))


def guarded_update(optimizer: optax.GradientTransformation, state: TrainState, loss, grads) -> tuple[TrainState, dict]:
  """The optimizer update of `state`, or `state` itself (params and optimizer state) when the loss or the
  gradient norm is not finite; -> (new state, {"loss", "grad_norm", "nonfinite"})."""
  grad_norm = global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  params = _keep(finite, params, state.params)
  opt_state = _keep(finite, opt_state, state.opt_state)
  metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": (~finite).astype(jnp.int32)}
  return TrainState(params, opt_state, state.step + 1, state.rng), metrics


def _keep(finite, new, old):
  # Element-wise selects that XLA fuses into the update's own loops: no extra pass over the parameters.
  return jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)


def make_train_step(graphdef, rest, optimizer, task, p: Plan, state: TrainState,
                    capacities: dict[str, int] | None = None, embedding_update: str = "dense",
                    sync_capacities: dict[str, dict[str, int]] | None = None) -> Callable:
  """train_step(state, sharded batch) -> (state, metrics); `state` (placed by placement.place_state) is
  donated. The task gives the per-shard sums (task.sums) and the loss of their totals (task.loss).

  capacities: per lookup call, the per-destination slots of the embedding all-to-all
  (sparse.capacity_for); a lookup that needs more runs an exact fallback round and says so in
  `emb/<call>/overflow`.
  embedding_update: "sparse" differentiates the rows the batch read and updates only those
  (gem_jax/run/table_update.py, with `optimizer` a run.optim.Optimizer); "dense" differentiates the tables
  whole (a V x E gradient per table) and gives them to the optimizer with everything else.
  sync_capacities: the sparse engine's update slots per table (lookups.sync_capacities); a table without
  them gets slots for every id it read.
  """
  capacities = dict(capacities or {})
  shardings = placement.state_shardings(state, p)
  if embedding_update == "sparse" and any(isinstance(v, Table) for v in jax.tree_util.tree_leaves(
      state.params, is_leaf=lambda x: isinstance(x, nnx.Variable))):
    from gem_jax.run import table_update
    sparse_step = table_update.make_step(graphdef, rest, optimizer, task, p, state, capacities,
                                         dict(sync_capacities or {}), global_norm=global_norm, guarded_keep=_keep)
    return jax.jit(sparse_step, in_shardings=(shardings, NamedSharding(p.mesh, P(DATA_AXES))),
                   out_shardings=(shardings, NamedSharding(p.mesh, P())), donate_argnums=0)
  param_specs = spmd.step_specs(p, state.params)
  batch_spec = spmd.data_spec(p.mesh)

  def body(params, batch, dropout_rng):
    stats: dict = {}
    with spmd.installed(p, capacities, stats):
      model = spmd.merge(graphdef, rest, params, param_specs, p.mesh)
      sums = task.sums(model, spmd.local(batch), spmd.device_key(dropout_rng, p))
    loss, metrics = task.loss({k: spmd.total(v, p.mesh) for k, v in sums.items()})
    return loss, {**metrics, **spmd.stat_metrics(stats, p)}

  sharded_loss = jax.shard_map(body, mesh=p.mesh, in_specs=(param_specs, batch_spec, P()), out_specs=(P(), P()))

  def train_step(state: TrainState, batch):
    dropout_rng = jax.random.fold_in(state.rng, state.step)
    (loss, aux), grads = jax.value_and_grad(sharded_loss, has_aux=True)(state.params, batch, dropout_rng)
    new_state, metrics = guarded_update(optimizer, state, loss, grads)
    return new_state, {**metrics, **aux}

  return jax.jit(train_step, in_shardings=(shardings, NamedSharding(p.mesh, P(DATA_AXES))),
                 out_shardings=(shardings, NamedSharding(p.mesh, P())), donate_argnums=0)


def make_eval_step(graphdef, rest, task, p: Plan, params, capacities: dict[str, int] | None = None) -> Callable:
  """eval_step(params, sharded batch) -> task.predict per example, (S, b, ...) in the batch's shard order."""
  capacities = dict(capacities or {})
  param_specs = spmd.step_specs(p, params)

  def body(params, batch):
    with spmd.installed(p, capacities, {}):
      model = spmd.merge(graphdef, rest, params, param_specs, p.mesh)
      return task.predict(model, spmd.local(batch))[None]

  # Every device returns its shard's predictions (context/tensor copies included); keep one copy each.
  per_device = jax.shard_map(body, mesh=p.mesh, in_specs=(param_specs, spmd.data_spec(p.mesh)),
                             out_specs=P(MESH_AXES))
  shape = tuple(p.mesh.shape[a] for a in MESH_AXES)

  def eval_step(params, batch):
    out = per_device(params, batch)
    out = out.reshape(shape + out.shape[1:])[:, :, :, 0, 0]
    return out.reshape((-1,) + out.shape[3:])

  # Replicated output: every process of a multi-process run can read all predictions.
  return jax.jit(eval_step, out_shardings=NamedSharding(p.mesh, P()))
